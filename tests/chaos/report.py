"""The figures of chaos runs: a line per run, a table per scenario, the docs' copy of it."""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.chaos import scenarios
from tests.chaos.services import DEFAULT_DIR, ROOT

DOCS = ROOT / "docs" / "reliability.md"
TABLE_START = "<!-- chaos-table:start -->"
TABLE_END = "<!-- chaos-table:end -->"
FAILOVER_START = "<!-- failover-table:start -->"
FAILOVER_END = "<!-- failover-table:end -->"


@dataclass
class Result:
    """What one run of one scenario did and what the oracle found."""

    scenario: str
    seed: int
    matrix: str
    messages: int = 0
    """Records in the topic (poison and duplicates included), or task runs fired."""
    faults: int = 0
    lost: int = 0
    doubled: int = 0
    dead_lettered: int = 0
    stale_refused: int = 0
    """Batches or task writes the fence turned away (stale_rejected / lease_lost events)."""
    stale_committed: int = 0
    """Writes that committed under a token that was no longer current: must be 0."""
    duplicates: int = 0
    """Copies suppressed (processed.duplicates)."""
    deadlocks: int = 0
    """Deadlocks Postgres broke in the run's database (each rolled a transaction back)."""
    recoveries: list[float] = field(default_factory=list)
    seconds: float = 0.0
    violations: list[str] = field(default_factory=list)
    broken: str | None = None
    lost_commits: int | None = None
    """Failover runs: acknowledged commits the promoted standby does not hold."""
    reapplied: int | None = None
    """Failover runs: records of those lost commits applied again, exactly once."""

    @property
    def worst_recovery(self) -> float | None:
        return max(self.recoveries) if self.recoveries else None

    def line(self) -> str:
        worst = self.worst_recovery
        return (
            f"chaos {self.scenario} seed={self.seed}"
            + (f" broken={self.broken}" if self.broken else "")
            + f": runs=1 messages={self.messages} faults={self.faults} lost={self.lost}"
            f" doubled={self.doubled} dead-lettered={self.dead_lettered}"
            f" stale-refused={self.stale_refused} stale-committed={self.stale_committed}"
            f" duplicates-suppressed={self.duplicates} deadlocks={self.deadlocks}"
            f" worst-recovery={'-' if worst is None else f'{worst:.1f}s'}"
            + (
                f" lost-commits={self.lost_commits} reapplied-once={self.reapplied}"
                if self.lost_commits is not None
                else ""
            )
            + f" violations={len(self.violations)} time={self.seconds:.0f}s"
        )


RESULTS: list[Result] = []
"""Every run of this session (broken builds excluded), for the summary table."""


def table(results: list[Result]) -> str:
    """One Markdown row per scenario, summed over its runs (seeds)."""
    order: list[str] = []
    by: dict[str, list[Result]] = {}
    for r in results:
        if r.scenario not in by:
            order.append(r.scenario)
        by.setdefault(r.scenario, []).append(r)
    rows = [
        "| scenario | runs (seeds) | messages | faults | lost | doubled | dead-lettered "
        "| stale writes refused | stale writes committed | duplicates suppressed "
        "| deadlocks | worst recovery |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in order:
        runs = by[name]
        worst = [w for r in runs if (w := r.worst_recovery) is not None]
        rows.append(
            f"| {name} | {len(runs)} ({', '.join(str(r.seed) for r in runs)})"
            f" | {sum(r.messages for r in runs)} | {sum(r.faults for r in runs)}"
            f" | {sum(r.lost for r in runs)} | {sum(r.doubled for r in runs)}"
            f" | {sum(r.dead_lettered for r in runs)} | {sum(r.stale_refused for r in runs)}"
            f" | {sum(r.stale_committed for r in runs)} | {sum(r.duplicates for r in runs)}"
            f" | {sum(r.deadlocks for r in runs)}"
            f" | {f'{max(worst):.1f} s' if worst else '-'} |"
        )
    return "\n".join(rows)


def failover_table(results: list[Result]) -> str:
    """One Markdown row per failover run: the acknowledged commits it lost, and what came again."""
    rows = [
        "| scenario | seed | commits acknowledged lost | their records applied again once "
        "| lost | doubled | recovery after the promotion |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        if r.lost_commits is None:
            continue
        worst = r.worst_recovery
        rows.append(
            f"| {r.scenario} | {r.seed} | {r.lost_commits} | {r.reapplied} | {r.lost}"
            f" | {r.doubled} | {'-' if worst is None else f'{worst:.1f} s'} |"
        )
    return "\n".join(rows)


def document(
    results: list[Result],
    matrix: str,
    seconds: float,
    render: Callable[[list[Result]], str] | None = None,
) -> str:
    """The table (``render``, default :func:`table`) with a line that says when, where and
    how long."""
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    failed = sum(1 for r in results if r.violations)
    return (
        f"{(render or table)(results)}\n\n"
        f"Matrix `{matrix}`, {len(results)} runs, {failed} with violations; {seconds / 60:.1f} min "
        f"on {os.cpu_count()} cores ({platform.machine()}, Python {platform.python_version()}), "
        f"{when}."
    )


def write(results: list[Result], matrix: str, seconds: float) -> Path:
    """Write the table to ``CHAOS_REPORT`` (default ``.services/chaos/results.md``)."""
    path = Path(os.environ.get("CHAOS_REPORT") or DEFAULT_DIR / "results.md")
    path.parent.mkdir(parents=True, exist_ok=True)
    text = document(results, matrix, seconds) + "\n"
    if any(r.lost_commits is not None for r in results):
        text += "\n" + failover_table(results) + "\n"
    path.write_text(text, encoding="utf-8")
    return path


def update_docs(results: list[Result], matrix: str, seconds: float) -> None:
    """Replace the table between the markers of docs/reliability.md (``make chaos`` does)."""
    replace_block(TABLE_START, TABLE_END, document(results, matrix, seconds))
    if any(r.lost_commits is not None for r in results):
        replace_block(FAILOVER_START, FAILOVER_END, failover_table(results))


def replace_block(start: str, end: str, body: str) -> None:
    """Put ``body`` between the markers ``start`` and ``end`` of docs/reliability.md."""
    text = DOCS.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"{DOCS} has no {start} ... {end} block")
    block = f"{start}\n{body}\n{end}"
    DOCS.write_text(pattern.sub(lambda _: block, text), encoding="utf-8")


def summarize(
    terminalreporter: Any,
    results: list[Result],
    *,
    title: str,
    suffix: str,
    render: Callable[[list[Result]], str],
    start: str,
    end: str,
) -> None:
    """A family's table (``render``): on the terminal under ``title``, in the file next to
    the chaos report named with ``suffix``, and, with ``CHAOS_UPDATE_DOCS=1``, between the
    markers ``start`` and ``end`` of docs/reliability.md."""
    if not results:
        return
    seconds = sum(r.seconds for r in results)
    terminalreporter.section(f"chaos figures: {title}")
    for r in results:
        terminalreporter.write_line(r.line())
    text = document(results, scenarios.matrix(), seconds, render=render)
    terminalreporter.write_line(text)
    path = Path(os.environ.get("CHAOS_REPORT") or DEFAULT_DIR / "results.md")
    path = path.with_name(f"{path.stem}-{suffix}.md")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")
    terminalreporter.write_line(f"written to {path}")
    if os.environ.get("CHAOS_UPDATE_DOCS") == "1":
        replace_block(start, end, text)
        terminalreporter.write_line(f"and to {DOCS}")
