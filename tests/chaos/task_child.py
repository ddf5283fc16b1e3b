"""A task runner of the chaos suite, in its own process: fired again until its task is done.

    python -m tests.chaos.task_child --dsn DSN --task T --key K --holder H \
        [--ttl SECONDS] [--work SECONDS] [--hold SECONDS] [--held] [--force]

Like a scheduler that fires ``TaskRunner.run`` for one (task, business key)
and fires it again while the task runs elsewhere or its run was lost, until
the task has succeeded (``--force``: until this runner's own forced run has).

The job works ``--work`` seconds, then in one fenced transaction writes its
``chaos_task_effects`` row (business key, token, holder) and marks the task
succeeded (``TaskRun.complete``); ``--hold`` keeps that transaction open a while
after the write, so the driver can pause the runner with the write in flight;
``--held`` keeps it open until ``release`` comes on stdin (the driver cuts the
runner's network meanwhile).  ``CHAOS_BREAK=no_fence``: the job's write commits
in a transaction of its own, unfenced, and marks nothing (the runner's own
fenced finish then refuses the run).

Lines on stdout: ``READY <holder>``, ``WORKING <token>`` when the job starts,
``WRITING <token>`` once its row is written (not committed), ``LOST <token>`` when
the runner tells it the lease is lost (``on_lease_lost``), ``OUTCOME <json>``
after every run.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any

import orjson

import dedup
from dedup.data import _db as db

EFFECTS = """
CREATE TABLE IF NOT EXISTS chaos_task_effects (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    task         text   NOT NULL,
    business_key text   NOT NULL,
    token        bigint NOT NULL,
    holder       text   NOT NULL,
    forced       boolean NOT NULL
);
"""
"""The job's business effect: one row per run that committed (no unique key, on purpose)."""

REFIRE_EVERY = 0.25
BREAKS = ("no_fence",)


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def release_on_stdin(released: asyncio.Event) -> None:
    """Set ``released`` when ``release`` comes on stdin."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).decode().split():
        if line[0] == "release":
            released.set()


async def main(args: argparse.Namespace) -> int:
    broken = os.environ.get("CHAOS_BREAK") or None
    if broken not in (None, *BREAKS):
        raise SystemExit(f"CHAOS_BREAK={broken!r}: expected one of {', '.join(BREAKS)}")
    pool = await db.create_pool(
        args.dsn,
        min_size=1,
        max_size=4,
        server_settings={
            "idle_in_transaction_session_timeout": str(args.idle_timeout_ms),
            "application_name": f"chaos:{args.holder}",
        },
    )

    released = asyncio.Event()
    if args.held:
        listener = asyncio.create_task(release_on_stdin(released))

    async def write(run: dedup.TaskRun, conn: Any) -> None:
        await conn.execute(
            "INSERT INTO chaos_task_effects (task, business_key, token, holder, forced)"
            " VALUES ($1, $2, $3, $4, $5)",
            run.task,
            run.business_key,
            run.token,
            run.holder,
            run.forced,
        )
        say(f"WRITING {run.token}")
        if args.hold:
            await asyncio.sleep(args.hold)
        if args.held:
            await released.wait()

    async def job(run: dedup.TaskRun) -> dict[str, object]:
        say(f"WORKING {run.token}")
        await asyncio.sleep(args.work)  # the job's work: others race it meanwhile
        if broken == "no_fence":
            # The classic mistake: the job's write commits on its own, unfenced.
            async with pool.acquire() as conn, conn.transaction():
                await write(run, conn)
            return {"holder": run.holder, "token": run.token}
        async with run.transaction() as conn:
            await write(run, conn)
            await run.complete(conn, {"holder": run.holder, "token": run.token})
        return {"holder": run.holder, "token": run.token}

    def lost(run: dedup.TaskRun, error: dedup.StaleTokenError) -> None:
        say(f"LOST {run.token}")

    runner = dedup.TaskRunner(pool=pool, holder=args.holder, max_attempts=50, on_lease_lost=lost)
    say(f"READY {args.holder}")
    try:
        while True:
            try:
                outcome = await runner.run(
                    args.task, args.key, job, lease_ttl=args.ttl, force=args.force
                )
            except dedup.ServiceUnavailableError as exc:
                say(f"UNAVAILABLE {exc}")
                await asyncio.sleep(REFIRE_EVERY)
                continue
            say(
                "OUTCOME "
                + orjson.dumps(
                    {
                        "status": outcome.status,
                        "token": outcome.token,
                        "holder": outcome.holder,
                        "forced": outcome.forced,
                        "error": outcome.error,
                    }
                ).decode()
            )
            if outcome.status == "succeeded" and (outcome.holder == args.holder or not args.force):
                return 0
            if outcome.status == "skipped_done" and not args.force:
                return 0
            await asyncio.sleep(REFIRE_EVERY)
    finally:
        if args.held:
            listener.cancel()
        await pool.close()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="task_child")
    p.add_argument("--dsn", required=True)
    p.add_argument("--task", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--holder", required=True)
    p.add_argument("--ttl", type=float, default=2.0)
    p.add_argument("--work", type=float, default=1.0)
    p.add_argument("--hold", type=float, default=0.0)
    p.add_argument("--idle-timeout-ms", type=int, default=4000)
    p.add_argument("--force", action="store_true")
    p.add_argument("--held", action="store_true")
    return p.parse_args(argv)


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    sys.exit(asyncio.run(main(parse())))
