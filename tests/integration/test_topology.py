"""Kafka's topology changing under a consumer with dedup's defaults: nothing lost in silence.

Partitions added while the group runs, retention deleting records the group had
not applied, a topic deleted and recreated, a record batch aiokafka cannot
decode between readable ones.  Each test checks the business rows (``effects``)
and what an operator sees: events, the CLI's output, the error's advice.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import Counter
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, NewTopic, RecordsToDelete
from aiokafka.producer import message_accumulator
from aiokafka.producer import producer as producer_module
from aiokafka.record import default_records
from aiokafka.structs import TopicPartition

import dedup
from dedup_dev import effects as support
from dedup_dev import helpers
from dedup_dev.audit import json_out, run_cli_async
from dedup_dev.kafka import Topics

METADATA_MAX_AGE_MS = 500  # new partitions are seen within it (aiokafka's default: 5 minutes)


def consumer(topic: str, bootstrap_servers: str, pool: Any, **options: Any) -> Any:
    """A consumer of ``topic`` with dedup's defaults unless ``options`` say otherwise."""
    return dedup.IdempotentConsumer(
        support.record_effects,
        topics=[topic],
        group_id=f"g-{topic}",
        bootstrap_servers=bootstrap_servers,
        pool=pool,
        key=dedup.keys.json_field("id"),
        install_signal_handlers=False,
        **options,
    )


async def produce(bootstrap_servers: str, topic: str, ids: list[str], partition: int = 0) -> None:
    await helpers.produce(
        bootstrap_servers,
        topic,
        [(None, orjson.dumps({"id": i})) for i in ids],
        partition=partition,
    )


async def applied(pool: Any) -> list[str]:
    return sorted(r["key"] for r in await pool.fetch("SELECT key FROM effects"))


async def topic_holding(bootstrap_servers: str, topics: Topics, pool: Any, ids: list[str]) -> str:
    """A new topic of one partition holding ``ids``, and the ``effects`` table."""
    topic = await topics.create(partitions=1)
    await pool.execute(support.EFFECTS)
    await produce(bootstrap_servers, topic, ids)
    return topic


async def all_applied(pool: Any, ids: list[str], what: str = "every record applied") -> None:
    await helpers.wait_for(lambda: helpers.equal(applied(pool), sorted(ids)), what=what)


async def admin(bootstrap_servers: str) -> AIOKafkaAdminClient:
    client = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await client.start()
    return client


async def events_of(pool: Any, kind: str) -> list[Any]:
    rows = await pool.fetch("SELECT resource, detail FROM dedup.events WHERE kind = $1", kind)
    return [(r["resource"], r["detail"]) for r in rows]


