"""dedup.FastStreamDedup's failure path, as a FastStream user sees it (real broker, real Postgres).

A FastStream app runs in this process on a one-partition topic, exactly-once
through the middleware, and writes ``applied`` rows (no unique constraint: a
double shows as two rows) on the transaction it takes from the context:

- a subscriber that raises for one record is called ``max_attempts`` times for
  it, then that record is in ``dedup.dead_letters`` whole, every other record
  is applied once and the partition moves on to its end;
- a batch subscriber whose batch holds one bad record applies the good ones
  once and dead-letters only the bad one;
- a lost Postgres connection on the first attempt is not the record's fault:
  it reaches FastStream, whose ``NACK_ON_ERROR`` delivers the record again,
  and it is applied once, with nothing dead-lettered.
"""

from __future__ import annotations

import collections
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from faststream import Context
from faststream.kafka import KafkaBroker, KafkaRouter
from faststream.middlewares import AckPolicy

import dedup
from dedup_dev import helpers
from dedup_dev import kafka as kafka_support
from dedup_dev.kafka import Topics

IDS = [f"k-{i}" for i in range(8)]
BAD = "k-3"


def _value(key: str) -> bytes:
    return orjson.dumps({"id": key, "amount": 5})


@contextlib.asynccontextmanager
async def _app(
    dsn: str,
    bootstrap_servers: str,
    topic: str,
    handler: Callable[..., Awaitable[None]],
    **options: Any,
) -> AsyncIterator[str]:
    """The FastStream app of the howto, running ``handler``; yields its group id."""
    group = f"fsf-{uuid.uuid4().hex[:8]}"
    exactly_once = dedup.FastStreamDedup(
        dsn=dsn, namespace=group, key=dedup.keys.json_field("id"), retry_backoff=0.01
    )
    broker = KafkaBroker(bootstrap_servers)
    router = KafkaRouter(middlewares=[exactly_once])
    router.subscriber(
        topic,
        group_id=group,
        auto_offset_reset="earliest",
        ack_policy=AckPolicy.NACK_ON_ERROR,
        **options,
    )(handler)
    broker.include_router(router)
    await broker.start()
    try:
        yield group
    finally:
        await broker.stop()
        await exactly_once.close()


async def _produce(bootstrap_servers: str, topic: str, ids: list[str]) -> None:
    await kafka_support.produce(bootstrap_servers, topic, ((k.encode(), _value(k)) for k in ids))


async def _settled(
    pool: Any, bootstrap_servers: str, group: str, topic: str, ids: set[str]
) -> None:
    """Wait until every key of ``ids`` is applied and the group committed the partition's end."""

    async def applied() -> bool:
        rows = await pool.fetch("SELECT DISTINCT key FROM applied")
        return {r["key"] for r in rows} >= ids

    await helpers.wait_for(applied, within=20, what=f"{sorted(ids)} applied")
    end = await kafka_support.end_offsets(bootstrap_servers, topic, 1)

    async def committed() -> bool:
        return await kafka_support.committed(bootstrap_servers, group, topic) == end

    await helpers.wait_for(committed, within=20, what=f"the group committing {end}")


async def _topic(pool: Any, topics: Topics) -> str:
    """A one-partition topic (its records in offset order), and the ``applied`` table."""
    await pool.execute("CREATE TABLE applied (key text)")
    return await topics.create(partitions=1, prefix="fsf")


def _take(
    calls: collections.Counter[str], trouble: Callable[[str, dedup.Tx], Awaitable[None]]
) -> Callable[..., Awaitable[None]]:
    """A single-record subscriber: counts its calls, inserts, then meets ``trouble``."""

    async def take(order: dict[str, Any], tx: dedup.Tx = Context("dedup_tx")) -> None:
        calls[order["id"]] += 1
        await tx.conn.execute("INSERT INTO applied (key) VALUES ($1)", order["id"])
        await trouble(order["id"], tx)

    return take


async def _applied(pool: Any) -> dict[str, int]:
    rows = await pool.fetch("SELECT key, count(*) AS n FROM applied GROUP BY key")
    return {r["key"]: r["n"] for r in rows}


