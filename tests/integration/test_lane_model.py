"""The lane model (issue 27), as a user sees it: a partition's batches run on a lane of
their own, one transaction per lane turn, and dedup sets nothing on the handler's
transaction but the handler deadline (``idle_in_transaction_session_timeout``).

So a handler meets its login role's own ``lock_timeout`` and ``statement_timeout``,
a lock it fails to take is its own failure (tried ``max_attempts`` times, then
dead-lettered), a hung handler holds up only its own partition, and a deadlock
between two lanes is retried and counted.  Each test checks what a user sees:
rows, dead letters, stored offsets, stats.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import orjson
import pytest
from aiokafka import AIOKafkaProducer

import dedup
from dedup_dev import effects as support
from dedup_dev import helpers
from dedup_dev.database import LoginAs
from dedup_dev.kafka import Topics
from tests.integration.test_handlers import dead_letter_reasons

ROLE_LOCK_TIMEOUT = "1234ms"
ROLE_STATEMENT_TIMEOUT = "4321ms"
HANDLER_TIMEOUT = 5.0
IDLE_TIMEOUT_SHOWN = "7s"
"""SHOW's text of handler_timeout + 2 s, the one setting dedup makes (7000 ms)."""
SETTINGS = ("lock_timeout", "statement_timeout", "idle_in_transaction_session_timeout")
ROLE_SETTINGS = (ROLE_LOCK_TIMEOUT, ROLE_STATEMENT_TIMEOUT, IDLE_TIMEOUT_SHOWN)
"""What a handler should see of :data:`SETTINGS` under the role of :func:`_login_with_timeouts`."""


def _item(key: str, **extra: Any) -> bytes:
    return orjson.dumps({"id": key, **extra})


async def _produce_per_partition(
    bootstrap_servers: str, topic: str, partitions: int, per_partition: int
) -> None:
    """``per_partition`` records ``p<partition>-<i>`` on each partition."""
    for p in range(partitions):
        await helpers.produce(
            bootstrap_servers,
            topic,
            [(None, _item(f"p{p}-{i}")) for i in range(per_partition)],
            partition=p,
        )


async def _offsets(pool: Any, topic: str) -> dict[int, int]:
    """The stored next offset of each of ``topic``'s partitions (dedup.partitions)."""
    rows = await pool.fetch(
        'SELECT "partition", next_offset FROM dedup.partitions'
        " WHERE topic = $1 AND next_offset IS NOT NULL",
        topic,
    )
    return {r["partition"]: r["next_offset"] for r in rows}


async def _at(pool: Any, topic: str, ends: dict[int, int]) -> bool:
    """Every partition of ``ends`` has its stored offset at its end."""
    stored = await _offsets(pool, topic)
    return all(stored.get(p) == end for p, end in ends.items())


async def _settle(pool: Any, topic: str, ends: dict[int, int], within: float = 20) -> None:
    await helpers.wait_for(
        lambda: _at(pool, topic, ends), within=within, what=f"offsets {ends} stored"
    )


async def _effect_keys(pool: Any) -> list[str]:
    return sorted(r["key"] for r in await pool.fetch("SELECT key FROM effects"))


async def _processed_keys(pool: Any) -> list[str]:
    rows = await pool.fetch("SELECT idempotency_key FROM dedup.processed")
    return sorted(r["idempotency_key"] for r in rows)


async def _login_with_timeouts(pool: Any, login_as: LoginAs) -> str:
    """A DSN for a new login granted the schema's runtime role, whose own settings are
    ``lock_timeout`` = :data:`ROLE_LOCK_TIMEOUT` and ``statement_timeout`` =
    :data:`ROLE_STATEMENT_TIMEOUT`, the way a DBA sets them for a service."""
    runtime = await pool.fetchval("SELECT role_name FROM dedup.roles WHERE purpose = 'runtime'")
    login = await login_as(runtime)
    name = urlsplit(login).username
    await pool.execute(
        f"ALTER ROLE \"{name}\" SET lock_timeout = '{ROLE_LOCK_TIMEOUT}';"
        f"ALTER ROLE \"{name}\" SET statement_timeout = '{ROLE_STATEMENT_TIMEOUT}'"
    )
    return login


async def _shown(conn: Any) -> tuple[str, ...]:
    """What ``SHOW`` says of each of :data:`SETTINGS` on ``conn``."""
    return tuple([await conn.fetchval(f"SHOW {name}") for name in SETTINGS])


