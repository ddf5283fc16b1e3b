"""The ``dedup`` command line.

Every command takes ``--dsn`` (default: the ``DEDUP_DSN`` variable) and
``--schema`` (default ``dedup``).  Exit codes: 0 done, 1 the command ran and
found a problem (a mismatch, a failed task), 2 bad usage or configuration;
``task run`` adds 3 (skipped: already succeeded) and 4 (skipped: running elsewhere).

The commands connect without asyncpg's statement cache: each is short-lived and
sends each statement a few times at most, and without it they work unchanged
through a pooler in transaction mode (pgbouncer), where a prepared statement
does not outlive its transaction.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import logging
import os
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

import asyncpg
import orjson

import dedup
from dedup import _audit as audit
from dedup import _db as db
from dedup import _dead_letters as dead_letters
from dedup import _errors as errors
from dedup import _imports as imports
from dedup import _migrations as migrations
from dedup import _offsets as offsets
from dedup import _reconciliation as reconciliation
from dedup import _report as report
from dedup import _retention as retention
from dedup import _sql as sql
from dedup import _task_command as task_command
from dedup import _tasks as tasks
from dedup import _timespec as timespec

Command = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2

POOL_OPTIONS = {"statement_cache_size": 0}
"""asyncpg options of every command's connections (see the module docstring)."""


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dsn",
        default=os.environ.get("DEDUP_DSN"),
        help="Postgres DSN (default: $DEDUP_DSN)",
    )
    parser.add_argument(
        "--schema",
        default=sql.DEFAULT_SCHEMA,
        help="schema holding dedup's tables (default: %(default)s)",
    )


def _dsn(args: argparse.Namespace) -> str:
    if not args.dsn:
        raise errors.ConfigurationError(
            "no database: pass --dsn postgresql://... or set DEDUP_DSN "
            "(compose/local/up writes one to .services/env)"
        )
    return str(args.dsn)


async def _migrate(args: argparse.Namespace) -> int:
    sql.quote(args.schema)  # a bad name is bad usage, found before connecting
    if args.all and not args.sql:
        raise errors.ConfigurationError("--all goes with --sql")
    if args.format != "table" and not args.status:
        raise errors.ConfigurationError("--format goes with --status")
    if args.sql:
        if args.all:
            found = migrations.discover(sql.migrations_dir())
        else:
            found = await migrations.pending(_dsn(args), schema_name=args.schema)
        print(migrations.script(found, schema_name=args.schema), end="")
        return EXIT_OK
    if args.status:
        return _migration_status(await migrations.status(_dsn(args), schema_name=args.schema), args)
    applied = await migrations.migrate(_dsn(args), schema_name=args.schema)
    for name in applied:
        print(f"applied {name}")
    print(f"schema {args.schema} is up to date ({len(applied)} applied now)")
    return EXIT_OK


_MIGRATION_COLUMNS = [
    report.Column(name) for name in ("component", "version", "name", "status", "applied_at")
]


def _migration_status(found: list[migrations.Status], args: argparse.Namespace) -> int:
    """Print what is applied and pending; exit 1 while something is pending."""
    rows = [
        {
            "component": s.component,
            "version": s.version,
            "name": s.name,
            "status": s.status,
            "applied_at": report.utc(s.applied_at),
        }
        for s in found
    ]
    waiting = sum(s.status == migrations.PENDING for s in found)
    done = report.Report(
        query={"schema": args.schema},
        sections=[report.Section("migrations", "migrations", _MIGRATION_COLUMNS, rows)],
    )
    print(done.render(args.format))
    if args.format == "table":
        if waiting:
            print(f"\n{waiting} pending: run `dedup migrate` (or apply `dedup migrate --sql`)")
        else:
            print(f"\nschema {args.schema} is up to date")
    return EXIT_PROBLEM if waiting else EXIT_OK


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
    job: tasks.Job = imports.load(spec, what="job", expected="async def job(run: dedup.TaskRun)")
    return job


async def _task_run(args: argparse.Namespace) -> int:
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
        pool_options=POOL_OPTIONS,
    )


# --- audit, events, dead-letters, purge: the operator commands -----------------------


