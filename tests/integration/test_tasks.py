"""``dedup.TaskRunner`` and ``dedup task run``: once per (task, business key), across processes.

Runners in other processes are ``dedup task run`` started by
:mod:`dedup_dev.task_worker`; every job proves it ran by a row in
``job_runs`` (:mod:`dedup_dev.task_jobs`), written under its token.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import dedup
from dedup_dev import helpers, task_jobs, task_worker

JOBS = "dedup_dev.task_jobs"
DAY = "2024-05-31"


@pytest.fixture
async def job_runs(pool: Any) -> AsyncIterator[None]:
    """The ``job_runs`` table the test jobs write to."""
    await pool.execute(task_jobs.JOB_RUNS)
    yield


def cli(dsn: str, job: str, *extra: str, task: str = "report", key: str = DAY) -> list[str]:
    """``dedup task run`` arguments."""
    return ["task", "run", f"{JOBS}:{job}", "--dsn", dsn, "--task", task, "--key", key, *extra]


async def runs(pool: Any) -> list[tuple[str, str, int]]:
    """(phase, holder, token) of every ``job_runs`` row, in order."""
    rows = await pool.fetch("SELECT phase, holder, token FROM job_runs ORDER BY id")
    return [tuple(r) for r in rows]


async def task_events(pool: Any, task: str = "report", key: str = DAY) -> list[Any]:
    """The task's events without the skips (each polling attempt writes one)."""
    return list(
        await pool.fetch(
            "SELECT kind, holder, token, from_state, to_state, detail FROM dedup.events"
            " WHERE namespace = $1 AND key = $2 AND kind <> 'task_skipped' ORDER BY id",
            task,
            key,
        )
    )


async def task_row(pool: Any, task: str = "report", key: str = DAY) -> Any:
    return await pool.fetchrow(
        "SELECT state, attempts, holder, token, forced, last_error, result FROM dedup.tasks"
        " WHERE task = $1 AND business_key = $2",
        task,
        key,
    )


async def take_over(runner: dedup.TaskRunner, job: Any, ttl: float = 1.0) -> dedup.TaskOutcome:
    """Run ``job`` with ``runner`` as soon as the current holder's lease has run out."""

    async def attempt() -> dedup.TaskOutcome | None:
        outcome = await runner.run("report", DAY, job, lease_ttl=ttl)
        return None if outcome.status == "skipped_running" else outcome

    return await helpers.wait_for(attempt, within=15, what="a takeover")