@pytest.mark.parametrize("given", ["dsn", "pool"])
async def test_a_handler_sees_the_roles_own_lock_timeout(
    given: str, bootstrap_servers: str, topics: Topics, pool: Any, login_as: LoginAs
) -> None:
    """Four partitions on four lanes: whichever lane a batch runs on, its handler sees
    the role's lock_timeout and statement_timeout, and dedup's deadline."""
    topic = await topics.create(partitions=4)
    login = await _login_with_timeouts(pool, login_as)
    await _produce_per_partition(bootstrap_servers, topic, 4, 5)
    seen: list[tuple[int, tuple[str, ...]]] = []

    async def handler(msg: dedup.Message, tx: dedup.Tx) -> None:
        seen.append((msg.partition, await _shown(tx.conn)))

    # The role's settings reach a pool dedup opens on its DSN, and a user's own pool alike.
    user_pool = None if given == "dsn" else await asyncpg.create_pool(login, min_size=1, max_size=8)
    consumer = support.consumer(
        handler,
        topic,
        bootstrap_servers,
        user_pool,
        dsn=login if user_pool is None else None,
        handler_timeout=HANDLER_TIMEOUT,
        concurrency=4,
    )
    try:
        async with support.running(consumer):
            await _settle(pool, topic, dict.fromkeys(range(4), 5))
    finally:
        if user_pool is not None:
            await user_pool.close()

    assert {p for p, _ in seen} == {0, 1, 2, 3}, "messages of every partition were handled"
    # The role's lock_timeout and statement_timeout; of dedup's, the idle timeout only.
    assert {shown for _, shown in seen} == {ROLE_SETTINGS}
    assert len(await _processed_keys(pool)) == 20
    assert consumer.stats["processed"] == 20


@pytest.mark.parametrize(
    "statement",
    ["SET LOCAL lock_timeout = '5ms'", "SET lock_timeout = '5ms'"],
    ids=["set-local", "set-session"],
)
async def test_a_lock_timeout_a_handler_sets_ends_with_its_transaction(
    statement: str, bootstrap_servers: str, topics: Topics, pool: Any, login_as: LoginAs
) -> None:
    """m2's handler sets its own lock_timeout; the next transactions on that connection
    see the role's again, not m2's and not one of dedup's."""
    topic = await topics.create()
    login = await _login_with_timeouts(pool, login_as)
    await helpers.produce(bootstrap_servers, topic, [(None, _item(f"m{i}")) for i in range(6)])
    seen: dict[str, tuple[int, tuple[str, ...]]] = {}
    after_set: list[str] = []

    async def handler(msg: dedup.Message, tx: dedup.Tx) -> None:
        seen[msg.idempotency_key] = (tx.conn.get_server_pid(), await _shown(tx.conn))
        if msg.idempotency_key == "m2":
            await tx.conn.execute(statement)
            after_set.append(await tx.conn.fetchval("SHOW lock_timeout"))

    # One lane, one message per transaction: m3..m5 run on m2's connection after it.
    consumer = support.consumer(
        handler,
        topic,
        bootstrap_servers,
        None,
        dsn=login,
        handler_timeout=HANDLER_TIMEOUT,
        concurrency=1,
        batch_size=1,
    )
    async with support.running(consumer):
        await _settle(pool, topic, {0: 6})

    assert after_set == ["5ms"], "the handler's own SET took effect in its transaction"
    assert {key: shown for key, (_, shown) in seen.items()} == dict.fromkeys(seen, ROLE_SETTINGS)
    assert sorted(seen) == [f"m{i}" for i in range(6)]
    m2_pid = seen["m2"][0]
    later = [key for key in ("m3", "m4", "m5") if seen[key][0] == m2_pid]
    assert later, "no later message ran on m2's connection: the test would show nothing"
    assert await dead_letter_reasons(pool) == {}


