"""``dedup offsets show | rewind | skip | delete-group``: where a consumer group stands, moving
it, and removing it.

A dedup consumer keeps its offsets in Postgres (``partitions.next_offset``,
moved in the same transaction as the effects) and seeks there on every
assignment; what Kafka holds is a copy for lag tools.  So a group is rewound or
a range skipped here, never with Kafka's ``kafka-consumer-groups
--reset-offsets`` (the consumer would overwrite Kafka's offset with Postgres'
within ``kafka_commit_interval``).

Moving a partition takes it the way a consumer does: a new fencing token, with
the command as holder (``dedup offsets rewind by alice@host``), so a running
owner's next write is refused.  The consumer sees the operator's token (at its
next batch, or within ``kafka_commit_interval`` when idle) and takes the
partition back from the offset set here.  Each move writes an event
(``offsets_rewound``, ``offsets_skipped``) with both offsets, both tokens and
who did it.  When the group has no members, Kafka's committed offsets are set
to the new ones at once, so Kafka's tools agree.

``dedup offsets delete-group`` removes a stopped group: from Kafka (with its
committed offsets) and, since a consumer of the group would resume from them,
its offsets in Postgres too, unless asked to keep them.  The keys in
``processed`` stay: a consumer of the same namespace that reads the messages
again counts each one applied before as a duplicate.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiokafka
import aiokafka.admin
import aiokafka.errors
import asyncpg
from aiokafka.structs import TopicPartition

from dedup import _errors as errors
from dedup import _offsets_kafka as offsets_kafka
from dedup import _report as report
from dedup import _timespec as timespec
from dedup.data import _db as db
from dedup.data import _events as events
from dedup.data import _sql as sql
from dedup.operations import _audit as audit

OPERATOR_PREFIX = "dedup offsets "
"""How the holder of a partition moved by this command starts."""

ACTIONS = ("rewind", "skip")

EVENT_KINDS = {"rewind": "offsets_rewound", "skip": "offsets_skipped"}

LOCK_TIMEOUT = "15s"
"""How long a move waits for a batch in flight on the partition to commit."""

SHOW_COLUMNS = report.columns("group_id:group, topic, partition:part, holder, token, next_offset")
KAFKA_COLUMNS = report.columns("end_offset:end, lag, kafka_committed")
NOTE_COLUMNS = report.columns("note")
"""Shown when a stored offset lies outside its partition's log (the JSON always has it)."""
MOVE_COLUMNS = report.columns(
    "group_id:group, topic, partition:part, status, old_offset, new_offset, "
    "old_token, new_token, kafka_committed"
)

log = logging.getLogger("dedup.offsets")


def operator_holder(action: str, who: str) -> str:
    """The holder a move writes, naming command and person: ``dedup offsets skip by bob@ops``."""
    return f"{OPERATOR_PREFIX}{action} by {who}"


def is_operator(holder: str) -> bool:
    """True when ``holder`` is a ``dedup offsets`` command (see :func:`operator_holder`)."""
    return holder.startswith(OPERATOR_PREFIX)


class GroupActiveError(errors.DedupError):
    """The consumer group has members in Kafka: a move the operator did not confirm
    (``--yes``), or a ``delete-group``, which Kafka refuses then."""


# ---------------------------------------------------------------------- show --


@dataclass(frozen=True)
class ShowQuery:
    """What ``dedup offsets show`` was asked; ``None`` means every group or topic."""

    group: str | None = None
    """The consumer group."""
    topic: str | None = None
    """The topic."""
    limit: int = report.DEFAULT_LIMIT
    """Most rows."""