async def test_twenty_processes_racing_on_one_key_run_the_job_once(
    dsn: str, pool: Any, job_runs: None, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    workers = [
        await task_worker.start(
            *cli(dsn, "record", "--ttl", "5", "--holder", f"r{i}"),
            ready=tmp_path / f"ready-{i}",
            go=go,
            env={"TASK_JOB_SECONDS": "1"},
        )
        for i in range(20)
    ]

    async def all_ready() -> bool:
        for w in workers:
            await w.running()
        return len(list(tmp_path.glob("ready-*"))) == 20  # noqa: ASYNC240 (a directory listing)

    await helpers.wait_for(all_ready, within=30, what="20 workers at the start line")
    go.touch()
    finished = await asyncio.gather(*(w.finish(within=40) for w in workers))
    codes = sorted(code for code, _, _ in finished)

    assert codes.count(0) == 1, finished
    assert set(codes) - {0} <= {3, 4}, finished
    assert 4 in codes, "some runners must have met the job while it ran"
    [(phase, winner, token)] = await runs(pool)
    assert (phase, token) == ("ran", 1)
    row = await task_row(pool)
    assert (row["state"], row["attempts"], row["holder"]) == ("succeeded", 1, winner)
    assert row["result"] == {"holder": winner, "token": 1}
    kinds = await pool.fetch(
        "SELECT kind, count(*) FROM dedup.events WHERE subject = 'task' GROUP BY kind"
    )
    assert dict(kinds) == {"task_started": 1, "task_succeeded": 1, "task_skipped": 19}


async def test_a_killed_holder_is_taken_over_after_its_ttl(
    dsn: str, pool: Any, job_runs: None
) -> None:
    holder = await task_worker.start(*cli(dsn, "hang", "--ttl", "2", "--holder", "A"))

    async def started() -> bool:
        await holder.running()
        return bool(await runs(pool))

    await helpers.wait_for(started, within=20, what="A's job to start")
    holder.proc.send_signal(signal.SIGKILL)
    assert (await holder.finish())[0] == -signal.SIGKILL
    expired_at = await pool.fetchval("SELECT expires_at FROM dedup.leases")

    outcome = await take_over(dedup.TaskRunner(pool=pool, holder="B"), task_jobs.record)

    assert (outcome.status, outcome.token, outcome.attempts) == ("succeeded", 2, 2)
    assert await pool.fetchval("SELECT acquired_at FROM dedup.leases") >= expired_at
    assert await runs(pool) == [("started", "A", 1), ("ran", "B", 2)]
    row = await task_row(pool)
    assert (row["state"], row["attempts"], row["holder"], row["token"]) == (
        "succeeded",
        2,
        "B",
        2,
    )
    story = [(e["kind"], e["holder"], e["token"]) for e in await task_events(pool)]
    assert story[:2] == [("lease_acquired", "A", 1), ("task_started", "A", 1)]
    assert story[-4:] == [
        ("lease_acquired", "B", 2),
        ("task_taken_over", "B", 2),
        ("task_succeeded", "B", 2),
        ("lease_released", "B", 2),
    ]
    taken = next(e for e in await task_events(pool) if e["kind"] == "task_taken_over")
    assert taken["detail"] == {
        "old_token": 1,
        "new_token": 2,
        "old_holder": "A",
        "attempt": 2,
        "forced": False,
        "lease_ttl": 1.0,
        "renew_every": pytest.approx(1 / 3),
    }


async def test_sigterm_marks_the_task_failed_and_frees_it_at_once(
    dsn: str, pool: Any, job_runs: None
) -> None:
    # A 30 s lease: the next runner gets the task at once only because it was released.
    holder = await task_worker.start(*cli(dsn, "hang", "--ttl", "30", "--holder", "A"))

    async def started() -> bool:
        await holder.running()
        return bool(await runs(pool))

    await helpers.wait_for(started, within=20, what="A's job to start")
    holder.proc.send_signal(signal.SIGTERM)
    code, _, err = await holder.finish()
    assert code == 1, err
    assert "interrupted; task report key 2024-05-31 marked failed" in err
    row = await task_row(pool)
    assert (row["state"], row["last_error"]) == ("failed", "cancelled before it finished")

    retry = await dedup.TaskRunner(pool=pool, holder="B").run("report", DAY, task_jobs.record)
    assert (retry.status, retry.token, retry.attempts) == ("succeeded", 2, 2)


async def test_a_paused_holder_that_resumes_is_fenced_off(
    dsn: str, pool: Any, job_runs: None, tmp_path: Path
) -> None:
    marker = tmp_path / "resume"
    holder = await task_worker.start(
        *cli(dsn, "stubborn", "--ttl", "2", "--holder", "A"),
        env={"TASK_JOB_MARKER": str(marker)},
    )

    async def started() -> bool:
        await holder.running()
        return bool(await runs(pool))

    await helpers.wait_for(started, within=20, what="A's job to start")
    holder.proc.send_signal(signal.SIGSTOP)
    try:
        outcome = await take_over(dedup.TaskRunner(pool=pool, holder="B"), task_jobs.record)
    finally:
        marker.touch()
        holder.proc.send_signal(signal.SIGCONT)
    assert (outcome.status, outcome.token) == ("succeeded", 2)

    code, out, err = await holder.finish()
    assert code == 1, out + err
    assert "fence refused token 1" in out
    assert "'B' took over with token 2" in out
    assert "failed (token 1, attempt 1, holder A)" in out
    # Nothing A wrote after the takeover committed, and the task stays B's.
    assert await runs(pool) == [("before", "A", 1), ("ran", "B", 2)]
    row = await task_row(pool)
    assert (row["state"], row["holder"], row["token"], row["attempts"]) == ("succeeded", "B", 2, 2)
    story = [(e["kind"], e["holder"], e["token"]) for e in await task_events(pool)]
    assert ("lease_lost", "A", 1) in story
    assert ("task_taken_over", "B", 2) in story
    assert not any(kind == "task_failed" for kind, _, _ in story)


async def test_a_rerun_is_skipped_and_a_forced_one_runs_and_says_so(
    pool: Any, job_runs: None
) -> None:
    runner = dedup.TaskRunner(pool=pool, holder="ops")
    first = await runner.run("report", DAY, task_jobs.record, lease_ttl=1)
    again = await runner.run("report", DAY, task_jobs.record, lease_ttl=1)
    forced = await runner.run("report", DAY, task_jobs.record, lease_ttl=1, force=True)

    assert (first.status, first.token, first.attempts) == ("succeeded", 1, 1)
    assert (again.status, again.token, again.attempts) == ("skipped_done", 1, 1)
    assert again.result == {"holder": "ops", "token": 1}
    assert (forced.status, forced.token, forced.attempts, forced.forced) == (
        "succeeded",
        2,
        2,
        True,
    )
    assert await runs(pool) == [("ran", "ops", 1), ("ran", "ops", 2)]
    starts = [
        (e["token"], e["from_state"], e["detail"]["forced"])
        for e in await task_events(pool)
        if e["kind"] == "task_started"
    ]
    assert starts == [(1, "pending", False), (2, "succeeded", True)]
    skip = await pool.fetchrow("SELECT detail FROM dedup.events WHERE kind = 'task_skipped'")
    assert skip["detail"] == {"reason": "done", "held_by": "ops"}
    assert (await task_row(pool))["forced"] is True


async def test_a_failed_task_is_retried_up_to_its_limit(pool: Any) -> None:
    calls: list[int] = []
    broken = True

    async def job(run: dedup.TaskRun) -> dict[str, int]:
        calls.append(run.token)
        if broken:
            raise ValueError("bank file missing")
        return {"statements": 3}

    runner = dedup.TaskRunner(pool=pool, holder="cron", max_attempts=2)
    outcomes = [await runner.run("report", DAY, job, lease_ttl=1) for _ in range(3)]

    assert [(o.status, o.attempts) for o in outcomes] == [
        ("failed", 1),
        ("failed", 2),
        ("failed", 2),
    ]
    assert outcomes[0].error == "ValueError: bank file missing"
    assert "no attempts left (2 of 2)" in (outcomes[2].error or "")
    assert calls == [1, 2], "no third run once the attempts are used up"
    row = await task_row(pool)
    assert (row["state"], row["last_error"]) == ("failed", "ValueError: bank file missing")

    broken = False
    fixed = await runner.run("report", DAY, job, lease_ttl=1, force=True)
    assert (fixed.status, fixed.attempts, fixed.result) == ("succeeded", 3, {"statements": 3})
    row = await task_row(pool)
    assert (row["state"], row["last_error"], row["result"]) == (
        "succeeded",
        None,
        {"statements": 3},
    )
    kinds = [e["kind"] for e in await task_events(pool) if e["kind"].startswith("task_")]
    assert kinds == [*["task_started", "task_failed"] * 2, "task_started", "task_succeeded"]


async def test_the_next_business_key_is_never_blocked_by_the_previous_one(
    pool: Any, job_runs: None
) -> None:
    release = asyncio.Event()

    async def slow(run: dedup.TaskRun) -> None:
        await task_jobs.write_row(run, "ran")
        await release.wait()

    async def broken(run: dedup.TaskRun) -> None:
        raise RuntimeError("upstream down")

    runner = dedup.TaskRunner(pool=pool, holder="cron", max_attempts=1)
    assert (await runner.run("report", "2024-05-29", broken, lease_ttl=1)).status == "failed"
    day_before = asyncio.create_task(runner.run("report", "2024-05-30", slow, lease_ttl=1))

    async def running() -> bool:
        return len(await runs(pool)) == 1

    await helpers.wait_for(running, within=10, what="the 30th to be running")
    other = dedup.TaskRunner(pool=pool, holder="other")
    assert (await other.run("report", "2024-05-30", task_jobs.record)).status == "skipped_running"
    # Neither the failed 29th nor the running 30th holds up the 31st.
    next_day = await other.run("report", DAY, task_jobs.record, lease_ttl=1)
    assert (next_day.status, next_day.token, next_day.attempts) == ("succeeded", 1, 1)
    release.set()
    assert (await day_before).status == "succeeded"
    assert await runs(pool) == [("ran", "cron", 1), ("ran", "other", 1)]


async def test_the_watchdog_renews_a_long_job_and_a_lost_lease_cancels_it(pool: Any) -> None:
    async def renewals() -> int:
        return int(
            await pool.fetchval("SELECT count(*) FROM dedup.events WHERE kind = 'lease_renewed'")
        )

    async def long_job(run: dedup.TaskRun) -> str:
        # Works for well over three ttls; meanwhile nobody else gets the task.
        await helpers.wait_for(lambda: _at_least(renewals, 4), within=10, what="renewals")
        rival = await dedup.TaskRunner(pool=pool, holder="rival").run("long", "k", long_job)
        return rival.status

    outcome = await dedup.TaskRunner(pool=pool, holder="w").run("long", "k", long_job, lease_ttl=1)
    assert (outcome.status, outcome.result, outcome.attempts) == ("succeeded", "skipped_running", 1)

    told: list[tuple[int, str]] = []
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def endless(run: dedup.TaskRun) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    runner = dedup.TaskRunner(
        pool=pool, holder="w", on_lease_lost=lambda run, err: told.append((run.token, str(err)))
    )
    running = asyncio.create_task(runner.run("lost", "k", endless, lease_ttl=1))
    await asyncio.wait_for(started.wait(), 10)
    # A stalled database (here: a row lock held elsewhere) keeps renewals from
    # getting through; the job is stopped before its lease would run out.
    async with pool.acquire() as blocker, blocker.transaction():
        await blocker.execute(
            "SELECT 1 FROM dedup.leases WHERE resource = 'task:lost:k' FOR UPDATE"
        )
        outcome = await asyncio.wait_for(running, 10)
    assert cancelled.is_set()
    assert outcome.status == "failed" and "could not be renewed" in (outcome.error or "")
    assert [token for token, _ in told] == [1]
    assert (await task_row(pool, "lost", "k"))["state"] == "running", "left for a takeover"
    kinds = [e["kind"] for e in await task_events(pool, "lost", "k")]
    assert [k for k in kinds if k != "lease_renewed"] == [
        "lease_acquired",
        "task_started",
        "lease_lost",
    ]


async def _at_least(probe: Any, n: int) -> bool:
    return bool(await probe() >= n)


async def test_complete_commits_the_success_with_the_jobs_own_writes(
    pool: Any, job_runs: None
) -> None:
    async def job(run: dedup.TaskRun) -> None:
        async with run.transaction() as conn:
            await task_jobs.insert_row(conn, run, "ran")
            await run.complete(conn, {"rows": 1})
        # The process dies here, after its commit: the task is done all the same.
        raise RuntimeError("crashed after committing")

    runner = dedup.TaskRunner(pool=pool, holder="w")
    outcome = await runner.run("report", DAY, job, lease_ttl=1)
    assert (outcome.status, outcome.result) == ("succeeded", {"rows": 1})
    assert (await runner.run("report", DAY, job, lease_ttl=1)).status == "skipped_done"
    assert await runs(pool) == [("ran", "w", 1)]
    assert (await task_row(pool))["state"] == "succeeded"


async def test_a_run_is_a_span_with_every_transition_as_an_event(
    pool: Any, spans: InMemorySpanExporter
) -> None:
    async def job(run: dedup.TaskRun) -> None:
        return None

    await dedup.TaskRunner(pool=pool, holder="w").run("report", DAY, job, lease_ttl=1)
    [span] = [s for s in spans.get_finished_spans() if s.name == "task report"]
    assert [e.name for e in span.events] == [
        "dedup.lease_acquired",
        "dedup.task_started",
        "dedup.task_succeeded",
        "dedup.lease_released",
    ]
    assert span.attributes is not None
    assert span.attributes["dedup.key"] == DAY
    assert span.attributes["dedup.status"] == "succeeded"
    assert span.attributes["dedup.token"] == 1
    trace_id = await pool.fetchval("SELECT DISTINCT trace_id FROM dedup.events")
    assert trace_id == format(span.context.trace_id, "032x")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["nowhere:job", "--task", "t", "--key", "k"], "cannot load job nowhere:job"),
        ([f"{JOBS}:record", "--task", "t"], "the following arguments are required: --key"),
        (
            [f"{JOBS}:record", "--task", "t", "--key", "k", "--ttl", "0"],
            "expected seconds from 1 to 604800",
        ),
        ([f"{JOBS}:record", "--task", "a:b", "--key", "k"], "invalid task code"),
        ([f"{JOBS}", "--task", "t", "--key", "k"], "name it MODULE:FUNCTION"),
    ],
)
def test_bad_usage_exits_2(dsn: str, args: list[str], says: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dedup", "task", "run", *args, "--dsn", dsn],
        capture_output=True,
        text=True,
        check=False,
        cwd=task_worker.ROOT,
    )
    assert done.returncode == 2, done.stderr
    assert says in done.stderr
