"""Dead letters for operators: list them, show one whole, replay them through Kafka.

Replay produces the original record again (same topic and partition, key,
value and headers in order, nulls kept: a tombstone goes back as a tombstone; a
new offset and timestamp), so it goes through the consumer's claim path like
any delivery: a key that has been applied since is counted as a duplicate, not
applied twice.  Each dead letter is replayed under
a row lock and marked ``replayed_at`` in the same transaction, after Kafka
acknowledged the record; a ``replayed`` event records who did it and where the
copy landed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiokafka
import aiokafka.errors
import asyncpg

from dedup import _errors as errors
from dedup import _kafka_client as kafka_client
from dedup import _report as report
from dedup import _timespec as timespec
from dedup.data import _events as events
from dedup.data import _sql as sql
from dedup.operations import _audit as audit

KAFKA_TIMEOUT_MS = 5000


@dataclass(frozen=True)
class ListQuery:
    """What ``dedup dead-letters list`` was asked; ``None`` means no filter."""

    namespace: str | None = None
    """Consumer namespace."""
    topic: str | None = None
    """Topic of the original record."""
    since: timespec.TimeSpec | None = None
    """Dead-lettered at or after."""
    until: timespec.TimeSpec | None = None
    """Dead-lettered before."""
    pending: bool = False
    """Only those not replayed yet."""
    limit: int = report.DEFAULT_LIMIT
    """Most rows."""


async def list_(conn: asyncpg.Connection, schema: str, q: ListQuery) -> report.Report:
    """Dead letters matching ``q``, oldest first (without the record bytes: see :func:`show`)."""
    queries = sql.Queries(schema)
    window = await audit.Window.resolve(conn, queries, q.since, q.until)
    rows, cut = await audit.limited(
        conn,
        queries.audit_dead_letters,
        q.limit,
        keys=None,
        namespaces=[q.namespace] if q.namespace is not None else None,
        topic=q.topic,
        partition=None,
        offset=None,
        since=window.since,
        until=window.until,
        pending=q.pending,
    )
    asked = {
        "namespace": q.namespace,
        "topic": q.topic,
        **window.as_query(),
        "pending": q.pending,
        "limit": q.limit,
    }
    return report.Report(
        query=asked,
        sections=[report.Section("dead_letters", "dead letters", audit.DEAD_LETTER_COLUMNS, rows)],
        truncated=cut,
        nothing=audit.nothing_matches("dead letters", asked),
    )


def _whole(record: Mapping[str, Any]) -> dict[str, Any]:
    """A dead letter with its headers as ``[{"name", "value"}]``, bytes base64."""
    row = report.json_row(
        {k: v for k, v in record.items() if k not in ("header_names", "header_values")}
    )
    row["headers"] = [
        {"name": name, "value": report.b64_bytes(value)}
        for name, value in zip(record["header_names"], record["header_values"], strict=True)
    ]
    return row


NULL = "(null)"
"""How ``show`` prints a null key, a tombstone's value and a null header value."""


def _readable(value: bytes | None) -> str:
    """Bytes as text when they are printable UTF-8, else ``base64:...``; a null as ``(null)``."""
    if value is None:
        return NULL
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and text.isprintable():
        return text
    return f"base64:{report.b64_bytes(value)}"


async def show(conn: asyncpg.Connection, schema: str, dead_letter_id: int) -> report.Report:
    """One dead letter whole: the record's key, value and headers, and why it failed."""
    record = await sql.Queries(schema).dead_letter_record.fetchrow(conn, id=dead_letter_id)
    rows = [_whole(record)] if record else []
    # Shown vertically: every field, no columns.
    section = report.Section("dead_letters", "dead letter", (), rows)
    if record:
        readable = dict(rows[0])
        readable["key"] = _readable(record["key"])
        readable["value"] = _readable(record["value"])
        readable["headers"] = (
            ", ".join(
                f"{n}={_readable(v)}"
                for n, v in zip(record["header_names"], record["header_values"], strict=True)
            )
            or None
        )
        section.table_rows = [readable]
    return report.Report(
        query={"id": dead_letter_id},
        sections=[section],
        nothing=f"no dead letter with id {dead_letter_id}",
        vertical=True,
    )


REPLAYED_COLUMNS = report.columns(
    "id, namespace, idempotency_key:key, topic, partition:part, offset, "
    "replayed_offset:new offset, replayed_at"
)
SKIPPED_COLUMNS = report.columns("id, reason")


