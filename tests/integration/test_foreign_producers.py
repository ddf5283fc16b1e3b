"""Records from producers no one here wrote: librdkafka (confluent-kafka), Kafka's console producer.

Each test checks the business rows (``effects``, one row per applied message):
every committed key applied exactly once, nothing from an aborted transaction.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import confluent_kafka
import orjson
import pytest
from aiokafka import AIOKafkaProducer

import dedup
from dedup_dev import consumer_process as processes
from dedup_dev import effects as support
from dedup_dev import helpers, kafka_tools
from dedup_dev.kafka import Topics

CODECS = ("gzip", "snappy", "lz4", "zstd")
KEEP_CODEC = {"compression.type": "producer"}  # the broker keeps each batch as it came

Record = tuple[bytes | None, bytes | None]


def records(prefix: str, n: int) -> list[Record]:
    """``n`` records keyed ``prefix-i`` (Kafka key and the JSON ``id``)."""
    return [
        (f"{prefix}-{i}".encode(), orjson.dumps({"id": f"{prefix}-{i}", "n": i})) for i in range(n)
    ]


def ids(recs: Sequence[Record]) -> list[str]:
    return [orjson.loads(value)["id"] for _, value in recs if value is not None]


def librdkafka_produce(
    bootstrap_servers: str,
    topic: str,
    recs: Sequence[Record],
    config: Mapping[str, Any],
    *,
    partition: int | None = None,
) -> None:
    """Produce with librdkafka and wait until every record is acknowledged."""
    producer = confluent_kafka.Producer(
        {"bootstrap.servers": bootstrap_servers, "linger.ms": 20, **config}
    )
    failed: list[Any] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            failed.append(err)

    where = {} if partition is None else {"partition": partition}
    for key, value in recs:
        producer.produce(topic, value=value, key=key, on_delivery=delivered, **where)
    assert producer.flush(30) == 0, "librdkafka did not deliver every record in 30 s"
    assert not failed, failed


def librdkafka_transactions(
    bootstrap_servers: str, topic: str, transactions: Sequence[tuple[Sequence[Record], bool]]
) -> None:
    """Each ``(records, commit)`` in a librdkafka transaction, committed or aborted."""
    producer = confluent_kafka.Producer(
        {"bootstrap.servers": bootstrap_servers, "transactional.id": f"tx-{topic}"}
    )
    producer.init_transactions(30)
    for recs, commit in transactions:
        producer.begin_transaction()
        for key, value in recs:
            producer.produce(topic, value=value, key=key)
        assert producer.flush(30) == 0  # in the log, whatever the outcome
        if commit:
            producer.commit_transaction(30)
        else:
            producer.abort_transaction(30)


async def aiokafka_transactions(
    bootstrap_servers: str, topic: str, transactions: Sequence[tuple[Sequence[Record], bool]]
) -> None:
    """The same with aiokafka's transactional producer."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers, transactional_id=f"tx-{topic}")
    await producer.start()
    try:
        for recs, commit in transactions:
            await producer.begin_transaction()
            sent = [await producer.send(topic, value, key=key) for key, value in recs]
            await asyncio.gather(*sent)
            if commit:
                await producer.commit_transaction()
            else:
                await producer.abort_transaction()
    finally:
        await producer.stop()


async def applied(pool: Any) -> Counter[str]:
    """How many effects rows each key has."""
    rows = await pool.fetch("SELECT key, count(*) AS n FROM effects GROUP BY key")
    return Counter({r["key"]: r["n"] for r in rows})


async def consume_all(consumer: dedup.IdempotentConsumer, pool: Any, n: int) -> None:
    """Run ``consumer`` until ``n`` records are committed, whatever their outcome."""

    async def done() -> bool:
        return consumer.stats["messages"] >= n

    async with support.running(consumer):
        await helpers.wait_for(done, what=f"{n} records handled")


