"""`dedup purge`: keys older than the window go in short batches; nothing inside it ever does."""

from __future__ import annotations

import asyncio
import datetime
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaProducer

from dedup_dev import audit as audit_support
from dedup_dev import effects as support
from dedup_dev import helpers
from dedup_dev.audit import (
    UTC,
    add_dead_letter,
    add_event,
    add_key,
    json_out,
    run_cli,
)
from dedup_dev.kafka import Topics

T = datetime.datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
TICK = datetime.timedelta(microseconds=1)


async def _keys(pool: Any) -> list[str]:
    rows = await pool.fetch("SELECT idempotency_key FROM dedup.processed ORDER BY 1")
    return [r["idempotency_key"] for r in rows]


async def _old_keys(pool: Any, n: int) -> None:
    """``n`` keys first seen 40 days ago, in first_seen order."""
    await pool.execute(
        'INSERT INTO dedup.processed (namespace, idempotency_key, topic, "partition",'
        ' "offset", token, payload_hash, first_seen, processed_at)'
        " SELECT 'payments', 'old-' || g, 'payments', g % 4, g, 1, '\\x00',"
        "        now() - interval '40 days' + g * interval '1 ms',"
        "        now() - interval '40 days' + g * interval '1 ms'"
        "   FROM generate_series(1, $1::int) AS g",
        n,
    )


async def test_the_cutoff_is_exact_and_a_key_inside_the_window_is_never_removed(
    dsn: str, pool: Any
) -> None:
    await add_key(pool, "just-before", first_seen=T - TICK)
    await add_key(pool, "at-cutoff", first_seen=T)
    await add_key(pool, "after", first_seen=T + TICK)
    # Old, but redelivered inside the window: still needed to stop the next copy.
    await add_key(pool, "old-but-duplicated", first_seen=T - datetime.timedelta(days=9))
    await pool.execute(
        "UPDATE dedup.processed SET duplicates = 1, last_duplicate_at = $1"
        " WHERE idempotency_key = 'old-but-duplicated'",
        T,
    )

    done = run_cli("purge", "--before", "2026-11-30T10:00:00Z", "--format", "json", dsn=dsn)
    assert done.returncode == 0, done.stderr
    doc = json_out(done)
    assert doc["cutoff"] == "2026-11-30T10:00:00.000000+00:00"
    assert doc["purged"] == {"processed": 1, "dead_letters": 0, "outbox": 0, "events": None}
    assert await _keys(pool) == ["after", "at-cutoff", "old-but-duplicated"]


async def test_older_than_counts_back_from_the_database_clock(dsn: str, pool: Any) -> None:
    now = await pool.fetchval("SELECT now()")
    window = datetime.timedelta(days=30)
    await add_key(pool, "outside", first_seen=now - window - datetime.timedelta(minutes=1))
    await add_key(pool, "inside", first_seen=now - window + datetime.timedelta(minutes=1))

    dry = json_out(
        run_cli("purge", "--older-than", "30d", "--dry-run", "--format", "json", dsn=dsn)
    )
    assert (dry["dry_run"], dry["purged"]["processed"]) == (True, 1)
    assert await _keys(pool) == ["inside", "outside"]

    done = run_cli("purge", "--older-than", "30d", dsn=dsn)
    assert done.returncode == 0, done.stderr
    assert "keys purged          1" in done.stdout
    assert await _keys(pool) == ["inside"]


async def test_many_old_keys_go_in_short_batches_and_the_next_purge_reads_little(
    dsn: str, pool: Any
) -> None:
    await _old_keys(pool, 30000)
    await add_key(pool, "fresh")
    await pool.execute("ANALYZE dedup.processed")

    args = ("purge", "--older-than", "30d", "--batch-size", "1000", "--pause", "0")
    doc = json_out(run_cli(*args, "--format", "json", dsn=dsn))
    assert doc["purged"]["processed"] == 30000
    assert doc["batches"] >= 25
    assert doc["batches_skipped"] == 0
    # The owner purged, so every emptied BRIN range was summarized afresh ...
    assert doc["brin_ranges_resummarized"] >= 4, doc
    assert doc["brin_ranges_not_resummarized"] == 0, doc
    assert await _keys(pool) == ["fresh"]

    # ... and the next purge's candidate scan skips them instead of reading them all again.
    async with pool.acquire() as conn, conn.transaction():
        # Through the BRIN index, as at scale (this small table's stats favour a seq scan).
        await conn.execute("SET LOCAL enable_seqscan = off")
        plan = await conn.fetchval(
            "EXPLAIN (ANALYZE, FORMAT JSON) SELECT count(*) FROM dedup.processed"
            " WHERE first_seen < now() - interval '30 days'"
        )
    assert _heap_blocks(plan[0]["Plan"]) == 0, doc  # (the pool decodes json)


