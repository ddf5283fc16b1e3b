"""The live-stream latency's judging and the suite's page blocks: pure functions, no services."""

from __future__ import annotations

from typing import Any

import pytest

from bench import live, suite


def _round(p50: float, p99: float) -> dict[str, Any]:
    return {"ok": True, "p50_ms": p50, "p99_ms": p99, "p999_ms": p99, "max_ms": p99}


def _summary(rounds: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    for by_arm in rounds.values():
        for runs in by_arm.values():
            for r in runs:
                r.setdefault("producer", {"achieved_rate": 1000.0})
                r.setdefault("tx_per_s", 100.0)
    return live.summarize(rounds)


def test_p99_ratio_is_taken_round_by_round_and_p50_is_judged_at_1000() -> None:
    found = _summary(
        {
            "1000": {
                "handwritten": [_round(5, 10), _round(10, 40)],
                "dedup_batch": [_round(8, 14), _round(9, 80)],
            },
            "5000": {
                "handwritten": [_round(5, 10)],
                "dedup_batch": [_round(20, 30)],
            },
        }
    )
    verdicts = {t["target"]: t for t in live.targets(found)}
    at_1000 = verdicts["live 1,000 msg/s: dedup_batch p99 / handwritten p99"]
    assert at_1000["value"] == pytest.approx((1.4 + 2.0) / 2)
    assert at_1000["status"] == "fail"
    assert verdicts["live 5,000 msg/s: dedup_batch p99 / handwritten p99"]["value"] == 3.0
    p50 = verdicts["live 1,000 msg/s: dedup_batch p50 (ms)"]
    assert (p50["value"], p50["status"]) == (8.5, "pass")


def test_a_void_or_missing_arm_leaves_its_target_unjudged() -> None:
    found = _summary(
        {"1000": {"handwritten": [_round(5, 10)], "dedup_batch": [{"ok": False, "error": "x"}]}}
    )
    assert {t["status"] for t in live.targets(found)} == {"n/a"}
    assert "VOID" in live.table({"rates": found, "targets": live.targets(found)})


def test_an_arm_variant_carries_its_options() -> None:
    assert live.variant("dedup_batch") == ("dedup_batch", {})
    assert live.variant("dedup_batch[concurrency=1,batch_size=50]") == (
        "dedup_batch",
        {"concurrency": 1, "batch_size": 50},
    )
    args = live.parse(["--arms", "handwritten,dedup_batch[concurrency=1,batch_size=5]"])
    assert args.arms == ["handwritten", "dedup_batch[concurrency=1,batch_size=5]"]


def test_the_suite_replaces_only_its_blocks_and_names_a_missing_one() -> None:
    page = "intro\n<!-- bench:live:begin -->\nold\n<!-- bench:live:end -->\nrest\n"
    assert suite.replace_block(page, "live", "new") == (
        "intro\n<!-- bench:live:begin -->\nnew\n<!-- bench:live:end -->\nrest\n"
    )
    with pytest.raises(SystemExit, match="bench:targets:begin"):
        suite.replace_block(page, "targets", "x")


def test_the_suite_prints_every_target_with_its_verdict() -> None:
    shown = suite.target_table(
        [
            {"target": "a/b", "value": 0.91, "limit": ">= 0.8", "status": "pass"},
            {"target": "p50", "value": None, "limit": "< 10", "status": "n/a"},
        ]
    )
    assert shown.splitlines() == [
        "a/b      0.91  (target >= 0.8): PASS",
        "p50         -  (target < 10): N/A",
    ]


def test_the_suite_names_the_make_command_that_reproduces_it() -> None:
    assert suite.make_command("full", ["--publish"]) == "make bench-full"
    assert suite.make_command("quick", ["--rounds", "1"]) == 'make bench BENCH_ARGS="--rounds 1"'
