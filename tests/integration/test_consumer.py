"""IdempotentConsumer against real Kafka and Postgres: one effect per key, whatever arrives.

Every test runs with the per-message handler and ``batch_size=1`` as well as
the batch handler and the default batch size, as the issue asks.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
import pytest

import dedup
from dedup_dev import effects as support
from dedup_dev import helpers
from dedup_dev import kafka as kafka_support
from dedup_dev.kafka import Topics

MODES = {
    "per_message_batch_1": {"handler": support.record_effect, "batch_size": 1},
    "batch_default": {"handler": support.record_effects},
}


@pytest.fixture(params=list(MODES))
def mode(request: pytest.FixtureRequest) -> dict[str, Any]:
    return dict(MODES[request.param])


def payment(pid: str, amount: int = 10, **extra: Any) -> bytes:
    return orjson.dumps({"payment_id": pid, "amount": amount, **extra})


def make_consumer(
    mode: dict[str, Any], topic: str, bootstrap_servers: str, pool: Any, **kw: Any
) -> dedup.IdempotentConsumer:
    options: dict[str, Any] = {
        "topics": [topic],
        "group_id": f"g-{topic}",
        "bootstrap_servers": bootstrap_servers,
        "pool": pool,
        "key": dedup.keys.json_field("payment_id"),
        "auto_offset_reset": "earliest",
        "install_signal_handlers": False,
        **mode,
        **kw,
    }
    return dedup.IdempotentConsumer(options.pop("handler"), **options)


async def test_duplicates_apply_once_and_offsets_are_stored(
    mode: dict[str, Any], bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create(partitions=2)
    await pool.execute(support.EFFECTS)
    # 30 payments, every third sent twice more (one copy right after, one later).
    records = []
    for i in range(30):
        records.append((None, payment(f"p{i}")))
        if i % 3 == 0:
            records += [(None, payment(f"p{i}")), (None, payment(f"p{i}"))]
    await helpers.produce(bootstrap_servers, topic, records, partition=0)
    await helpers.produce(bootstrap_servers, topic, [(None, payment("p1"))], partition=1)

    consumer = make_consumer(mode, topic, bootstrap_servers, pool)
    async with support.running(consumer):
        await helpers.wait_for(
            lambda: _handled(consumer, len(records) + 1), what="every copy handled"
        )

    assert await support.effect_counts(pool) == (30, 30)
    assert consumer.stats["processed"] == 30
    assert consumer.stats["duplicates"] == len(records) + 1 - 30
    rows = await pool.fetch(
        "SELECT idempotency_key, duplicates FROM dedup.processed WHERE duplicates > 0"
    )
    assert {r["idempotency_key"]: r["duplicates"] for r in rows} == {
        **{f"p{i}": 2 for i in range(0, 30, 3)},
        "p1": 1,
    }
    # Postgres holds the next offset of each partition; Kafka got it too (for lag tools).
    stored = await pool.fetch('SELECT "partition", next_offset FROM dedup.partitions')
    assert {r["partition"]: r["next_offset"] for r in stored} == {0: len(records), 1: 1}
    kafka = await kafka_support.committed(bootstrap_servers, f"g-{topic}")
    assert kafka[0] == len(records)


async def test_restart_resumes_from_the_offset_in_postgres(
    mode: dict[str, Any], bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    await helpers.produce(bootstrap_servers, topic, [(None, payment(f"a{i}")) for i in range(10)])
    first = make_consumer(mode, topic, bootstrap_servers, pool)
    async with support.running(first):
        await helpers.wait_for(lambda: _handled(first, 10), what="first 10")

    # Kafka's committed offset is rewound to 0: Postgres stays authoritative.
    await kafka_support.reset(bootstrap_servers, f"g-{topic}", topic, {0: 0})
    await helpers.produce(bootstrap_servers, topic, [(None, payment(f"b{i}")) for i in range(5)])
    second = make_consumer(mode, topic, bootstrap_servers, pool)
    async with support.running(second):
        await helpers.wait_for(lambda: _handled(second, 5), what="the 5 new ones")

    assert second.stats["duplicates"] == 0, "nothing before the stored offset is read again"
    assert await support.effect_counts(pool) == (15, 15)
    tokens = await pool.fetch("SELECT DISTINCT token FROM effects ORDER BY token")
    assert [r["token"] for r in tokens] == [1, 2], "each owner wrote under its own token"


async def test_same_key_different_payload_is_a_conflict_and_dead_lettered(
    mode: dict[str, Any],
    bootstrap_servers: str,
    topics: Topics,
    pool: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    await helpers.produce(
        bootstrap_servers,
        topic,
        [(None, payment("c1", 10)), (None, payment("c2")), (None, payment("c1", 99))],
    )
    consumer = make_consumer(mode, topic, bootstrap_servers, pool)
    async with support.running(consumer):
        await helpers.wait_for(lambda: _handled(consumer, 3), what="3 messages")

    assert consumer.stats["conflicts"] == 1
    effect = await pool.fetchrow("SELECT payload FROM effects WHERE key = 'c1'")
    assert effect["payload"]["amount"] == 10, "the first payload stays applied"
    row = await pool.fetchrow(
        "SELECT conflicts, duplicates FROM dedup.processed WHERE idempotency_key = 'c1'"
    )
    assert (row["conflicts"], row["duplicates"]) == (1, 0)
    letter = await pool.fetchrow('SELECT "offset", value, reason FROM dedup.dead_letters')
    assert letter["offset"] == 2
    assert orjson.loads(letter["value"])["amount"] == 99
    assert "conflict" in letter["reason"] and f"{topic}:0:0" in letter["reason"]
    kinds = await pool.fetch("SELECT kind FROM dedup.events WHERE key = 'c1' ORDER BY id")
    assert [r["kind"] for r in kinds] == ["conflict", "dead_lettered"]
    # The service's log says so too, not only the tables.
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(m.startswith(f"dead-lettered {topic}:0:2: conflict: key 'c1'") for m in warned)


async def test_copies_in_one_batch_are_judged_against_the_stored_payload(
    mode: dict[str, Any], bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    # c1 is applied first; then a batch holds a changed copy, an exact copy of
    # what was applied, and the changed copy again.  Compared with the stored
    # payload (not with the batch's first copy) that is conflict, duplicate,
    # conflict.
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    await helpers.produce(bootstrap_servers, topic, [(None, payment("c1", 10))])
    first = make_consumer(mode, topic, bootstrap_servers, pool)
    async with support.running(first):
        await helpers.wait_for(lambda: _handled(first, 1), what="the original")
    copies = [payment("c1", 99), payment("c1", 10), payment("c1", 99)]
    await helpers.produce(bootstrap_servers, topic, [(None, value) for value in copies])
    second = make_consumer(mode, topic, bootstrap_servers, pool)
    async with support.running(second):
        await helpers.wait_for(lambda: _handled(second, 3), what="the three copies")

    assert (second.stats["conflicts"], second.stats["duplicates"]) == (2, 1)
    row = await pool.fetchrow(
        "SELECT conflicts, duplicates FROM dedup.processed WHERE idempotency_key = 'c1'"
    )
    assert (row["conflicts"], row["duplicates"]) == (2, 1)
    letters = await pool.fetch('SELECT "offset", reason FROM dedup.dead_letters ORDER BY 1')
    assert [r["offset"] for r in letters] == [1, 3]
    assert all(f"from {topic}:0:0 " in r["reason"] for r in letters)
    assert await support.effect_counts(pool) == (1, 1)


async def test_poison_messages_are_dead_lettered_whole_and_the_partition_moves_on(
    mode: dict[str, Any], bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    headers = [("trace", b"abc"), ("trace", b"def")]
    records = [
        (b"k0", payment("ok0")),
        (b"k1", b"{not json"),
        (b"k2", orjson.dumps({"amount": 5})),  # no payment_id
        (b"k3", payment("boom", explode=True)),  # the handler raises for this one
        (b"k4", payment("ok1")),
    ]
    await helpers.produce(bootstrap_servers, topic, records, headers=headers)
    consumer = make_consumer(mode, topic, bootstrap_servers, pool, max_attempts=2)
    async with support.running(consumer):
        await helpers.wait_for(lambda: _handled(consumer, 5), what="5 messages")

    assert await support.effect_counts(pool) == (2, 2)
    letters = await pool.fetch(
        'SELECT "offset", key, value, header_names, header_values, reason, error, attempts'
        ' FROM dedup.dead_letters ORDER BY "offset"'
    )
    assert [r["offset"] for r in letters] == [1, 2, 3]
    assert [r["key"] for r in letters] == [b"k1", b"k2", b"k3"]
    assert [r["value"] for r in letters] == [records[1][1], records[2][1], records[3][1]]
    assert all(r["header_names"] == ["trace", "trace"] for r in letters)
    assert all(r["header_values"] == [b"abc", b"def"] for r in letters)
    assert "invalid JSON" in letters[0]["reason"]
    assert "missing key field 'payment_id'" in letters[1]["reason"]
    assert "handler failed 2 times" in letters[2]["reason"]
    assert "handler bug" in letters[2]["error"] and letters[2]["attempts"] == 2
    assert await pool.fetchval("SELECT next_offset FROM dedup.partitions") == 5


async def test_missing_key_can_fall_back_to_the_offset(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    await helpers.produce(bootstrap_servers, topic, [(None, orjson.dumps({"amount": 1}))])
    consumer = make_consumer(
        MODES["batch_default"], topic, bootstrap_servers, pool, on_missing_key="offset"
    )
    async with support.running(consumer):
        await helpers.wait_for(lambda: _handled(consumer, 1), what="1 message")
    assert await pool.fetchval("SELECT key FROM effects") == f"{topic}:0:0"


async def _handled(consumer: dedup.IdempotentConsumer, n: int) -> bool:
    return consumer.stats["messages"] >= n


@pytest.mark.parametrize("concurrency", [1, 4])
async def test_partitions_run_side_by_side_each_in_offset_order(
    concurrency: int, bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create(partitions=4)
    await pool.execute(support.EFFECTS)
    in_flight, peak = 0, 0
    overlapped = asyncio.Event()

    async def waiting(msgs: list[dedup.Message], tx: dedup.Tx) -> None:
        # With lanes, a batch waits here (a second at most: a poll may hold one
        # partition only) until another partition's batch has started too.
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        if in_flight > 1:
            overlapped.set()
        try:
            await support.record_effects(msgs, tx)
            if concurrency > 1:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(overlapped.wait(), 1)
        finally:
            in_flight -= 1

    for part in range(4):
        records = [(None, payment(f"p{part}-{i}")) for i in range(50)]
        await helpers.produce(bootstrap_servers, topic, records, partition=part)
    consumer = make_consumer(
        {"handler": waiting, "batch_size": 10, "concurrency": concurrency},
        topic,
        bootstrap_servers,
        pool,
    )
    async with support.running(consumer):
        await helpers.wait_for(lambda: _handled(consumer, 200), what="all 200")

    assert await support.effect_counts(pool) == (200, 200)
    if concurrency == 1:
        assert peak == 1
    else:
        assert 2 <= peak <= concurrency
    # Within a partition, effects were written in offset order (ids grow with offsets).
    rows = await pool.fetch('SELECT "partition", "offset" FROM effects ORDER BY id')
    for part in range(4):
        offsets = [r["offset"] for r in rows if r["partition"] == part]
        assert offsets == sorted(offsets) == list(range(50))