async def show(
    conn: asyncpg.Connection, schema: str, q: ShowQuery, kafka: offsets_kafka.Kafka | None
) -> report.Report:
    """The stored offsets of ``q``'s partitions, with Kafka's end offsets and lag when asked."""
    rows, cut = await audit.limited(
        conn, sql.Queries(schema).offsets_list, q.limit, group_id=q.group, topic=q.topic
    )
    columns: tuple[report.Column, ...] = SHOW_COLUMNS
    for row in rows:
        row.update(end_offset=None, lag=None, kafka_committed=None, note=None)
    if kafka is not None:
        await _add_kafka(rows, kafka)
        columns += KAFKA_COLUMNS
        if any(row["note"] for row in rows):
            columns += NOTE_COLUMNS
    return report.Report(
        query={
            "group": q.group,
            "topic": q.topic,
            "bootstrap_servers": kafka.bootstrap_servers if kafka else None,
            "limit": q.limit,
        },
        sections=[report.Section("partitions", "partitions", columns, rows)],
        truncated=cut,
        nothing="no stored offsets match" + _described(q.group, q.topic),
    )


async def _add_kafka(rows: list[dict[str, Any]], kafka: offsets_kafka.Kafka) -> None:
    """Fill in end_offset, lag and kafka_committed (topics Kafka no longer has stay null)."""
    try:
        present = await kafka.topics()
        tps = sorted({TopicPartition(r["topic"], r["partition"]) for r in rows})
        logs = await kafka.log_range([tp for tp in tps if tp.topic in present])
        committed = {g: await kafka.committed(g) for g in sorted({r["group_id"] for r in rows})}
    except aiokafka.errors.KafkaError as exc:
        raise kafka.unavailable(exc) from exc
    for row in rows:
        tp = TopicPartition(row["topic"], row["partition"])
        row["kafka_committed"] = committed[row["group_id"]].get(tp)
        if tp in logs:
            row["end_offset"] = logs[tp].stop - 1
            if row["next_offset"] is not None:
                row["lag"] = row["end_offset"] - row["next_offset"]
                row["note"] = _outside(row, logs[tp])


def _outside(row: dict[str, Any], log: range) -> str | None:
    """What a stored offset outside the partition's log means (dedup.consumer._out_of_range)."""
    start, end, stored = log.start, log.stop - 1, row["next_offset"]
    if stored < start:
        return (
            f"below the log start {start}: offsets {stored} to {start - 1} were deleted by "
            "retention; the consumer resumes at the log start and records the loss"
        )
    if stored > end:
        return (
            f"beyond the log end {end} (was the topic recreated?): the consumer holds the "
            f"partition until `dedup offsets rewind --group {row['group_id']} --topic "
            f"{row['topic']} --partition {row['partition']} --to-offset {start}`"
        )
    return None


def _described(group: str | None, topic: str | None) -> str:
    given = [f"{k}={v}" for k, v in (("group", group), ("topic", topic)) if v is not None]
    return f" {' '.join(given)}" if given else ""


# -------------------------------------------------------------- rewind, skip --


@dataclass(frozen=True)
class Move:
    """What ``dedup offsets rewind`` or ``skip`` was asked."""

    action: str
    """``rewind`` (move back: messages are offered again) or ``skip`` (move forward)."""
    group: str
    """The consumer group."""
    topic: str
    """The topic."""
    partitions: Sequence[int] = ()
    """The partitions to move (empty: every partition of the topic)."""
    to_offset: int | None = None
    """The new next offset (with one partition)."""
    to_time: timespec.TimeSpec | None = None
    """Or a time: each partition moves to its first record at or after it."""
    yes: bool = False
    """Go ahead although the group has members."""
    who: str | None = None
    """Who moves it, for the holder and the event (default: user@host)."""

    def check(self) -> None:
        """Refuse a request that cannot mean one thing."""
        if self.action not in ACTIONS:
            raise errors.ConfigurationError(f"unknown action {self.action!r}")
        if (self.to_offset is None) == (self.to_time is None):
            raise errors.ConfigurationError("give one of --to-offset N or --to-time T")
        if self.to_offset is not None and len(self.partitions) != 1:
            raise errors.ConfigurationError(
                "--to-offset needs one --partition: offsets are per partition "
                "(--to-time moves several partitions at once)"
            )

    def as_query(self, when: datetime.datetime | None) -> dict[str, Any]:
        """The request as a report's ``query``."""
        return {
            "action": self.action,
            "group": self.group,
            "topic": self.topic,
            "partitions": list(self.partitions) or None,
            "to_offset": self.to_offset,
            "to_time": report.utc(when),
            "yes": self.yes,
        }


