"""``dedup.Scheduler`` and ``dedup schedule``: each period once, across schedulers and restarts.

Schedulers in other processes are ``dedup schedule run`` started by
:mod:`dedup_dev.task_worker` (which can also set their wall clock wrong);
every job proves it ran by a ``job_runs`` row (:mod:`dedup_dev.task_jobs`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

import dedup
from dedup_dev import helpers, task_jobs, task_worker
from dedup_dev.services import ROOT

JOB = "dedup_dev.task_jobs:record"
EVERY_SECOND = "* * * * * *"
EVERY_TWO_SECONDS = "* * * * * */2"
BY_SECOND = "%Y-%m-%dT%H:%M:%S"


@pytest.fixture
async def job_runs(pool: Any) -> AsyncIterator[None]:
    await pool.execute(task_jobs.JOB_RUNS)
    yield


async def ran(pool: Any, task: str = "report") -> list[str]:
    """The business keys of the ``job_runs`` rows, in the order they were written."""
    rows = await pool.fetch("SELECT business_key FROM job_runs WHERE task = $1 ORDER BY id", task)
    return [r["business_key"] for r in rows]


async def schedule_events(pool: Any, kind: str) -> list[Any]:
    return list(
        await pool.fetch(
            "SELECT key, holder, detail FROM dedup.events WHERE subject = 'schedule' AND kind = $1"
            " ORDER BY id",
            kind,
        )
    )


@contextlib.asynccontextmanager
async def running(*schedulers: dedup.Scheduler) -> AsyncIterator[None]:
    """The schedulers' ``run()`` in the background; stopped (and checked) after."""
    tasks = [asyncio.ensure_future(s.run()) for s in schedulers]
    try:
        yield
    finally:
        for s in schedulers:
            await s.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)


async def db_now(pool: Any) -> dt.datetime:
    now: dt.datetime = await pool.fetchval("SELECT clock_timestamp()")
    return now


async def past(pool: Any, moment: dt.datetime) -> bool:
    """Has the database's clock passed ``moment``?"""
    return await db_now(pool) > moment


async def settled(pool: Any) -> bool:
    """No task is pending or running: nothing a scheduler round would run again."""
    unfinished = await pool.fetchval(
        "SELECT count(*) FROM dedup.tasks WHERE state IN ('pending', 'running')"
    )
    return bool(unfinished == 0)


async def at_least(pool: Any, runs: int) -> bool:
    return len(await ran(pool)) >= runs


async def test_three_scheduler_processes_run_each_period_once(
    dsn: str, pool: Any, job_runs: None
) -> None:
    scheduler = dedup.Scheduler(dsn=dsn)
    await scheduler.add(
        "report", cron=EVERY_TWO_SECONDS, task="report", job=JOB, key_format=BY_SECOND
    )
    procs = [
        await task_worker.start(
            "schedule", "run", "--dsn", dsn, "--holder", f"s{i}", "--poll-interval", "0.2"
        )
        for i in range(3)
    ]

    async def four_periods() -> bool:
        for p in procs:
            await p.running()
        return len(await ran(pool)) >= 4

    await helpers.wait_for(four_periods, within=30, what="four periods run")
    for p in procs:
        p.proc.send_signal(signal.SIGTERM)
    finished = [await p.finish() for p in procs]

    assert [code for code, _, _ in finished] == [0, 0, 0], finished
    keys = await ran(pool)
    assert len(keys) == len(set(keys)), keys
    fired = await schedule_events(pool, "schedule_fired")
    assert sorted(e["key"] for e in fired) == sorted(keys)
    # Each period was the two-second mark it names, run after it came due by the database's clock.
    rows = await pool.fetch("SELECT business_key, at FROM job_runs")
    for row in rows:
        period = dt.datetime.fromisoformat(row["business_key"]).replace(tzinfo=dt.UTC)
        assert period.second % 2 == 0
        assert period <= row["at"] < period + dt.timedelta(seconds=5), row
    states = await pool.fetch("SELECT DISTINCT state, attempts FROM dedup.tasks")
    assert [tuple(s) for s in states] == [("succeeded", 1)]


