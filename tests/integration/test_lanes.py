"""The lanes on a real Postgres: the lock wait of a batch on a shared lane gives up well
before Postgres's deadlock check would run, and is set for that transaction only; on
serial lanes the handlers take turns while the next batch's claim runs alongside."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiokafka
import asyncpg
import orjson
import pytest

import dedup
from dedup import _lanes as lanes
from dedup import _store as store
from dedup_dev import effects as support
from tests import helpers
from tests.conftest import Topics


def item(i: int, **extra: Any) -> bytes:
    return orjson.dumps({"id": f"m{i}", **extra})


def one_message(key: str = "k", partition: int = 0) -> dedup.Message:
    return dedup.Message(
        topic="t",
        partition=partition,
        offset=0,
        key=None,
        value=b"{}",
        headers={},
        timestamp=0,
        idempotency_key=key,
    )


async def bump(msg: dedup.Message, tx: dedup.Tx) -> None:
    await tx.conn.execute("UPDATE hot SET n = n + 1 WHERE id = 1")


async def test_a_batch_on_a_shared_lane_gives_up_a_lock_wait_before_the_deadlock_check(
    pool: Any,
) -> None:
    await pool.execute("CREATE TABLE hot (id int PRIMARY KEY, n int NOT NULL)")
    await pool.execute("INSERT INTO hot VALUES (1, 0)")
    writes = store.Store(schema="dedup", namespace="lanes")
    async with pool.acquire() as holder, pool.acquire() as waiter:
        held = holder.transaction()
        await held.start()
        await holder.execute("UPDATE hot SET n = n + 1 WHERE id = 1")
        started = time.monotonic()
        with pytest.raises(asyncpg.LockNotAvailableError) as caught:
            async with waiter.transaction():
                await writes.apply(
                    waiter,
                    [one_message()],
                    handler=bump,
                    batch_handler=False,
                    fence=None,
                    lock_timeout=lanes.LOCK_WAIT,
                )
        waited = time.monotonic() - started
        await held.rollback()
        # Postgres's deadlock_timeout is 1 s: four tangled lanes would take seconds.
        assert lanes.LOCK_WAIT <= waited < 1.0
        assert lanes.contended(caught.value, shared=True)
        # The setting was the transaction's: the session keeps its own.
        assert await waiter.fetchval("SHOW lock_timeout") == "0"
    assert await pool.fetchval("SELECT n FROM hot") == 0
    assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == 0


@pytest.mark.parametrize("same_consumer", [True, False], ids=["one consumer", "two consumers"])
async def test_on_serial_lanes_a_claim_runs_while_another_handler_holds_the_turn(
    same_consumer: bool, pool: Any
) -> None:
    writes = store.Store(schema="dedup", namespace="lanes")
    in_first = asyncio.Event()
    release_first = asyncio.Event()
    ran: list[str] = []

    async def first_handler(msg: dedup.Message, tx: dedup.Tx) -> None:
        ran.append("first")
        in_first.set()
        await release_first.wait()

    async def second_handler(msg: dedup.Message, tx: dedup.Tx) -> None:
        ran.append("second")

    # Two batches of one consumer share its turns; two consumers' only the group's.
    mine = asyncio.Lock()
    turns = [lanes.Turn(mine if same_consumer else asyncio.Lock(), "group-a") for _ in "ab"]

    async def batch(conn: Any, key: str, partition: int, handler: Any, turn: lanes.Turn) -> None:
        try:
            async with conn.transaction():
                await writes.apply(
                    conn,
                    [one_message(key, partition)],
                    handler=handler,
                    batch_handler=False,
                    fence=None,
                    turn=turn,
                )
        finally:
            turn.end()

    async with pool.acquire() as one, pool.acquire() as two:
        second_pid = two.get_server_pid()
        first = asyncio.create_task(batch(one, "a", 0, first_handler, turns[0]))
        await asyncio.wait_for(in_first.wait(), 10)
        second = asyncio.create_task(batch(two, "b", 1, second_handler, turns[1]))

        async def waits_for_its_turn() -> bool:
            row = await pool.fetchrow(
                "SELECT wait_event, state, backend_xmin FROM pg_stat_activity WHERE pid = $1",
                second_pid,
            )
            if row is None:
                return False
            if same_consumer:
                # It waits in the consumer, holding no snapshot that would keep the
                # hot rows' dead versions from being pruned.
                return row["state"] == "idle in transaction" and row["backend_xmin"] is None
            return row["wait_event"] == "advisory"

        # Its claim ran already: it holds a lock on dedup.processed for the key it wrote.
        async def claimed() -> bool:
            held = await pool.fetchval(
                "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
                " WHERE l.pid = $1 AND c.relname = 'processed' AND l.mode = 'RowExclusiveLock'",
                second_pid,
            )
            return bool(held == 1)

        await helpers.wait_for(claimed, within=10, what="the second batch's claim")
        await helpers.wait_for(waits_for_its_turn, within=10, what="the second batch's wait")
        assert ran == ["first"]
        release_first.set()
        await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert ran == ["first", "second"]
    keys = await pool.fetch("SELECT idempotency_key FROM dedup.processed ORDER BY 1")
    assert [r["idempotency_key"] for r in keys] == ["a", "b"]


async def test_a_batch_waiting_for_its_turn_outlives_the_idle_timeout(pool: Any) -> None:
    """The server's idle-in-transaction timeout cuts sessions that idle; a batch that only
    waits for its turn keeps its session alive (it is not a handler failure)."""
    writes = store.Store(schema="dedup", namespace="lanes")
    mine = asyncio.Lock()
    holder, waiter = lanes.Turn(mine, "group-b"), lanes.Turn(mine, "group-b")
    ran: list[str] = []

    async def handler(msg: dedup.Message, tx: dedup.Tx) -> None:
        ran.append(msg.idempotency_key or "")

    async with pool.acquire() as one, pool.acquire() as two:
        async with one.transaction():
            await holder.wait(_nothing, None)  # the turn is taken: the next waits
            waiting = asyncio.create_task(_batch(writes, two, waiter, handler, idle_timeout=0.5))
            # Three times the idle timeout: without keep-alives the server would cut it.
            await asyncio.sleep(1.5)
            assert not waiting.done()
        holder.end()
        await asyncio.wait_for(waiting, 10)
    assert ran == ["w"]


async def _nothing() -> None:
    pass


async def _batch(
    writes: store.Store, conn: Any, turn: lanes.Turn, handler: Any, idle_timeout: float
) -> None:
    try:
        async with conn.transaction():
            await writes.apply(
                conn,
                [one_message("w", 3)],
                handler=handler,
                batch_handler=False,
                fence=None,
                idle_timeout=idle_timeout,
                turn=turn,
            )
    finally:
        turn.end()


async def test_small_batches_of_several_partitions_ride_in_one_transaction(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    """What a live stream brings (a few records per partition per fetch) commits in one
    transaction, as a hand-written loop's fetch does; each handler call still gets one
    partition's messages, in offset order, under that partition's token."""
    topic = await topics.create(partitions=4)
    await pool.execute(
        'CREATE TABLE seen ("partition" int, "offset" bigint, token bigint, call int, tx xid8)'
    )
    calls: list[list[tuple[int, int]]] = []

    async def handler(msgs: list[dedup.Message], tx: dedup.Tx) -> None:
        calls.append([(m.partition, m.offset) for m in msgs])
        await tx.conn.execute(
            "INSERT INTO seen SELECT p, o, $3, $4, pg_current_xact_id()"
            " FROM unnest($1::int[], $2::bigint[]) AS x(p, o)",
            [m.partition for m in msgs],
            [m.offset for m in msgs],
            tx.token,
            len(calls),
        )

    consumer = support.consumer(handler, topic, bootstrap_servers, pool)
    async with support.running(consumer):
        await _warm_up(bootstrap_servers, topic, consumer, 4)
        records = {p: [(None, item(10 * p + i)) for i in range(3)] for p in range(4)}
        await _produce_at_once(bootstrap_servers, topic, records)
        await helpers.wait_for(lambda: support.handled(consumer, 16), what="all 16 records")
    assert all(len({p for p, _ in call}) == 1 for call in calls), calls
    assert all([o for _, o in call] == sorted(o for _, o in call) for call in calls), calls
    # Each partition's rows carry its own token, as its fence has it.
    mismatched = await pool.fetchval(
        "SELECT count(*) FROM seen s JOIN dedup.partitions p"
        ' ON p.topic = $1 AND p."partition" = s."partition" WHERE p.token <> s.token',
        topic,
    )
    assert mismatched == 0
    widest = await pool.fetchval(
        'SELECT max(n) FROM (SELECT count(DISTINCT "partition") AS n FROM seen GROUP BY tx) t'
    )
    assert widest >= 2, "small batches of several partitions shared a transaction"
    assert await pool.fetchval("SELECT count(*) FROM seen") == 16
    stored = await pool.fetch(
        'SELECT "partition", next_offset FROM dedup.partitions WHERE topic = $1', topic
    )
    assert {r["partition"]: r["next_offset"] for r in stored} == {p: 4 for p in range(4)}


async def _warm_up(
    bootstrap_servers: str, topic: str, consumer: dedup.IdempotentConsumer, partitions: int
) -> None:
    """One record per partition, handled: each partition's first batch, which runs alone
    once its start is marked (``PartitionWorker._starts``), is behind us."""
    for p in range(partitions):
        await helpers.produce(bootstrap_servers, topic, [(None, item(900 + p))], partition=p)
    await helpers.wait_for(
        lambda: support.handled(consumer, partitions), what="the warm-up records"
    )


async def _produce_at_once(
    bootstrap_servers: str, topic: str, records: dict[int, list[tuple[None, bytes]]]
) -> None:
    """Each partition's records in one produce request, as a live stream's fetch sees them."""
    producer = aiokafka.AIOKafkaProducer(bootstrap_servers=bootstrap_servers, linger_ms=100)
    await producer.start()
    try:
        sent = [
            await producer.send(topic, value, partition=p)
            for p, batch in records.items()
            for _, value in batch
        ]
        await asyncio.gather(*sent)
    finally:
        await producer.stop()


async def test_a_handler_failing_in_a_shared_transaction_costs_the_other_partitions_nothing(
    bootstrap_servers: str, topics: Topics, pool: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The shared transaction rolls back and every batch runs alone: the others commit,
    the culprit is dead-lettered after its attempts, the rest of its partition applied."""
    topic = await topics.create(partitions=4)
    await pool.execute(support.EFFECTS)
    consumer = support.consumer(support.record_effects, topic, bootstrap_servers, pool)
    with caplog.at_level(logging.INFO, logger="dedup.worker"):
        async with support.running(consumer):
            # The first batch of each partition runs alone once marked (_starts): warm up.
            await _warm_up(bootstrap_servers, topic, consumer, 4)
            records = {
                p: [(None, item(10 * p + i, explode=(p == 0 and i == 1))) for i in range(3)]
                for p in range(4)
            }
            await _produce_at_once(bootstrap_servers, topic, records)
            await helpers.wait_for(lambda: support.handled(consumer, 16), what="all 16 records")
    shared = "partitions failed (RuntimeError('handler bug in batch')); each runs alone"
    assert shared in caplog.text
    assert await support.effect_counts(pool) == (15, 15)
    letters = await pool.fetch("SELECT idempotency_key, attempts FROM dedup.dead_letters")
    assert [(r["idempotency_key"], r["attempts"]) for r in letters] == [("m1", 3)]
    assert consumer.stats["processed"] == 15
    assert consumer.stats["dead_lettered"] == 1


async def test_handlers_too_slow_to_share_a_transaction_run_side_by_side_again(
    bootstrap_servers: str, topics: Topics, pool: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A shared transaction runs its handler calls one after another; slow handlers (an
    HTTP call each, say) cut it, and the batches run alone, on the lanes, from then on."""
    topic = await topics.create(partitions=4)
    await pool.execute(support.EFFECTS)

    async def slow(msg: dedup.Message, tx: dedup.Tx) -> None:
        await asyncio.sleep(0.1)  # the handler's own slow work, not a test's wait
        await support.record_effect(msg, tx)

    consumer = support.consumer(slow, topic, bootstrap_servers, pool)
    with caplog.at_level(logging.INFO, logger="dedup.lanes"):
        async with support.running(consumer):
            await _warm_up(bootstrap_servers, topic, consumer, 4)
            records = {p: [(None, item(10 * p + i)) for i in range(3)] for p in range(4)}
            await _produce_at_once(bootstrap_servers, topic, records)
            await helpers.wait_for(lambda: support.handled(consumer, 16), what="all 16 records")
    assert "handlers too slow to share a transaction; nobody rides" in caplog.text
    assert await support.effect_counts(pool) == (16, 16)
    assert consumer.stats["dead_lettered"] == 0
