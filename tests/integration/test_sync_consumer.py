"""``dedup.sync.Consumer`` on the real broker and Postgres: confluent-kafka and psycopg, no asyncio.

- a group of them applies 3,000 keys sent one to three times each (by
  confluent-kafka's producer) exactly once, through a member's SIGKILL in the
  middle of a transaction, a restart and a second member joining, and leaves
  the offsets at the log end in Postgres and in Kafka;
- what it leaves in ``processed``, ``dead_letters``, ``events`` and ``dedup
  audit`` for a duplicate, a conflict, a record without a key and a handler
  bug is what ``dedup.IdempotentConsumer`` on asyncpg leaves;
- a handler that fails (raises, ends dedup's transaction, runs past
  ``handler_timeout``) has its message dead-lettered after ``max_attempts``,
  with the error, and the partition moves on;
- a member whose partition was taken in Postgres under a newer token has its
  next transaction refused by the fence, and drops the partition.

Members that get killed run as OS processes (:mod:`dedup_dev.sync_consumer_process`);
the others run ``Consumer.run()`` in a thread of this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import psycopg
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

import dedup
from dedup import _store as store
from dedup_dev import children, effects, helpers, sync_consumer_process
from dedup_dev import kafka as kafka_support
from dedup_dev.audit import json_out, run_cli_async
from dedup_dev.kafka import Topics

KEYS = 3_000


def sync_consumer(
    handler: Callable[..., object],
    topic: str,
    dsn: str,
    bootstrap_servers: str,
    *,
    group_id: str | None = None,
    **options: Any,
) -> dedup.sync.Consumer:
    """A ``dedup.sync.Consumer`` of ``topic`` in its own group (``g-<topic>``), keyed by ``id``."""
    return dedup.sync.Consumer(
        handler,
        topics=[topic],
        group_id=group_id or f"g-{topic}",
        config={"bootstrap.servers": bootstrap_servers, "session.timeout.ms": 3000},
        dsn=dsn,
        key=dedup.keys.json_field("id"),
        install_signal_handlers=False,
        **options,
    )


@contextlib.asynccontextmanager
async def running(consumer: dedup.sync.Consumer) -> AsyncIterator[asyncio.Future[None]]:
    """``consumer.run()`` in a thread; stopped (and what stopped it raised) on the way out."""
    task = asyncio.ensure_future(asyncio.to_thread(consumer.run))
    try:
        yield task
    finally:
        consumer.stop()
        await asyncio.wait_for(task, 30)


def record(value: dict[str, Any]) -> tuple[bytes, bytes]:
    return str(value.get("id")).encode(), orjson.dumps(value)


async def produce(bootstrap_servers: str, topic: str, values: list[dict[str, Any]]) -> None:
    records = [record(v) for v in values]
    await asyncio.to_thread(kafka_support.produce_confluent, bootstrap_servers, topic, records)


# ------------------------------------------------------------- acceptance --


async def test_a_group_applies_every_key_once_through_a_sigkill(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics
) -> None:
    topic = await topics.create(partitions=4, prefix="sync")
    group = f"sync-{uuid.uuid4().hex[:8]}"
    rng = random.Random(32)
    sends = [{"id": k} for k in range(KEYS) for _ in range(rng.randint(1, 3))]
    rng.shuffle(sends)
    half = len(sends) // 2
    await pool.execute(effects.EFFECTS)
    args = ("--dsn", dsn, "--bootstrap-servers", bootstrap_servers, "--topic", topic)
    args += ("--group", group, "--batch-size", "50")

    async def applied() -> int:
        return int(await pool.fetchval("SELECT count(DISTINCT key) FROM effects"))

    async with sync_consumer_process.started(*args, "--hold", "0.05") as doomed:
        await doomed.expect("READY")
        await produce(bootstrap_servers, topic, sends[:half])
        await helpers.wait_for(
            lambda: pool.fetchval("SELECT count(*) >= 300 FROM effects"), what="keys applied"
        )
        # Strike inside a transaction: its rows are written, not committed.
        _, line = await doomed.expect("IN_BATCH", after=len(doomed.lines))
        await doomed.kill()
    _, partition, offset, _token = line.split()
    in_flight = await pool.fetchval(
        'SELECT count(*) FROM effects WHERE "partition" = $1 AND "offset" = $2',
        int(partition),
        int(offset),
    )
    assert in_flight == 0, "the killed transaction rolled back"
    assert await applied() < KEYS, "the stream ended before the kill: nothing was mid-stream"
    killed_at = await pool.fetchval("SELECT max(id) FROM dedup.events")

    async with (
        sync_consumer_process.started(*args, "--hold", "0.02") as again,
        sync_consumer_process.started(*args, "--hold", "0.02") as second,
    ):
        holders = {(await member.expect("READY"))[1].split()[1] for member in (again, second)}

        async def both_hold_partitions() -> bool:
            # The last take of each partition since the kill: by both members, four in all.
            rows = await pool.fetch(
                "SELECT DISTINCT ON (resource) holder FROM dedup.events"
                " WHERE kind = 'partition_acquired' AND id > $1 ORDER BY resource, id DESC",
                killed_at,
            )
            return len(rows) == 4 and {r["holder"] for r in rows} == holders

        await helpers.wait_for(both_hold_partitions, within=30, what="the group of two settled")
        await produce(bootstrap_servers, topic, sends[half:])
        await helpers.wait_for(
            lambda: helpers.equal(applied(), KEYS), within=60, what=f"all {KEYS} keys applied"
        )
        for member in (again, second):
            assert await member.terminate() == 0, await member.stderr()
            _, line = await member.expect("STATS")
            assert children.json_of(line)["processed"] > 0, "both members applied records"

    assert await effects.effect_counts(pool) == (KEYS, KEYS), "a key applied twice"
    assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == KEYS
    assert await pool.fetchval("SELECT count(*) FROM dedup.dead_letters") == 0
    suppressed = await pool.fetchval("SELECT coalesce(sum(duplicates), 0) FROM dedup.processed")
    assert suppressed >= len(sends) - KEYS
    ends = await kafka_support.end_offsets(bootstrap_servers, topic, 4)
    stored = await pool.fetch('SELECT "partition", next_offset FROM dedup.partitions')
    assert {r["partition"]: r["next_offset"] for r in stored} == ends
    assert await kafka_support.committed(bootstrap_servers, group, topic) == ends


# ---------------------------------------------------------------- history --

HISTORY = [
    {"id": "k1", "amount": 1},
    {"id": "k2", "amount": 2},
    {"id": "k1", "amount": 1},  # a copy: a duplicate
    {"id": "k2", "amount": 3},  # the same key, another payload: a conflict
    {"amount": 4},  # no key: dead-lettered
    {"id": "k3", "explode": True},  # a handler bug: dead-lettered after max_attempts
    {"id": "k4", "amount": 5},
]


def blocking_record_effects(msgs: list[dedup.Message], tx: dedup.sync.Tx) -> None:
    """:func:`dedup_dev.effects.record_effects`, blocking: the same rows, the same error."""
    if any(m.json().get("explode") for m in msgs):
        raise RuntimeError("handler bug in batch")
    sync_consumer_process.record_effects(msgs, tx)


async def history(pool: Any, namespace: str, topic: str) -> dict[str, Any]:
    """What a consumer of ``namespace`` left, without what differs between two runs: ids,
    times, holders, tokens, trace ids (and the namespace itself, named ``NS``)."""

    def named(value: Any) -> Any:
        return value.replace(namespace, "NS") if isinstance(value, str) else value

    processed = await pool.fetch(
        'SELECT idempotency_key, topic, "partition", "offset", payload_hash, status,'
        " duplicates, conflicts FROM dedup.processed WHERE namespace = $1 ORDER BY 1",
        namespace,
    )
    letters = await pool.fetch(
        'SELECT topic, "partition", "offset", key, value, idempotency_key, reason, error,'
        ' attempts FROM dedup.dead_letters WHERE namespace = $1 ORDER BY "offset"',
        namespace,
    )
    events = await pool.fetch(
        "SELECT subject, kind, key, resource, from_state, to_state, detail::text AS detail"
        " FROM dedup.events WHERE namespace = $1",
        namespace,
    )
    return {
        "processed": [tuple(r) for r in processed],
        "dead_letters": [tuple(r) for r in letters],
        "events": sorted((tuple(named(v) for v in r) for r in events), key=repr),
    }


def audited(doc: Any, namespace: str, group: str) -> Any:
    """``dedup audit --format json`` without its times, ids, holders and tokens."""
    if isinstance(doc, dict):
        return {
            k: audited(v, namespace, group)
            for k, v in doc.items()
            if k not in ("id", "at", "created_at", "first_seen", "processed_at", "holder", "token")
            and not k.endswith(("_at", "_time"))
        }
    if isinstance(doc, list):
        return [audited(v, namespace, group) for v in doc]
    if isinstance(doc, str):
        return doc.replace(namespace, "NS").replace(group, "NS")
    return doc


async def test_the_history_is_the_async_consumers(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics
) -> None:
    topic = await topics.create(partitions=1, prefix="hist")
    await pool.execute(effects.EFFECTS)
    await produce(bootstrap_servers, topic, HISTORY)
    groups = {"async": f"a-{topic}", "sync": f"s-{topic}"}

    def done(group: str) -> Callable[[], Any]:
        return lambda: pool.fetchval(
            "SELECT next_offset = $2 FROM dedup.partitions WHERE group_id = $1",
            group,
            len(HISTORY),
        )

    on_asyncpg = effects.consumer(
        effects.record_effects, topic, bootstrap_servers, pool, group_id=groups["async"],
        max_attempts=2,
    )  # fmt: skip
    async with effects.running(on_asyncpg):
        await helpers.wait_for(done(groups["async"]), what="the async consumer at the end")
    blocking = sync_consumer(
        blocking_record_effects, topic, dsn, bootstrap_servers, group_id=groups["sync"],
        max_attempts=2,
    )  # fmt: skip
    async with running(blocking):
        await helpers.wait_for(done(groups["sync"]), what="the blocking consumer at the end")
    assert dict(blocking.stats) == dict(on_asyncpg.stats)

    found = {kind: await history(pool, group, topic) for kind, group in groups.items()}
    assert found["sync"] == found["async"]
    assert [r[6] for r in found["sync"]["dead_letters"]] == [
        "conflict: key 'k2' was applied from " + f"{topic}:0:1 with a different payload",
        "no idempotency key: " + found["sync"]["dead_letters"][1][6].split(": ", 1)[1],
        "handler failed 2 times",
    ]
    assert found["sync"]["dead_letters"][2][7] == "RuntimeError: handler bug in batch"
    for key in ("k2", "k3"):
        audits = {
            kind: audited(
                json_out(await run_cli_async(
                    "audit", "--key", key, "--namespace", group, "--format", "json", dsn=dsn
                )),
                group,
                group,
            )
            for kind, group in groups.items()
        }  # fmt: skip
        assert audits["sync"] == audits["async"], key
        assert audits["sync"]["processed"] or audits["sync"]["dead_letters"], audits


# -------------------------------------------------------------- failures --


def fail_on_bad(how: str) -> Callable[[dedup.Message, dedup.sync.Tx], None]:
    """A per-message handler writing ``effects`` that fails on ``bad`` as ``how`` says."""

    def handler(msg: dedup.Message, tx: dedup.sync.Tx) -> None:
        sync_consumer_process.record_effects([msg], tx)
        if msg.idempotency_key != "bad":
            return
        if how == "raises":
            raise RuntimeError("handler bug for bad")
        if how == "commits":
            tx.conn.commit()
        if how == "runs past its deadline":
            time.sleep(0.3)
        if how == "leaves the transaction aborted":
            with contextlib.suppress(psycopg.errors.UndefinedTable):
                tx.conn.execute("SELECT * FROM no_such_table")

    return handler


FAILURES = {
    "raises": "RuntimeError: handler bug for bad",
    "commits": "HandlerError: the handler called tx.conn.commit(): dedup owns",
    "runs past its deadline": "HandlerError: the handler ran 0.3s, past handler_timeout=0.2s",
    "leaves the transaction aborted": "HandlerError: the transaction was aborted by a statement",
}


@pytest.mark.parametrize("how", list(FAILURES))
async def test_a_failing_handler_has_its_message_dead_lettered_with_the_error(
    how: str, dsn: str, pool: Any, bootstrap_servers: str, topics: Topics
) -> None:
    topic = await topics.create(partitions=1, prefix="poison")
    await pool.execute(effects.EFFECTS)
    await produce(bootstrap_servers, topic, [{"id": "a"}, {"id": "bad"}, {"id": "b"}])
    consumer = sync_consumer(
        fail_on_bad(how), topic, dsn, bootstrap_servers, max_attempts=2, handler_timeout=0.2
    )
    async with running(consumer):
        await helpers.wait_for(
            lambda: pool.fetchval("SELECT next_offset = 3 FROM dedup.partitions"),
            what="the partition past the poison record",
        )
    letter = await pool.fetchrow("SELECT * FROM dedup.dead_letters")
    assert (letter["offset"], letter["idempotency_key"], letter["attempts"]) == (1, "bad", 2)
    assert letter["reason"] == "handler failed 2 times"
    assert letter["error"].startswith(FAILURES[how]), letter["error"]
    assert letter["value"] == orjson.dumps({"id": "bad"})
    rows = await pool.fetch("SELECT key FROM effects ORDER BY key")
    assert [r["key"] for r in rows] == ["a", "b"], "the failed attempts rolled back"
    assert consumer.stats["dead_lettered"] == 1
    assert consumer.stats["processed"] == 2


# ---------------------------------------------------------------- fencing --


async def test_a_stale_member_is_refused_by_the_fence_and_drops_the_partition(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics
) -> None:
    topic = await topics.create(partitions=1, prefix="stale")
    await pool.execute(effects.EFFECTS)
    # No periodic owner look: the next transaction's fence is what finds the newer owner.
    consumer = sync_consumer(
        blocking_record_effects, topic, dsn, bootstrap_servers, kafka_commit_interval=3600
    )
    async with running(consumer):
        await produce(bootstrap_servers, topic, [{"id": "first"}])
        await helpers.wait_for(
            lambda: pool.fetchval("SELECT count(*) = 1 FROM effects"), what="the first record"
        )
        token = await pool.fetchval("SELECT token FROM dedup.partitions")
        # Another member takes the partition in Postgres (as after a rebalance it missed).
        async with pool.acquire() as conn, conn.transaction():
            taken = await store.Store(schema="dedup", namespace=f"g-{topic}").take_partitions(
                conn, f"g-{topic}", "usurper", [(topic, 0)]
            )
        await produce(bootstrap_servers, topic, [{"id": "second"}, {"id": "third"}])
        stale = await helpers.wait_for(
            lambda: pool.fetchrow("SELECT * FROM dedup.events WHERE kind = 'stale_rejected'"),
            what="the stale member's transaction refused",
        )
        assert (stale["holder"], stale["token"]) == (consumer.holder, token)
        assert consumer.assignment == set(), "the partition was dropped"
        assert consumer.stats["stale"] == 1
    assert [r["key"] for r in await pool.fetch("SELECT key FROM effects")] == ["first"]
    row = await pool.fetchrow("SELECT holder, token, next_offset FROM dedup.partitions")
    assert tuple(row) == ("usurper", taken[(topic, 0)][0], 1)


async def test_a_lost_connection_is_opened_again_and_the_transaction_run_again(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics
) -> None:
    topic = await topics.create(partitions=1, prefix="lost")
    await pool.execute(effects.EFFECTS)
    name = f"sync-{topic}"
    consumer = sync_consumer(
        blocking_record_effects, topic, dsn, bootstrap_servers,
        connect_options={"application_name": name},
    )  # fmt: skip
    async with running(consumer):
        await produce(bootstrap_servers, topic, [{"id": "before"}])
        await helpers.wait_for(
            lambda: pool.fetchval("SELECT count(*) = 1 FROM effects"), what="the first record"
        )
        backends = "SELECT pid FROM pg_stat_activity WHERE application_name = $1"
        before = {r["pid"] for r in await pool.fetch(backends, name)}
        assert len(before) == 2, "its lane's connection and the one that takes partitions"
        for pid in before:
            assert await pool.fetchval("SELECT pg_terminate_backend($1)", pid)
        await produce(bootstrap_servers, topic, [{"id": "after"}, {"id": "later"}])
        await helpers.wait_for(
            lambda: pool.fetchval("SELECT count(*) = 3 FROM effects"),
            what="the records after the loss applied on a new connection",
        )
        now = {r["pid"] for r in await pool.fetch(backends, name)}
        assert now and not now & before
    assert await effects.effect_counts(pool) == (3, 3)


async def test_the_lanes_apply_partitions_side_by_side_each_on_its_own_connection(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics
) -> None:
    topic = await topics.create(partitions=4, prefix="lanes")
    await pool.execute(effects.EFFECTS)
    # Each of partitions 0 and 1 has its first transaction wait inside its handler for the
    # other's: a consumer that applied them one at a time would never get past the barrier.
    meet = threading.Barrier(2, timeout=20)
    backends: dict[int, int] = {}

    def side_by_side(msgs: list[dedup.Message], tx: dedup.sync.Tx) -> None:
        first = msgs[0].partition
        if first in (0, 1) and first not in backends:
            backends[first] = tx.conn.info.backend_pid
            meet.wait()
        blocking_record_effects(msgs, tx)

    consumer = sync_consumer(side_by_side, topic, dsn, bootstrap_servers)
    assert consumer.concurrency == 4, "a batch handler's default: the async consumer's"
    async with running(consumer):
        await produce(bootstrap_servers, topic, [{"id": f"k{i}"} for i in range(40)])
        await helpers.wait_for(
            lambda: pool.fetchval("SELECT count(*) = 40 FROM effects"), what="every key applied"
        )
    assert await pool.fetchval("SELECT count(*) FROM dedup.dead_letters") == 0
    assert sorted(backends) == [0, 1] and backends[0] != backends[1], backends
    assert await effects.effect_counts(pool) == (40, 40)


# -------------------------------------------------------------- telemetry --


def series(reader: InMemoryMetricReader, kind: str, attributes: dict[str, Any]) -> dict[str, float]:
    """Each metric's value of ``kind`` (``Sum``: a counter) on the series of ``attributes``."""
    data = reader.get_metrics_data()
    return {
        metric.name: point.value
        for resource in (data.resource_metrics if data else [])
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if type(metric.data).__name__ == kind
        for point in metric.data.data_points
        if dict(point.attributes or {}) == attributes
    }


