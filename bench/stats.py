"""The arithmetic of the benchmark: no I/O, so it is unit-tested (tests/unit/test_bench_stats.py).

Ratios are taken round by round (arm A of round k against arm B of round k,
which ran minutes apart on the same machine) and only then summarised by their
median, so drift of a shared machine cancels instead of piling up.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linearly interpolated (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Summary:
    """Median and spread of one figure over the rounds."""

    median: float
    """The median over the rounds."""
    low: float
    """The smallest round."""
    high: float
    """The largest round."""
    n: int
    """How many rounds counted."""

    @property
    def spread_pct(self) -> float:
        """(high - low) as a percentage of the median: how much the rounds disagree."""
        return 100 * (self.high - self.low) / self.median if self.median else 0.0

    def as_dict(self) -> dict[str, float | int]:
        """The summary as plain JSON values."""
        return {
            "median": self.median,
            "min": self.low,
            "max": self.high,
            "spread_pct": round(self.spread_pct, 1),
            "n": self.n,
        }


def summarize(values: Sequence[float]) -> Summary | None:
    """Median, min and max of ``values``; None when there are none."""
    if not values:
        return None
    return Summary(statistics.median(values), min(values), max(values), len(values))


def round_ratios(
    rounds: Sequence[Mapping[str, float | None]], numerator: str, denominator: str
) -> list[float]:
    """``numerator / denominator`` for each round in which both arms have a valid figure.

    ``rounds`` holds one mapping per round, arm name -> figure (None or absent
    when that arm was void or did not run in that round).
    """
    ratios = []
    for figures in rounds:
        num = figures.get(numerator)
        den = figures.get(denominator)
        if num is None or den is None or den <= 0:
            continue
        ratios.append(num / den)
    return ratios


@dataclass(frozen=True)
class Target:
    """A performance target: ``numerator / denominator >= threshold``, from the same run."""

    numerator: str
    """The arm held to the target."""
    denominator: str
    """The arm it is measured against."""
    threshold: float
    """The least acceptable median ratio."""

    @property
    def name(self) -> str:
        """``numerator/denominator``, the key of this ratio in results.json."""
        return f"{self.numerator}/{self.denominator}"


TARGETS = (
    Target("dedup_batch", "handwritten", 0.9),
    Target("dedup_batch", "handwritten_concurrent", 0.9),
    Target("dedup_batch", "naive", 10.0),
    Target("dedup_per_message", "naive", 0.9),
    Target("dedup_batch_traced", "dedup_batch", 0.85),
    Target("hot_rows", "hot_rows_serial", 1.0),
    Target("dedup_confluent", "handwritten_confluent", 0.8),
)
"""The targets of issue 7; issue 13's (on hot rows, the default lanes are no slower than one);
issue 27's (dedup's defaults at 0.9 of both hand-written loops); issue 32's (dedup.sync.Consumer
at 0.8 of the hand-written confluent-kafka + psycopg loop)."""

REFERENCE_ARMS = ("handwritten", "naive")
"""Every arm's throughput is also reported as a ratio against these."""


def ratios_table(
    rounds: Sequence[Mapping[str, float | None]], arms: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """Round-by-round ratios of every arm against the reference arms and for every target.

    Returns ``{"a/b": {"median": m, "rounds": [...]}}``; a ratio with no round in
    which both arms were valid is left out.
    """
    pairs: list[tuple[str, str]] = [
        (arm, ref) for ref in REFERENCE_ARMS for arm in arms if arm != ref and ref in arms
    ]
    pairs += [(t.numerator, t.denominator) for t in TARGETS]
    table: dict[str, dict[str, Any]] = {}
    for num, den in pairs:
        values = round_ratios(rounds, num, den)
        if values:
            table[f"{num}/{den}"] = {
                "median": statistics.median(values),
                "rounds": [round(v, 4) for v in values],
            }
    return table


def evaluate_targets(ratios: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each target with its median ratio and ``pass``, ``fail`` or ``n/a`` (an arm missing)."""
    verdicts = []
    for target in TARGETS:
        found = ratios.get(target.name)
        value = None if found is None else float(found["median"])
        if value is None:
            status = "n/a"
        else:
            status = "pass" if value >= target.threshold else "fail"
        verdicts.append(
            {"ratio": target.name, "threshold": target.threshold, "value": value, "status": status}
        )
    return verdicts


def rss_flat(samples_mb: Sequence[float], tolerance: float = 0.10) -> tuple[bool, float, float]:
    """Is memory flat? The last quarter's peak within ``tolerance`` of the first quarter's.

    Returns ``(flat, first_quarter_peak, last_quarter_peak)``; at least four
    samples are needed.
    """
    if len(samples_mb) < 4:
        raise ValueError("need at least 4 RSS samples to compare quarters")
    quarter = len(samples_mb) // 4
    first = max(samples_mb[:quarter])
    last = max(samples_mb[-quarter:])
    return last <= first * (1 + tolerance), first, last
