"""The ``dedup`` command line: the parser of every command, and ``task run`` and ``run``.

Every command takes ``--dsn`` (default: the ``DEDUP_DSN`` variable) and
``--schema`` (default ``dedup``).  Exit codes: 0 done, 1 the command ran and
found a problem (a mismatch, a failed task), 2 bad usage or configuration;
``task run`` adds 3 (skipped: already succeeded) and 4 (skipped: running elsewhere).

The other commands live beside it: ``_cli_migrate`` (migrate), ``_cli_audit``
(audit, events, dead-letters, purge, reconcile), ``_cli_offsets`` (offsets);
what they share is in ``_cli_common``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import dedup
from dedup import _cli_audit as cli_audit
from dedup import _cli_common as common
from dedup import _cli_migrate as cli_migrate
from dedup import _cli_offsets as cli_offsets
from dedup import _errors as errors
from dedup import _tasks as tasks

Command = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]

# The names `task run` and `run` use, from what every command shares.
EXIT_OK = common.EXIT_OK
EXIT_PROBLEM = common.EXIT_PROBLEM
EXIT_USAGE = common.EXIT_USAGE
POOL_OPTIONS = common.POOL_OPTIONS
_common = common.add_common
_dsn = common.dsn


EXIT_SKIPPED_DONE = 3
EXIT_SKIPPED_RUNNING = 4
_TASK_EXIT = {
    "succeeded": EXIT_OK,
    "failed": EXIT_PROBLEM,
    "skipped_done": EXIT_SKIPPED_DONE,
    "skipped_running": EXIT_SKIPPED_RUNNING,
}


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _load_job(spec: str) -> tasks.Job:
    """The async function named by ``MODULE:FUNCTION``, importable from the working directory."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise errors.ConfigurationError(
            f"job {spec!r}: name it MODULE:FUNCTION, e.g. myjobs:send_statements"
        )
    # Like `python -m`: a job module next to where the cron line runs is found.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as exc:
        raise errors.ConfigurationError(f"cannot load job {spec}: {exc}") from exc
    if not callable(found):
        raise errors.ConfigurationError(f"job {spec} is not callable: {found!r}")
    job: tasks.Job = found
    return job


async def _task_run(args: argparse.Namespace) -> int:
    job = _load_job(args.job)
    runner = tasks.TaskRunner(
        dsn=_dsn(args),
        holder=args.holder,
        schema_name=args.schema,
        max_attempts=args.max_attempts,
        pool_options=POOL_OPTIONS,
    )
    # SIGTERM (a scheduler's timeout, a deploy) cancels the run: the task is
    # marked failed and its lease released, so the next runner need not wait.
    loop = asyncio.get_running_loop()
    current = asyncio.current_task()
    assert current is not None  # noqa: S101 (asyncio.run gives us a task)
    loop.add_signal_handler(signal.SIGTERM, current.cancel)
    try:
        async with runner:
            outcome = await runner.run(
                args.task, args.key, job, lease_ttl=args.ttl, force=args.force
            )
    except asyncio.CancelledError:
        print(
            f"dedup task run: interrupted; task {args.task} key {args.key} marked failed",
            file=sys.stderr,
        )
        return EXIT_PROBLEM
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    forced = ", forced" if outcome.forced else ""
    print(
        f"task {outcome.task} key {outcome.business_key}: {outcome.status} "
        f"(token {outcome.token}, attempt {outcome.attempts}, holder {outcome.holder}{forced})"
    )
    if outcome.error:
        print(f"dedup task run: {outcome.error}", file=sys.stderr)
    return _TASK_EXIT[outcome.status]


# --- run: the bundled services -------------------------------------------------------


def _load_service(spec: str) -> Callable[[list[str]], Any]:
    """The entry point named by ``MODULE`` (its ``main``) or ``MODULE:FUNCTION``."""
    module_name, _, attribute = spec.partition(":")
    # Like `python -m`: a service module next to where the command runs is found.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise errors.ConfigurationError(f"cannot import service {module_name}: {exc}") from exc
    entry = getattr(module, attribute or "main", None)
    if not callable(entry):
        raise errors.ConfigurationError(
            f"{module_name} has no {attribute or 'main'}(argv) entry point: a service module "
            "defines `async def main(argv: list[str]) -> int`"
        )
    found: Callable[[list[str]], Any] = entry
    return found


async def _run(args: argparse.Namespace) -> int:
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
    p = sub.add_parser(
        "run",
        help="run a service module, e.g. dedup run consumers.payments",
        description="Imports MODULE and calls its entry point with the arguments after it: "
        "`main(argv) -> int` (async or not), or the FUNCTION named. `dedup run MODULE --help` "
        "shows the service's own options. The exit code is the service's.",
    )
    p.add_argument("--dsn", help="passed to the service as --dsn (it reads $DEDUP_DSN itself)")
    p.add_argument("--schema", help="passed to the service as --schema")
    p.add_argument("service", metavar="MODULE[:FUNCTION]", help="e.g. consumers.payments")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the service's own options")
    p.set_defaults(func=_run)


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

    task = sub.add_parser("task", help="run-once tasks").add_subparsers(
        dest="task_command", required=True, metavar="TASK_COMMAND"
    )
    p = task.add_parser(
        "run",
        help="run a job once per (task, business key), however many machines fire it",
        description="Exit codes: 0 this runner ran the job and it succeeded, 1 it failed "
        "(or no attempts are left, or the lease was lost), 2 bad usage, "
        "3 skipped: already succeeded, 4 skipped: running on another holder.",
    )
    p.add_argument("job", metavar="MODULE:FUNCTION", help="async def job(run: dedup.TaskRun)")
    p.add_argument("--task", required=True, help="the task code, e.g. statements")
    p.add_argument("--key", required=True, help="the business key, e.g. 2024-05-31")
    p.add_argument(
        "--ttl",
        type=_seconds,
        default=tasks.DEFAULT_LEASE_TTL,
        help="lease seconds, renewed every third of it while the job runs (default: %(default)s)",
    )
    p.add_argument("--force", action="store_true", help="run even if it already succeeded")
    p.add_argument("--holder", help="this runner's name (default: hostname:pid)")
    p.add_argument(
        "--max-attempts",
        type=int,
        default=tasks.DEFAULT_MAX_ATTEMPTS,
        help="runs before a failing task is left alone until --force (default: %(default)s)",
    )
    _common(p)
    p.set_defaults(func=_task_run)

    for add in (
        cli_audit.add_audit,
        cli_audit.add_events,
        cli_audit.add_dead_letters,
        cli_audit.add_purge,
        cli_offsets.add_offsets,
    ):
        add(sub)
    _add_run(sub)
    cli_audit.add_reconcile(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``dedup`` command and return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Command = args.func
    try:
        return asyncio.run(func(args))
    except errors.ConfigurationError as exc:
        print(f"dedup {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except errors.DedupError as exc:
        print(f"dedup {args.command}: {exc}", file=sys.stderr)
        return EXIT_PROBLEM


if __name__ == "__main__":
    sys.exit(main())
