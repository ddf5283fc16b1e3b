"""Keys of any length, against real Kafka and Postgres: applied once, found by the key a user knows.

A key longer than a B-tree entry (~2.7 KB) used to be dead-lettered and then
stop the partition for good: the event written with it overflowed the index
on ``events (namespace, key)``.  Long keys are now stored as a digest
(docs/concepts/guarantees.md, "Key format").
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

import dedup
from dedup import keys
from dedup.cli import _main as cli
from dedup_dev import effects as support
from dedup_dev import helpers
from dedup_dev.audit import json_out, run_cli
from dedup_dev.kafka import Topics

LIMIT = 3 * 1024 * 1024
"""Topic and producer limit: a record with a 1 MiB key is past Kafka's default of ~1 MB."""


async def big_record_topic(bootstrap_servers: str, topics: Topics) -> str:
    name = f"big-{uuid.uuid4().hex[:12]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        topic = NewTopic(name, 1, 1, topic_configs={"max.message.bytes": str(LIMIT)})
        await admin.create_topics([topic])
    finally:
        await admin.close()
    topics.created.append(name)
    return name


async def send_in_order(
    bootstrap_servers: str, topic: str, records: list[tuple[bytes, Any]]
) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers, max_request_size=LIMIT)
    await producer.start()
    try:
        for key, body in records:
            await (await producer.send(topic, orjson.dumps(body), key=key, partition=0))
    finally:
        await producer.stop()


async def test_a_3_kb_and_a_1_mb_key_apply_once_and_audit_finds_them_by_the_key_itself(
    bootstrap_servers: str,
    topics: Topics,
    pool: Any,
    dsn: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic = await big_record_topic(bootstrap_servers, topics)
    await pool.execute(support.EFFECTS)
    kb3 = ("k-3kb-é" * 500)[:3000]
    mb1 = "m" * (1024 * 1024)
    # A short key that reads like the 3 KB key's digest is a key of its own.
    lookalike = "sha256:" + hashlib.sha256(kb3.encode()).hexdigest()
    records = [
        (b"before", {"n": 1}),
        (kb3.encode(), {"n": 2}),
        (mb1.encode(), {"n": 3}),
        (lookalike.encode(), {"n": 4}),
        (kb3.encode(), {"n": 2}),  # redelivered: a duplicate
        (mb1.encode(), {"n": 3}),  # redelivered: a duplicate
        (kb3.encode(), {"n": 99}),  # same key, new payload: a conflict, dead-lettered
        (b"after", {"n": 5}),
    ]
    await send_in_order(bootstrap_servers, topic, records)

    consumer = dedup.IdempotentConsumer(
        support.record_effects,
        topics=[topic],
        group_id=f"g-{topic}",
        bootstrap_servers=bootstrap_servers,
        pool=pool,
        auto_offset_reset="earliest",
        install_signal_handlers=False,
    )  # the default key: header "idempotency-key", else the Kafka key
    async with support.running(consumer) as running:
        await helpers.wait_for(
            lambda: _counted(consumer, len(records)), what="every record handled"
        )
        assert not running.done(), "the consumer keeps running"
        stats = dict(consumer.stats)

    assert (stats["processed"], stats["duplicates"], stats["conflicts"]) == (5, 2, 1)
    assert stats["dead_lettered"] == 1
    stored = {k: keys.stored(k) for k in ("before", kb3, mb1, lookalike, "after")}
    assert stored["before"] == "before" and stored["after"] == "after"
    assert len(set(stored.values())) == 5, "the look-alike is not the 3 KB key"
    effects = await pool.fetch("SELECT key, count(*) AS n FROM effects GROUP BY key")
    assert {r["key"]: r["n"] for r in effects} == dict.fromkeys(stored.values(), 1)
    rows = await pool.fetch("SELECT idempotency_key, duplicates, conflicts FROM dedup.processed")
    assert {r["idempotency_key"]: (r["duplicates"], r["conflicts"]) for r in rows} == {
        stored["before"]: (0, 0),
        stored[kb3]: (1, 1),
        stored[mb1]: (1, 0),
        stored[lookalike]: (0, 0),
        stored["after"]: (0, 0),
    }
    letter = await pool.fetchrow("SELECT idempotency_key, key, reason FROM dedup.dead_letters")
    assert letter["idempotency_key"] == stored[kb3]
    assert letter["key"] == kb3.encode(), "the dead letter keeps the whole record"
    assert "conflict" in letter["reason"] and len(letter["reason"]) < 300
    kinds = await pool.fetch(
        "SELECT kind FROM dedup.events WHERE key = $1 ORDER BY id", stored[kb3]
    )
    assert [r["kind"] for r in kinds] == ["conflict", "dead_lettered"]
    assert await pool.fetchval("SELECT next_offset FROM dedup.partitions") == len(records)

    # The operator asks by the key they know (3 KB fits on a command line)...
    found = json_out(run_cli("audit", "--key", kb3, "--format", "json", dsn=dsn))
    assert [r["idempotency_key"] for r in found["processed"]] == [stored[kb3]]
    assert [r["offset"] for r in found["dead_letters"]] == [6]
    story = json_out(run_cli("events", "--key", kb3, "--format", "json", dsn=dsn))
    assert [e["kind"] for e in story["events"]] == ["conflict", "dead_lettered"]
    # ... or by the digest a listing shows, and the look-alike finds only itself
    by_digest = json_out(run_cli("audit", "--key", stored[mb1], "--format", "json", dsn=dsn))
    assert [r["offset"] for r in by_digest["processed"]] == [2]
    alike = json_out(run_cli("audit", "--key", lookalike, "--format", "json", dsn=dsn))
    found_keys = {r["idempotency_key"] for r in alike["processed"]}
    assert found_keys == {stored[lookalike], stored[kb3]}, "its own row and the row it names"
    # A 1 MiB key is past what one command-line argument may hold (128 KiB on
    # Linux): the same command through main().
    capsys.readouterr()
    argv = ["audit", "--key", mb1, "--format", "json", "--dsn", dsn]
    assert await asyncio.to_thread(cli.main, argv) == cli.EXIT_OK
    by_key = orjson.loads(capsys.readouterr().out)
    assert [(r["idempotency_key"], r["offset"]) for r in by_key["processed"]] == [(stored[mb1], 2)]
    # Nothing found: the message names the key without printing a megabyte.
    argv = ["audit", "--key", "n" * 1_000_000, "--dsn", dsn]
    assert await asyncio.to_thread(cli.main, argv) == cli.EXIT_PROBLEM
    assert len(capsys.readouterr().out) < 200


async def _counted(consumer: dedup.IdempotentConsumer, n: int) -> bool:
    return consumer.stats["messages"] >= n
