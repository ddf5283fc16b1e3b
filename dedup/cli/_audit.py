"""The operator commands: ``audit``, ``events``, ``dead-letters``, ``purge``, ``reconcile``.

Each reads (or purges) what the consumers and task runners left in the
database and prints one :class:`dedup._report.Report`, as a table or JSON.
A command's function says in its docstring what ``--help`` shows (see
:func:`dedup.cli._common.command`).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
from typing import Any

import orjson

from dedup import _errors as errors
from dedup import _kafka_client as kafka_client
from dedup import _report as report
from dedup.cli import _common as common
from dedup.operations import _audit as audit
from dedup.operations import _dead_letters as dead_letters
from dedup.operations import _diagnose as diagnosis
from dedup.operations import _reconciliation as reconciliation
from dedup.operations import _retention as retention


async def _audit(args: argparse.Namespace) -> int:
    """what happened to a message: its claimed key and any dead letter

    Exit codes: 0 found, 1 nothing matches, 2 bad usage.
    """
    query = common.from_args(audit.AuditQuery, args)
    query.check()
    async with common.connection(args) as conn:
        return common.show(await audit.audit(conn, args.schema, query), args)


async def _events(args: argparse.Namespace) -> int:
    """the transitions recorded for a key, a resource or a task

    Exit codes: 0 found, 1 nothing matches, 2 bad usage.
    """
    if args.business_key is not None and args.task is None:
        raise errors.ConfigurationError("--business-key goes with --task CODE")
    if args.task is not None and args.key is not None:
        raise errors.ConfigurationError("with --task, give the business key as --business-key")
    if args.task is not None and args.namespace is not None:
        raise errors.ConfigurationError(
            "--task is the task's namespace: give --task or --namespace, not both"
        )
    key = args.business_key if args.task is not None else args.key
    query = common.from_args(audit.EventsQuery, args, key=key)
    query.check()
    async with common.connection(args) as conn:
        return common.show(await audit.events(conn, args.schema, query), args)


async def _dead_letters_list(args: argparse.Namespace) -> int:
    """dead letters, oldest first

    Exit codes: 0 found, 1 none match, 2 bad usage.
    """
    query = common.from_args(dead_letters.ListQuery, args)
    async with common.connection(args) as conn:
        return common.show(await dead_letters.list_(conn, args.schema, query), args)


async def _dead_letters_show(args: argparse.Namespace) -> int:
    """one dead letter whole: key, value, headers, reason

    Exit codes: 0 found, 1 no such id, 2 bad usage.
    """
    async with common.connection(args) as conn:
        return common.show(await dead_letters.show(conn, args.schema, args.id), args)


async def _dead_letters_replay(args: argparse.Namespace) -> int:
    """produce dead letters to their topic again, through the claim path

    Exit codes: 0 all replayed, 1 some not (unknown id, replayed already), 2 bad usage.
    """
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
    async with common.connection(args) as conn:
        done = await dead_letters.replay(
            conn,
            args.schema,
            args.ids,
            bootstrap_servers=args.bootstrap_servers,
            again=args.again,
            holder=args.holder,
            kafka_options=kafka_client.kafka_options(args),
        )
    return common.show(done, args, ok=not done.section("skipped").rows)


async def _purge(args: argparse.Namespace) -> int:
    """delete keys older than the retention window, in short batches

    Exit codes: 0 done, 1 some batches were skipped (locked; rerun), 2 bad usage.
    """
    # --before 30d means the same as --older-than 30d.
    older_than = args.older_than
    before = args.before
    if isinstance(before, datetime.timedelta):
        older_than, before = before, None
    async with common.connection(args) as conn:
        done = await retention.purge(
            conn,
            args.schema,
            older_than=older_than,
            before=before,
            events_older_than=args.events_older_than,
            batch_size=args.batch_size,
            pause=args.pause,
            dry_run=args.dry_run,
            force=args.force,
        )
    if done.forced:
        did = "would purge" if args.dry_run else "purged"
        print(f"dedup purge: --force: {did} with a cutoff that is not in the past", file=sys.stderr)
    return common.show(done.as_report(), args, ok=not done.batches_skipped)


async def _reconcile(args: argparse.Namespace) -> int:
    """compare a task's source and result for one business date

    Runs the source and result queries declared for the task code (RECONCILE
    in a module: --module, $DEDUP_RECONCILE_MODULES, or an entry point of the
    dedup.reconcile group) for one business date, in one snapshot; prints both figures
    and the difference and writes a reconcile event. A difference within the
    check's thresholds is OK. --all checks every declared task, and --since D
    every date from D to today, one line each. Exit codes: 0 they agree,
    1 mismatch, 2 bad usage (unknown task, bad date, a query that fails).
    """
    registry = reconciliation.Registry.default(args.module)
    if args.list:
        for check in registry.checks():
            print(f"{report.escape(check.task)}\t{report.escape(check.description)}")
        return common.EXIT_OK
    if args.all or args.since is not None:
        return await _sweep(args, registry)
    if not args.task or args.date is None:
        raise errors.ConfigurationError(
            "give --task CODE and --date YYYY-MM-DD (or --all, --since, --list)"
        )
    check = registry.get(args.task)
    async with common.connection(args) as conn:
        found = await reconciliation.reconcile(
            conn, check, args.date, schema=args.schema, holder=args.holder
        )
    return common.show(found.as_report(), args, ok=found.ok)


async def _sweep(args: argparse.Namespace, registry: reconciliation.Registry) -> int:
    """``reconcile --all`` and ``--since``: every task (or one) on every date, a line each."""
    if (args.date is None) == (args.since is None):
        raise errors.ConfigurationError("give one of --date YYYY-MM-DD and --since YYYY-MM-DD")
    checks = registry.swept() if args.all else [registry.get(args.task or "")]
    if not checks:
        raise errors.ConfigurationError("no reconcile check declared (see --list)")
    async with common.connection(args) as conn:
        found = await reconciliation.sweep(
            conn,
            checks,
            date=args.date,
            since=args.since,
            schema=args.schema,
            holder=args.holder,
            alert_url=args.alert_url or os.environ.get(reconciliation.ALERT_URL_VARIABLE) or None,
        )
    if args.format == "json":
        print(orjson.dumps(found.as_json()).decode())
    else:
        print(*(report.escape(line) for line in found.lines()), sep="\n")
    return common.EXIT_PROBLEM if found.mismatches else common.EXIT_OK


async def _diagnose(args: argparse.Namespace) -> int:
    """say which layer failed for a task and business date, with the evidence

    Reads the task's runs and the lease's losses from the events, and the
    figures of the task's reconcile check if one is declared (as for reconcile):
    duplicate_triggering (two holders started the period at once),
    duplicate_execution (one at a time, but it succeeded twice, or the result
    table holds more than the source), stale_holder_refused (the fence refused a
    stale holder), or none. Exit codes: 0 none or a refused stale holder, 1 a
    duplicate found, 2 bad usage.
    """
    registry = reconciliation.Registry.default(args.module)
    check = registry.get(args.task) if args.task in registry.tasks() else None
    async with common.connection(args) as conn:
        found = await diagnosis.diagnose(
            conn, args.task, args.date, check=check, schema=args.schema
        )
    if args.format == "json":
        print(orjson.dumps(found.as_json()).decode())
    else:
        print(*(report.escape(line) for line in found.lines()), sep="\n")
        if check is None:
            print(report.escape(f"(no reconcile check declared for {args.task}: runs only)"))
    return common.EXIT_OK if found.ok else common.EXIT_PROBLEM


# What audit and events both look a message up by.
_KEY_FILTERS = {
    "key": "the idempotency key, as known or as stored (sha256:...)",
    "namespace": "the consumer namespace (default: all)",
}


def add_audit(sub: Any) -> None:
    """The ``audit`` command."""
    p = common.command(sub, "audit", _audit)
    where = "with --partition and --offset: where the message was read"
    common.add_filters(p, **_KEY_FILTERS, topic=where)
    p.add_argument("--partition", type=common.integer(0, common.INT32_MAX), help="see --topic")
    p.add_argument("--offset", type=common.integer(0, common.INT64_MAX), help="see --topic")
    common.add_window(p, "first seen (dead letters: created)")
    p.add_argument(
        "--status",
        dest="statuses",
        type=common.argtype(audit.parse_statuses, "status"),
        action="extend",
        help=f"any of {', '.join(audit.STATUSES)} (repeat or comma-separate)",
    )
    common.add_output(p)


def add_events(sub: Any) -> None:
    """The ``events`` command."""
    p = common.command(sub, "events", _events)
    common.add_filters(
        p,
        **_KEY_FILTERS,
        resource="a lease resource or topic:partition",
        task="a task code",
        business_key="with --task: the task's business key",
        kind="only this transition, e.g. task_taken_over",
    )
    common.add_window(p, "recorded")
    common.add_output(p)


def add_dead_letters(sub: Any) -> None:
    """The ``dead-letters list | show | replay`` commands."""
    dl = common.command(sub, "dead-letters", help="list, show and replay dead letters")
    commands = dl.add_subparsers(dest="dead_letters_command", required=True, metavar="ACTION")
    p = common.command(commands, "list", _dead_letters_list)
    common.add_filters(p, namespace="the consumer namespace", topic="the original record's topic")
    common.add_window(p, "dead-lettered")
    p.add_argument("--pending", action="store_true", help="only those not replayed yet")
    common.add_output(p)

    p = common.command(commands, "show", _dead_letters_show)
    p.add_argument("id", type=common.integer(1, common.INT64_MAX), help="the dead letter's id")
    common.add_output(p, limit=False)

    p = common.command(commands, "replay", _dead_letters_replay)
    p.add_argument(
        "ids",
        metavar="ID",
        nargs="+",
        type=common.integer(1, common.INT64_MAX),
        help="dead letter ids",
    )
    common.add_kafka(p, "Kafka", secured=True)
    p.add_argument("--again", action="store_true", help="also resend those replayed already")
    p.add_argument("--holder", help="who replays, for the events table (default: user@host)")
    common.add_output(p, limit=False)


def add_purge(sub: Any) -> None:
    """The ``purge`` command."""
    p = common.command(sub, "purge", _purge)
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--older-than", type=common.DURATION, help="the window: 30d, 12h, 90m, 3600s")
    when.add_argument("--before", type=common.TIME, help="an exact cutoff (ISO 8601)")
    p.add_argument(
        "--events-older-than",
        type=common.DURATION,
        help="also delete events older than this (default: keep events; needs the owner)",
    )
    p.add_argument(
        "--batch-size",
        type=common.integer(1, retention.MAX_BATCH_SIZE),
        default=retention.DEFAULT_BATCH_SIZE,
        help="rows per DELETE transaction (default: %(default)s)",
    )
    p.add_argument(
        "--pause",
        type=common.seconds(0, retention.MAX_PAUSE),
        default=retention.DEFAULT_PAUSE,
        help="seconds between batches (default: %(default)s)",
    )
    p.add_argument("--dry-run", action="store_true", help="count what would go; delete nothing")
    p.add_argument(
        "--force",
        action="store_true",
        help="purge although the cutoff is not in the past (every key goes: redeliveries apply)",
    )
    common.add_output(p, limit=False)


def add_diagnose(sub: Any) -> None:
    """The ``diagnose`` command."""
    p = common.command(sub, "diagnose", _diagnose)
    p.add_argument("--task", required=True, help="the task code, e.g. statements")
    p.add_argument(
        "--date",
        required=True,
        type=common.argtype(reconciliation.parse_date, "date"),
        help="the business date, YYYY-MM-DD",
    )
    p.add_argument(
        "--module", action="append", default=[], help="a module declaring RECONCILE (repeatable)"
    )
    p.add_argument("--format", choices=("table", "json"), default="table")
    common.add_common(p)


def add_reconcile(sub: Any) -> None:
    """The ``reconcile`` command."""
    p = common.command(sub, "reconcile", _reconcile)
    p.add_argument("--task", help="the task code, e.g. statements")
    p.add_argument(
        "--date",
        type=common.argtype(reconciliation.parse_date, "date"),
        help="the business date, YYYY-MM-DD",
    )
    p.add_argument(
        "--module",
        action="append",
        default=[],
        help="a module declaring RECONCILE (repeatable)",
    )
    p.add_argument("--list", action="store_true", help="list the known task codes and exit")
    p.add_argument(
        "--all",
        action="store_true",
        help="the daily sweep: every check of the --module(s) and $DEDUP_RECONCILE_MODULES, "
        "or, when they declare none, of every entry point",
    )
    p.add_argument(
        "--since",
        type=common.argtype(reconciliation.parse_date, "date"),
        help="every business date from this one to today (instead of --date)",
    )
    p.add_argument(
        "--alert-url",
        help=f"with --all or --since: POST each mismatch's alert (JSON) here, once per task and "
        f"date, through the outbox (default: ${reconciliation.ALERT_URL_VARIABLE})",
    )
    p.add_argument("--holder", help="who checks, for the events table (default: hostname:pid)")
    common.add_output(p, limit=False)
