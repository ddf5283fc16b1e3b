"""Handlers that real code contains: each one reproduces a way the consumer used to lose
messages or stop, and checks what a user sees now (rows, dead letters, offsets, stats).

Invariant checked after every run: no key is claimed in ``dedup.processed`` without
its effect row, and every offset of the topic is accounted for.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from typing import Any

import asyncpg
import orjson
import pytest

import dedup
from dedup.data import _db as db
from dedup_dev import consumer_process as processes
from dedup_dev import effects as support
from dedup_dev import helpers
from dedup_dev.kafka import Topics


def item(i: int, **extra: Any) -> bytes:
    return orjson.dumps({"id": f"m{i}", **extra})


async def settled(pool: Any, topic: str, total: int) -> bool:
    """The partition's stored offset reached ``total``: every record was handled."""
    stored = await pool.fetchval(
        'SELECT next_offset FROM dedup.partitions WHERE topic = $1 AND "partition" = 0', topic
    )
    return stored == total


async def claimed_without_effect(pool: Any) -> list[str]:
    rows = await pool.fetch(
        "SELECT idempotency_key FROM dedup.processed p"
        " WHERE NOT EXISTS (SELECT FROM effects e WHERE e.key = p.idempotency_key)"
    )
    return [r["idempotency_key"] for r in rows]


async def dead_letter_reasons(pool: Any) -> dict[str, str]:
    rows = await pool.fetch("SELECT idempotency_key, reason, error FROM dedup.dead_letters")
    return {r["idempotency_key"]: f"{r['reason']}: {r['error']}" for r in rows}


async def run_until_settled(
    consumer: dedup.IdempotentConsumer, pool: Any, topic: str, total: int, within: float = 60
) -> None:
    async with support.running(consumer):
        await helpers.wait_for(
            lambda: settled(pool, topic, total), within=within, what=f"offset {total} stored"
        )


def misbehaving(bad: str, action: Any) -> Any:
    """A per-message handler that writes its effect, then does ``action`` for key ``bad``."""

    async def handler(msg: dedup.Message, tx: dedup.Tx) -> None:
        await support.record_effect(msg, tx)
        if msg.idempotency_key == bad:
            await action(tx)

    return handler


async def _cancelled(tx: dedup.Tx) -> None:
    raise asyncio.CancelledError  # e.g. a timeout or a cancelled HTTP call in user code


