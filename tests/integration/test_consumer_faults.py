"""The consumer under the faults of the failure model: kills, pauses, rebalances, lost connections.

Consumers that get killed or paused run as real OS processes
(:mod:`dedup_dev.consumer_process`); the group test runs three
consumers in this process.  Each scenario runs with ``batch_size=1`` and with
the default batch size.
"""

from __future__ import annotations

import asyncio
import random
import signal
from typing import Any

import asyncpg
import orjson
import pytest

import dedup
from dedup import _faults as faults
from dedup.data import _db as db
from dedup_dev import effects as support
from dedup_dev import helpers
from dedup_dev.consumer_process import started
from dedup_dev.kafka import Topics

BATCH_SIZES = {"batch_size_1": 1, "batch_default": dedup._config.DEFAULT_BATCH_SIZE}


@pytest.fixture(params=list(BATCH_SIZES))
def batch_size(request: pytest.FixtureRequest) -> int:
    return BATCH_SIZES[request.param]


def item(i: int) -> bytes:
    return orjson.dumps({"id": f"m{i}", "amount": i})


def process_args(dsn: str, bootstrap_servers: str, topic: str, batch_size: int) -> list[str]:
    """Arguments of a consumer process in this test's group; batches of at most 40."""
    return [
        *("--dsn", dsn, "--bootstrap-servers", bootstrap_servers, "--topic", topic),
        *("--group", f"g-{topic}", "--batch-size", str(min(batch_size, 40))),
    ]


async def stored_offsets(pool: Any) -> dict[int, int]:
    rows = await pool.fetch('SELECT "partition", next_offset FROM dedup.partitions')
    return {r["partition"]: r["next_offset"] for r in rows if r["next_offset"] is not None}


