"""``dedup task stats``: real runs' durations, against the lease and the platform's timeout."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import orjson
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import dedup
from dedup_dev import helpers
from dedup_dev.services import ROOT
from tests.integration.test_tracing import counter_totals

SECONDS = [1.0, 1.1, 1.2, 1.3, 1.6]
"""How long each business day's run works: the p95 is about 1.5 s."""


async def work(run: dedup.TaskRun) -> None:
    day = int(run.business_key[-2:])
    await asyncio.sleep(SECONDS[(day - 1) % len(SECONDS)])  # the job's work, as long as it takes


async def five_runs(pool: Any, lease_ttl: float = 3) -> None:
    """Five days' runs, each with a lease of ``lease_ttl`` (3 s: over 1.5 x the p95)."""
    runner = dedup.TaskRunner(pool=pool)
    for day in range(1, 6):
        outcome = await runner.run("report", f"2024-05-0{day}", work, lease_ttl=lease_ttl)
        assert outcome.status == "succeeded"


def stats(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dedup", "task", "stats", "--task", "report", "--dsn", dsn, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_a_platform_timeout_under_the_p95_duration_fails_the_check(
    dsn: str, pool: Any
) -> None:
    await five_runs(pool)

    short = stats(dsn, "--timeout", "1.2", "--check")
    enough = stats(dsn, "--timeout", "3", "--check")
    unchecked = stats(dsn, "--timeout", "1.2")
    as_json = orjson.loads(stats(dsn, "--format", "json").stdout)

    assert short.returncode == 1, short
    lines = short.stdout.splitlines()
    assert lines[0].startswith("task report: 5 successful runs; duration p50 1.2 s, p95 1.5 s")
    assert lines[1] == "lease ttl 3.0 s, renewed every 1.0 s while a run lasts"
    assert lines[-1].startswith(
        "warning: platform timeout 1.2 s (--timeout) is under the p95 duration 1.5 s"
    )
    assert (enough.returncode, "warning" in enough.stdout) == (0, False), enough
    assert (unchecked.returncode, "warning" in unchecked.stdout) == (0, True), unchecked
    duration = as_json["duration"]
    # Database time, start to success: each run's sleep and a few milliseconds.
    assert 1.6 <= duration["max"] < 1.9, duration
    assert duration["p50"] >= 1.2 and as_json["runs"] == 5
    assert as_json["warnings"] == []


async def test_a_schedule_firing_under_a_short_platform_timeout_warns_as_event_and_metric(
    dsn: str, pool: Any, metric_reader: InMemoryMetricReader
) -> None:
    await five_runs(pool)
    scheduler = dedup.Scheduler(dsn=dsn, poll_interval=0.1)
    await scheduler.add(
        "report",
        cron="* * * * * *",
        task="report",
        job=work,
        key_format="2024-06-%S",
        catch_up="none",
        platform_timeout=1.0,
    )
    before = counter_totals(metric_reader)["dedup.task.timeouts_too_short"]

    async def warned() -> list[Any]:
        return list(
            await pool.fetch(
                "SELECT detail FROM dedup.events WHERE kind = 'schedule_timeout_too_short'"
            )
        )

    run = asyncio.ensure_future(scheduler.run())
    try:
        [event, *_] = await helpers.wait_for(warned, within=10, what="the warning")
    finally:
        await scheduler.stop()
        await run
    assert event["detail"]["platform_timeout"] == 1.0
    assert 1.4 < event["detail"]["p95"] < 1.8
    assert counter_totals(metric_reader)["dedup.task.timeouts_too_short"] > before
    from_schedule = stats(dsn)
    assert "platform timeout 1.0 s (schedule report)" in from_schedule.stdout


async def test_a_lease_under_one_and_a_half_p95_fails_the_check_and_warns_when_a_run_starts(
    dsn: str, pool: Any, metric_reader: InMemoryMetricReader
) -> None:
    await five_runs(pool, lease_ttl=2)  # under 1.5 x the p95 (about 1.5 s)
    before = counter_totals(metric_reader)["dedup.task.leases_too_short"]

    short = stats(dsn, "--timeout", "3", "--check")  # the platform's timeout is long enough
    outcome = await dedup.TaskRunner(pool=pool).run("report", "2024-05-06", work, lease_ttl=2)
    warned = await pool.fetch(
        "SELECT key, detail FROM dedup.events WHERE kind = 'task_lease_too_short' ORDER BY id"
    )
    enough = await dedup.TaskRunner(pool=pool).run("report", "2024-05-07", work, lease_ttl=3)
    after = await pool.fetchval(
        "SELECT count(*) FROM dedup.events WHERE kind = 'task_lease_too_short'"
    )

    assert short.returncode == 1, short
    assert short.stdout.splitlines()[-1].startswith(
        "warning: lease ttl 2.0 s is under 1.5 x the p95 duration 1.5 s"
    ), short.stdout
    # A run warns once its history's p95 is over 2 / 1.5 s: the sixth, at the latest.
    assert [r["key"] for r in warned][-1] == "2024-05-06" and outcome.status == "succeeded"
    assert warned[-1]["detail"]["lease_ttl"] == 2.0 and 1.4 < warned[-1]["detail"]["p95"] < 1.8
    assert counter_totals(metric_reader)["dedup.task.leases_too_short"] > before
    assert (enough.status, after) == ("succeeded", len(warned))  # 3 s is enough: no new warning