async def test_a_transaction_is_traced_and_counted_as_the_async_consumers_are(
    dsn: str,
    pool: Any,
    bootstrap_servers: str,
    topics: Topics,
    spans: InMemorySpanExporter,
    metric_reader: InMemoryMetricReader,
) -> None:
    topic = await topics.create(partitions=1, prefix="traced")
    await pool.execute(effects.EFFECTS)
    await produce(bootstrap_servers, topic, [{"id": "a"}, {"id": "a"}, {"amount": 1}])
    labels = {
        "messaging.system": "kafka",
        "messaging.consumer.group.name": f"g-{topic}",
        "messaging.destination.name": topic,
        "dedup.namespace": f"g-{topic}",
    }
    consumer = sync_consumer(blocking_record_effects, topic, dsn, bootstrap_servers)
    async with running(consumer):
        await helpers.wait_for(
            lambda: pool.fetchval("SELECT next_offset = 3 FROM dedup.partitions"),
            what="the three records committed",
        )
        # The lag gauge: Kafka's log end (as last fetched) minus Postgres' offset.
        partition = {k: v for k, v in labels.items() if k != "dedup.namespace"}
        partition["messaging.destination.partition.id"] = "0"
        gauges = series(metric_reader, "Gauge", partition)
    assert gauges.get("dedup.consumer.lag") == 0
    counted = series(metric_reader, "Sum", labels)
    assert [counted.get(f"dedup.messages.{n}") for n in ("processed", "duplicates")] == [1, 1]
    assert counted.get("dedup.messages.dead_lettered") == 1
    finished = spans.get_finished_spans()
    [process] = [s for s in finished if s.name == f"process {topic}"]
    assert process.kind is SpanKind.CONSUMER
    assert process.attributes is not None
    assert process.attributes["messaging.batch.message_count"] == 3
    inside = [s for s in finished if s.parent and s.parent.span_id == process.context.span_id]
    [transaction] = [s for s in inside if s.name == "dedup transaction"]
    statements = [
        s for s in finished if s.parent and s.parent.span_id == transaction.context.span_id
    ]
    assert {s.kind for s in statements} == {SpanKind.CLIENT}
    assert {"BEGIN", "COMMIT"} <= {s.name for s in statements}