@pytest.mark.parametrize("batch_size", [1, 500])
async def test_a_handler_raising_cancelled_error_is_a_failure_not_a_skip(
    batch_size: int, bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    await helpers.produce(bootstrap_servers, topic, [(None, item(i)) for i in range(10)])
    consumer = support.consumer(
        misbehaving("m3", _cancelled), topic, bootstrap_servers, pool, batch_size=batch_size
    )
    await run_until_settled(consumer, pool, topic, 10)

    keys = {r["key"] for r in await pool.fetch("SELECT key FROM effects")}
    assert keys == {f"m{i}" for i in range(10)} - {"m3"}
    reasons = await dead_letter_reasons(pool)
    assert list(reasons) == ["m3"] and "CancelledError" in reasons["m3"]
    assert await claimed_without_effect(pool) == []
    assert consumer.stats["processed"] == 9 and consumer.stats["dead_lettered"] == 1


@pytest.mark.parametrize(
    ("statement", "named"),
    [("COMMIT", "COMMIT"), ("ROLLBACK", "ROLLBACK"), ("END", "END"), ("abort", "ABORT")],
)
async def test_a_handler_cannot_end_dedups_transaction(
    statement: str, named: str, bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    await helpers.produce(bootstrap_servers, topic, [(None, item(i)) for i in range(10)])
    errors: list[BaseException] = []

    async def end_it(tx: dedup.Tx) -> None:
        try:
            await tx.conn.execute(f"/* sneaky */ {statement}")
        except dedup.HandlerError as exc:
            errors.append(exc)
            raise

    consumer = support.consumer(misbehaving("m4", end_it), topic, bootstrap_servers, pool)
    await run_until_settled(consumer, pool, topic, 10)

    assert errors and named in str(errors[0]), "the handler is told what it tried"
    keys = {r["key"] for r in await pool.fetch("SELECT key FROM effects")}
    assert keys == {f"m{i}" for i in range(10)} - {"m4"}, "each effect once, m4's rolled back"
    assert await claimed_without_effect(pool) == [], "no key claimed without its effect"
    assert named in (await dead_letter_reasons(pool))["m4"]


async def test_a_commit_hidden_in_a_multi_statement_string_is_refused(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    await helpers.produce(bootstrap_servers, topic, [(None, item(i)) for i in range(4)])

    async def sneaky(tx: dedup.Tx) -> None:
        await tx.conn.execute("SELECT 'a; COMMIT'; COMMIT; SELECT 1")

    consumer = support.consumer(misbehaving("m2", sneaky), topic, bootstrap_servers, pool)
    await run_until_settled(consumer, pool, topic, 4)
    assert await claimed_without_effect(pool) == []
    assert "COMMIT" in (await dead_letter_reasons(pool))["m2"]
    assert await support.effect_counts(pool) == (3, 3)


async def test_savepoints_are_fine_and_transaction_misuse_is_a_handler_failure(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    await helpers.produce(bootstrap_servers, topic, [(None, item(i)) for i in range(6)])

    async def handler(msg: dedup.Message, tx: dedup.Tx) -> None:
        if msg.idempotency_key == "m1":  # a savepoint undoes part of the work
            async with tx.conn.transaction():
                await support.record_effect(msg, tx)
            with contextlib.suppress(asyncpg.NotNullViolationError):
                async with tx.conn.transaction():
                    await tx.conn.execute("INSERT INTO effects (key) VALUES ('never')")
            return
        if msg.idempotency_key == "m2":  # a nested transaction of another isolation level
            async with tx.conn.transaction(isolation="serializable"):
                await support.record_effect(msg, tx)
            return
        if msg.idempotency_key == "m3":
            await tx.conn.close()
        await support.record_effect(msg, tx)

    consumer = support.consumer(handler, topic, bootstrap_servers, pool, batch_size=1)
    await run_until_settled(consumer, pool, topic, 6)
    keys = {r["key"] for r in await pool.fetch("SELECT key FROM effects")}
    assert keys == {"m0", "m1", "m4", "m5"}
    reasons = await dead_letter_reasons(pool)
    assert set(reasons) == {"m2", "m3"}
    assert "isolation" in reasons["m2"] and "close" in reasons["m3"]
    assert await claimed_without_effect(pool) == []


def sync_handler(msg: dedup.Message, tx: dedup.Tx) -> None:
    """Not async: refused at construction."""


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"handler": sync_handler}, "handler="),
        ({"key": "id"}, "key='id'"),
        ({"key": None}, "key=None"),
        ({"key": dedup.keys.json_field}, "key=json_field"),
        ({"batch_size": "10"}, "batch_size='10'"),
        ({"batch_size": True}, "batch_size=True"),
        ({"handler_timeout": 0}, "handler_timeout=0"),
        ({"concurrency": 2.5}, "concurrency=2.5"),
    ],
)
def test_wrong_arguments_fail_at_construction_naming_the_argument(
    options: dict[str, Any], named: str
) -> None:
    settings: dict[str, Any] = {
        "handler": support.record_effect,
        "topics": ["t"],
        "group_id": "g",
        "bootstrap_servers": "127.0.0.1:1",
        "dsn": "postgresql://nowhere/x",
        "key": dedup.keys.json_field("id"),
        **options,
    }
    with pytest.raises(dedup.ConfigurationError, match=named.replace("(", r"\(")):
        dedup.IdempotentConsumer(settings.pop("handler"), **settings)


async def test_an_async_callable_object_and_a_partial_are_accepted(dsn: str) -> None:
    import functools

    class Handler:
        async def __call__(self, msg: dedup.Message, tx: dedup.Tx) -> None: ...

    async def with_extra(msg: dedup.Message, tx: dedup.Tx, *, extra: int) -> None: ...

    for handler in (Handler(), functools.partial(with_extra, extra=1)):
        dedup.IdempotentConsumer(
            handler, topics=["t"], group_id="g", bootstrap_servers="127.0.0.1:1", dsn=dsn
        )


