"""Postgres forgot a consumer's last commits (a failover to an async standby): they come again.

After the promotion of a standby that had not received the last commits, the
partition's row holds the consumer's token at an earlier offset (or an older
token, or no row), and the effects and keys of those commits are gone with it.
The consumer goes on without a restart: it takes the partition back from the
offset Postgres holds, and Kafka delivers those records again, each applied
once.  What the promotion leaves is made here by hand, in one transaction; the
chaos suite's ``failover`` scenario does it with a real standby.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from dedup_dev import effects as support
from dedup_dev import helpers
from dedup_dev import kafka as kafka_support
from dedup_dev.kafka import Topics


async def forget(pool: Any, topic: str, *, from_offset: int, row: str) -> None:
    """What a promotion that lost every commit from ``from_offset`` on leaves behind."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute('DELETE FROM effects WHERE "offset" >= $1', from_offset)
        await conn.execute('DELETE FROM dedup.processed WHERE "offset" >= $1', from_offset)
        if row == "offset":  # our token, an earlier offset
            await conn.execute(
                "UPDATE dedup.partitions SET next_offset = $2 WHERE topic = $1", topic, from_offset
            )
        elif row == "token":  # the partition was taken (a new token) in the lost commits
            await conn.execute(
                "UPDATE dedup.partitions SET next_offset = $2, token = token - 1 WHERE topic = $1",
                topic,
                from_offset,
            )
        else:  # the consumer took the partition for the first time in the lost commits
            await conn.execute("DELETE FROM dedup.partitions WHERE topic = $1", topic)


@pytest.mark.parametrize("row", ["offset", "token", "none"])
@pytest.mark.parametrize("found_by", ["look", "fence"])
async def test_commits_postgres_forgot_are_applied_again_once(
    row: str, found_by: str, bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create(partitions=1)
    await pool.execute(support.EFFECTS)
    items = [(None, orjson.dumps({"id": f"k{i}"})) for i in range(20)]
    await kafka_support.produce(bootstrap_servers, topic, items[:10])
    consumer = support.consumer(
        support.record_effects,
        topic,
        bootstrap_servers,
        pool,
        # look: the periodic look at its partitions finds the row behind while idle;
        # fence: it looks too seldom, and the next batch's fence finds it.
        kafka_commit_interval=0.5 if found_by == "look" else 600,
    )

    async def keys() -> list[str]:
        rows = await pool.fetch("SELECT key FROM effects ORDER BY id")
        return [r["key"] for r in rows]

    async def stored() -> int | None:
        return await pool.fetchval(
            "SELECT next_offset FROM dedup.partitions WHERE topic = $1", topic
        )

    async with support.running(consumer):
        await helpers.wait_for(lambda: helpers.equal(stored(), 10), within=30, what="offset 10")
        first = 0 if row == "none" else 4
        await forget(pool, topic, from_offset=first, row=row)
        if found_by == "look":
            await helpers.wait_for(
                lambda: helpers.equal(stored(), 10), within=30, what="the forgotten records again"
            )
        await kafka_support.produce(bootstrap_servers, topic, items[10:])
        await helpers.wait_for(lambda: helpers.equal(stored(), 20), within=30, what="offset 20")

    found = await keys()
    assert sorted(found) == sorted(f"k{i}" for i in range(20)), "each key applied once"
    assert consumer.stats["stale"] == 0