async def test_an_operators_rewind_is_taken_back_and_applies_nothing_twice(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics
) -> None:
    topic = await topics.create(partitions=1, prefix="rewind")
    await pool.execute(effects.EFFECTS)
    group = f"g-{topic}"
    consumer = sync_consumer(blocking_record_effects, topic, dsn, bootstrap_servers)
    at_end = "SELECT holder = $1 AND next_offset = 3 FROM dedup.partitions"
    async with running(consumer):
        await produce(bootstrap_servers, topic, [{"id": "a"}, {"id": "b"}, {"id": "c"}])
        await helpers.wait_for(lambda: pool.fetchval(at_end, consumer.holder), what="applied")
        token = await pool.fetchval("SELECT token FROM dedup.partitions")
        done = await run_cli_async(
            "offsets", "rewind", "--group", group, "--topic", topic, "--partition", "0",
            "--to-offset", "1", "--yes", "--bootstrap-servers", bootstrap_servers, dsn=dsn,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        # The consumer finds the move within kafka_commit_interval, takes the partition back
        # from offset 1 and reads b and c again: duplicates now.
        await helpers.wait_for(
            lambda: pool.fetchval(at_end, consumer.holder), what="the partition taken back"
        )

        async def read_again() -> bool:
            return consumer.stats["duplicates"] == 2

        await helpers.wait_for(read_again, what="b and c read again as duplicates")
    assert await pool.fetchval("SELECT token FROM dedup.partitions") > token + 1
    assert await effects.effect_counts(pool) == (3, 3)


async def test_the_handlers_savepoint_lock_and_outbox_record_are_in_dedups_transaction(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics
) -> None:
    topic = await topics.create(partitions=1, prefix="tx")
    await pool.execute(effects.EFFECTS)

    def handler(msg: dedup.Message, tx: dedup.sync.Tx) -> None:
        tx.lock(msg.idempotency_key)
        # A statement that fails, undone by its savepoint: the rest of the work stands.
        with contextlib.suppress(psycopg.errors.UndefinedTable), tx.conn.transaction():
            tx.conn.execute("SELECT * FROM no_such_table")
        sync_consumer_process.record_effects([msg], tx)
        tx.publish("shipped", {"order": msg.idempotency_key}, key=msg.idempotency_key)

    consumer = sync_consumer(handler, topic, dsn, bootstrap_servers)
    async with running(consumer):
        await produce(bootstrap_servers, topic, [{"id": "o1"}, {"id": "o2"}, {"id": "o1"}])
        await helpers.wait_for(
            lambda: pool.fetchval("SELECT next_offset = 3 FROM dedup.partitions"),
            what="the three records committed",
        )
    assert await effects.effect_counts(pool) == (2, 2)
    rows = await pool.fetch(
        "SELECT key, destination, message_key, value, token FROM dedup.outbox ORDER BY id"
    )
    token = await pool.fetchval("SELECT token FROM dedup.partitions")
    assert [tuple(r) for r in rows] == [
        (f"g-{topic}:{k}:0", "shipped", k.encode(), orjson.dumps({"order": k}), token)
        for k in ("o1", "o2")
    ]
    assert await pool.fetchval("SELECT count(*) FROM dedup.dead_letters") == 0
