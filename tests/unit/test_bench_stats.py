"""The benchmark's arithmetic: percentiles, round-by-round ratios, targets, flat memory."""

from __future__ import annotations

import pytest

from bench import stats


def test_percentile_interpolates_like_numpy() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert stats.percentile(values, 0) == 1.0
    assert stats.percentile(values, 50) == 3.0
    assert stats.percentile(values, 100) == 5.0
    assert stats.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert stats.percentile([10.0, 20.0, 30.0, 40.0], 25) == pytest.approx(17.5)
    with pytest.raises(ValueError, match="no values"):
        stats.percentile([], 50)


def test_summary_gives_median_and_spread() -> None:
    found = stats.summarize([90.0, 110.0, 100.0])
    assert found is not None
    assert (found.median, found.low, found.high, found.n) == (100.0, 90.0, 110.0, 3)
    assert found.spread_pct == pytest.approx(20.0)
    assert stats.summarize([]) is None


def test_ratios_are_taken_round_by_round_then_the_median() -> None:
    # The machine slows down in round 2: both arms halve, the ratio does not move.
    rounds = [
        {"dedup_batch": 800.0, "handwritten": 1000.0, "naive": 50.0},
        {"dedup_batch": 400.0, "handwritten": 500.0, "naive": 25.0},
        {"dedup_batch": 900.0, "handwritten": 1000.0, "naive": 60.0},
    ]
    assert stats.round_ratios(rounds, "dedup_batch", "handwritten") == pytest.approx(
        [0.8, 0.8, 0.9]
    )
    table = stats.ratios_table(rounds, ["naive", "handwritten", "dedup_batch"])
    assert table["dedup_batch/handwritten"]["median"] == pytest.approx(0.8)
    assert table["dedup_batch/naive"]["median"] == pytest.approx(16.0)
    assert table["handwritten/naive"]["median"] == pytest.approx(20.0)
    # The median of the per-round ratios (2, 20, 3), not the ratio of the medians (20 / 5).
    skewed = [{"a": 10.0, "naive": 5.0}, {"a": 20.0, "naive": 1.0}, {"a": 30.0, "naive": 10.0}]
    assert stats.ratios_table(skewed, ["a", "naive"])["a/naive"]["median"] == pytest.approx(3.0)


def test_a_void_or_missing_arm_leaves_its_round_out() -> None:
    rounds: list[dict[str, float | None]] = [
        {"dedup_batch": 800.0, "handwritten": None},
        {"dedup_batch": 700.0},
        {"dedup_batch": 900.0, "handwritten": 1000.0},
    ]
    assert stats.round_ratios(rounds, "dedup_batch", "handwritten") == pytest.approx([0.9])
    assert stats.round_ratios(rounds, "dedup_batch", "naive") == []


def test_targets_pass_fail_and_not_measured() -> None:
    ratios = {
        "dedup_batch/handwritten": {"median": 0.9},
        "dedup_batch/handwritten_concurrent": {"median": 0.89},
        "dedup_batch/naive": {"median": 9.99},
        "dedup_batch_traced/dedup_batch": {"median": 0.9},
        "dedup_confluent/handwritten_confluent": {"median": 0.79},
    }
    verdicts = {v["ratio"]: v["status"] for v in stats.evaluate_targets(ratios)}
    assert verdicts == {
        "dedup_batch/handwritten": "pass",  # the threshold itself passes
        "dedup_batch/handwritten_concurrent": "fail",
        "dedup_batch/naive": "fail",
        "dedup_per_message/naive": "n/a",
        "dedup_batch_traced/dedup_batch": "pass",
        "hot_rows/hot_rows_serial": "n/a",
        "dedup_confluent/handwritten_confluent": "fail",
    }


def test_memory_is_flat_when_the_last_quarter_peak_stays_within_ten_percent() -> None:
    assert stats.rss_flat([100, 104, 102, 103, 105, 104, 108, 109]) == (True, 104, 109)
    flat, first, last = stats.rss_flat([100, 100, 105, 110, 115, 120, 125, 130])
    assert (flat, first, last) == (False, 100, 130)
    with pytest.raises(ValueError, match="4 RSS samples"):
        stats.rss_flat([1, 2, 3])