@pytest.mark.parametrize("concurrency", [1, 4])
async def test_a_handlers_own_nowait_failure_is_a_handler_failure(
    concurrency: int, bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    """Another session holds a row for the whole test; the handler of "blocked" takes it
    with NOWAIT and fails at once (55P03).  That is the handler's failure, not contention
    between lanes: tried max_attempts times, then dead-lettered; the rest go on."""
    topic = await topics.create(partitions=4)
    await pool.execute(support.EFFECTS)
    await pool.execute("CREATE TABLE held (id int PRIMARY KEY); INSERT INTO held VALUES (1)")
    records = {p: [_item(f"p{p}-{i}") for i in range(5)] for p in range(4)}
    records[0][2] = _item("blocked")
    for p, values in records.items():
        await helpers.produce(bootstrap_servers, topic, [(None, v) for v in values], partition=p)
    blocked_calls: list[float] = []

    async def handler(msg: dedup.Message, tx: dedup.Tx) -> None:
        if msg.idempotency_key == "blocked":
            blocked_calls.append(time.monotonic())
            await tx.conn.execute("SELECT id FROM held WHERE id = 1 FOR UPDATE NOWAIT")
        await support.record_effect(msg, tx)

    holder = await asyncpg.connect(dsn)
    holding = holder.transaction()
    await holding.start()
    try:
        await holder.execute("SELECT id FROM held WHERE id = 1 FOR UPDATE")
        # One message per transaction: the handler runs once per attempt of "blocked".
        consumer = support.consumer(
            handler,
            topic,
            bootstrap_servers,
            pool,
            concurrency=concurrency,
            batch_size=1,
            max_attempts=3,
        )
        async with support.running(consumer):
            await _settle(pool, topic, dict.fromkeys(range(4), 5))
    finally:
        await holding.rollback()
        await holder.close()

    assert len(blocked_calls) == 3, "tried max_attempts times, no more, no less"
    letter = await pool.fetchrow(
        "SELECT reason, error, attempts FROM dedup.dead_letters WHERE idempotency_key = 'blocked'"
    )
    assert letter is not None, await dead_letter_reasons(pool)
    assert "LockNotAvailableError" in letter["error"], letter["error"]
    assert letter["attempts"] == 3
    others = sorted(f"p{p}-{i}" for p in range(4) for i in range(5) if (p, i) != (0, 2))
    assert await _effect_keys(pool) == others, "every other message applied once"
    assert await _processed_keys(pool) == others
    assert list(await dead_letter_reasons(pool)) == ["blocked"]
    assert consumer.stats["dead_lettered"] == 1
    assert consumer.stats["processed"] == 19


async def test_a_hung_handler_holds_up_only_its_own_lane(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    """One message early on partition 0 hangs for good.  Partitions 1-3 get the second
    half of their records once it hangs, and reach their ends while its first attempt
    still runs; it is dead-lettered on handler_timeout; then partition 0 goes on."""
    handler_timeout, max_attempts, per_partition = 1.0, 2, 20
    half = per_partition // 2
    topic = await topics.create(partitions=4)
    await pool.execute(support.EFFECTS)
    records = {p: [_item(f"p{p}-{i}") for i in range(per_partition)] for p in range(4)}
    records[0][2] = _item("hang")
    for p, values in records.items():
        sent = values if p == 0 else values[:half]
        await helpers.produce(bootstrap_servers, topic, [(None, v) for v in sent], partition=p)
    entered: list[float] = []
    cancelled: list[float] = []

    async def handler(msg: dedup.Message, tx: dedup.Tx) -> None:
        if msg.idempotency_key == "hang":
            entered.append(time.monotonic())
            try:
                await asyncio.Event().wait()  # never set
            except asyncio.CancelledError:
                cancelled.append(time.monotonic())
                raise
        await support.record_effect(msg, tx)

    consumer = support.consumer(
        handler,
        topic,
        bootstrap_servers,
        pool,
        concurrency=4,
        handler_timeout=handler_timeout,
        max_attempts=max_attempts,
    )
    others = {p: per_partition for p in (1, 2, 3)}
    # Started beforehand: the second half goes out at once, well within the first attempt.
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers, linger_ms=0)
    await producer.start()
    try:
        async with support.running(consumer):
            await helpers.wait_for(lambda: _true(entered), what="the hung handler to start")
            first = entered[0]
            await asyncio.gather(
                *[
                    await producer.send(topic, value, partition=p)
                    for p in others
                    for value in records[p][half:]
                ]
            )
            await helpers.wait_for(
                lambda: _at(pool, topic, others),
                within=max(first + handler_timeout - time.monotonic(), 0.1),
                interval=0.05,
                what="partitions 1-3 at their ends within the hung handler's first attempt",
            )
            # Cancelled already: its first attempt was cut short (a deadline shared with
            # other partitions' batches), not given its own handler_timeout.
            assert not cancelled, "the hung handler's first attempt ended before its deadline"

            slack = 3.0
            await helpers.wait_for(
                lambda: _true(dead_letter_reasons(pool)),
                within=max(first + max_attempts * handler_timeout + slack - time.monotonic(), 0.1),
                what=f"the hung message dead-lettered within {max_attempts} handler timeouts",
            )
            await _settle(pool, topic, {0: per_partition, **others}, within=10)
    finally:
        await producer.stop()

    reasons = await dead_letter_reasons(pool)
    assert list(reasons) == ["hang"]
    assert "handler_timeout" in reasons["hang"], reasons["hang"]
    assert cancelled, "the hung handler was cancelled"
    partition_0 = await pool.fetch('SELECT key FROM effects WHERE "partition" = 0')
    assert sorted(r["key"] for r in partition_0) == sorted(
        f"p0-{i}" for i in range(per_partition) if i != 2
    ), "every other message of partition 0 applied exactly once"
    keys = await _effect_keys(pool)
    assert len(keys) == len(set(keys)) == 4 * per_partition - 1, "every other message once"
    assert consumer.stats["dead_lettered"] == 1


BARRIER_WAIT = 3.0
"""Seconds a tangled handler waits for the other lane's first update (then goes on)."""


async def test_deadlocked_lanes_are_retried_and_counted(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    """Partition 0's handler updates a then b, partition 1's b then a, each waiting for
    the other's first update in between: Postgres finds the deadlock (deadlock_timeout)
    and fails one transaction with 40P01.  dedup runs it again; both apply once."""
    topic = await topics.create(partitions=2)
    await pool.execute(support.EFFECTS)
    await pool.execute(
        "CREATE TABLE accounts (id text PRIMARY KEY, balance int NOT NULL);"
        "INSERT INTO accounts VALUES ('a', 0), ('b', 0)"
    )
    tangles = {0: ("a", "b"), 1: ("b", "a")}
    for p, order in tangles.items():
        await helpers.produce(
            bootstrap_servers, topic, [(None, _item(f"p{p}-0", tangle=order))], partition=p
        )
    first_update = {p: asyncio.Event() for p in tangles}

    async def handler(msg: dedup.Message, tx: dedup.Tx) -> None:
        order = msg.json().get("tangle")
        if order:
            first, second = order
            update = "UPDATE accounts SET balance = balance + 1 WHERE id = $1"
            await tx.conn.execute(update, first)
            first_update[msg.partition].set()
            # Lanes that run one after the other never meet here: go on after a while.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(first_update[1 - msg.partition].wait(), BARRIER_WAIT)
            await tx.conn.execute(update, second)
        await support.record_effect(msg, tx)

    consumer = support.consumer(handler, topic, bootstrap_servers, pool, concurrency=2)
    async with support.running(consumer):
        await _settle(pool, topic, {0: 1, 1: 1})
        tangled = await _effect_keys(pool)
        for p in tangles:  # the lanes go on after the deadlock
            await helpers.produce(
                bootstrap_servers,
                topic,
                [(None, _item(f"p{p}-{i}")) for i in range(1, 4)],
                partition=p,
            )
        await _settle(pool, topic, {0: 4, 1: 4})

    assert tangled == ["p0-0", "p1-0"], "both tangled messages applied once"
    balances = dict(await pool.fetch("SELECT id, balance FROM accounts"))
    assert balances == {"a": 2, "b": 2}, "each tangled handler's updates committed once"
    assert await _effect_keys(pool) == sorted(f"p{p}-{i}" for p in tangles for i in range(4))
    assert await dead_letter_reasons(pool) == {}
    assert consumer.stats["deadlocks"] >= 1, str(dict(consumer.stats))
    assert consumer.stats["processed"] == 8


async def _true(value: Any) -> bool:
    """``value`` (awaited first when it is awaitable) as a probe for :func:`helpers.wait_for`."""
    if asyncio.iscoroutine(value):
        value = await value
    return bool(value)


async def test_a_deferred_constraint_the_commit_breaks_is_a_handler_failure(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    """The handler of "bad" writes a row that breaks a deferred unique constraint, which
    fails at COMMIT: the handler's failure (tried max_attempts times, then dead-lettered),
    not dedup's (which would stop the consumer); the handler's SET in that transaction
    does not reach the next one on the connection, and the rest apply once."""
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    await pool.execute(
        "CREATE TABLE ledger (ref text, CONSTRAINT one_ref UNIQUE (ref)"
        " DEFERRABLE INITIALLY DEFERRED)"
    )
    keys_ = ["m0", "m1", "bad", "m3", "m4"]
    await helpers.produce(bootstrap_servers, topic, [(None, _item(k)) for k in keys_])
    bad_calls = 0
    names: dict[str, str] = {}

    async def handler(msg: dedup.Message, tx: dedup.Tx) -> None:
        nonlocal bad_calls
        names[msg.idempotency_key] = await tx.conn.fetchval("SHOW application_name")
        if msg.idempotency_key == "bad":
            bad_calls += 1
            await tx.conn.execute("SET application_name = 'set-by-bad'")
            await tx.conn.execute("INSERT INTO ledger VALUES ('same'), ('same')")
        await support.record_effect(msg, tx)

    consumer = support.consumer(
        handler, topic, bootstrap_servers, pool, concurrency=1, batch_size=1, max_attempts=3
    )
    async with support.running(consumer):
        await _settle(pool, topic, {0: 5})

    assert bad_calls == 3, "tried max_attempts times"
    letter = await pool.fetchrow(
        "SELECT error, attempts FROM dedup.dead_letters WHERE idempotency_key = 'bad'"
    )
    assert letter is not None, await dead_letter_reasons(pool)
    assert "UniqueViolationError" in letter["error"], letter["error"]
    assert letter["attempts"] == 3
    assert await _effect_keys(pool) == ["m0", "m1", "m3", "m4"]
    assert "set-by-bad" not in {names["m3"], names["m4"]}
    assert await pool.fetchval("SELECT count(*) FROM ledger") == 0
    assert consumer.stats["dead_lettered"] == 1