async def test_partitions_added_while_the_group_runs_are_consumed_from_their_start(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    # Records already in the topic before the group's first start.
    before = [f"p0-{i}" for i in range(10)]
    topic = await topic_holding(bootstrap_servers, topics, pool, before)
    running = consumer(topic, bootstrap_servers, pool, metadata_max_age_ms=METADATA_MAX_AGE_MS)
    async with support.running(running):
        await all_applied(pool, before)
        kafka = await admin(bootstrap_servers)
        try:
            await kafka.create_partitions({topic: NewPartitions(total_count=3)})
        finally:
            await kafka.close()
        added = [f"p{p}-{i}" for p in (1, 2) for i in range(10)]
        for p in (1, 2):  # at once: before the consumer's first fetch of them
            await produce(bootstrap_servers, topic, [k for k in added if k.startswith(f"p{p}")], p)
        await all_applied(pool, before + added, "every record of the added partitions applied")


async def test_records_lost_to_retention_are_recorded_and_the_rest_applied(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    first = [f"a{i}" for i in range(10)]
    topic = await topic_holding(bootstrap_servers, topics, pool, first)
    # auto_offset_reset given: the old default (latest) would hide what this test shows.
    stopped = consumer(topic, bootstrap_servers, pool, auto_offset_reset="earliest")
    async with support.running(stopped):
        await all_applied(pool, first)
    # While the group is stopped: 20 more, and retention deletes up to offset 20.
    later = [f"b{i}" for i in range(20)]
    await produce(bootstrap_servers, topic, later)
    kafka = await admin(bootstrap_servers)
    try:
        await kafka.delete_records({TopicPartition(topic, 0): RecordsToDelete(20)})
    finally:
        await kafka.close()

    again = consumer(topic, bootstrap_servers, pool, auto_offset_reset="earliest")
    async with support.running(again):
        remaining = later[10:]  # offsets 20 to 29, still in the log
        await all_applied(pool, first + remaining, "the records still in the log applied")
    [(resource, detail)] = await events_of(pool, "offsets_lost_to_retention")
    assert resource == f"g-{topic}:{topic}:0"
    assert (detail["lost_from"], detail["lost_to"], detail["records"]) == (10, 20, 10)
    stored = await pool.fetchval("SELECT next_offset FROM dedup.partitions WHERE topic = $1", topic)
    assert stored == 30


async def recreate(bootstrap_servers: str, topic: str) -> None:
    """Delete ``topic`` and make it again, empty, once Kafka has forgotten it."""
    kafka = await admin(bootstrap_servers)
    try:
        await kafka.delete_topics([topic])

        async def gone() -> bool:
            return topic not in await kafka.list_topics()

        await helpers.wait_for(gone, what=f"{topic} deleted")

        async def made() -> bool:
            try:
                await kafka.create_topics([NewTopic(topic, 1, 1)])
            except Exception:  # still being deleted: TopicAlreadyExists
                return False
            return True

        await helpers.wait_for(made, what=f"{topic} created again")
    finally:
        await kafka.close()


async def test_a_recreated_topic_holds_the_partition_naming_the_rewind_and_loses_nothing(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    old = [f"old{i}" for i in range(70)]
    topic = await topic_holding(bootstrap_servers, topics, pool, old)
    group = f"g-{topic}"
    first = consumer(topic, bootstrap_servers, pool, auto_offset_reset="earliest")
    async with support.running(first):
        await all_applied(pool, old)
    await recreate(bootstrap_servers, topic)
    new = [f"new{i}" for i in range(5)]
    await produce(bootstrap_servers, topic, new)

    held = consumer(topic, bootstrap_servers, pool, auto_offset_reset="earliest")
    async with support.running(held):

        async def beyond() -> list[Any]:
            return await events_of(pool, "offsets_beyond_log_end")

        [(resource, detail)] = await helpers.wait_for(beyond, what="the partition held")
        command = (
            f"dedup offsets rewind --group {group} --topic {topic} --partition 0 "
            "--to-offset 0 --yes"
        )
        assert resource == f"{group}:{topic}:0"
        assert detail == {"next_offset": 70, "log_start": 0, "log_end": 5, "command": command}
        # Held, not skipped: nothing of the new log was applied nor passed over.
        shown = json_out(
            await run_cli_async(
                "offsets", "show", "--group", group, "--format", "json",
                "--bootstrap-servers", bootstrap_servers, dsn=dsn,
            )
        )  # fmt: skip
        [row] = shown["partitions"]
        assert (row["next_offset"], row["end_offset"]) == (70, 5)
        assert "beyond the log end" in row["note"]
        assert await applied(pool) == sorted(old)

        # The operator runs the command the event names, while the group runs.
        argv = command.split()[2:-1]  # without "dedup offsets" and --yes, given below
        done = await run_cli_async(
            "offsets", *argv, "--yes", "--bootstrap-servers", bootstrap_servers, dsn=dsn
        )
        assert done.returncode == 0, done.stderr
        await all_applied(pool, old + new, "the new log applied after the rewind")


async def test_a_topic_recreated_under_a_running_consumer_is_held_and_aiokafka_stays_quiet(
    bootstrap_servers: str, topics: Topics, pool: Any, caplog: pytest.LogCaptureFixture
) -> None:
    old = [f"old{i}" for i in range(10)]
    topic = await topic_holding(bootstrap_servers, topics, pool, old)
    caplog.set_level(logging.WARNING)
    running = consumer(
        topic,
        bootstrap_servers,
        pool,
        auto_offset_reset="earliest",
        metadata_max_age_ms=METADATA_MAX_AGE_MS,
    )
    async with support.running(running):
        await all_applied(pool, old)
        await recreate(bootstrap_servers, topic)
        await produce(bootstrap_servers, topic, ["new0"])

        async def beyond() -> list[Any]:
            return await events_of(pool, "offsets_beyond_log_end")

        [(_, detail)] = await helpers.wait_for(beyond, what="the partition held")
    assert (detail["next_offset"], detail["log_end"]) == (10, 1)
    assert await applied(pool) == sorted(old)
    # While the topic was gone aiokafka said each thing at most once (the rate limit passes
    # one line per message every kafka_logs.INTERVAL s; this test takes less than that).
    # Whether it says anything at all depends on how fast the topic came back; the limit
    # itself is tested in tests/unit/test_kafka_logs.py.
    said = Counter((r.name, r.msg) for r in caplog.records if r.name.startswith("aiokafka"))
    assert max(said.values(), default=0) <= 1, said.most_common(3)


class NotUtf8(str):
    """A header name whose bytes on the wire are not UTF-8 (no client here writes one)."""

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b"\xff\xfe"


async def produce_one_by_one(
    bootstrap_servers: str, topic: str, values: list[tuple[bytes, list[Any]]]
) -> None:
    """Each ``(value, headers)`` in a batch of its own."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers)
    await producer.start()
    try:
        for value, headers in values:
            await producer.send_and_wait(topic, value, headers=headers)
    finally:
        await producer.stop()


async def test_an_undecodable_header_stops_after_the_readable_records_and_skips_only_it(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    topic = await topics.create(partitions=1)
    group = f"g-{topic}"
    await pool.execute(support.EFFECTS)
    # aiokafka's pure-Python batch builder writes the header name NotUtf8 encodes to.
    python_builder = default_records._DefaultRecordBatchBuilderPy
    monkeypatch.setattr(message_accumulator, "DefaultRecordBatchBuilder", python_builder)
    monkeypatch.setattr(producer_module, "DefaultRecordBatchBuilder", python_builder)
    good = [(orjson.dumps({"id": f"good{i}"}), []) for i in range(3)]
    bad = [(orjson.dumps({"id": "bad"}), [(NotUtf8("name"), b"x")])]
    after = [(orjson.dumps({"id": f"after{i}"}), []) for i in range(3)]
    await produce_one_by_one(bootstrap_servers, topic, good + bad + after)
    monkeypatch.undo()

    stops = consumer(topic, bootstrap_servers, pool, auto_offset_reset="earliest")
    with pytest.raises(dedup.UndecodableBatchError) as raised:
        await asyncio.wait_for(stops.run(), 60)
    error = str(raised.value)
    # The readable records fetched before the bad batch are applied, nothing after it.
    readable = ["good0", "good1", "good2"]
    assert await applied(pool) == readable
    assert raised.value.offset == 3
    assert raised.value.batch == (3, 4)
    assert "the group stands at offset 3" in error
    skip = re.search(r"`dedup (offsets skip [^`]+)`", error)
    assert skip is not None, error
    assert skip[1] == f"offsets skip --group {group} --topic {topic} --partition 0 --to-offset 4"

    done = await run_cli_async(*skip[1].split(), "--bootstrap-servers", bootstrap_servers, dsn=dsn)
    assert done.returncode == 0, done.stderr
    again = consumer(topic, bootstrap_servers, pool, auto_offset_reset="earliest")
    async with support.running(again):
        await helpers.wait_for(
            lambda: helpers.equal(applied(pool), ["after0", "after1", "after2", *readable]),
            what="the records after the skipped batch applied",
        )