@dataclass
class _Target:
    """One partition to move, and what happened to it."""

    tp: TopicPartition
    offset: int
    log_start: int
    old: asyncpg.Record | None = None
    new_token: int | None = None
    status: str = "unchanged"

    def row(self, group: str, kafka_committed: bool) -> dict[str, Any]:
        return {
            "group_id": group,
            "topic": self.tp.topic,
            "partition": self.tp.partition,
            "status": self.status,
            "old_offset": self.old["next_offset"] if self.old else None,
            "new_offset": self.offset,
            "old_token": self.old["token"] if self.old else None,
            "new_token": self.new_token,
            "old_holder": self.old["holder"] if self.old else None,
            "kafka_committed": kafka_committed,
        }


async def move(
    conn: asyncpg.Connection, schema: str, m: Move, kafka: offsets_kafka.Kafka
) -> tuple[report.Report, str | None]:
    """Move ``m``'s partitions; return the report and a note for the operator, if any.

    Raises :class:`GroupActiveError` when the group has members and ``m.yes``
    is not set, :class:`dedup.ConfigurationError` for an offset outside the
    partition's log or a move in the wrong direction (nothing is moved then).
    """
    m.check()
    queries = sql.Queries(schema)
    when = timespec.resolve(m.to_time, await queries.database_now.fetchval(conn))
    try:
        members = await kafka.members(m.group)
        if members and not m.yes:
            raise GroupActiveError(
                f"group {m.group} has {members} active member(s) in Kafka: moving its offsets "
                "fences out the running consumer, which then takes the partition back from "
                "the new offset. Pass --yes to go ahead, or stop the group first"
            )
        targets = await _targets(m, when, kafka)
    except aiokafka.errors.KafkaError as exc:
        raise kafka.unavailable(exc) from exc

    holder = operator_holder(m.action, m.who or audit.operator())
    async with db.transaction(conn, {"lock_timeout": LOCK_TIMEOUT}):
        await _lock(conn, queries, m, targets)
        moving = [t for t in targets if t.status != "unchanged"]
        if moving:
            rows = await queries.offsets_move.fetch(
                conn,
                group_id=m.group,
                topic=m.topic,
                holder=holder,
                partitions=[t.tp.partition for t in moving],
                next_offsets=[t.offset for t in moving],
            )
            tokens = {r["partition"]: r["token"] for r in rows}
            for t in moving:
                t.new_token = tokens[t.tp.partition]
            await events.record(conn, schema, [_event(m, t, holder, when) for t in moving])

    note = None
    committed = False
    if members:
        note = (
            f"group {m.group} is running: its consumers take the moved partitions back and "
            "write the new offsets to Kafka within their kafka_commit_interval"
        )
    else:
        try:
            await kafka.commit(m.group, {t.tp: t.offset for t in targets})
            committed = True
        except aiokafka.errors.KafkaError as exc:
            note = (
                f"Postgres has the new offsets; Kafka's committed offsets were not updated "
                f"({exc!r}): the group's consumers write them when they start"
            )
    rows = [t.row(m.group, committed) for t in targets]
    found = report.Report(
        query=m.as_query(when),
        sections=[report.Section("partitions", "partitions", MOVE_COLUMNS, rows)],
    )
    return found, note


async def _targets(
    m: Move, when: datetime.datetime | None, kafka: offsets_kafka.Kafka
) -> list[_Target]:
    """The partitions to move and their new offsets, each inside the partition's log."""
    known = await kafka.partitions(m.topic)
    wanted = list(m.partitions) or known
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        raise errors.ConfigurationError(
            f"--partition {unknown[0]}: topic {m.topic} has partitions {_span(known)}"
        )
    tps = [TopicPartition(m.topic, p) for p in wanted]
    logs = await kafka.log_range(tps)
    if when is not None:
        offsets = await kafka.at_time(tps, when)
    else:
        assert m.to_offset is not None  # noqa: S101 (Move.check)
        offsets = dict.fromkeys(tps, m.to_offset)
    for tp in tps:
        if offsets[tp] not in logs[tp]:
            raise errors.ConfigurationError(
                f"--to-offset {offsets[tp]}: partition {tp.partition} of {tp.topic} holds "
                f"offsets {logs[tp].start} to {logs[tp].stop - 1} (its end)"
            )
    return [_Target(tp, offsets[tp], logs[tp].start) for tp in tps]


