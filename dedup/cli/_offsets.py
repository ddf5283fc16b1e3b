"""``dedup offsets show | rewind | skip | delete-group``: where a group stands in Postgres,
moving it, and removing it."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dedup import _errors as errors
from dedup import _kafka_client as kafka_client
from dedup import _offsets_kafka as offsets_kafka
from dedup import _report as report
from dedup.cli import _common as common
from dedup.operations import _offsets as offsets


def _kafka(args: argparse.Namespace) -> offsets_kafka.Kafka:
    return offsets_kafka.Kafka(args.bootstrap_servers, kafka_client.kafka_options(args))


async def _show(args: argparse.Namespace) -> int:
    """each partition's stored offset, holder and token; Kafka's end offset and lag

    Exit codes: 0 found, 1 nothing matches, 2 bad usage.
    """
    query = common.from_args(offsets.ShowQuery, args)
    offsets_kafka.quiet_aiokafka()
    async with common.connection(args) as conn:
        if not args.bootstrap_servers:
            return common.show(await offsets.show(conn, args.schema, query, None), args)
        async with _kafka(args) as kafka:
            return common.show(await offsets.show(conn, args.schema, query, kafka), args)


async def _move(args: argparse.Namespace) -> int:
    request = common.from_args(
        offsets.Move,
        args,
        action=args.offsets_command,
        partitions=sorted(set(args.partition or ())),
        who=args.holder,
    )
    request.check()
    if not args.bootstrap_servers:
        raise errors.ConfigurationError(
            f"`offsets {args.offsets_command}` needs Kafka to check that the group is stopped, "
            "to find the partitions' offsets and to write Kafka's committed offsets: pass "
            "--bootstrap-servers host:port or set KAFKA_BOOTSTRAP_SERVERS"
        )
    offsets_kafka.quiet_aiokafka()
    async with (
        common.connection(args) as conn,
        _kafka(args) as kafka,
    ):
        done, note = await offsets.move(conn, args.schema, request, kafka)
    common.show(done, args)  # before the note, on a terminal too
    if note:
        print(report.escape(f"dedup offsets {args.offsets_command}: {note}"), file=sys.stderr)
    return common.EXIT_OK


async def _delete_group(args: argparse.Namespace) -> int:
    """delete a stopped group: in Kafka, and its offsets in Postgres

    Kafka deletes the group with its committed offsets; dedup deletes the
    group's stored offsets (a consumer would resume from them), each with an
    offsets_deleted event, unless --keep-offsets. The keys stay: a consumer
    that reads the messages again counts them as duplicates. Exit codes: 0
    deleted, 1 refused (the group has members; no such group in Kafka or
    Postgres) or Kafka/Postgres unavailable, 2 bad usage.
    """
    if not args.bootstrap_servers:
        raise errors.ConfigurationError(
            "`offsets delete-group` deletes the group in Kafka: pass --bootstrap-servers "
            "host:port or set KAFKA_BOOTSTRAP_SERVERS"
        )
    request = common.from_args(offsets.DeleteGroup, args, who=args.holder)
    offsets_kafka.quiet_aiokafka()
    async with (
        common.connection(args) as conn,
        _kafka(args) as kafka,
    ):
        done = await offsets.delete_group(conn, args.schema, request, kafka)
    return common.show(done, args, ok=True)


_MOVES = (
    (
        "rewind",
        "move back: the messages are offered again (duplicates unless their keys are purged)",
    ),
    ("skip", "move forward: the messages in between are never applied"),
)


def add_offsets(sub: Any) -> None:
    """The ``offsets show | rewind | skip | delete-group`` commands."""
    group = common.command(
        sub,
        "offsets",
        help="show, rewind or skip a consumer group's offsets (Postgres holds them), "
        "or delete the group",
        description="A dedup consumer resumes from the offsets in Postgres, not Kafka's: "
        "rewind, skip and delete a group here, not with kafka-consumer-groups "
        "--reset-offsets or --delete.",
    )
    commands = group.add_subparsers(dest="offsets_command", required=True, metavar="ACTION")
    p = common.command(commands, "show", _show)
    common.add_filters(
        p, group="the consumer group (default: all)", topic="the topic (default: all)"
    )
    common.add_kafka(p, "Kafka, for end offsets and lag; '' for none", secured=True)
    common.add_output(p)
    for action, what in _MOVES:
        _add_move(commands, action, what)
    p = common.command(commands, offsets.DELETE_GROUP, _delete_group)
    p.add_argument("--group", required=True, help="the consumer group")
    p.add_argument(
        "--keep-offsets",
        action="store_true",
        help="delete the group in Kafka only; its offsets in Postgres stay (it resumes there)",
    )
    p.add_argument("--holder", help="who deletes it, for the events table (default: user@host)")
    common.add_kafka(p, "Kafka", secured=True)
    common.add_output(p, limit=False)


def _add_move(commands: Any, action: str, what: str) -> None:
    p = common.command(
        commands,
        action,
        _move,
        help=what,
        description=f"{what[0].upper()}{what[1:]}. Fences out a running owner (new token) "
        "and records an event. Exit codes: 0 done, 1 refused (the group has members and "
        "no --yes) or Kafka/Postgres unavailable, 2 bad usage.",
    )
    p.add_argument("--group", required=True, help="the consumer group")
    p.add_argument("--topic", required=True, help="the topic")
    p.add_argument(
        "--partition",
        type=common.integer(0, common.INT32_MAX),
        action="append",
        help="a partition (repeatable; default: every partition of the topic)",
    )
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument(
        "--to-offset", type=common.integer(0, common.INT64_MAX), help="the next offset to consume"
    )
    to.add_argument(
        "--to-time",
        type=common.TIME,
        help="the first record at or after this time (ISO 8601, or 2h, 7d ago); "
        "the end of a partition with none",
    )
    p.add_argument("--yes", action="store_true", help="go ahead although the group has members")
    p.add_argument("--holder", help="who moves it, for the events table (default: user@host)")
    common.add_kafka(p, "Kafka", secured=True)
    common.add_output(p, limit=False)
