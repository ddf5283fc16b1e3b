"""``run.step(name)``: a job's steps are done once across reruns of its task.

Each batch proves it was applied by a ``job_runs`` row written through
``step.conn`` (the step's own transaction), never by a log line.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

import dedup
from dedup_dev import task_jobs

DAY = "2024-05-31"


@pytest.fixture
async def job_runs(pool: Any) -> AsyncIterator[None]:
    await pool.execute(task_jobs.JOB_RUNS)
    yield


class BatchJob:
    """A job of ten batches; ``fail_at`` makes that batch raise after its write."""

    def __init__(self, fail_at: int | None) -> None:
        self.fail_at = fail_at
        self.handed: list[tuple[str, int]] = []

    async def __call__(self, run: dedup.TaskRun) -> int:
        applied = 0
        for batch in range(1, 11):
            async with run.step(f"batch-{batch}") as step:
                self.handed.append((step.key, step.token))
                if step.done:
                    continue
                assert step.conn is not None
                await task_jobs.insert_row(step.conn, run, f"batch-{batch}")
                if batch == self.fail_at:
                    raise RuntimeError(f"downstream refused batch {batch}")
                applied += 1
        return applied


async def applied(pool: Any) -> list[tuple[str, int]]:
    rows = await pool.fetch("SELECT phase, token FROM job_runs ORDER BY id")
    return [(r["phase"], r["token"]) for r in rows]


async def step_events(pool: Any, kind: str) -> list[str]:
    rows = await pool.fetch(
        "SELECT detail->>'step' AS step FROM dedup.events WHERE kind = $1 ORDER BY id", kind
    )
    return [r["step"] for r in rows]


async def test_a_job_failing_at_batch_seven_reruns_seven_to_ten_only(
    pool: Any, job_runs: None
) -> None:
    runner = dedup.TaskRunner(pool=pool, holder="A")

    first = await runner.run("statements", DAY, BatchJob(fail_at=7))
    again = BatchJob(fail_at=None)
    second = await runner.run("statements", DAY, again)

    assert (first.status, first.error) == ("failed", "RuntimeError: downstream refused batch 7")
    assert (second.status, second.token, second.result) == ("succeeded", 2, 4)
    # Batches 1-6 under the first run's token, once; batch 7's write rolled back
    # with its failure; 7-10 under the rerun's token, once.
    assert await applied(pool) == [(f"batch-{b}", 1) for b in range(1, 7)] + [
        (f"batch-{b}", 2) for b in range(7, 11)
    ]
    assert await step_events(pool, "task_step_done") == [f"batch-{b}" for b in range(1, 11)]
    assert await step_events(pool, "task_step_skipped") == [f"batch-{b}" for b in range(1, 7)]
    steps = await pool.fetch("SELECT step, token, attempt FROM dedup.task_steps ORDER BY step")
    assert {r["step"]: (r["token"], r["attempt"]) for r in steps} == {
        **{f"batch-{b}": (1, 1) for b in range(1, 7)},
        **{f"batch-{b}": (2, 2) for b in range(7, 11)},
    }
    # What an external call would be sent: the step's key and this run's token.
    assert again.handed[0] == (f"statements:{DAY}:batch-1", 2)


async def test_a_forced_rerun_skips_every_completed_step(pool: Any, job_runs: None) -> None:
    runner = dedup.TaskRunner(pool=pool, holder="A")
    await runner.run("statements", DAY, BatchJob(fail_at=None))

    forced = await runner.run("statements", DAY, BatchJob(fail_at=None), force=True)

    assert (forced.status, forced.forced, forced.result) == ("succeeded", True, 0)
    assert len(await applied(pool)) == 10
    assert len(await step_events(pool, "task_step_skipped")) == 10


async def test_a_step_name_used_twice_at_once_is_refused_and_rolled_back(
    pool: Any, job_runs: None
) -> None:
    async def twice(run: dedup.TaskRun) -> None:
        async with run.step("same") as outer:
            assert outer.conn is not None
            async with run.step("same") as inner:
                assert inner.conn is not None
                await task_jobs.insert_row(inner.conn, run, "inner")
            await task_jobs.insert_row(outer.conn, run, "outer")

    outcome = await dedup.TaskRunner(pool=pool).run("statements", DAY, twice)

    assert outcome.status == "failed"
    assert "step 'same'" in (outcome.error or "")
    assert await applied(pool) == [("inner", 1)]  # the inner step committed; the outer did not