async def test_a_handler_past_handler_timeout_is_cancelled_and_dead_lettered(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    await helpers.produce(bootstrap_servers, topic, [(None, item(i)) for i in range(5)])
    cancelled: list[str] = []

    async def hang(tx: dedup.Tx) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append("m2")
            raise

    consumer = support.consumer(
        misbehaving("m2", hang), topic, bootstrap_servers, pool, handler_timeout=0.3, batch_size=1
    )
    await run_until_settled(consumer, pool, topic, 5)
    assert len(cancelled) == 3, "tried max_attempts times, cancelled each time"
    assert "handler_timeout=0.3s" in (await dead_letter_reasons(pool))["m2"]
    assert await support.effect_counts(pool) == (4, 4)
    assert await claimed_without_effect(pool) == []


async def test_a_handler_within_its_deadline_keeps_its_session(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    """The server's idle timeout is derived from handler_timeout, whatever the pool says."""
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    await helpers.produce(bootstrap_servers, topic, [(None, item(i)) for i in range(3)])
    short = await dedup.data._db.create_pool(
        dsn, max_size=3, server_settings={"idle_in_transaction_session_timeout": "500"}
    )

    async def think(tx: dedup.Tx) -> None:
        await asyncio.sleep(1.5)  # three times the pool's idle timeout, within the deadline
        await tx.conn.execute("SELECT 1")

    consumer = support.consumer(
        misbehaving("m1", think), topic, bootstrap_servers, short, handler_timeout=5
    )
    try:
        await run_until_settled(consumer, pool, topic, 3)
    finally:
        await short.close()
    assert await support.effect_counts(pool) == (3, 3)
    assert consumer.stats["retries"] == 0 and consumer.stats["dead_lettered"] == 0


async def test_a_session_the_server_cut_is_a_handler_failure_not_an_endless_retry(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    """Blocking code in an async handler holds the transaction idle past the server's limit."""
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    await helpers.produce(bootstrap_servers, topic, [(None, item(i)) for i in range(3)])
    calls: list[str] = []

    async def block(tx: dedup.Tx) -> None:
        calls.append("m1")
        # Blocking the event loop: the handler's deadline can't fire, the server's does.
        time.sleep(0.5 + dedup.consumer._consumer.IDLE_MARGIN + 0.6)  # noqa: ASYNC251
        await tx.conn.execute("SELECT 1")

    consumer = support.consumer(
        misbehaving("m1", block),
        topic,
        bootstrap_servers,
        pool,
        handler_timeout=0.5,
        max_attempts=2,
        batch_size=1,
    )
    await run_until_settled(consumer, pool, topic, 3, within=90)
    assert calls == ["m1", "m1"], "tried max_attempts times, not forever"
    assert "idle_in_transaction_session_timeout" in (await dead_letter_reasons(pool))["m1"]
    assert await support.effect_counts(pool) == (2, 2)
    assert await claimed_without_effect(pool) == []


async def test_one_hung_partition_does_not_hold_up_the_others(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create(partitions=3)
    await pool.execute(support.EFFECTS)
    release = asyncio.Event()
    hung: list[int] = []

    async def handler(msg: dedup.Message, tx: dedup.Tx) -> None:
        if msg.partition == 0:
            hung.append(msg.offset)
            await release.wait()  # partition 0's handler hangs
        await support.record_effect(msg, tx)

    # A per-message handler has one lane unless asked: three, one per partition.
    consumer = support.consumer(
        handler, topic, bootstrap_servers, pool, handler_timeout=120, concurrency=3
    )

    async def offsets() -> dict[int, int]:
        rows = await pool.fetch(
            'SELECT "partition", next_offset FROM dedup.partitions WHERE next_offset IS NOT NULL'
        )
        return {r["partition"]: r["next_offset"] for r in rows}

    async with support.running(consumer):
        for round_ in range(3):
            for p in (1, 2):
                await helpers.produce(
                    bootstrap_servers,
                    topic,
                    [(None, item(1000 * p + 10 * round_ + i)) for i in range(10)],
                    partition=p,
                )
            if round_ == 0:
                await helpers.produce(bootstrap_servers, topic, [(None, item(0))], partition=0)
                await helpers.wait_for(lambda: _true(hung), what="partition 0's handler to hang")
            want = 10 * (round_ + 1)

            async def advanced(want: int = want) -> bool:
                got = await offsets()
                return got.get(1) == want and got.get(2) == want

            await helpers.wait_for(advanced, what=f"partitions 1 and 2 at offset {want}")
            assert (await offsets()).get(0, 0) == 0, "partition 0 is still in its first batch"
        release.set()
        await helpers.wait_for(
            lambda: _equals(offsets, {0: 1, 1: 30, 2: 30}), what="partition 0 to finish"
        )
    assert await support.effect_counts(pool) == (61, 61)


async def test_hot_rows_under_four_lanes_apply_every_payment_once(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    """The README's handler: one balance update per payment, on few accounts, unsorted."""
    topic = await topics.create(partitions=4)
    await pool.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
    await pool.execute("INSERT INTO accounts SELECT g, 0 FROM generate_series(0, 4) g")
    await pool.execute("CREATE TABLE payments (id text PRIMARY KEY, account int, amount int)")

    async def pay(msgs: list[dedup.Message], tx: dedup.Tx) -> None:
        for m in msgs:  # in offset order, so two lanes lock accounts in different orders
            body = m.json()
            await tx.conn.execute(
                "UPDATE accounts SET balance = balance + $2 WHERE id = $1",
                body["account"],
                body["amount"],
            )
        await tx.conn.executemany(
            "INSERT INTO payments VALUES ($1, $2, $3)",
            [(m.idempotency_key, m.json()["account"], m.json()["amount"]) for m in msgs],
        )

    per_partition = 300
    for p in range(4):
        await helpers.produce(
            bootstrap_servers,
            topic,
            [
                (None, orjson.dumps({"id": f"p{p}-{i}", "account": (i * (p + 1)) % 5, "amount": 1}))
                for i in range(per_partition)
            ],
            partition=p,
        )
    consumer = support.consumer(pay, topic, bootstrap_servers, pool, batch_size=50, batch=True)
    async with support.running(consumer):
        await helpers.wait_for(
            lambda: _count(pool, "SELECT count(*) FROM payments", 4 * per_partition),
            within=120,
            what="every payment",
        )
    assert await pool.fetchval("SELECT sum(balance) FROM accounts") == 4 * per_partition
    assert consumer.stats["processed"] == 4 * per_partition
    assert consumer.stats["dead_lettered"] == 0, "a deadlock is no handler failure"
    # Every deadlock ran its transaction again; nothing else failed.
    assert consumer.stats["retries"] == consumer.stats["deadlocks"]


async def test_a_retry_after_a_split_skips_the_parts_that_committed(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    """A batch split around a failing message, then a deadlock in a later part: the retry
    runs only what had not committed (found by the chaos suite's hot_rows scenario)."""
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    await helpers.produce(bootstrap_servers, topic, [(None, item(i)) for i in range(10)])
    calls: list[list[str]] = []
    deadlocked: list[str] = []

    async def handler(msgs: list[dedup.Message], tx: dedup.Tx) -> None:
        keys = [m.idempotency_key for m in msgs]
        calls.append(keys)
        if "m3" in keys:
            raise RuntimeError("m3 is poison")
        if "m7" in keys and not deadlocked:
            deadlocked.append("m7")
            # What an UPDATE of a hot row raises when this lane loses a deadlock.
            raise asyncpg.DeadlockDetectedError("deadlock detected")
        await support.record_effects(msgs, tx)

    consumer = support.consumer(handler, topic, bootstrap_servers, pool, batch=True)
    await run_until_settled(consumer, pool, topic, 10)

    assert calls.count(["m3"]) == 3, "the culprit is tried max_attempts times, not again"
    assert list(await dead_letter_reasons(pool)) == ["m3"]
    assert await support.effect_counts(pool) == (9, 9)
    assert await pool.fetchval("SELECT sum(duplicates) FROM dedup.processed") == 0
    assert consumer.stats["deadlocks"] == 1 and consumer.stats["duplicates"] == 0


async def test_hot_rows_across_consumers_of_a_group_take_turns_with_tx_lock(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    """Two consumers of one group (two processes, as far as their lanes know) whose handlers
    update the same few rows unsorted: locking the accounts first (``tx.lock``, sorted)
    makes the transactions that share an account take turns, across consumers, and
    nothing deadlocks."""
    topic = await topics.create(partitions=4)
    await pool.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
    await pool.execute("INSERT INTO accounts SELECT g, 0 FROM generate_series(0, 4) g")
    await pool.execute("CREATE TABLE payments (id text PRIMARY KEY)")

    async def pay(msgs: list[dedup.Message], tx: dedup.Tx) -> None:
        await tx.lock(*{str(m.json()["account"]) for m in msgs})
        for m in msgs:  # offset order: without the locks, batches would deadlock
            body = m.json()
            await tx.conn.execute(
                "UPDATE accounts SET balance = balance + 1 WHERE id = $1", body["account"]
            )
            await asyncio.sleep(0.002)  # a call out between two updates, rows held
        await tx.conn.executemany(
            "INSERT INTO payments VALUES ($1)", [(m.idempotency_key,) for m in msgs]
        )

    per_partition = 150
    accounts = random.Random(13)
    for p in range(4):
        await helpers.produce(
            bootstrap_servers,
            topic,
            [
                (None, orjson.dumps({"id": f"p{p}-{i}", "account": accounts.randrange(5)}))
                for i in range(per_partition)
            ],
            partition=p,
        )
    other_pool = await db.create_pool(dsn, max_size=8)
    first, second = (
        support.consumer(pay, topic, bootstrap_servers, p, batch_size=25, batch=True)
        for p in (pool, other_pool)
    )
    try:
        async with support.running(first), support.running(second):
            await helpers.wait_for(
                lambda: _count(pool, "SELECT count(*) FROM payments", 4 * per_partition),
                within=60,
                what="every payment",
            )
    finally:
        await other_pool.close()
    assert await pool.fetchval("SELECT sum(balance) FROM accounts") == 4 * per_partition
    assert first.stats["deadlocks"] + second.stats["deadlocks"] == 0, (first.stats, second.stats)
    assert first.stats["processed"] + second.stats["processed"] == 4 * per_partition


async def _true(value: Any) -> bool:
    return bool(value)


async def _equals(probe: Any, want: Any) -> bool:
    return bool(await probe() == want)


async def _count(pool: Any, sql: str, want: int) -> bool:
    return int(await pool.fetchval(sql)) >= want


@pytest.mark.parametrize("second_signal", [False, True])
async def test_sigterm_with_a_hung_handler_exits_within_shutdown_timeout(
    second_signal: bool, bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    topic = await topics.create()
    await helpers.produce(bootstrap_servers, topic, [(None, item(i)) for i in range(5)])
    args = [
        *("--dsn", dsn, "--bootstrap-servers", bootstrap_servers, "--topic", topic),
        *("--group", f"g-{topic}", "--hang", "--shutdown-timeout", "4"),
        *("--handler-timeout", "120"),
    ]
    async with processes.started(*args) as child:
        await child.expect("HUNG", within=60)
        started = time.monotonic()
        child.signal(signal.SIGTERM)
        if second_signal:
            # asyncio handles the two in the order they came: stop, then cut at once.
            child.signal(signal.SIGINT)
        code = await asyncio.wait_for(child.proc.wait(), 4 + 5)
        took = time.monotonic() - started
        stderr = await child.stderr()
    assert code == 0, stderr[-2000:]
    if second_signal:
        assert took < 3.5, f"the second signal cuts at once ({took:.1f}s)"
    else:
        assert took >= 3.5, "the batch in flight had its shutdown_timeout"
    assert "cutting the batches in flight of" in stderr and f"{topic}" in stderr
    # The hung batch rolled back: nothing applied, the offset not moved.
    assert await pool.fetchval("SELECT count(*) FROM effects") == 0
    assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == 0