@pytest.mark.parametrize(
    ("catch_up", "expected"),
    [("all", ["yesterday", "today"]), ("latest", ["today"]), ("none", [])],
)
async def test_periods_missed_while_every_scheduler_was_down_go_by_the_catch_up_policy(
    dsn: str, pool: Any, job_runs: None, catch_up: str, expected: list[str]
) -> None:
    # A daily period half an hour ago, and the day before: both passed while no
    # scheduler ran (the schedule was last decided 47 hours ago).
    now = await db_now(pool)
    due = now - dt.timedelta(minutes=30)
    days = {
        "yesterday": (due - dt.timedelta(days=1)).date().isoformat(),
        "today": due.date().isoformat(),
    }
    schedulers = [dedup.Scheduler(dsn=dsn, holder=f"s{i}", poll_interval=0.2) for i in range(3)]
    await schedulers[0].add(
        "report",
        cron=f"{due.minute} {due.hour} * * *",
        task="report",
        job=JOB,
        catch_up=catch_up,
        start=now - dt.timedelta(hours=47),
    )

    async def decided() -> bool:
        found = await schedule_events(pool, "schedule_fired") + await schedule_events(
            pool, "schedule_skipped"
        )
        return len(found) > 0 and len(await ran(pool)) == len(expected)

    async with running(*schedulers):
        await helpers.wait_for(decided, within=30, what=f"the missed periods decided ({catch_up})")
        # A period runs twice only from a pending or running task (a round picks
        # those up again): wait until none is left, then count.
        await helpers.wait_for(
            lambda: settled(pool), within=30, what="every decided period finished"
        )

    assert await ran(pool) == [days[d] for d in expected]
    skipped = await schedule_events(pool, "schedule_skipped")
    assert sum(e["detail"]["periods"] for e in skipped) == 2 - len(expected)


async def test_a_scheduler_whose_clock_is_hours_ahead_fires_nothing_early(
    dsn: str, pool: Any, job_runs: None
) -> None:
    scheduler = dedup.Scheduler(dsn=dsn)
    await scheduler.add(
        "report", cron=EVERY_TWO_SECONDS, task="report", job=JOB, key_format=BY_SECOND
    )
    ahead = await task_worker.start(
        "schedule", "run", "--dsn", dsn, "--poll-interval", "0.2", clock_offset=5 * 3600
    )

    async def two_periods() -> bool:
        await ahead.running()
        return len(await ran(pool)) >= 2

    await helpers.wait_for(two_periods, within=30, what="two periods run")
    ahead.proc.send_signal(signal.SIGTERM)
    assert (await ahead.finish())[0] == 0

    for row in await pool.fetch("SELECT business_key, at, worker_time FROM job_runs"):
        period = dt.datetime.fromisoformat(row["business_key"]).replace(tzinfo=dt.UTC)
        assert row["worker_time"] - row["at"] > dt.timedelta(hours=4.9)  # its clock was wrong
        assert period <= row["at"] < period + dt.timedelta(seconds=5), row  # fired on time anyway


async def test_pause_holds_and_resume_catches_up(dsn: str, pool: Any, job_runs: None) -> None:
    scheduler = dedup.Scheduler(dsn=dsn, poll_interval=0.2)
    await scheduler.add("report", cron=EVERY_SECOND, task="report", job=JOB, key_format=BY_SECOND)
    await scheduler.pause("report")
    paused_at = await db_now(pool)

    async with running(scheduler):
        await helpers.wait_for(
            lambda: past(pool, paused_at + dt.timedelta(seconds=3)),
            within=10,
            what="three seconds paused",
        )
        assert await ran(pool) == []
        await scheduler.resume("report")
        await helpers.wait_for(lambda: ran(pool), within=10, what="the missed periods run")
        resumed_at = await db_now(pool)
        await helpers.wait_for(
            lambda: past(pool, resumed_at + dt.timedelta(seconds=1)),
            within=10,
            what="a period after the resume",
        )

    keys = await ran(pool)
    assert len(keys) == len(set(keys))
    caught_up = [
        k for k in keys if dt.datetime.fromisoformat(k).replace(tzinfo=dt.UTC) < resumed_at
    ]
    # Every second paused ran once, oldest first (catch_up all).
    assert len(caught_up) >= 3
    assert caught_up == sorted(caught_up)
    kinds = [r["kind"] for r in await pool.fetch("SELECT kind FROM dedup.events ORDER BY id")]
    assert kinds.index("schedule_resumed") < kinds.index("schedule_fired")


