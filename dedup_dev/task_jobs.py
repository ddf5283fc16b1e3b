"""Jobs for the task tests: in-process, or ``dedup task run dedup_dev.task_jobs:NAME``.

Each job proves it ran by a row in ``job_runs`` (written in a fenced
transaction), never by a log line.  Jobs in other processes are configured
through the environment: ``TASK_JOB_SECONDS`` (how long ``record`` works after
its write) and ``TASK_JOB_MARKER`` (the file ``stubborn`` waits for).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import time
from pathlib import Path
from typing import Any

import dedup

JOB_RUNS = """
CREATE TABLE job_runs (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    task         text        NOT NULL,
    business_key text        NOT NULL,
    holder       text        NOT NULL,
    token        bigint      NOT NULL,
    phase        text        NOT NULL,
    worker_time  timestamptz NOT NULL,   -- time.time() in the job's process
    worker_now   timestamptz NOT NULL,   -- datetime.now() in the job's process
    at           timestamptz NOT NULL DEFAULT clock_timestamp()
)"""


async def write_row(run: dedup.TaskRun, phase: str) -> None:
    """One ``job_runs`` row under the run's token, committed only if the fence holds."""
    async with run.transaction() as conn:
        await insert_row(conn, run, phase)


async def insert_row(conn: Any, run: dedup.TaskRun, phase: str) -> None:
    """The ``job_runs`` row of ``run``, in the caller's transaction."""
    await conn.execute(
        "INSERT INTO job_runs (task, business_key, holder, token, phase, worker_time, worker_now)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7)",
        run.task,
        run.business_key,
        run.holder,
        run.token,
        phase,
        dt.datetime.fromtimestamp(time.time(), dt.UTC),
        dt.datetime.now(dt.UTC),
    )


async def record(run: dedup.TaskRun) -> dict[str, Any]:
    """Write a row, then keep working for ``TASK_JOB_SECONDS`` (default 0)."""
    await write_row(run, "ran")
    seconds = float(os.environ.get("TASK_JOB_SECONDS", "0"))
    if seconds:
        await asyncio.sleep(seconds)  # the job's work: others race it meanwhile
    return {"holder": run.holder, "token": run.token}


async def hang(run: dedup.TaskRun) -> None:
    """Write a ``started`` row, then work until the process is killed."""
    await write_row(run, "started")
    await asyncio.Event().wait()


async def stubborn(run: dedup.TaskRun) -> None:
    """Write ``before``; wait for ``TASK_JOB_MARKER``; then write ``after`` whatever happens.

    It ignores the watchdog's cancellation, as a process that resumes from a
    pause in the middle of its write would: only ``run.fence`` stands between
    its second write and the database.  What it sees goes to stdout.
    """
    await write_row(run, "before")
    marker = Path(os.environ["TASK_JOB_MARKER"])
    try:
        while not marker.exists():  # noqa: ASYNC110, ASYNC240 (a stat; created while we are stopped)
            await asyncio.sleep(0.02)
    except asyncio.CancelledError:
        print("cancelled by the watchdog", flush=True)

    async def write_after() -> None:
        async with run.pool.acquire() as conn, conn.transaction():
            await insert_row(conn, run, "after")
            try:
                await run.fence(conn)
            except dedup.StaleTokenError as exc:
                print(f"fence refused token {run.token}: {exc}", flush=True)
                raise

    write = asyncio.ensure_future(write_after())
    try:
        await asyncio.shield(write)
    except asyncio.CancelledError:
        print("cancelled by the watchdog", flush=True)
        await write