async def test_sigkill_mid_batch_three_times_applies_each_key_once(
    batch_size: int, bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    topic = await topics.create(partitions=2)
    n = 300
    await helpers.produce(bootstrap_servers, topic, [(None, item(i)) for i in range(n)])
    common = process_args(dsn, bootstrap_servers, topic, batch_size)

    # Three kills may strike the same message each time; at the default max_attempts
    # it would be dead-lettered as one that ends the process (test_handler_contract.py).
    common += ["--max-attempts", "10"]
    for _ in range(3):
        async with started(*common, "--hold", "0.3") as child:
            # Strike inside the second batch: its rows are written, not committed.
            first, _ = await child.expect("IN_BATCH")
            _, line = await child.expect("IN_BATCH", after=first + 1)
            await child.kill()
        _, partition, offset, _token = line.split()
        in_flight = await pool.fetchval(
            'SELECT count(*) FROM effects WHERE "partition" = $1 AND "offset" = $2',
            int(partition),
            int(offset),
        )
        assert in_flight == 0, "the killed batch rolled back"

    async with started(*common) as child:
        await helpers.wait_for(
            lambda: _all_applied(pool, n), within=60, what=f"all {n} keys applied"
        )
        assert await child.terminate() == 0

    assert await support.effect_counts(pool) == (n, n)
    assert sum((await stored_offsets(pool)).values()) == n
    tokens = await pool.fetchval("SELECT max(token) FROM dedup.partitions")
    assert tokens >= 4, "every restart took the partitions with a newer token"


async def test_paused_owner_is_fenced_after_another_takes_over(
    batch_size: int, bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    topic = await topics.create(partitions=1)
    n = 40
    await helpers.produce(bootstrap_servers, topic, [(None, item(i)) for i in range(n)])
    common = process_args(dsn, bootstrap_servers, topic, batch_size)

    async with started(*common, "--hold", "2", "--holder", "paused-A") as a:
        _, line = await a.expect("IN_BATCH")
        a.signal(signal.SIGSTOP)  # A holds an open transaction with its batch written
        _, _, first_offset, token_a = line.split()
        async with started(*common, "--holder", "B") as b:
            # B waits out A's session (3 s) and A's open transaction (cut at 3 s).
            await helpers.wait_for(
                lambda: _all_applied(pool, n), within=60, what="B applied everything"
            )
            a.signal(signal.SIGCONT)
            stale = await helpers.wait_for(
                lambda: pool.fetchrow(
                    "SELECT token FROM dedup.events"
                    " WHERE kind = 'stale_rejected' AND holder = 'paused-A'"
                ),
                within=30,
                what="A's resumed batch refused by the fence",
            )
            assert stale["token"] == int(token_a)
            assert await b.terminate() == 0
        assert await a.terminate() == 0

    assert await support.effect_counts(pool) == (n, n)
    writers = await pool.fetch("SELECT DISTINCT token FROM effects")
    assert int(token_a) not in {r["token"] for r in writers}, "nothing A wrote committed"
    assert int(first_offset) == 0


async def test_two_consumers_and_a_third_joining_and_leaving(
    batch_size: int, bootstrap_servers: str, topics: Topics, dsn: str
) -> None:
    topic = await topics.create(partitions=4)
    rng = random.Random(5000)
    copies = [(None, item(i)) for i in range(5000) for _ in range(rng.randint(1, 3))]
    rng.shuffle(copies)
    half = len(copies) // 2

    async def produce(records: list[tuple[None, bytes]]) -> None:
        for p in range(4):  # every partition gets some, so every owner has work
            await helpers.produce(bootstrap_servers, topic, records[p::4], partition=p)

    pools = [await db.create_pool(dsn, max_size=2) for _ in range(3)]
    await pools[0].execute(support.EFFECTS)
    handler = support.record_effect if batch_size == 1 else support.record_effects
    consumers = [
        support.consumer(
            handler, topic, bootstrap_servers, p, batch_size=batch_size, session_timeout_ms=6000
        )
        for p in pools
    ]

    def handled() -> int:
        return sum(c.stats["messages"] for c in consumers)

    try:
        await produce(copies[:half])
        async with support.running(consumers[0]), support.running(consumers[1]):
            await helpers.wait_for(_at_least(handled, half // 2), what="a quarter")
            async with support.running(consumers[2]):
                await helpers.wait_for(
                    lambda: _true(consumers[2].assignment), within=60, what="the third to join"
                )
                await produce(copies[half:])
                await helpers.wait_for(
                    _at_least(lambda: consumers[2].stats["messages"], 1),
                    within=60,
                    what="the third consumer to apply something",
                )
            await helpers.wait_for(_at_least(handled, len(copies)), within=120, what="every copy")
        assert await support.effect_counts(pools[0]) == (5000, 5000)
        assert sum(c.stats["processed"] for c in consumers) == 5000
        assert sum(c.stats["duplicates"] for c in consumers) == len(copies) - 5000
    finally:
        for p in pools:
            await p.close()


async def test_backend_killed_mid_transaction_is_retried_without_loss(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    topic = await topics.create(partitions=2)
    await pool.execute(support.EFFECTS)
    own = await db.create_pool(dsn, max_size=2, server_settings={"application_name": "victim"})

    async def lingering(msgs: list[dedup.Message], tx: dedup.Tx) -> None:
        await support.record_effects(msgs, tx)
        await asyncio.sleep(0.05)  # a slow handler: the transaction stays open a while

    consumer = support.consumer(lingering, topic, bootstrap_servers, own, batch_size=20)

    async def kill_in_transaction() -> bool:
        return bool(
            await pool.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = 'victim' AND datname = current_database()"
                " AND state = 'idle in transaction'"
            )
        )

    try:
        async with support.running(consumer):
            for round_ in range(3):
                base = round_ * 100
                await helpers.produce(
                    bootstrap_servers, topic, [(None, item(base + i)) for i in range(100)]
                )
                await helpers.wait_for(
                    kill_in_transaction, interval=0.005, what="a batch transaction to kill"
                )
            await helpers.wait_for(lambda: _all_applied(pool, 300), within=60, what="all 300")
    finally:
        await own.close()
    assert await support.effect_counts(pool) == (300, 300)
    assert consumer.stats["retries"] >= 3, "each killed transaction was retried"


async def test_a_commit_whose_answer_was_lost_does_not_stall_the_partition(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    """COMMIT succeeds on the server, the connection drops before the answer comes back.

    The retry's fence then finds the offset moved by our own token: the consumer
    must see that the batch landed and go on, not take itself for a stale owner.
    """
    topic = await topics.create(partitions=1)
    await pool.execute(support.EFFECTS)
    lost: list[bool] = []

    async def lose_the_answer(**_: Any) -> None:
        # Right after the batch's COMMIT returned: as if the answer never came back.
        if not lost:
            lost.append(True)
            raise asyncpg.ConnectionDoesNotExistError("connection was closed mid-operation")

    consumer = support.consumer(support.record_effects, topic, bootstrap_servers, pool)
    with faults.install(faults.Point.AFTER_COMMIT, lose_the_answer):
        async with support.running(consumer):
            await helpers.produce(bootstrap_servers, topic, [(None, item(i)) for i in range(10)])
            await helpers.wait_for(lambda: _all_applied(pool, 10), within=30, what="the first 10")
            await helpers.produce(
                bootstrap_servers, topic, [(None, item(i)) for i in range(10, 20)]
            )
            await helpers.wait_for(
                lambda: _all_applied(pool, 20), within=30, what="the partition to go on after it"
            )
    assert lost, "the fault was injected"
    assert await support.effect_counts(pool) == (20, 20)
    assert consumer.stats["stale"] == 0, "our own commit is not a newer owner's"
    assert consumer.stats["retries"] >= 1
    stored = await pool.fetchval(
        'SELECT next_offset FROM dedup.partitions WHERE topic = $1 AND "partition" = 0', topic
    )
    assert stored == 20


async def _all_applied(pool: Any, n: int) -> bool:
    return int(await pool.fetchval("SELECT count(DISTINCT key) FROM effects")) >= n


async def _true(value: Any) -> bool:
    return bool(value)


def _at_least(count: Any, n: int) -> Any:
    async def probe() -> bool:
        await asyncio.sleep(0)
        return bool(count() >= n)

    return probe
