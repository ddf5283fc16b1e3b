"""Issue 12's combined acceptance: every boundary case mixed into one partition.

A 1 MiB key, a 3 KB key, a null-valued ``traceparent`` header, a tombstone and
snappy, lz4 and zstd batches from librdkafka, with ordinary messages between
them, keyed by the Kafka key and consumed with tracing on.  What a user sees:
the consumer keeps running, every message applied exactly once (the handler
below applies a tombstone as a delete), nothing dead-lettered, the stored
offset at the partition's end, and the same messages sent again are duplicates.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import dedup
from dedup import keys
from dedup_dev import effects as support
from dedup_dev import helpers
from dedup_dev import kafka as kafka_support
from dedup_dev.kafka import Topics
from tests.integration.test_foreign_producers import (
    KEEP_CODEC,
    Record,
    applied,
    librdkafka_produce,
    records,
)
from tests.integration.test_key_format import LIMIT

KB3 = ("k-3kb-é" * 500)[:3000]
MB1 = "m" * (1024 * 1024)
DELETED = b'{"deleted": true}'
"""What the handler records for a tombstone: a delete is a business effect too."""

Odd = tuple[bytes, bytes | None, list[tuple[str, Any]]]
"""A record sent on its own by aiokafka: key, value (None: a tombstone), headers."""


def odd(key: str, value: bytes | None, headers: list[tuple[str, Any]] | None = None) -> Odd:
    return (key.encode(), value, headers or [])


# In log order: ("odd", record) goes alone through aiokafka, ("codec", records)
# as compressed batches through librdkafka, ("plain", records) uncompressed.
PLAN: list[tuple[str, Any]] = [
    ("plain", records("o1", 3)),
    ("odd", odd(MB1, b'{"n": "1mb"}')),
    ("plain", records("o2", 2)),
    ("odd", odd(KB3, b'{"n": "3kb"}')),
    ("plain", records("o3", 2)),
    ("odd", odd("null-tp", b'{"n": "null-tp"}', [("traceparent", None)])),
    ("plain", records("o4", 2)),
    ("odd", odd("acct-gone", None)),
    ("plain", records("o5", 2)),
    ("snappy", records("snappy", 20)),
    ("plain", records("o6", 2)),
    ("lz4", records("lz4", 20)),
    ("plain", records("o7", 2)),
    ("zstd", records("zstd", 20)),
    ("plain", records("o8", 2)),
]


def sent_keys() -> list[str]:
    """Every Kafka key of the plan, in log order."""
    found: list[str] = []
    for kind, what in PLAN:
        recs: list[Record] = [what[:2]] if kind == "odd" else what
        found += [k.decode() for k, _ in recs if k is not None]
    return found


async def produce_plan(bootstrap_servers: str, topic: str) -> None:
    """Send the plan to partition 0, each step acknowledged before the next starts."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers, max_request_size=LIMIT)
    await producer.start()
    try:
        for kind, what in PLAN:
            if kind == "odd":
                key, value, headers = what
                await producer.send_and_wait(topic, value, key=key, headers=headers, partition=0)
            else:
                config = {} if kind == "plain" else {"compression.type": kind}
                await asyncio.to_thread(
                    librdkafka_produce, bootstrap_servers, topic, what, config, partition=0
                )
    finally:
        await producer.stop()


async def apply(msg: dedup.Message, tx: dedup.Tx) -> None:
    """The business handler: one effects row per message, a tombstone recorded as a delete."""
    if msg.tombstone:
        msg = dataclasses.replace(msg, value=DELETED)
    await support.record_effect(msg, tx)


async def test_every_boundary_case_in_one_partition_applies_once_and_the_partition_goes_on(
    bootstrap_servers: str, topics: Topics, pool: Any, spans: InMemorySpanExporter
) -> None:
    topic = await topics.create(config={"max.message.bytes": str(LIMIT), **KEEP_CODEC})
    await pool.execute(support.EFFECTS)
    await produce_plan(bootstrap_servers, topic)
    sent = sent_keys()
    expected = Counter(keys.stored(k) for k in sent)
    assert len(expected) == len(sent) == 81, "every key distinct"

    consumer = support.consumer(apply, topic, bootstrap_servers, pool, key=keys.kafka_key())

    async def next_offset() -> int | None:
        value = await pool.fetchval("SELECT next_offset FROM dedup.partitions")
        return None if value is None else int(value)

    async def caught_up(end: int) -> bool:
        # Both: the stats are counted just after the commit that moves next_offset.
        return consumer.stats["messages"] >= end and await next_offset() == end

    async with support.running(consumer) as running:
        [end] = (await kafka_support.end_offsets(bootstrap_servers, topic, 1)).values()
        assert end == len(sent)
        await helpers.wait_for(lambda: caught_up(end), what=f"next_offset {end}")
        assert not running.done(), "the consumer keeps running"
        assert await applied(pool) == expected
        assert consumer.stats["processed"] == len(sent)
        assert (consumer.stats["dead_lettered"], consumer.stats["retries"]) == (0, 0)
        assert await pool.fetchval("SELECT count(*) FROM dedup.dead_letters") == 0
        gone = await pool.fetchval("SELECT payload FROM effects WHERE key = 'acct-gone'")
        assert gone == orjson.loads(DELETED), "the tombstone applied once, as a delete"
        # Tracing was on: one span per batch, none failed (the null traceparent included).
        process = [s for s in spans.get_finished_spans() if s.name == f"process {topic}"]
        assert process and all(s.status.status_code != StatusCode.ERROR for s in process)

        # Redelivery: the same records again, each a duplicate of what was applied.
        await produce_plan(bootstrap_servers, topic)
        [end] = (await kafka_support.end_offsets(bootstrap_servers, topic, 1)).values()
        assert end == 2 * len(sent)
        await helpers.wait_for(lambda: caught_up(end), what=f"next_offset {end}")
        assert not running.done(), "the consumer keeps running"
        stats = dict(consumer.stats)

    assert await applied(pool) == expected, "no new business rows"
    assert (stats["processed"], stats["duplicates"]) == (len(sent), len(sent))
    assert (stats["dead_lettered"], stats["conflicts"]) == (0, 0)
    assert await pool.fetchval("SELECT count(*) FROM dedup.dead_letters") == 0
    assert await next_offset() == end