async def test_a_record_the_subscriber_cannot_take_is_retried_then_dead_lettered_whole(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics
) -> None:
    topic = await _topic(pool, topics)
    calls: collections.Counter[str] = collections.Counter()

    async def refuse(order_id: str, tx: dedup.Tx) -> None:
        if order_id == BAD:
            raise ValueError(f"order {order_id} has no customer")

    async with _app(dsn, bootstrap_servers, topic, _take(calls, refuse)) as group:
        await _produce(bootstrap_servers, topic, IDS)  # k-3 at offset 3, four records after it
        await _settled(pool, bootstrap_servers, group, topic, set(IDS) - {BAD})
        # The stream goes on after the dead letter: a later record is taken too.
        await _produce(bootstrap_servers, topic, ["k-8"])
        await _settled(pool, bootstrap_servers, group, topic, {"k-8"})

    good = [k for k in [*IDS, "k-8"] if k != BAD]
    assert calls == collections.Counter({BAD: 3}) + collections.Counter(good)  # max_attempts: 3
    # Each failed attempt rolled its insert back; the others are applied once.
    assert await _applied(pool) == dict.fromkeys(good, 1)
    letters = await pool.fetch("SELECT * FROM dedup.dead_letters")
    assert len(letters) == 1
    letter = letters[0]
    assert (letter["namespace"], letter["topic"], letter["partition"], letter["offset"]) == (
        group,
        topic,
        0,
        3,
    )
    assert (letter["key"], letter["value"]) == (BAD.encode(), _value(BAD))
    assert letter["idempotency_key"] == BAD
    assert letter["attempts"] == 3
    assert letter["reason"] == "handler failed 3 times"
    assert letter["error"] == f"ValueError: order {BAD} has no customer"
    processed = await pool.fetch(
        "SELECT idempotency_key, status FROM dedup.processed WHERE namespace = $1", group
    )
    # The bad key stays unclaimed, so replaying the dead letter can still apply it.
    assert sorted(tuple(r) for r in processed) == [(k, "processed") for k in good]


async def test_a_batch_with_one_bad_record_applies_the_good_ones_once(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics
) -> None:
    topic = await _topic(pool, topics)
    batches: list[list[str]] = []
    # All eight in one produce call: one Kafka record batch, fetched whole into one delivery.
    await _produce(bootstrap_servers, topic, IDS)

    async def take(orders: list[dict[str, Any]], tx: dedup.Tx = Context("dedup_tx")) -> None:
        batches.append([o["id"] for o in orders])
        await tx.conn.executemany(
            "INSERT INTO applied (key) VALUES ($1)", [(o["id"],) for o in orders]
        )
        if any(o["id"] == BAD for o in orders):
            raise ValueError(f"order {BAD} has no customer")

    async with _app(dsn, bootstrap_servers, topic, take, batch=True, max_records=50) as group:
        await _settled(pool, bootstrap_servers, group, topic, set(IDS) - {BAD})

    # The whole batch failed once, then its records went one by one: the bad one
    # max_attempts times, each good one once.
    assert batches[0] == IDS
    assert batches[1:] == [[k] for k in IDS[:3]] + [[BAD]] * 3 + [[k] for k in IDS[4:]]
    assert await _applied(pool) == {k: 1 for k in IDS if k != BAD}
    letters = await pool.fetch(
        'SELECT topic, "partition", "offset", key, error FROM dedup.dead_letters'
    )
    assert [tuple(r) for r in letters] == [
        (topic, 0, 3, BAD.encode(), f"ValueError: order {BAD} has no customer")
    ]


async def test_a_lost_connection_is_redelivered_by_faststream_and_applied_once(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics
) -> None:
    topic = await _topic(pool, topics)
    calls: collections.Counter[str] = collections.Counter()

    async def lose_connection(order_id: str, tx: dedup.Tx) -> None:
        if order_id == BAD and calls[BAD] == 1:
            # The server ends this session mid-transaction, as a failover or a
            # restart does: the claim and the insert roll back with it.
            await tx.conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")

    async with _app(dsn, bootstrap_servers, topic, _take(calls, lose_connection)) as group:
        await _produce(bootstrap_servers, topic, IDS)
        await _settled(pool, bootstrap_servers, group, topic, set(IDS))

    # Redelivered by FastStream (not retried by dedup, not dead-lettered): twice, applied once.
    assert calls == collections.Counter(IDS) + collections.Counter([BAD])
    assert await _applied(pool) == {k: 1 for k in IDS}
    assert await pool.fetchval("SELECT count(*) FROM dedup.dead_letters") == 0
    assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == len(IDS)


async def test_a_subscriber_that_swallows_a_failed_statement_is_a_failure_not_a_commit(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics
) -> None:
    """A failed statement aborts the transaction; the COMMIT then rolls back. Not a success."""
    topic = await _topic(pool, topics)
    calls: collections.Counter[str] = collections.Counter()

    async def swallow(order_id: str, tx: dedup.Tx) -> None:
        if order_id == BAD:
            with contextlib.suppress(Exception):
                await tx.conn.execute("SELECT 1 / 0")

    async with _app(dsn, bootstrap_servers, topic, _take(calls, swallow)) as group:
        await _produce(bootstrap_servers, topic, IDS)
        await _settled(pool, bootstrap_servers, group, topic, set(IDS) - {BAD})

    assert calls[BAD] == 3
    assert await _applied(pool) == {k: 1 for k in IDS if k != BAD}
    [letter] = await pool.fetch("SELECT idempotency_key, error FROM dedup.dead_letters")
    assert letter["idempotency_key"] == BAD
    assert letter["error"].startswith("HandlerError: the transaction was aborted by a statement")
    claimed = await pool.fetchval(
        "SELECT count(*) FROM dedup.processed WHERE namespace = $1 AND idempotency_key = $2",
        group,
        BAD,
    )
    assert claimed == 0, "nothing of the aborted transaction committed, its claim neither"