async def test_a_table_held_by_autovacuum_costs_one_lock_timeout_per_pass_not_per_range(
    dsn: str, pool: Any
) -> None:
    # One block per BRIN range: the purge below empties about 200 ranges.
    await pool.execute(
        "ALTER INDEX dedup.processed_first_seen_brin SET (pages_per_range = 1);"
        " REINDEX INDEX dedup.processed_first_seen_brin"
    )
    await _old_keys(pool, 30000)
    async with pool.acquire() as vacuum, vacuum.transaction():
        # What an autovacuum of the table holds; the DELETEs don't conflict with it.
        await vacuum.execute("LOCK TABLE dedup.processed IN SHARE UPDATE EXCLUSIVE MODE")
        started = time.monotonic()
        done = run_cli("purge", "--older-than", "30d", "--pause", "0", "--format", "json", dsn=dsn)
        took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    doc = json_out(done)
    assert doc["purged"]["processed"] == 30000
    assert doc["brin_ranges_resummarized"] == 0
    assert doc["brin_ranges_not_resummarized"] >= 150, doc
    # Five tries of 100 ms and 7.5 s of backoff; a try per range would be 5 x 150 x 100 ms.
    assert took < 25, doc


def _heap_blocks(node: dict[str, Any]) -> int:
    own = node.get("Exact Heap Blocks", 0) + node.get("Lossy Heap Blocks", 0)
    if node["Node Type"] == "Seq Scan":
        own = 10**9  # a sequential scan reads everything
    return int(own) + sum(_heap_blocks(child) for child in node.get("Plans", []))


async def test_replayed_dead_letters_go_and_events_only_when_asked(dsn: str, pool: Any) -> None:
    now = await pool.fetchval("SELECT now()")
    old, lately = now - datetime.timedelta(days=60), now - datetime.timedelta(days=1)
    await add_dead_letter(
        pool, offset=1, created_at=old, replayed_at=old, reason="replayed long ago"
    )
    await add_dead_letter(pool, offset=2, created_at=old, replayed_at=None, reason="never replayed")
    await add_dead_letter(pool, offset=3, created_at=old, replayed_at=lately, reason="lately")
    await add_event(pool, "message", "duplicate", namespace="p", key="k", at=old)
    await add_event(pool, "message", "duplicate", namespace="p", key="k", at=lately)

    doc = json_out(run_cli("purge", "--older-than", "30d", "--format", "json", dsn=dsn))
    assert doc["purged"] == {"processed": 0, "dead_letters": 1, "outbox": 0, "events": None}
    left = await pool.fetch('SELECT reason FROM dedup.dead_letters ORDER BY "offset"')
    assert [r["reason"] for r in left] == ["never replayed", "lately"]
    assert await pool.fetchval("SELECT count(*) FROM dedup.events") == 2

    for window, purged in (("90d", 0), ("45d", 1)):
        args = ("purge", "--older-than", "30d", "--events-older-than", window, "--format", "json")
        assert json_out(run_cli(*args, dsn=dsn))["purged"]["events"] == purged
    assert await pool.fetchval("SELECT count(*) FROM dedup.events WHERE at = $1", lately) == 1


OLD_KEYS = 1_000_000
BACKLOG = 700_000


async def _produce_backlog(bootstrap_servers: str, topic: str) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap_servers, linger_ms=20, max_batch_size=256 * 1024
    )
    await producer.start()
    try:
        for start in range(0, BACKLOG, 50_000):
            sent = [
                await producer.send(topic, orjson.dumps({"payment_id": f"p{i}", "amount": i}))
                for i in range(start, start + 50_000)
            ]
            await asyncio.gather(*sent)
    finally:
        await producer.stop()