def _argtype(parse: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """An argparse ``type`` that shows the parser's own message (it names the input)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name
    return convert


def _integer(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise ValueError(f"invalid value {text!r}: expected an integer >= {minimum}")
        return value

    return _argtype(parse, "integer")


def _pause(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"invalid pause {text!r}: expected seconds >= 0")
    return value


_TIME = _argtype(timespec.parse_time, "time")
_DURATION = _argtype(timespec.parse_duration, "duration")


def _output(parser: argparse.ArgumentParser, *, limit: bool = True) -> None:
    parser.add_argument(
        "--format",
        choices=("table", "json"),
        default="table",
        help="aligned table, or one JSON document (fields: docs/reference/cli.md)",
    )
    if limit:
        parser.add_argument(
            "--limit",
            type=_integer(1),
            default=audit.DEFAULT_LIMIT,
            help="most rows per list (default: %(default)s); JSON says truncated: true when cut",
        )
    _common(parser)


def _window(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--since",
        type=_TIME,
        help=f"{what} at or after: ISO 8601 (UTC unless given), or 2h, 7d ago",
    )
    parser.add_argument("--until", type=_TIME, help=f"{what} before (same forms as --since)")


@contextlib.asynccontextmanager
async def _connection(args: argparse.Namespace) -> AsyncIterator[asyncpg.Connection]:
    sql.quote(args.schema)  # a bad name is bad usage, found before connecting
    pool = await db.create_pool(_dsn(args), min_size=1, max_size=1, **POOL_OPTIONS)
    try:
        async with pool.acquire() as conn:
            await migrations.check(conn, schema_name=args.schema)
            yield conn
    except (asyncpg.UndefinedTableError, asyncpg.InvalidSchemaNameError) as exc:
        raise errors.ConfigurationError(
            f"no dedup tables in schema {args.schema!r} ({exc}): check --schema, or run "
            "`dedup migrate`"
        ) from exc
    except asyncpg.InsufficientPrivilegeError as exc:
        raise errors.ConfigurationError(
            f"{exc}: connect as a role granted dedup_audit (reading) or dedup_runtime "
            "(replay, purge); see docs/howto/audit-and-purge.md"
        ) from exc
    except (asyncpg.PostgresConnectionError, asyncpg.InterfaceError) as exc:
        raise errors.ServiceUnavailableError(
            f"lost the connection to Postgres ({exc}); run the command again"
        ) from exc
    finally:
        await pool.close()


def _show(found: report.Report, args: argparse.Namespace) -> int:
    """Print ``found``; exit 0 when something matched, 1 when nothing did."""
    print(found.render(args.format))
    return EXIT_OK if found.found else EXIT_PROBLEM


async def _audit(args: argparse.Namespace) -> int:
    query = audit.AuditQuery(
        key=args.key,
        namespace=args.namespace,
        topic=args.topic,
        partition=args.partition,
        offset=args.offset,
        since=args.since,
        until=args.until,
        statuses=args.status,
        limit=args.limit,
    )
    query.check()
    async with _connection(args) as conn:
        return _show(await audit.audit(conn, args.schema, query), args)


async def _events(args: argparse.Namespace) -> int:
    if args.business_key is not None and args.task is None:
        raise errors.ConfigurationError("--business-key goes with --task CODE")
    if args.task is not None and args.key is not None:
        raise errors.ConfigurationError("with --task, give the business key as --business-key")
    query = audit.EventsQuery(
        key=args.business_key if args.task is not None else args.key,
        namespace=args.namespace,
        resource=args.resource,
        task=args.task,
        kind=args.kind,
        since=args.since,
        until=args.until,
        limit=args.limit,
    )
    query.check()
    async with _connection(args) as conn:
        return _show(await audit.events(conn, args.schema, query), args)


async def _dead_letters_list(args: argparse.Namespace) -> int:
    query = dead_letters.ListQuery(
        namespace=args.namespace,
        topic=args.topic,
        since=args.since,
        until=args.until,
        pending=args.pending,
        limit=args.limit,
    )
    async with _connection(args) as conn:
        return _show(await dead_letters.list_(conn, args.schema, query), args)


async def _dead_letters_show(args: argparse.Namespace) -> int:
    async with _connection(args) as conn:
        return _show(await dead_letters.show(conn, args.schema, args.id), args)


async def _dead_letters_replay(args: argparse.Namespace) -> int:
    if not args.bootstrap_servers:
        raise errors.ConfigurationError(
            "no Kafka to replay to: pass --bootstrap-servers host:port or set "
            "KAFKA_BOOTSTRAP_SERVERS"
        )
    # aiokafka logs an error per metadata retry while it looks for a missing
    # topic; the report says it once, in the skipped list.
    logging.getLogger("aiokafka.cluster").addFilter(
        lambda record: "not found in cluster metadata" not in str(record.msg)
    )
    async with _connection(args) as conn:
        done = await dead_letters.replay(
            conn,
            args.schema,
            args.ids,
            bootstrap_servers=args.bootstrap_servers,
            again=args.again,
            holder=args.holder,
        )
    print(done.render(args.format))
    return EXIT_PROBLEM if done.sections[1].rows else EXIT_OK


async def _purge(args: argparse.Namespace) -> int:
    # --before 30d means the same as --older-than 30d.
    older_than = args.older_than
    before = args.before
    if isinstance(before, datetime.timedelta):
        older_than, before = before, None
    async with _connection(args) as conn:
        done = await retention.purge(
            conn,
            args.schema,
            older_than=older_than,
            before=before,
            events_older_than=args.events_older_than,
            batch_size=args.batch_size,
            pause=args.pause,
            dry_run=args.dry_run,
        )
    if args.format == "json":
        print(orjson.dumps(done.as_json(), option=orjson.OPT_INDENT_2).decode())
    else:
        print(done.as_table())
    return EXIT_PROBLEM if done.batches_skipped else EXIT_OK


def _add_audit(sub: Any) -> None:
    p = sub.add_parser(
        "audit",
        help="what happened to a message: its claimed key and any dead letter",
        description="Exit codes: 0 found, 1 nothing matches, 2 bad usage.",
    )
    p.add_argument("--key", help="the idempotency key, as known or as stored (sha256:...)")
    p.add_argument("--namespace", help="the consumer namespace (default: all)")
    p.add_argument("--topic", help="with --partition and --offset: where the message was read")
    p.add_argument("--partition", type=_integer(0), help="see --topic")
    p.add_argument("--offset", type=_integer(0), help="see --topic")
    _window(p, "first seen (dead letters: created)")
    p.add_argument(
        "--status",
        type=_argtype(audit.parse_statuses, "status"),
        action="extend",
        help=f"any of {', '.join(audit.STATUSES)} (repeat or comma-separate)",
    )
    _output(p)
    p.set_defaults(func=_audit)


def _add_events(sub: Any) -> None:
    p = sub.add_parser(
        "events",
        help="the transitions recorded for a key, a resource or a task",
        description="Exit codes: 0 found, 1 nothing matches, 2 bad usage.",
    )
    p.add_argument("--key", help="an idempotency key, as known or as stored (sha256:...)")
    p.add_argument("--namespace", help="with --key: the consumer namespace (default: all)")
    p.add_argument("--resource", help="a lease resource or topic:partition")
    p.add_argument("--task", help="a task code")
    p.add_argument("--business-key", help="with --task: the task's business key")
    p.add_argument("--kind", help="only this transition, e.g. task_taken_over")
    _window(p, "recorded")
    _output(p)
    p.set_defaults(func=_events)


def _add_dead_letters(sub: Any) -> None:
    dl = sub.add_parser("dead-letters", help="list, show and replay dead letters")
    commands = dl.add_subparsers(dest="dead_letters_command", required=True, metavar="ACTION")
    p = commands.add_parser(
        "list",
        help="dead letters, oldest first",
        description="Exit codes: 0 found, 1 none match, 2 bad usage.",
    )
    p.add_argument("--namespace", help="the consumer namespace")
    p.add_argument("--topic", help="the original record's topic")
    _window(p, "dead-lettered")
    p.add_argument("--pending", action="store_true", help="only those not replayed yet")
    _output(p)
    p.set_defaults(func=_dead_letters_list)

    p = commands.add_parser(
        "show",
        help="one dead letter whole: key, value, headers, reason",
        description="Exit codes: 0 found, 1 no such id, 2 bad usage.",
    )
    p.add_argument("id", type=_integer(1), help="the dead letter's id")
    _output(p, limit=False)
    p.set_defaults(func=_dead_letters_show)

    p = commands.add_parser(
        "replay",
        help="produce dead letters to their topic again, through the claim path",
        description="Exit codes: 0 all replayed, 1 some not (unknown id, replayed already), "
        "2 bad usage.",
    )
    p.add_argument("ids", metavar="ID", nargs="+", type=_integer(1), help="dead letter ids")
    p.add_argument(
        "--bootstrap-servers",
        default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"),
        help="Kafka (default: $KAFKA_BOOTSTRAP_SERVERS)",
    )
    p.add_argument("--again", action="store_true", help="also resend those replayed already")
    p.add_argument("--holder", help="who replays, for the events table (default: user@host)")
    _output(p, limit=False)
    p.set_defaults(func=_dead_letters_replay)


def _add_purge(sub: Any) -> None:
    p = sub.add_parser(
        "purge",
        help="delete keys older than the retention window, in short batches",
        description="Exit codes: 0 done, 1 some batches were skipped (locked; rerun), 2 bad usage.",
    )
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--older-than", type=_DURATION, help="the window: 30d, 12h, 90m, 3600s")
    when.add_argument("--before", type=_TIME, help="an exact cutoff (ISO 8601)")
    p.add_argument(
        "--events-older-than",
        type=_DURATION,
        help="also delete events older than this (default: keep events; needs the owner)",
    )
    p.add_argument(
        "--batch-size",
        type=_integer(1),
        default=retention.DEFAULT_BATCH_SIZE,
        help="rows per DELETE transaction (default: %(default)s)",
    )
    p.add_argument(
        "--pause",
        type=_pause,
        default=retention.DEFAULT_PAUSE,
        help="seconds between batches (default: %(default)s)",
    )
    p.add_argument("--dry-run", action="store_true", help="count what would go; delete nothing")
    _output(p, limit=False)
    p.set_defaults(func=_purge)


# --- offsets: where a consumer group stands in Postgres, and moving it ---------------


def _kafka_option(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument(
        "--bootstrap-servers",
        default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"),
        help=f"{help} (default: $KAFKA_BOOTSTRAP_SERVERS)",
    )


async def _offsets_show(args: argparse.Namespace) -> int:
    query = offsets.ShowQuery(group=args.group, topic=args.topic, limit=args.limit)
    offsets.quiet_aiokafka()
    async with _connection(args) as conn:
        if not args.bootstrap_servers:
            return _show(await offsets.show(conn, args.schema, query, None), args)
        async with offsets.Kafka(args.bootstrap_servers) as kafka:
            return _show(await offsets.show(conn, args.schema, query, kafka), args)


async def _offsets_move(args: argparse.Namespace) -> int:
    request = offsets.Move(
        action=args.offsets_command,
        group=args.group,
        topic=args.topic,
        partitions=sorted(set(args.partition or ())),
        to_offset=args.to_offset,
        to_time=args.to_time,
        yes=args.yes,
        who=args.holder,
    )
    request.check()
    if not args.bootstrap_servers:
        raise errors.ConfigurationError(
            f"`offsets {args.offsets_command}` needs Kafka to check that the group is stopped, "
            "to find the partitions' offsets and to write Kafka's committed offsets: pass "
            "--bootstrap-servers host:port or set KAFKA_BOOTSTRAP_SERVERS"
        )
    offsets.quiet_aiokafka()
    async with _connection(args) as conn, offsets.Kafka(args.bootstrap_servers) as kafka:
        done, note = await offsets.move(conn, args.schema, request, kafka)
    print(done.render(args.format), flush=True)  # before the note, on a terminal too
    if note:
        print(f"dedup offsets {args.offsets_command}: {note}", file=sys.stderr)
    return EXIT_OK


def _add_offsets(sub: Any) -> None:
    group = sub.add_parser(
        "offsets",
        help="show, rewind or skip a consumer group's offsets (Postgres holds them)",
        description="A dedup consumer resumes from the offsets in Postgres, not Kafka's: "
        "rewind and skip here, not with kafka-consumer-groups --reset-offsets.",
    )
    commands = group.add_subparsers(dest="offsets_command", required=True, metavar="ACTION")
    p = commands.add_parser(
        "show",
        help="each partition's stored offset, holder and token; Kafka's end offset and lag",
        description="Exit codes: 0 found, 1 nothing matches, 2 bad usage.",
    )
    p.add_argument("--group", help="the consumer group (default: all)")
    p.add_argument("--topic", help="the topic (default: all)")
    _kafka_option(p, "Kafka, for end offsets and lag; '' for none")
    _output(p)
    p.set_defaults(func=_offsets_show)

    for action, what in (
        (
            "rewind",
            "move back: the messages are offered again (duplicates unless their keys are purged)",
        ),
        ("skip", "move forward: the messages in between are never applied"),
    ):
        p = commands.add_parser(
            action,
            help=what,
            description=f"{what[0].upper()}{what[1:]}. Fences out a running owner (new token) "
            "and records an event. Exit codes: 0 done, 1 refused (the group has members and "
            "no --yes) or Kafka/Postgres unavailable, 2 bad usage.",
        )
        p.add_argument("--group", required=True, help="the consumer group")
        p.add_argument("--topic", required=True, help="the topic")
        p.add_argument(
            "--partition",
            type=_integer(0),
            action="append",
            help="a partition (repeatable; default: every partition of the topic)",
        )
        to = p.add_mutually_exclusive_group(required=True)
        to.add_argument("--to-offset", type=_integer(0), help="the next offset to consume")
        to.add_argument(
            "--to-time",
            type=_TIME,
            help="the first record at or after this time (ISO 8601, or 2h, 7d ago); "
            "the end of a partition with none",
        )
        p.add_argument("--yes", action="store_true", help="go ahead although the group has members")
        p.add_argument("--holder", help="who moves it, for the events table (default: user@host)")
        _kafka_option(p, "Kafka")
        _output(p, limit=False)
        p.set_defaults(func=_offsets_move)


# --- run, reconcile: the bundled services and the reconciliation layer -----------------


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
    entry = _load_service(args.service)
    forwarded = []
    for flag, value in (("--dsn", args.dsn), ("--schema", args.schema)):
        if value:
            forwarded += [flag, value]
    outcome = entry([*forwarded, *args.args])
    if asyncio.iscoroutine(outcome):
        outcome = await outcome
    return EXIT_OK if outcome is None else int(outcome)


async def _reconcile(args: argparse.Namespace) -> int:
    registry = reconciliation.Registry.default(args.module)
    if args.list:
        for check in registry.checks():
            print(f"{check.task}\t{check.description}")
        return EXIT_OK
    if not args.task or args.date is None:
        raise errors.ConfigurationError("give --task CODE and --date YYYY-MM-DD (or --list)")
    check = registry.get(args.task)
    async with _connection(args) as conn:
        found = await reconciliation.reconcile(
            conn, check, args.date, schema_name=args.schema, holder=args.holder
        )
    print(found.render(args.format))
    return EXIT_OK if found.ok else EXIT_PROBLEM


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


def _add_reconcile(sub: Any) -> None:
    p = sub.add_parser(
        "reconcile",
        help="compare a task's source and result for one business date",
        description="Runs the source and result queries declared for the task code (RECONCILE "
        "in a module: --module, $DEDUP_RECONCILE_MODULES, or an entry point of the "
        "dedup.reconcile group) for one business date, in one snapshot; prints both figures "
        "and the difference and writes a reconcile event. Exit codes: 0 they agree, "
        "1 mismatch, 2 bad usage (unknown task, bad date, a query that fails).",
    )
    p.add_argument("--task", help="the task code, e.g. statements")
    p.add_argument(
        "--date",
        type=_argtype(reconciliation.parse_date, "date"),
        help="the business date, YYYY-MM-DD",
    )
    p.add_argument(
        "--module",
        action="append",
        default=[],
        help="a module declaring RECONCILE (repeatable)",
    )
    p.add_argument("--list", action="store_true", help="list the known task codes and exit")
    p.add_argument("--holder", help="who checks, for the events table (default: hostname:pid)")
    _output(p, limit=False)
    p.set_defaults(func=_reconcile)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every ``dedup`` command."""
    parser = argparse.ArgumentParser(
        prog="dedup", description="Exactly-once effects for Kafka consumers and scheduled jobs."
    )
    parser.add_argument(
        "--version", action="version", version=f"dedup (dedup-kafka) {dedup.__version__}"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "migrate",
        help="create or update dedup's tables (safe to rerun); print their SQL; list them",
        description="Applies the pending migrations under an advisory lock. Exit codes: "
        "0 done (--status: up to date), 1 --status: migrations are pending, 2 bad usage, "
        "or a role that may not migrate.",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--sql",
        action="store_true",
        help="print the SQL of the pending migrations instead of applying it "
        "(for alembic, flyway, a DBA)",
    )
    what.add_argument("--status", action="store_true", help="list applied and pending migrations")
    p.add_argument(
        "--all",
        action="store_true",
        help="with --sql: every migration, for an empty schema; needs no database",
    )
    p.add_argument(
        "--format",
        choices=("table", "json"),
        default="table",
        help="with --status: aligned table, or one JSON document",
    )
    _common(p)
    p.set_defaults(func=_migrate)

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
    p.add_argument("--holder", help="this runner's name (default: hostname:pid:xxxxxx)")
    p.add_argument(
        "--max-attempts",
        type=int,
        default=tasks.DEFAULT_MAX_ATTEMPTS,
        help="runs before a failing task is left alone until --force (default: %(default)s)",
    )
    _common(p)
    p.set_defaults(func=_task_run)

    for add in (_add_audit, _add_events, _add_dead_letters, _add_purge, _add_offsets):
        add(sub)
    _add_run(sub)
    _add_reconcile(sub)
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
