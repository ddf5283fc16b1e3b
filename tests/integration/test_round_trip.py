"""The foundation works end to end: Kafka in, Postgres out, on the real services."""

from __future__ import annotations

from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from dedup_dev import helpers
from dedup_dev.kafka import Topics


async def test_message_produced_to_kafka_lands_in_postgres(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create(partitions=2)
    sent = await helpers.produce(
        bootstrap_servers, topic, [(f"k{i}".encode(), f"v{i}".encode()) for i in range(20)]
    )
    await pool.execute("CREATE TABLE seen (k text PRIMARY KEY, v text NOT NULL)")

    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap_servers,
        group_id=f"g-{topic}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    try:

        async def consume_some() -> int:
            batches = await consumer.getmany(timeout_ms=500)
            rows = [(m.key.decode(), m.value.decode()) for ms in batches.values() for m in ms]
            await pool.executemany("INSERT INTO seen VALUES ($1, $2)", rows)
            await consumer.commit()
            return int(await pool.fetchval("SELECT count(*) FROM seen")) >= sent

        await helpers.wait_for(consume_some, what="all 20 messages in Postgres")
        committed = [await consumer.committed(TopicPartition(topic, p)) for p in (0, 1)]
    finally:
        await consumer.stop()

    rows = await pool.fetch("SELECT k, v FROM seen ORDER BY k")
    assert {r["k"]: r["v"] for r in rows} == {f"k{i}": f"v{i}" for i in range(20)}
    assert sum(c or 0 for c in committed) == 20


async def test_each_test_gets_a_migrated_database_of_its_own(pool: Any) -> None:
    tables = await pool.fetch(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = 'dedup'"
    )
    assert {"processed", "partitions", "events", "dead_letters", "migrations"} <= {
        r["table_name"] for r in tables
    }
    assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == 0
    await pool.execute("INSERT INTO dedup.events (subject, kind) VALUES ('test', 'marker')")
