"""Limits against the real Postgres and Kafka: bad input writes nothing, the longest fits.

A bad task code, business key, holder or ``lease_ttl`` is refused before any
row is touched; the longest allowed values, random so they can't compress,
fit every index; a message whose key is long, holds a NUL or whose strategy
quotes one in its reason never stops the consumer.
"""

from __future__ import annotations

import secrets
import string
from typing import Any

import orjson
import pytest

import dedup
from dedup import _limits as limits
from dedup_dev import effects as support
from dedup_dev import helpers, task_jobs
from dedup_dev.kafka import Topics

TABLES = ("tasks", "leases", "events", "processed", "dead_letters", "partitions")


def incompressible(size: int) -> str:
    """``size`` random printable ASCII bytes: nothing for Postgres's compression to shrink."""
    alphabet = string.ascii_letters + string.digits + string.punctuation.replace(":", "")
    return "".join(secrets.choice(alphabet) for _ in range(size))


async def row_counts(pool: Any) -> dict[str, int]:
    return {t: await pool.fetchval(f"SELECT count(*) FROM dedup.{t}") for t in TABLES}


NOTHING = dict.fromkeys(TABLES, 0)


@pytest.mark.parametrize(
    ("task", "business_key", "lease_ttl", "says"),
    [
        ("t" * 256, "2024-05-31", 30.0, "task='ttttt"),
        ("r\x00", "2024-05-31", 30.0, "task='r\\x00' has a NUL character at character 1"),
        ("r\ud800", "2024-05-31", 30.0, "task='r\\ud800' has a lone surrogate"),
        ("report", incompressible(1025), 30.0, "is 1,025 bytes of UTF-8; at most 1,024"),
        ("report", "day\x00", 30.0, "business_key='day\\x00' has a NUL"),
        ("report", "\ud800", 30.0, "business_key='\\ud800' has a lone surrogate"),
        ("report", "2024-05-31", float("nan"), "lease_ttl=nan: expected a number of seconds"),
        ("report", "2024-05-31", float("inf"), "lease_ttl=inf: expected"),
        ("report", "2024-05-31", 1e12, "lease_ttl=1000000000000.0: expected"),
        ("report", "2024-05-31", 1e-9, "lease_ttl=1e-09: expected a number of seconds from 1"),
        ("report", "2024-05-31", 0, "lease_ttl=0: expected"),
        ("report", "2024-05-31", -5.0, "to 604800"),
    ],
)
async def test_a_bad_task_run_is_refused_before_any_row_is_written(
    pool: Any, task: str, business_key: str, lease_ttl: float, says: str
) -> None:
    runner = dedup.TaskRunner(pool=pool, holder="w")
    with pytest.raises(dedup.ConfigurationError) as info:
        await runner.run(task, business_key, task_jobs.record, lease_ttl=lease_ttl)
    assert says in str(info.value)
    assert await row_counts(pool) == NOTHING


@pytest.mark.parametrize(
    ("resource", "holder", "ttl", "says"),
    [
        (incompressible(1537), "w", 5.0, "resource=.* is 1,537 bytes of UTF-8; at most 1,536"),
        ("r", "w\x00", 5.0, "holder=.* has a NUL"),
        ("r", "w", float("nan"), "ttl=nan: expected a number of seconds from 0.1 to 604800"),
        ("r", "w", 1e-9, "ttl=1e-09"),
    ],
)
async def test_a_bad_lease_is_refused_before_any_row_is_written(
    pool: Any, resource: str, holder: str, ttl: float, says: str
) -> None:
    with pytest.raises(dedup.ConfigurationError, match=says):
        await dedup.Leases(pool).acquire(resource, holder, ttl)
    assert await row_counts(pool) == NOTHING