@pytest.mark.parametrize(
    ("partitions", "codecs"),
    [(2, CODECS), (1, ("none", "snappy", "none"))],
    ids=["every-codec", "none-then-snappy"],
)
async def test_compressed_batches_from_librdkafka_are_applied_once(
    partitions: int, codecs: Sequence[str], bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create(partitions=partitions, config=KEEP_CODEC)
    await pool.execute(support.EFFECTS)
    sent: list[Record] = []
    for step, codec in enumerate(codecs):  # a producer per step: batches of each codec in turn
        recs = records(f"{codec}{step}", 40)
        await asyncio.to_thread(
            librdkafka_produce, bootstrap_servers, topic, recs, {"compression.type": codec}
        )
        sent += recs

    consumer = support.consumer(support.record_effects, topic, bootstrap_servers, pool)
    await consume_all(consumer, pool, len(sent))

    assert await applied(pool) == Counter(ids(sent))
    assert consumer.stats["dead_lettered"] == 0


async def test_a_batch_that_cannot_be_decoded_stops_the_consumer_naming_where_and_what_to_do(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    topic = await topics.create(config=KEEP_CODEC)
    plain, packed = records("plain", 20), records("packed", 20)
    await asyncio.to_thread(librdkafka_produce, bootstrap_servers, topic, plain, {})
    await asyncio.to_thread(
        librdkafka_produce, bootstrap_servers, topic, packed, {"compression.type": "snappy"}
    )
    group = f"g-{topic}"
    args = ("--dsn", dsn, "--bootstrap-servers", bootstrap_servers, "--topic", topic)
    # An environment where the snappy library is missing: cramjam cannot be imported.
    async with processes.started(*args, "--group", group, hide=["cramjam"]) as child:
        await child.expect("READY")
        code = await asyncio.wait_for(child.proc.wait(), 60)
        stderr = await child.stderr()
    assert code == 1, stderr
    error = stderr.strip().splitlines()[-1]
    assert error.startswith("dedup.UndecodableBatchError: cannot decode a record batch")
    assert f"of topic {topic!r} partition 0 (the batch holds offsets " in error
    assert "the records before it are applied, the group stands at offset 20" in error
    assert "Libraries for snappy compression codec not found" in error
    assert "pip install 'aiokafka[snappy,lz4,zstd]'" in error
    skip = f"dedup offsets skip --group {group} --topic {topic} --partition 0 --to-offset 40"
    assert f"`{skip}`" in error
    batch = re.search(r"the batch holds offsets (\d+) to (\d+)", error)
    assert batch and 20 <= int(batch[1]) <= int(batch[2]) == 39, error
    # Every readable record before the batch was applied, nothing of it.
    done = await applied(pool)
    assert done == Counter(ids(plain))

    # With the codec installed, the same group goes on from where it stopped.
    consumer = support.consumer(support.record_effects, topic, bootstrap_servers, pool)
    await consume_all(consumer, pool, 40 - sum(done.values()))
    assert await applied(pool) == Counter(ids(plain + packed))


@pytest.mark.parametrize("producer", ["aiokafka", "librdkafka"])
async def test_aborted_transactions_are_never_applied(
    producer: str, bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create(partitions=2)
    await pool.execute(support.EFFECTS)
    first, aborted, last = records("c1", 60), records("ab", 60), records("c2", 60)
    plan = [(first, True), (aborted, False), (last, True)]
    if producer == "aiokafka":
        await aiokafka_transactions(bootstrap_servers, topic, plan)
    else:
        await asyncio.to_thread(librdkafka_transactions, bootstrap_servers, topic, plan)

    consumer = support.consumer(support.record_effects, topic, bootstrap_servers, pool)
    async with support.running(consumer):

        async def all_committed() -> bool:
            return sum((await applied(pool)).values()) >= len(first) + len(last)

        await helpers.wait_for(all_committed, what="the committed records")
    # The aborted transaction lies between the two committed ones: it was passed over.
    assert await applied(pool) == Counter(ids(first + last))
    assert consumer.stats["messages"] == len(first) + len(last)

    # The records are in the log: a consumer that asks for read_uncommitted sees them.
    seen: list[str] = []

    async def note(msgs: list[dedup.Message], tx: dedup.Tx) -> None:
        seen.extend(m.idempotency_key for m in msgs)

    uncommitted = dedup.IdempotentConsumer(
        note,
        topics=[topic],
        group_id=f"u-{topic}",
        bootstrap_servers=bootstrap_servers,
        pool=pool,
        key=dedup.keys.json_field("id"),
        auto_offset_reset="earliest",
        install_signal_handlers=False,
        isolation_level="read_uncommitted",
    )
    await consume_all(uncommitted, pool, len(first) + len(aborted) + len(last))
    assert set(ids(aborted)) <= set(seen)


async def test_an_idempotent_producer_and_its_resends_apply_once_and_leave_no_lag(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create(partitions=3)
    await pool.execute(support.EFFECTS)
    recs = records("idem", 150)
    config = {"enable.idempotence": True, "acks": "all", "max.in.flight": 5}
    await asyncio.to_thread(librdkafka_produce, bootstrap_servers, topic, recs, config)
    # The application's own retry after a timeout it could not read: the same events again.
    await asyncio.to_thread(librdkafka_produce, bootstrap_servers, topic, recs[:40], config)

    consumer = support.consumer(support.record_effects, topic, bootstrap_servers, pool)
    await consume_all(consumer, pool, 190)

    assert await applied(pool) == Counter(ids(recs))
    assert consumer.stats["duplicates"] == 40
    # A plain topic, consumed to its end: Kafka's own tool shows no lag anywhere.
    lag = await kafka_tools.group_lag(bootstrap_servers, f"g-{topic}")
    assert lag == {(topic, p): 0 for p in range(3)}


async def test_the_console_producer_with_keys_headers_and_a_null_header_applies_once(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    lines = [
        'source:billing,traceparent:NULL\tacct-1\t{"id": "cp-1", "amount": 1}',
        'source:billing,source:retry\tacct-2\t{"id": "cp-2", "amount": 2}',
        'source:billing,traceparent:NULL\tacct-1\t{"id": "cp-1", "amount": 1}',
        'source:billing,note:NULL\tNULL\t{"id": "cp-3", "amount": 3}',
        "source:billing,traceparent:NULL\tacct-4\t{broken",
    ]
    await kafka_tools.console_produce(
        bootstrap_servers,
        topic,
        lines,
        "parse.key=true",
        "parse.headers=true",
        "null.marker=NULL",
    )
    seen: dict[str, dedup.Message] = {}

    async def handler(msgs: list[dedup.Message], tx: dedup.Tx) -> None:
        seen.update((m.idempotency_key, m) for m in msgs)
        await support.record_effects(msgs, tx)

    consumer = support.consumer(handler, topic, bootstrap_servers, pool)
    await consume_all(consumer, pool, len(lines))

    assert await applied(pool) == Counter(["cp-1", "cp-2", "cp-3"])
    assert consumer.stats["duplicates"] == 1
    one, two, three = seen["cp-1"], seen["cp-2"], seen["cp-3"]
    assert (one.key, one.raw_headers) == (
        b"acct-1",
        (("source", b"billing"), ("traceparent", None)),
    )
    assert one.headers == {"source": b"billing", "traceparent": b""}
    assert two.raw_headers == (("source", b"billing"), ("source", b"retry"))
    assert two.headers == {"source": b"retry"}
    assert three.key is None

    # The broken one is dead-lettered whole, its null header kept null.
    row = await pool.fetchrow("SELECT * FROM dedup.dead_letters")
    assert (row["offset"], row["key"], row["value"]) == (4, b"acct-4", b"{broken")
    assert list(zip(row["header_names"], row["header_values"], strict=True)) == [
        ("source", b"billing"),
        ("traceparent", None),
    ]
