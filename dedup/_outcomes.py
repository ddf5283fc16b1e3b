"""What a batch leaves besides its effects: dead letters, and the events of what it refused.

Written by :class:`dedup._store.Store` in the batch's transaction, after the
handler ran.  Duplicates are the happy path: counted on the key's row and in
one span event per batch, never written (a replay would double the writes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import asyncpg

from dedup import _message as message_
from dedup import _results as store
from dedup import _telemetry as telemetry
from dedup.data import _events as events
from dedup.data import _sql as sql

DUPLICATE_KEYS_SHOWN = 20
"""How many keys a batch's ``dedup.duplicate`` span event lists (its count has them all)."""


async def record(
    conn: asyncpg.Connection,
    queries: sql.Queries,
    namespace: str,
    result: store.BatchResult,
    fence: store.Fence | None,
) -> None:
    """Write the batch's dead letters, and the events of its conflicts and dead letters."""
    if result.dead_letters:
        await _dead_letter(conn, queries, namespace, result.dead_letters, fence)
    await events.record(conn, queries.schema, _events(namespace, result, fence))


async def _dead_letter(
    conn: asyncpg.Connection,
    queries: sql.Queries,
    namespace: str,
    dead: Sequence[store.DeadLetter],
    fence: store.Fence | None,
) -> None:
    await queries.dead_letter.executemany(
        conn,
        [
            {
                "namespace": namespace,
                "group_id": fence.group_id if fence else None,
                "topic": d.msg.topic,
                "partition": d.msg.partition,
                "offset": d.msg.offset,
                "timestamp_ms": d.msg.timestamp,
                "kafka_key": d.msg.key,
                "value": None if d.msg.tombstone else d.msg.value,  # a tombstone stays null
                "header_names": [name for name, _ in d.msg.raw_headers],
                "header_values": [value for _, value in d.msg.raw_headers],
                "idempotency_key": d.msg.idempotency_key or None,
                "reason": d.reason,
                "error": d.error,
                "attempts": d.attempts,
                "token": fence.token if fence else None,
            }
            for d in dead
        ],
    )


def _events(
    namespace: str, result: store.BatchResult, fence: store.Fence | None
) -> list[events.Event]:
    token = fence.token if fence else None

    def event(kind: str, msg: message_.Message, **detail: Any) -> events.Event:
        return events.Event(
            "message",
            kind,
            namespace=namespace,
            key=msg.idempotency_key or None,
            resource=f"{msg.topic}:{msg.partition}",
            token=token,
            detail={"offset": msg.offset, **detail},
        )

    if result.duplicates:
        telemetry.transition(
            "duplicate",
            {
                "namespace": namespace,
                "token": token,
                "count": len(result.duplicates),
                "keys": [m.idempotency_key for m in result.duplicates[:DUPLICATE_KEYS_SHOWN]],
            },
        )
    made = [event("conflict", m) for m in result.conflicts]
    made += [
        event("dead_lettered", d.msg, reason=d.reason, attempts=d.attempts)
        for d in result.dead_letters
    ]
    return made