@pytest.mark.slow
async def test_purging_a_million_old_keys_keeps_the_consumer_above_half_speed(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics
) -> None:
    topic = await topics.create(partitions=2)
    await pool.execute(support.EFFECTS)
    old_keys = pool.execute(
        'INSERT INTO dedup.processed (namespace, idempotency_key, topic, "partition",'
        ' "offset", token, payload_hash, first_seen, processed_at)'
        " SELECT 'payments', 'old-' || g, 'payments', g % 8, g, 1, '\\x00',"
        "        now() - interval '40 days' + g * interval '1 ms',"
        "        now() - interval '40 days' + g * interval '1 ms'"
        f"   FROM generate_series(1, {OLD_KEYS}) AS g"
    )
    await asyncio.gather(old_keys, _produce_backlog(bootstrap_servers, topic))
    await pool.execute("VACUUM ANALYZE dedup.processed")

    consumer = audit_support.consumer(support.record_effects, topic, bootstrap_servers, pool)

    async def processed() -> int:
        return int(consumer.stats["processed"])

    async with support.running(consumer):
        await helpers.wait_for(
            lambda: _above(processed, 20_000), within=60, what="the consumer at full speed"
        )
        before = await _rate(processed, lambda: asyncio.sleep(4))
        purge = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dedup", "purge", "--older-than", "30d", "--dsn", dsn,
            "--format", "json", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        during = await _rate(processed, purge.communicate)
        out, err = during.result
        assert purge.returncode == 0, err.decode()
        assert await processed() < BACKLOG, "the backlog ran out: raise BACKLOG"

    doc = orjson.loads(out)
    print(
        f"\nconsumer {before.per_second:,.0f} msg/s without purge, {during.per_second:,.0f} "
        f"msg/s during it; purge: {doc['purged']['processed']:,} keys in "
        f"{doc['seconds']:.1f} s, {doc['batches']} batches"
    )
    assert doc["purged"]["processed"] == OLD_KEYS
    assert during.per_second > before.per_second / 2
    # Every key the consumer claimed during the purge is still there.
    kept = await pool.fetchval("SELECT count(*) FROM dedup.processed")
    assert kept == await pool.fetchval("SELECT count(*) FROM effects") >= during.count


@dataclass
class _Rate:
    count: int
    seconds: float
    result: Any

    @property
    def per_second(self) -> float:
        return self.count / self.seconds


async def _rate(counter: Callable[[], Awaitable[int]], work: Callable[[], Awaitable[Any]]) -> _Rate:
    """How fast ``counter`` grows while ``work`` runs."""
    start, began = await counter(), time.monotonic()
    result = await work()
    return _Rate(await counter() - start, time.monotonic() - began, result)


async def _above(counter: Callable[[], Awaitable[int]], n: int) -> bool:
    return await counter() >= n


async def test_sent_outbox_rows_before_the_cutoff_go_and_pending_or_failed_ones_stay(
    dsn: str, pool: Any
) -> None:
    # Old and sent; sent just after the cutoff; old but pending; old and failed.
    rows = [
        ("sent-old", "sent", T - datetime.timedelta(days=9)),
        ("sent-new", "sent", T + TICK),
        ("pending-old", "pending", None),
        ("failed-old", "failed", None),
    ]
    for key, status, sent_at in rows:
        await pool.execute(
            "INSERT INTO dedup.outbox (key, sink, destination, value, status, sent_at, created_at)"
            " VALUES ($1, 'kafka', 'payment-applied', '\\x7b7d', $2, $3, $4)",
            key,
            status,
            sent_at,
            T - datetime.timedelta(days=10),
        )

    dry = json_out(run_cli("purge", "--before", "2026-11-30T10:00:00Z", "--dry-run",
                           "--format", "json", dsn=dsn))  # fmt: skip
    done = run_cli("purge", "--before", "2026-11-30T10:00:00Z", "--format", "json", dsn=dsn)

    assert done.returncode == 0, done.stderr
    assert dry["purged"]["outbox"] == json_out(done)["purged"]["outbox"] == 1
    left = await pool.fetch("SELECT key FROM dedup.outbox ORDER BY key")
    assert [r["key"] for r in left] == ["failed-old", "pending-old", "sent-new"]
