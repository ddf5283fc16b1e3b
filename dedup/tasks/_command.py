"""``dedup task run`` as a function, for the CLI and for programs of their own.

The command line (``dedup task run MODULE:FUNCTION``) and a service that runs a
task itself (``dedup run dedup_services.statements``) share this path: the same
signals, the same outcome line, the same exit codes.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Mapping
from typing import Any

from dedup import _report as report
from dedup.data import _sql as sql
from dedup.tasks import _run as task_run
from dedup.tasks import _runner as tasks

EXIT_CODES: Mapping[task_run.Status, int] = {
    "succeeded": 0,
    "failed": 1,
    "skipped_done": 3,
    "skipped_running": 4,
}
"""The exit code of ``dedup task run`` for each outcome (2 is bad usage)."""


async def run_task(
    job: tasks.Job,
    *,
    task: str,
    key: str,
    dsn: str,
    schema: str = sql.DEFAULT_SCHEMA,
    holder: str | None = None,
    max_attempts: int = tasks.DEFAULT_MAX_ATTEMPTS,
    lease_ttl: float = tasks.DEFAULT_LEASE_TTL,
    force: bool = False,
    pool_options: Mapping[str, Any] | None = None,
    prog: str = "dedup task run",
) -> int:
    """What ``dedup task run`` does, for a program of its own: run, print, return the exit code.

    Runs ``job`` once for (``task``, ``key``) with a :class:`dedup.TaskRunner` on
    ``dsn``, prints the outcome line (and an error on stderr, prefixed with
    ``prog``) and returns the command's exit code (:data:`EXIT_CODES`).
    SIGTERM or SIGINT (a scheduler's timeout, a deploy, Ctrl-C) cancels the
    run: the task is marked failed and its lease released, so the next runner
    need not wait; the exit code is then 1.
    """
    runner = tasks.TaskRunner(
        dsn=dsn,
        holder=holder,
        schema=schema,
        max_attempts=max_attempts,
        pool_options=pool_options,
    )
    loop = asyncio.get_running_loop()
    current = asyncio.current_task()
    assert current is not None  # noqa: S101 (asyncio.run gives us a task)
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, current.cancel)
    try:
        async with runner:
            outcome = await runner.run(task, key, job, lease_ttl=lease_ttl, force=force)
    except asyncio.CancelledError:
        current.uncancel()
        print(
            report.escape(f"{prog}: interrupted; task {task} key {key} marked failed"),
            file=sys.stderr,
        )
        return EXIT_CODES["failed"]
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
    forced = ", forced" if outcome.forced else ""
    # The key, the holder and the job's error are anyone's text: escaped.
    print(
        report.escape(
            f"task {outcome.task} key {outcome.business_key}: {outcome.status} "
            f"(token {outcome.token}, attempt {outcome.attempts}, holder {outcome.holder}{forced})"
        )
    )
    if outcome.error:
        print(report.escape(f"{prog}: {outcome.error}"), file=sys.stderr)
    return EXIT_CODES[outcome.status]