def _span(numbers: Sequence[int]) -> str:
    return f"{numbers[0]} to {numbers[-1]}" if numbers else "none"


async def _lock(
    conn: asyncpg.Connection, queries: sql.Queries, m: Move, targets: list[_Target]
) -> None:
    """Lock the partitions' rows, read where they stand and check the direction of the move."""
    try:
        rows = await queries.offsets_lock.fetch(
            conn, group_id=m.group, topic=m.topic, partitions=[t.tp.partition for t in targets]
        )
    except asyncpg.LockNotAvailableError as exc:
        raise errors.ServiceUnavailableError(
            f"a batch of group {m.group} kept a partition of {m.topic} locked for "
            f"{LOCK_TIMEOUT}; run the command again"
        ) from exc
    stored = {r["partition"]: r for r in rows}
    for t in targets:
        t.old = stored.get(t.tp.partition)
        current = t.old["next_offset"] if t.old else None
        if current == t.offset:
            continue
        backwards = current is not None and t.offset < current
        if current is not None and backwards != (m.action == "rewind"):
            other = "skip" if m.action == "rewind" else "rewind"
            raise errors.ConfigurationError(
                f"group {m.group} is at offset {current} on partition {t.tp.partition} of "
                f"{m.topic}: {m.action} to {t.offset} would move it "
                f"{'back' if backwards else 'forward'}; use `dedup offsets {other}`"
            )
        t.status = "rewound" if m.action == "rewind" else "skipped"


def _event(m: Move, t: _Target, holder: str, when: datetime.datetime | None) -> events.Event:
    old_offset = t.old["next_offset"] if t.old else None
    detail: dict[str, Any] = {
        "old_offset": old_offset,
        "new_offset": t.offset,
        "old_token": t.old["token"] if t.old else None,
        "new_token": t.new_token,
        "old_holder": t.old["holder"] if t.old else None,
    }
    if when is not None:
        detail["to_time"] = report.utc(when)
    if m.action == "skip":
        # Offsets skipped_from .. skipped_to - 1 are never applied by this group.
        detail["skipped_from"] = t.log_start if old_offset is None else old_offset
        detail["skipped_to"] = t.offset
    return events.Event(
        "partition",
        EVENT_KINDS[m.action],
        resource=f"{m.group}:{t.tp.topic}:{t.tp.partition}",
        holder=holder,
        token=t.new_token,
        detail=detail,
    )


# -------------------------------------------------------------- delete-group --

DELETE_GROUP = "delete-group"
"""The action's name, in the holder of its events (``dedup offsets delete-group by ...``)."""
DELETED_EVENT = "offsets_deleted"
"""The event written for each stored offset ``delete-group`` deletes."""
DELETE_COLUMNS = report.columns(
    "group_id:group, topic, partition:part, status, old_offset, old_token, old_holder"
)


class NoSuchGroupError(errors.DedupError):
    """``delete-group`` found nothing to delete: no such group in Kafka, no offsets of it in
    Postgres."""


@dataclass(frozen=True)
class DeleteGroup:
    """What ``dedup offsets delete-group`` was asked."""

    group: str
    """The consumer group."""
    keep_offsets: bool = False
    """Delete the group in Kafka only; the offsets in Postgres stay (the group resumes there)."""
    who: str | None = None
    """Who deletes it, for the holder of the events (default: user@host)."""


