"""A FastStream group, exactly-once through dedup.FastStreamDedup, survives a member's SIGKILL.

Two members of one group (dedup_dev/faststream_member.py, batch
subscribers) consume 3,000 keys sent one to three times each; one member is
SIGKILLed mid-stream, FastStream's group hands its partitions to the other,
which gets again every record the dead member had not committed to Kafka.
Every key is applied exactly once: one ``effects`` row each, no more.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

import orjson

from dedup_dev import effects, faststream_member, helpers
from dedup_dev import kafka as kafka_support
from dedup_dev.kafka import Topics

KEYS = 3_000


async def test_a_faststream_group_applies_every_key_once_through_a_sigkill(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics
) -> None:
    topic = await topics.create(partitions=4, prefix="fs")
    group = f"fs-{uuid.uuid4().hex[:8]}"
    rng = random.Random(18)
    sends = [k for k in range(KEYS) for _ in range(rng.randint(1, 3))]
    rng.shuffle(sends)
    args = ("--dsn", dsn, "--bootstrap-servers", bootstrap_servers, "--topic", topic)
    args += ("--group", group, "--max-records", "50")
    # The members' effects table, made once here: two CREATE TABLE IF NOT EXISTS
    # at the same moment can collide in Postgres's catalog.
    await pool.execute(effects.EFFECTS)
    async with (
        faststream_member.started(*args) as doomed,
        faststream_member.started(*args) as survivor,
    ):
        await doomed.expect("READY")
        await survivor.expect("READY")
        await kafka_support.produce(
            bootstrap_servers,
            topic,
            ((str(k).encode(), orjson.dumps({"id": k})) for k in sends),
        )

        async def some_applied() -> bool:
            return bool(await pool.fetchval("SELECT count(*) >= 300 FROM effects"))

        await helpers.wait_for(some_applied, within=30, what="the group applying keys")
        await doomed.kill()
        at_kill = await pool.fetchval("SELECT count(DISTINCT key) FROM effects")
        assert at_kill < KEYS, "the stream ended before the kill: nothing was mid-stream"

        async def all_applied() -> bool:
            return bool(await pool.fetchval("SELECT count(DISTINCT key) = $1 FROM effects", KEYS))

        await helpers.wait_for(all_applied, within=30, what=f"all {KEYS} keys applied")
        assert await survivor.stop() == 0, survivor.stderr_tail()

    rows = await pool.fetch(
        "SELECT key, count(*) AS n FROM effects GROUP BY key HAVING count(*) > 1"
    )
    assert rows == [], f"applied more than once: {rows[:5]}"
    assert await pool.fetchval("SELECT count(*) FROM effects") == KEYS
    assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == KEYS
    assert await pool.fetchval("SELECT count(*) FROM dedup.dead_letters") == 0
    # The copies were counted as duplicates on the keys' rows, not applied.
    suppressed = await pool.fetchval("SELECT coalesce(sum(duplicates), 0) FROM dedup.processed")
    assert suppressed >= len(sends) - KEYS