@pytest.mark.parametrize("overlap", ["skip", "buffer_one", "allow"])
async def test_overlap_of_a_job_longer_than_its_period(
    dsn: str, pool: Any, job_runs: None, overlap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TASK_JOB_SECONDS", "2.5")  # each run outlasts two periods
    scheduler = dedup.Scheduler(dsn=dsn, poll_interval=0.1)
    await scheduler.add(
        "report",
        cron=EVERY_SECOND,
        task="report",
        job=task_jobs.record,
        key_format=BY_SECOND,
        overlap=overlap,
    )

    async with running(scheduler):
        await helpers.wait_for(
            lambda: at_least(pool, 3 if overlap == "allow" else 2),
            within=20,
            what="runs",
        )

    spans = await pool.fetch(
        "SELECT business_key, started_at, finished_at FROM dedup.tasks"
        " WHERE state = 'succeeded' ORDER BY started_at"
    )
    overlapping = any(b["started_at"] < a["finished_at"] for a, b in itertools.pairwise(spans))
    assert overlapping == (overlap == "allow"), spans
    skipped = await schedule_events(pool, "schedule_skipped")
    assert bool(skipped) == (overlap != "allow")
    if overlap == "buffer_one":
        [first, second, *_] = spans
        # The buffered period started as soon as the first run ended.
        assert second["started_at"] - first["finished_at"] < dt.timedelta(seconds=1)
        buffered = await schedule_events(pool, "schedule_buffered")
        assert second["business_key"] in [e["key"] for e in buffered]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dedup", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_backfill_runs_each_day_once_and_a_second_backfill_none(
    dsn: str, pool: Any, job_runs: None
) -> None:
    added = cli(
        "schedule", "add", "daily", JOB, "--cron", "0 2 * * *", "--task", "report", "--dsn", dsn
    )
    assert (added.returncode, added.stdout) == (0, "schedule daily: added\n"), added.stderr
    backfill = (
        "schedule",
        "backfill",
        "daily",
        "--from",
        "2024-05-01",
        "--to",
        "2024-05-05",
        "--dsn",
        dsn,
    )

    first = cli(*backfill)
    second = cli(*backfill)
    forced = cli(*backfill[:-2], "--force", "--dsn", dsn)

    days = [f"2024-05-0{d}" for d in range(1, 6)]
    assert first.returncode == 0, first.stderr
    assert [line.split()[4] for line in first.stdout.splitlines()] == ["succeeded"] * 5
    assert second.returncode == 0, second.stderr
    assert [line.split()[4] for line in second.stdout.splitlines()] == ["skipped_done"] * 5
    assert forced.returncode == 0, forced.stderr
    assert all(line.endswith(", forced)") for line in forced.stdout.splitlines())
    assert await ran(pool) == days + days  # the backfill, then the forced rerun
    forced_starts = await pool.fetch(
        "SELECT key FROM dedup.events WHERE kind = 'task_started' AND (detail->>'forced')::boolean"
        " ORDER BY id"
    )
    assert [r["key"] for r in forced_starts] == days
    backfills = await schedule_events(pool, "schedule_backfill")
    assert [e["detail"]["forced"] for e in backfills] == [False, False, True]


async def test_the_schedule_commands(dsn: str, pool: Any) -> None:
    bad = cli("schedule", "add", "x", JOB, "--cron", "61 * * * *", "--task", "t", "--dsn", dsn)
    assert bad.returncode == 2
    assert "invalid cron expression '61 * * * *'" in bad.stderr
    assert await pool.fetchval("SELECT count(*) FROM dedup.schedules") == 0
    add = ("schedule", "add", "x", JOB, "--cron", "0 6 * * 1", "--tz", "Europe/Berlin")
    assert cli(*add, "--task", "t", "--dsn", dsn).returncode == 0
    again = cli(*add, "--task", "t", "--dsn", dsn)
    assert again.stdout == "schedule x: unchanged\n"
    listed = cli("schedule", "list", "--dsn", dsn)
    assert listed.stdout.startswith(
        "x: 0 6 * * 1 (Europe/Berlin) task t dedup_dev.task_jobs:record"
    ), listed
    assert cli("schedule", "pause", "x", "--dsn", dsn).stdout == "schedule x: paused\n"
    assert "paused" in cli("schedule", "list", "--dsn", dsn).stdout
    assert cli("schedule", "resume", "x", "--dsn", dsn).stdout == "schedule x: resumed\n"
    assert cli("schedule", "remove", "x", "--dsn", dsn).stdout == "schedule x: removed\n"
    gone = cli("schedule", "pause", "x", "--dsn", dsn)
    assert (gone.returncode, gone.stderr) == (2, "dedup schedule: no schedule named 'x'\n")
    kinds = await pool.fetch("SELECT kind FROM dedup.events WHERE subject = 'schedule' ORDER BY id")
    assert [k["kind"] for k in kinds] == [
        "schedule_added",
        "schedule_paused",
        "schedule_resumed",
        "schedule_removed",
    ]