async def _start_producer(
    bootstrap_servers: str, kafka_options: Mapping[str, Any]
) -> aiokafka.AIOKafkaProducer:
    options = kafka_client.client_options(kafka_options)
    # The dead letter stays locked in an open transaction while its record is
    # produced: the request timeout keeps that well under the server's
    # idle_in_transaction_session_timeout (dedup.db).
    producer = aiokafka.AIOKafkaProducer(
        bootstrap_servers=bootstrap_servers,
        acks="all",
        enable_idempotence=True,
        request_timeout_ms=KAFKA_TIMEOUT_MS,
        **options,
    )
    try:
        await producer.start()
    except aiokafka.errors.KafkaError as exc:
        await producer.stop()
        raise await kafka_client.unreachable(
            bootstrap_servers, options, exc, what="dead-letters replay"
        ) from exc
    return producer


async def _missing_destination(
    producer: aiokafka.AIOKafkaProducer, topic: str, partition: int
) -> str | None:
    """Why the record cannot go back where it came from, or None when it can."""
    try:
        partitions = await producer.partitions_for(topic)
    except aiokafka.errors.KafkaError as exc:
        return f"topic {topic!r} is not in Kafka ({type(exc).__name__})"
    if partition not in partitions:
        return f"topic {topic!r} has no partition {partition}"
    return None


async def _replay_one(
    conn: asyncpg.Connection,
    producer: aiokafka.AIOKafkaProducer,
    schema: str,
    dead_letter_id: int,
    *,
    again: bool,
    holder: str,
) -> tuple[dict[str, Any] | None, str | None]:
    """Replay one dead letter; return (what was replayed, None) or (None, why not)."""
    queries = sql.Queries(schema)
    first = await queries.dead_letter_record.fetchrow(conn, id=dead_letter_id)
    if first is None:
        return None, "no dead letter with this id"
    # Found out before the row is locked: waiting for a missing topic takes seconds.
    missing = await _missing_destination(producer, first["topic"], first["partition"])
    if missing:
        return None, missing
    async with conn.transaction():
        record = await queries.dead_letter_locked.fetchrow(conn, id=dead_letter_id)
        if record["replayed_at"] is not None and not again:
            when = report.utc(record["replayed_at"])
            return None, f"replayed already at {when} (--again to resend)"
        try:
            sent = await producer.send_and_wait(
                record["topic"],
                record["value"],
                key=record["key"],
                partition=record["partition"],
                headers=list(zip(record["header_names"], record["header_values"], strict=True)),
            )
        except aiokafka.errors.KafkaError as exc:
            raise errors.ServiceUnavailableError(
                f"dead letter {dead_letter_id}: Kafka did not take the record: {exc}; "
                "it is not marked replayed, run the replay again"
            ) from exc
        replayed_at = await queries.dead_letter_replayed.fetchval(conn, id=dead_letter_id)
        await events.record(
            conn,
            schema,
            [
                events.Event(
                    "message",
                    "replayed",
                    namespace=record["namespace"],
                    key=record["idempotency_key"],
                    resource=f"{record['topic']}:{record['partition']}",
                    holder=holder,
                    detail={
                        "dead_letter_id": dead_letter_id,
                        "offset": record["offset"],
                        "replayed_offset": sent.offset,
                    },
                )
            ],
        )
    return {
        "id": dead_letter_id,
        "namespace": record["namespace"],
        "idempotency_key": record["idempotency_key"],
        "topic": record["topic"],
        "partition": record["partition"],
        "offset": record["offset"],
        "replayed_offset": sent.offset,
        "replayed_at": report.utc(replayed_at),
    }, None


async def replay(
    conn: asyncpg.Connection,
    schema: str,
    ids: Sequence[int],
    *,
    bootstrap_servers: str,
    again: bool = False,
    holder: str | None = None,
    kafka_options: Mapping[str, Any] | None = None,
) -> report.Report:
    """Produce each dead letter's record to its topic again; mark it replayed.

    ``kafka_options`` are the producer's security settings (aiokafka's names,
    and ``ssl_cafile``...: dedup._kafka_client).

    The report's ``skipped`` section names the ids not replayed now and why
    (unknown id, replayed already).
    """
    producer = await _start_producer(bootstrap_servers, kafka_options or {})
    replayed: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    try:
        for dead_letter_id in ids:
            done, why = await _replay_one(
                conn,
                producer,
                schema,
                dead_letter_id,
                again=again,
                holder=holder or audit.operator(),
            )
            if done is not None:
                replayed.append(done)
            else:
                skipped.append({"id": dead_letter_id, "reason": why})
    finally:
        await producer.stop()
    return report.Report(
        query={"ids": list(ids), "again": again},
        sections=[
            report.Section("replayed", "replayed", REPLAYED_COLUMNS, replayed),
            report.Section("skipped", "not replayed", SKIPPED_COLUMNS, skipped),
        ],
        nothing="nothing to replay",
    )
