"""The ``effects`` business table, its handlers, and the consumer the tests build on it.

``effects`` has no unique constraint on purpose: a message applied twice shows
up as two rows, so tests can count doubles instead of hitting an error.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import dedup

EFFECTS = """
CREATE TABLE IF NOT EXISTS effects (
    id      bigserial PRIMARY KEY,
    key     text   NOT NULL,
    payload jsonb  NOT NULL,
    token   bigint NOT NULL,
    "partition" int NOT NULL,
    "offset" bigint NOT NULL
)
"""


async def record_effect(msg: dedup.Message, tx: dedup.Tx) -> None:
    """The per-message handler: one effects row per applied message."""
    body = msg.json()
    if body.get("explode"):
        raise RuntimeError(f"handler bug for {msg.idempotency_key}")
    await tx.conn.execute(
        'INSERT INTO effects (key, payload, token, "partition", "offset")'
        " VALUES ($1, $2, $3, $4, $5)",
        msg.idempotency_key,
        body,
        tx.token,
        msg.partition,
        msg.offset,
    )


async def record_effects(msgs: list[dedup.Message], tx: dedup.Tx) -> None:
    """The batch handler: the same rows, one statement per batch."""
    if any(m.json().get("explode") for m in msgs):
        raise RuntimeError("handler bug in batch")
    await tx.conn.execute(
        'INSERT INTO effects (key, payload, token, "partition", "offset")'
        " SELECT * FROM unnest($1::text[], $2::jsonb[], $3::bigint[], $4::int[], $5::bigint[])",
        [m.idempotency_key for m in msgs],
        [m.json() for m in msgs],
        [tx.token] * len(msgs),
        [m.partition for m in msgs],
        [m.offset for m in msgs],
    )


def consumer(
    handler: Any,
    topic: str,
    bootstrap_servers: str,
    pool: Any,
    *,
    key_field: str = "id",
    key: Any = None,
    group_id: str | None = None,
    **options: Any,
) -> dedup.IdempotentConsumer:
    """An IdempotentConsumer of ``topic`` in its own group (``g-<topic>``), from offset 0.

    Keyed by the JSON field ``key_field``, or by the strategy ``key`` when one is given.
    It leaves the process's signals alone unless ``install_signal_handlers=True``
    (a consumer that is a process of its own).
    """
    options.setdefault("install_signal_handlers", False)
    return dedup.IdempotentConsumer(
        handler,
        topics=[topic],
        group_id=group_id or f"g-{topic}",
        bootstrap_servers=bootstrap_servers,
        pool=pool,
        key=key or dedup.keys.json_field(key_field),
        auto_offset_reset="earliest",
        **options,
    )


@contextlib.asynccontextmanager
async def running(consumer: dedup.IdempotentConsumer) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``consumer`` in the background; stop it (and surface its error) on exit."""
    task = asyncio.create_task(consumer.run())
    try:
        yield task
    finally:
        await consumer.stop()
        if task.done() and not task.cancelled() and task.exception():
            raise task.exception()  # type: ignore[misc]
        await task


async def effect_counts(pool: Any) -> tuple[int, int]:
    """(rows, distinct keys) in ``effects``."""
    row = await pool.fetchrow("SELECT count(*) AS n, count(DISTINCT key) AS d FROM effects")
    return int(row["n"]), int(row["d"])


async def handled(consumer: dedup.IdempotentConsumer, n: int) -> bool:
    """True once ``consumer`` has committed ``n`` records (applied, duplicate or dead-lettered)."""
    return consumer.stats["messages"] >= n
