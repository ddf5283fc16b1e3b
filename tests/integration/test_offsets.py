"""Stored offsets follow Kafka's real position, and Kafka's committed offsets follow Postgres.

A transactional producer leaves records no consumer is handed (commit and
abort markers, and under read_committed the records of aborted transactions);
a caught-up consumer must still store the partition's end offset, in Postgres
and in Kafka, so lag tools show 0.  And whatever an operator did to Kafka's
committed offsets, the consumer writes Postgres' back after an assignment.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from dedup_dev import effects as support
from dedup_dev import helpers, kafka_tools
from dedup_dev import kafka as kafka_support
from dedup_dev.kafka import Topics


def item(key: str) -> bytes:
    return orjson.dumps({"id": key})


async def stored_offsets(pool: Any) -> dict[int, int | None]:
    rows = await pool.fetch('SELECT "partition", next_offset FROM dedup.partitions')
    return {r["partition"]: r["next_offset"] for r in rows}


async def effect_keys(pool: Any) -> list[str]:
    return [r["key"] for r in await pool.fetch("SELECT key FROM effects ORDER BY key")]


# (commit?, keys) per transaction; each transaction writes to both partitions.
TRANSACTIONS = [
    (True, ["c0", "c1", "c2", "c3"]),
    (False, ["a0", "a1", "a2", "a3"]),
    (True, ["c4", "c5"]),
    (False, ["a4", "a5", "a6", "a7"]),
    (False, ["a8", "a9"]),
    (True, ["c6", "c7", "c8", "c9"]),
    (False, ["a10", "a11"]),  # the partitions end with an aborted transaction
]


@pytest.mark.parametrize("batch_size", [1, 500])
async def test_transactional_topic_applies_committed_keys_once_and_ends_with_no_lag(
    batch_size: int, bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create(partitions=2)
    await pool.execute(support.EFFECTS)
    await kafka_support.produce_transactions(
        bootstrap_servers,
        topic,
        [(commit, [(i % 2, item(k)) for i, k in enumerate(keys)]) for commit, keys in TRANSACTIONS],
    )
    ends = await kafka_support.end_offsets(bootstrap_servers, topic, 2)
    group = f"g-{topic}"
    consumer = support.consumer(
        support.record_effects,
        topic,
        bootstrap_servers,
        pool,
        batch_size=batch_size,
        isolation_level="read_committed",
    )

    async def caught_up() -> bool:
        kafka = await kafka_support.committed(bootstrap_servers, group)
        return await stored_offsets(pool) == ends and kafka == ends

    async with support.running(consumer):
        await helpers.wait_for(caught_up, within=20, what=f"offsets at the end {ends}")

    committed = sorted(k for ok, keys in TRANSACTIONS if ok for k in keys)
    assert await effect_keys(pool) == committed, "each committed key once, no aborted key"
    assert consumer.stats["processed"] == len(committed)
    # What an operator sees in Kafka's own tool: a caught-up group has no lag.
    lag = await kafka_tools.group_lag(bootstrap_servers, group)
    assert lag == {(topic, 0): 0, (topic, 1): 0}


async def test_markers_alone_are_followed_under_read_uncommitted(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    # Without read_committed every record is handed out, but the commit marker
    # after the last one is not: the stored offset must still reach the end.
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    await kafka_support.produce_transactions(
        bootstrap_servers, topic, [(True, [(0, item(f"k{i}")) for i in range(3)])]
    )
    ends = await kafka_support.end_offsets(bootstrap_servers, topic, 1)
    assert ends == {0: 4}  # three records and the commit marker
    consumer = support.consumer(
        support.record_effects, topic, bootstrap_servers, pool, isolation_level="read_uncommitted"
    )
    async with support.running(consumer):
        await helpers.wait_for(
            lambda: helpers.equal(kafka_support.committed(bootstrap_servers, f"g-{topic}"), ends),
            within=10,
            what="Kafka's committed offset at the end",
        )
    assert await stored_offsets(pool) == ends
    assert await effect_keys(pool) == ["k0", "k1", "k2"]


async def test_kafka_offsets_reset_by_an_operator_are_rewritten_from_postgres(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create(partitions=2)
    await pool.execute(support.EFFECTS)
    await helpers.produce(bootstrap_servers, topic, [(None, item(f"k{i}")) for i in range(12)])
    group = f"g-{topic}"
    first = support.consumer(support.record_effects, topic, bootstrap_servers, pool)
    async with support.running(first):
        await helpers.wait_for(lambda: support.handled(first, 12), what="all 12")
    stored = await stored_offsets(pool)
    assert sum(o or 0 for o in stored.values()) == 12
    assert await kafka_support.committed(bootstrap_servers, group) == stored

    # kafka-consumer-groups --reset-offsets --to-earliest on the stopped group.
    await kafka_support.reset(bootstrap_servers, group, topic, {0: 0, 1: 0})
    assert await kafka_support.committed(bootstrap_servers, group) == {0: 0, 1: 0}

    second = support.consumer(
        support.record_effects, topic, bootstrap_servers, pool, kafka_commit_interval=0.5
    )
    async with support.running(second):
        # Nothing new arrives: only the assignment can make the consumer write.
        await helpers.wait_for(
            lambda: helpers.equal(kafka_support.committed(bootstrap_servers, group), stored),
            within=15,
            what=f"Kafka's committed offsets back at Postgres' {stored}",
        )
    assert second.stats["messages"] == 0, "Postgres decided where to resume, not Kafka"
    assert await support.effect_counts(pool) == (12, 12)
