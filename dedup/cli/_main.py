"""The ``dedup`` command line: the parser of every command, and ``task run`` and ``run``.

Every command takes ``--dsn`` (default: the ``DEDUP_DSN`` variable) and
``--schema`` (default ``dedup``).  Exit codes: 0 done, 1 the command ran and
found a problem (a mismatch, a failed task), 2 bad usage or configuration;
``task run`` adds 3 (skipped: already succeeded) and 4 (skipped: running elsewhere).

The other commands live beside it: ``cli._migrate`` (migrate), ``cli._audit``
(audit, events, dead-letters, purge, reconcile), ``cli._offsets`` (offsets),
``cli._schedule`` (schedule); what they share is in ``cli._common``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence
from typing import Any

import orjson

import dedup
from dedup import _errors as errors
from dedup import _imports as imports
from dedup import _limits as limits
from dedup import _report as report
from dedup import _timespec as timespec
from dedup.cli import _audit as cli_audit
from dedup.cli import _common as common
from dedup.cli import _migrate as cli_migrate
from dedup.cli import _offsets as cli_offsets
from dedup.cli import _relay as cli_relay
from dedup.cli import _schedule as cli_schedule
from dedup.operations import _task_stats as task_stats
from dedup.tasks import _command as task_command
from dedup.tasks import _runner as tasks

# The names `task run` and `run` use, from what every command shares.
EXIT_OK = common.EXIT_OK
EXIT_PROBLEM = common.EXIT_PROBLEM
EXIT_USAGE = common.EXIT_USAGE
POOL_OPTIONS = common.POOL_OPTIONS
_common = common.add_common
_dsn = common.dsn


def _load_job(spec: str) -> tasks.Job:
    """The async function named by ``MODULE:FUNCTION``, importable from the working directory."""
    job: tasks.Job = imports.load(spec, what="job", expected="async def job(run: dedup.TaskRun)")
    return job


async def _task_run(args: argparse.Namespace) -> int:
    """run a job once per (task, business key), however many machines fire it

    Exit codes: 0 this runner ran the job and it succeeded, 1 it failed
    (or no attempts are left, or the lease was lost), 2 bad usage,
    3 skipped: already succeeded, 4 skipped: running on another holder.
    """
    return await task_command.run_task(
        _load_job(args.job),
        task=args.task,
        key=args.key,
        dsn=_dsn(args),
        schema=args.schema,
        holder=args.holder,
        max_attempts=args.max_attempts,
        lease_ttl=args.ttl,
        force=args.force,
        pool_options={**POOL_OPTIONS, "timeout": args.connect_timeout},
    )


async def _task_stats(args: argparse.Namespace) -> int:
    """how long a task's runs take, against its lease and its platform's timeout

    Reads the successful runs of the window: p50, p95 and max duration, the
    lease ttl of the latest run and how often it is renewed, and the platform
    timeout (--timeout, else each schedule's of the task). Warns when a
    platform timeout is under the p95 duration or the lease ttl under 1.5 x
    the p95; with --check, exit code 1 then.
    """
    async with common.connection(args) as conn:
        found = await task_stats.task_stats(
            conn,
            args.task,
            schema=args.schema,
            window=args.window,
            runs=args.runs,
            platform_timeout=args.timeout,
        )
    if args.format == "json":
        print(orjson.dumps(found.as_json()).decode())
    else:
        print(*(report.escape(line) for line in found.lines()), sep="\n")
    return EXIT_PROBLEM if args.check and found.warnings else EXIT_OK


# --- run: the bundled services -------------------------------------------------------


def _load_service(spec: str) -> Callable[[list[str]], Any]:
    """The entry point named by ``MODULE`` (its ``main``) or ``MODULE:FUNCTION``."""
    entry: Callable[[list[str]], Any] = imports.load(
        spec,
        what="service",
        default="main",
        expected="a service module defines `async def main(argv: list[str]) -> int`",
    )
    return entry


async def _run(args: argparse.Namespace) -> int:
    """run a service module, e.g. dedup run dedup_services.payments

    Imports MODULE and calls its entry point with the arguments after it:
    `main(argv) -> int` (async or not), or the FUNCTION named. `dedup run MODULE --help`
    shows the service's own options. The exit code is the service's.
    """
    entry = _load_service(args.service)
    forwarded = []
    for flag, value in (("--dsn", args.dsn), ("--schema", args.schema)):
        if value:
            forwarded += [flag, value]
    outcome = entry([*forwarded, *args.args])
    if asyncio.iscoroutine(outcome):
        outcome = await outcome
    return EXIT_OK if outcome is None else int(outcome)


def _add_run(sub: Any) -> None:
    p = common.command(sub, "run", _run)
    p.add_argument("--dsn", help="passed to the service as --dsn (it reads $DEDUP_DSN itself)")
    p.add_argument("--schema", help="passed to the service as --schema")
    p.add_argument("service", metavar="MODULE[:FUNCTION]", help="e.g. dedup_services.payments")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the service's own options")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every ``dedup`` command."""
    parser = argparse.ArgumentParser(
        prog="dedup", description="Exactly-once effects for Kafka consumers and scheduled jobs."
    )
    parser.add_argument(
        "--version", action="version", version=f"dedup (dedup-kafka) {dedup.__version__}"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    cli_migrate.add_migrate(sub)

    task = common.command(sub, "task", help="run-once tasks").add_subparsers(
        dest="task_command", required=True, metavar="TASK_COMMAND"
    )
    p = common.command(task, "run", _task_run)
    p.add_argument("job", metavar="MODULE:FUNCTION", help="async def job(run: dedup.TaskRun)")
    p.add_argument("--task", required=True, help="the task code, e.g. statements")
    p.add_argument("--key", required=True, help="the business key, e.g. 2024-05-31")
    p.add_argument(
        "--ttl",
        type=common.seconds(tasks.MIN_TASK_LEASE_TTL, limits.MAX_LEASE_TTL),
        default=tasks.DEFAULT_LEASE_TTL,
        help="lease seconds, renewed every third of it while the job runs (default: %(default)s)",
    )
    p.add_argument("--force", action="store_true", help="run even if it already succeeded")
    p.add_argument("--holder", help="this runner's name (default: hostname:pid:xxxxxx)")
    p.add_argument(
        "--max-attempts",
        type=common.integer(1, common.INT32_MAX),
        default=tasks.DEFAULT_MAX_ATTEMPTS,
        help="runs before a failing task is left alone until --force (default: %(default)s)",
    )
    _common(p)
    p = common.command(task, "stats", _task_stats)
    p.add_argument("--task", required=True, help="the task code, e.g. statements")
    p.add_argument(
        "--timeout",
        type=common.seconds(1, 7 * 86400),
        help="your platform's timeout of a run, seconds (default: the task's schedules')",
    )
    p.add_argument(
        "--window",
        type=common.argtype(timespec.parse_duration, "duration"),
        default=task_stats.DEFAULT_WINDOW,
        help="read the runs of this long ago up to now, e.g. 7d (default: 30d)",
    )
    p.add_argument(
        "--runs",
        type=common.integer(1, 100_000),
        default=task_stats.DEFAULT_RUNS,
        help="read at most the latest this many successful runs (default: %(default)s)",
    )
    p.add_argument("--check", action="store_true", help="exit 1 when there is a warning")
    p.add_argument("--format", choices=("table", "json"), default="table")
    _common(p)

    for add in (
        cli_audit.add_audit,
        cli_audit.add_events,
        cli_audit.add_dead_letters,
        cli_audit.add_purge,
        cli_offsets.add_offsets,
    ):
        add(sub)
    cli_schedule.add_schedule(sub)
    cli_relay.add_relay(sub)
    _add_run(sub)
    cli_audit.add_reconcile(sub)
    cli_audit.add_diagnose(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``dedup`` command and return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func: common.Command = args.func
    try:
        return asyncio.run(func(args))
    except errors.ConfigurationError as exc:
        print(f"dedup {args.command}: {report.escape(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except errors.DedupError as exc:
        print(f"dedup {args.command}: {report.escape(str(exc))}", file=sys.stderr)
        return EXIT_PROBLEM


if __name__ == "__main__":
    sys.exit(main())