async def test_the_longest_task_code_business_key_and_holder_fit(pool: Any) -> None:
    task = incompressible(limits.MAX_NAME_BYTES)
    key = incompressible(limits.MAX_BUSINESS_KEY_BYTES)
    holder = incompressible(limits.MAX_NAME_BYTES)
    await pool.execute(task_jobs.JOB_RUNS)
    runner = dedup.TaskRunner(pool=pool, holder=holder)
    outcome = await runner.run(task, key, task_jobs.record, lease_ttl=1)
    assert outcome.status == "succeeded"
    assert await pool.fetchval("SELECT count(*) FROM job_runs WHERE business_key = $1", key) == 1
    again = await runner.run(task, key, task_jobs.record, lease_ttl=1)
    assert again.status == "skipped_done"
    assert (
        await pool.fetchval(
            "SELECT state FROM dedup.tasks WHERE task = $1 AND business_key = $2", task, key
        )
        == "succeeded"
    )
    assert (
        await pool.fetchval(
            "SELECT count(*) FROM dedup.leases WHERE resource = $1", f"task:{task}:{key}"
        )
        == 1
    )


async def test_a_claim_with_a_bad_namespace_writes_nothing(pool: Any) -> None:
    msg = dedup.Message("t", 0, 0, b"k", b"{}", {}, 0)
    async with pool.acquire() as conn, conn.transaction():
        with pytest.raises(dedup.ConfigurationError, match=r"namespace=.* is 3,000 bytes"):
            await dedup.claim(conn, [msg], namespace="n" * 3000, key=dedup.keys.kafka_key())
    assert await row_counts(pool) == NOTHING


def quoting_strategy(msg: dedup.Message) -> str | None:
    """A user's strategy that quotes the raw Kafka key in its reason when it refuses one."""
    assert msg.key is not None
    text = msg.key.decode("utf-8", "surrogateescape")
    if text.startswith("tenant?"):
        raise dedup.KeyExtractionError(f"unknown tenant in {text}")
    return text


async def test_long_and_unstorable_keys_never_stop_the_consumer(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    # The longest names too, so every index the consumer writes holds its longest entry.
    topic = await topics.create(prefix="t" * (limits.MAX_TOPIC_BYTES - 13))
    namespace = incompressible(limits.MAX_NAME_BYTES)
    await pool.execute(support.EFFECTS)
    long_key = incompressible(5000).encode()
    records = [
        (b"good-1", orjson.dumps({"n": 1})),
        (long_key, orjson.dumps({"n": 2})),
        (b"nul\x00key", orjson.dumps({"n": 3})),
        (b"tenant?\x00", orjson.dumps({"n": 4})),  # its reason quotes a NUL
        (b"tenant?\xed\xa0\x80", orjson.dumps({"n": 5})),  # ... and a lone surrogate
        (long_key, orjson.dumps({"n": 2})),  # redelivered copies: applied once
        (b"nul\x00key", orjson.dumps({"n": 3})),
        (b"good-2", orjson.dumps({"n": 6})),
    ]
    await helpers.produce(bootstrap_servers, topic, records)
    consumer = support.consumer(
        support.record_effects,
        topic,
        bootstrap_servers,
        pool,
        key=quoting_strategy,
        group_id=incompressible(limits.MAX_NAME_BYTES),
        namespace=namespace,
        holder=incompressible(limits.MAX_NAME_BYTES),
    )
    async with support.running(consumer) as task:
        await helpers.wait_for(lambda: support.handled(consumer, len(records)), what="all")
        assert not task.done(), "run() never stopped"
    assert consumer.stats["processed"] == 4 and consumer.stats["duplicates"] == 2
    assert [r["key"] for r in await pool.fetch('SELECT key FROM effects ORDER BY "offset"')] == [
        "good-1",
        dedup.keys.stored(long_key.decode()),
        dedup.keys.stored("nul\x00key"),
        "good-2",
    ]
    letters = await pool.fetch(
        'SELECT "offset", key, namespace, reason FROM dedup.dead_letters ORDER BY "offset"'
    )
    assert [(r["offset"], r["key"], r["namespace"]) for r in letters] == [
        (3, records[3][0], namespace),
        (4, records[4][0], namespace),
    ], "the whole record is kept"
    assert [r["reason"] for r in letters] == [
        "no idempotency key: unknown tenant in tenant?\\x00",
        "no idempotency key: unknown tenant in tenant?\\udced\\udca0\\udc80",
    ]
    assert await pool.fetchval("SELECT next_offset FROM dedup.partitions") == len(records)