async def delete_group(
    conn: asyncpg.Connection, schema: str, d: DeleteGroup, kafka: offsets_kafka.Kafka
) -> report.Report:
    """Delete ``d.group`` in Kafka and, unless ``d.keep_offsets``, its offsets in Postgres.

    Nothing is deleted when Kafka shows members (:class:`GroupActiveError`) or when
    neither Kafka nor Postgres knows the group (:class:`NoSuchGroupError`).  The
    rows go in a transaction that commits only once Kafka has deleted the group
    or answered that it has none: a consumer that joins in between makes Kafka
    refuse, and the rows stay.  Each deleted row writes an ``offsets_deleted``
    event with the offset, token and holder it had.
    """
    queries = sql.Queries(schema)
    try:
        members = await kafka.members(d.group)
    except aiokafka.errors.KafkaError as exc:
        raise kafka.unavailable(exc) from exc
    if members:
        raise GroupActiveError(_not_empty(d.group, f"{members} active member(s)"))
    holder = operator_holder(DELETE_GROUP, d.who or audit.operator())
    async with db.transaction(conn, {"lock_timeout": LOCK_TIMEOUT}):
        if d.keep_offsets:
            stored = await queries.offsets_list.fetch(
                conn, group_id=d.group, topic=None, limit=report.MAX_LIMIT
            )
        else:
            stored = await _delete_stored(conn, queries, d.group)
            await events.record(conn, schema, [_deleted(d.group, r, holder) for r in stored])
        in_kafka = await _delete_in_kafka(kafka, d.group)
        if not in_kafka and (d.keep_offsets or not stored):
            where = "" if d.keep_offsets else " and Postgres holds no offsets of it"
            raise NoSuchGroupError(
                f"no group {d.group}: Kafka answers {aiokafka.errors.GroupIdNotFound.message} "
                f"(the group id does not exist){where}; nothing was deleted"
            )
    status = "kept" if d.keep_offsets else "deleted"
    rows = [
        {
            "group_id": d.group,
            "topic": r["topic"],
            "partition": r["partition"],
            "status": status,
            "old_offset": r["next_offset"],
            "old_token": r["token"],
            "old_holder": r["holder"],
        }
        for r in sorted(stored, key=lambda r: (r["topic"], r["partition"]))
    ]
    kafka_said = (
        f"kafka: group {d.group} deleted, its committed offsets with it"
        if in_kafka
        else f"kafka: no group {d.group} ({aiokafka.errors.GroupIdNotFound.message}), "
        "nothing to delete there"
    )
    return report.Report(
        query={"group": d.group, "keep_offsets": d.keep_offsets},
        sections=[report.Section("partitions", "partitions", DELETE_COLUMNS, rows)],
        fields={"kafka_group": "deleted" if in_kafka else "not_found"},
        heading=kafka_said,
        nothing=f"no stored offsets of group {d.group} in Postgres",
    )


def _not_empty(group: str, members: str) -> str:
    return (
        f"group {group} has {members} in Kafka, and Kafka deletes only an empty group "
        f"(it answers {aiokafka.errors.NonEmptyGroup.message}): stop its consumers first; "
        "nothing was deleted"
    )


async def _delete_stored(
    conn: asyncpg.Connection, queries: sql.Queries, group: str
) -> list[asyncpg.Record]:
    """Delete the group's rows, once a batch in flight on them has committed."""
    try:
        rows: list[asyncpg.Record] = await queries.offsets_delete_group.fetch(conn, group_id=group)
    except asyncpg.LockNotAvailableError as exc:
        raise errors.ServiceUnavailableError(
            f"a batch of group {group} kept a partition locked for {LOCK_TIMEOUT}; "
            "run the command again"
        ) from exc
    return rows


async def _delete_in_kafka(kafka: offsets_kafka.Kafka, group: str) -> bool:
    """Delete the group in Kafka: True when it did, False when Kafka has no such group."""
    try:
        await kafka.delete_group(group)
    except aiokafka.errors.GroupIdNotFound:
        return False
    except aiokafka.errors.NonEmptyGroup as exc:
        # A consumer joined since the members were counted.
        raise GroupActiveError(_not_empty(group, "active members")) from exc
    except aiokafka.errors.KafkaError as exc:
        raise kafka.unavailable(exc) from exc
    return True


def _deleted(group: str, row: asyncpg.Record, holder: str) -> events.Event:
    return events.Event(
        "partition",
        DELETED_EVENT,
        resource=f"{group}:{row['topic']}:{row['partition']}",
        holder=holder,
        token=row["token"],
        detail={
            "old_offset": row["next_offset"],
            "old_token": row["token"],
            "old_holder": row["holder"],
        },
    )
