"""``dedup.claim`` on psycopg 3, and ``dedup.sync.claim`` on its blocking connection.

The same records claimed on asyncpg and on each psycopg way in (an
``AsyncConnection``, a ``Connection`` through ``dedup.sync.claim``, SQLAlchemy
sessions and connections on the psycopg dialect, async and blocking) leave the
same rows in ``processed``, ``dead_letters`` and ``events``, compared column by
column but for ids and times.  The claims commit or roll back with the
caller's writes, outside a transaction nothing runs, and a connection of the
wrong kind is named.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import asyncpg
import confluent_kafka
import orjson
import psycopg
import pytest
from aiokafka.structs import ConsumerRecord
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import dedup
from dedup_dev import kafka as kafka_support
from dedup_dev.kafka import Topics

KEY = dedup.keys.json_field("id")
TOPIC = "payments"

Claim = Callable[[list[Any], str], Awaitable[dedup.ClaimResult]]
"""Claims ``records`` in namespace ``ns`` in a transaction of its own, which commits."""


def record(
    offset: int,
    value: dict[str, Any] | None,
    partition: int = 0,
    key: bytes | None = None,
    headers: tuple[tuple[str, bytes | None], ...] = (),
) -> ConsumerRecord[Any, Any]:
    body = None if value is None else orjson.dumps(value)
    size = 0 if body is None else len(body)
    return ConsumerRecord(
        TOPIC, partition, offset, 1_700_000_000_000 + offset, 0, key, body, None, 0, size,
        list(headers),
    )  # fmt: skip


# Every outcome: a key once, twice and three times (in a partition and across
# two), a conflicting copy with a Kafka key and headers (one null), a record
# with no key, a tombstone; text a statement would mistake for a placeholder.
RECORDS = [
    record(0, {"id": "a", "n": 1}),
    record(1, {"id": "a", "n": 1}),
    record(0, {"id": "a", "n": 1}, partition=1),
    record(2, {"id": "b", "n": "50% off, $1"}),
    record(3, {"id": "b", "n": "50% off, $1"}),
    record(4, {"id": "c", "n": 3}, key=b"c-key"),
    record(5, {"id": "a", "n": 2}, key=b"\x00k", headers=(("h", b"\x01v"), ("h", None))),
    record(6, {"no_id": True}, headers=(("trace", b"t"),)),
    record(7, None, key=b"gone"),
]


def where(msgs: list[dedup.Message]) -> list[tuple[int, int]]:
    return [(m.partition, m.offset) for m in msgs]


def outcome(got: dedup.ClaimResult) -> tuple[list[tuple[int, int]], ...]:
    return tuple(where(m) for m in (got.fresh, got.duplicates, got.conflicts, got.dead_lettered))


async def table_rows(pool: Any, namespace: str) -> dict[str, list[dict[str, Any]]]:
    """Every column of dedup's rows of ``namespace``, but ids, times and the namespace."""

    def kept(row: Any) -> dict[str, Any]:
        return {
            k: v
            for k, v in dict(row).items()
            if k not in ("id", "namespace") and not isinstance(v, datetime.datetime)
        }

    found = {}
    for table, order in (
        ("processed", "idempotency_key"),
        ("dead_letters", '"partition", "offset"'),
        ("events", "id"),
    ):
        rows = await pool.fetch(
            f"SELECT * FROM dedup.{table} WHERE namespace = $1 ORDER BY {order}",
            namespace,
        )
        found[table] = [kept(r) for r in rows]
    return found


@pytest.fixture
async def async_engine(dsn: str) -> AsyncIterator[AsyncEngine]:
    made = create_async_engine(dsn.replace("postgresql://", "postgresql+psycopg://", 1))
    yield made
    await made.dispose()


@pytest.fixture
def engine(dsn: str) -> Iterator[Engine]:
    made = create_engine(dsn.replace("postgresql://", "postgresql+psycopg://", 1))
    yield made
    made.dispose()


async def on_asyncpg(dsn: str) -> Claim:
    async def claim(records: list[Any], ns: str) -> dedup.ClaimResult:
        conn = await asyncpg.connect(dsn)
        try:
            async with conn.transaction():
                return await dedup.claim(conn, records, namespace=ns, key=KEY)
        finally:
            await conn.close()

    return claim


def ways(dsn: str, async_engine: AsyncEngine, engine: Engine) -> dict[str, Claim]:
    """Each psycopg way into ``dedup.claim`` / ``dedup.sync.claim``, by name."""

    async def psycopg_async(records: list[Any], ns: str) -> dedup.ClaimResult:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            async with conn.transaction():
                return await dedup.claim(conn, records, namespace=ns, key=KEY)

    async def psycopg_sync(records: list[Any], ns: str) -> dedup.ClaimResult:
        with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
            return dedup.sync.claim(conn, records, namespace=ns, key=KEY)

    async def sqlalchemy_async_session(records: list[Any], ns: str) -> dedup.ClaimResult:
        async with AsyncSession(async_engine) as session, session.begin():
            return await dedup.claim(session, records, namespace=ns, key=KEY)

    async def sqlalchemy_session(records: list[Any], ns: str) -> dedup.ClaimResult:
        with Session(engine) as session, session.begin():
            return dedup.sync.claim(session, records, namespace=ns, key=KEY)

    async def sqlalchemy_connection(records: list[Any], ns: str) -> dedup.ClaimResult:
        with engine.begin() as conn:
            return dedup.sync.claim(conn, records, namespace=ns, key=KEY)

    return {
        "psycopg_async": psycopg_async,
        "psycopg_sync": psycopg_sync,
        "sqlalchemy_async_session": sqlalchemy_async_session,
        "sqlalchemy_session": sqlalchemy_session,
        "sqlalchemy_connection": sqlalchemy_connection,
    }


WAYS = [
    "psycopg_async",
    "psycopg_sync",
    "sqlalchemy_async_session",
    "sqlalchemy_session",
    "sqlalchemy_connection",
]


@pytest.mark.parametrize("way", WAYS)
async def test_each_psycopg_way_leaves_the_rows_asyncpg_leaves_for_the_same_records(
    dsn: str, pool: Any, async_engine: AsyncEngine, engine: Engine, way: str
) -> None:
    reference = await on_asyncpg(dsn)
    claim = ways(dsn, async_engine, engine)[way]
    # Delivered, then delivered again (a restart before the Kafka commit).
    expected = [await reference(RECORDS, "asyncpg") for _ in range(2)]
    got = [await claim(RECORDS, way) for _ in range(2)]

    assert [outcome(g) for g in got] == [outcome(e) for e in expected]
    assert outcome(got[0]) == (
        [(0, 0), (0, 2), (0, 4)],
        [(0, 1), (1, 0), (0, 3)],
        [(0, 5)],
        [(0, 6), (0, 7), (0, 5)],
    )
    assert outcome(got[1])[:3] == ([], [(0, 0), (0, 2), (0, 4), (0, 1), (1, 0), (0, 3)], [(0, 5)])
    rows = await table_rows(pool, way)
    assert rows == await table_rows(pool, "asyncpg")
    # What those rows say (read back on the test's pool, which decodes JSON).
    assert [(r["idempotency_key"], r["duplicates"], r["conflicts"]) for r in rows["processed"]] == [
        ("a", 5, 2),
        ("b", 3, 0),
        ("c", 1, 0),
    ]
    conflict = rows["dead_letters"][0]
    assert (conflict["key"], conflict["header_names"], conflict["header_values"]) == (
        b"\x00k",
        ["h", "h"],
        [b"\x01v", None],
    )
    assert conflict["reason"] == (
        "conflict: key 'a' was applied from payments:0:0 with a different payload"
    )
    tombstone = rows["dead_letters"][2]
    assert (tombstone["offset"], tombstone["value"], tombstone["key"]) == (7, None, b"gone")
    delivery = [
        ("conflict", {"offset": 5}),
        ("dead_lettered", {"offset": 6, "reason": rows["dead_letters"][1]["reason"],
                           "attempts": 1}),
        ("dead_lettered", {"offset": 7, "reason": tombstone["reason"], "attempts": 1}),
        ("dead_lettered", {"offset": 5, "reason": conflict["reason"], "attempts": 1}),
    ]  # fmt: skip
    assert [(e["kind"], e["detail"]) for e in rows["events"]] == delivery * 2


async def test_a_balance_update_applied_through_dedup_sync_moves_the_balance_once(
    dsn: str, pool: Any
) -> None:
    await pool.execute("CREATE TABLE accounts (id text PRIMARY KEY, balance numeric NOT NULL)")
    await pool.execute("INSERT INTO accounts VALUES ('acme', 0)")
    payments = [
        record(0, {"id": "p1", "amount": "10.00"}),
        record(1, {"id": "p2", "amount": "5.50"}),
        record(2, {"id": "p1", "amount": "10.00"}),  # a producer retry
    ]

    def apply(records: list[Any], fail: bool = False) -> dedup.ClaimResult:
        with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
            got = dedup.sync.claim(conn, records, namespace="ledger", key=KEY)
            for msg in got.fresh:
                conn.execute(
                    "UPDATE accounts SET balance = balance + %s WHERE id = 'acme'",
                    (msg.json()["amount"],),
                )
            if fail:
                raise RuntimeError("the business write failed")
        return got

    with pytest.raises(RuntimeError, match="business write failed"):
        apply(payments, fail=True)  # rolled back: its claims with it
    assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == 0
    first = await asyncio.to_thread(apply, payments)  # a worker thread: no event loop there
    again = apply(payments)  # redelivered
    assert [m.idempotency_key for m in first.fresh] == ["p1", "p2"]
    assert again.fresh == [] and len(again.duplicates) == 3
    assert str(await pool.fetchval("SELECT balance FROM accounts")) == "15.50"


def test_dedup_sync_claim_runs_where_no_event_loop_exists(dsn: str) -> None:
    # A plain function, as a Django view or a Celery task calls it.
    with pytest.raises(RuntimeError):
        asyncio.get_running_loop()
    with psycopg.connect(dsn) as conn:  # autocommit off: psycopg's own transaction
        got = dedup.sync.claim(conn, [record(0, {"id": "a"})], namespace="n", key=KEY)
        conn.rollback()  # the claim goes with it
        again = dedup.sync.claim(conn, [record(0, {"id": "a"})], namespace="n", key=KEY)
        conn.commit()
        after = dedup.sync.claim(conn, [record(0, {"id": "a"})], namespace="n", key=KEY)
        conn.commit()
    assert (where(got.fresh), where(again.fresh), where(after.duplicates)) == (
        [(0, 0)],
        [(0, 0)],
        [(0, 0)],
    )


async def test_an_async_connection_with_autocommit_off_claims_in_its_own_transaction(
    dsn: str, pool: Any
) -> None:
    conn = await psycopg.AsyncConnection.connect(dsn)
    try:
        got = await dedup.claim(conn, [record(0, {"id": "a"})], namespace="n", key=KEY)
        assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == 0, "not committed"
        await conn.commit()
    finally:
        await conn.close()
    assert where(got.fresh) == [(0, 0)]
    assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == 1


async def test_outside_a_transaction_nothing_is_claimed(
    dsn: str, pool: Any, async_engine: AsyncEngine, engine: Engine
) -> None:
    records = [record(0, {"id": "a"})]
    outside = r"must run inside your transaction.*"
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
        with pytest.raises(dedup.ConfigurationError, match=outside + r"async with conn\.tr"):
            await dedup.claim(aconn, records, namespace="n", key=KEY)
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(dedup.ConfigurationError, match=outside + r"`with conn\.transaction"):
            dedup.sync.claim(conn, records, namespace="n", key=KEY)
    with Session(engine) as session:
        with pytest.raises(dedup.ConfigurationError, match=r"`with session\.begin\(\):`"):
            dedup.sync.claim(session, records, namespace="n", key=KEY)
    with engine.connect() as sa_conn:
        with pytest.raises(dedup.ConfigurationError, match=r"`with engine\.begin\(\) as conn:`"):
            dedup.sync.claim(sa_conn, records, namespace="n", key=KEY)
    with engine.execution_options(isolation_level="AUTOCOMMIT").begin() as sa_conn:
        with pytest.raises(dedup.ConfigurationError, match="AUTOCOMMIT"):
            dedup.sync.claim(sa_conn, records, namespace="n", key=KEY)
    async with async_engine.execution_options(isolation_level="AUTOCOMMIT").begin() as a_conn:
        with pytest.raises(dedup.ConfigurationError, match="AUTOCOMMIT"):
            await dedup.claim(a_conn, records, namespace="n", key=KEY)
    async with AsyncSession(async_engine) as a_session:
        with pytest.raises(dedup.ConfigurationError, match=r"async with session\.begin"):
            await dedup.claim(a_session, records, namespace="n", key=KEY)
    assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == 0


async def test_a_connection_of_the_other_kind_is_named_with_the_call_that_takes_it(
    dsn: str, pool: Any, async_engine: AsyncEngine, engine: Engine
) -> None:
    records = [record(0, {"id": "a"})]
    to_sync = r"which blocks: call `dedup\.sync\.claim\(conn, records, \.\.\.\)` \(no await\)"
    to_async = r"which runs on an event loop: call `await dedup\.claim\(conn, records, \.\.\.\)`"
    with psycopg.connect(dsn) as conn:
        with pytest.raises(dedup.ConfigurationError, match=r"psycopg\.Connection, " + to_sync):
            await dedup.claim(conn, records, namespace="n", key=KEY)
    with Session(engine) as session, session.begin():
        with pytest.raises(dedup.ConfigurationError, match="orm.session.Session, " + to_sync):
            await dedup.claim(session, records, namespace="n", key=KEY)
    async with await psycopg.AsyncConnection.connect(dsn) as aconn:
        with pytest.raises(dedup.ConfigurationError, match="AsyncConnection, " + to_async):
            dedup.sync.claim(aconn, records, namespace="n", key=KEY)
    async with AsyncSession(async_engine) as a_session, a_session.begin():
        with pytest.raises(dedup.ConfigurationError, match="AsyncSession, " + to_async):
            dedup.sync.claim(a_session, records, namespace="n", key=KEY)
    a_conn = await asyncpg.connect(dsn)
    try:
        async with a_conn.transaction():
            with pytest.raises(dedup.ConfigurationError, match="Connection, " + to_async):
                dedup.sync.claim(a_conn, records, namespace="n", key=KEY)
    finally:
        await a_conn.close()
    with pytest.raises(dedup.ConfigurationError, match=r"builtins\.str; expected a psycopg"):
        dedup.sync.claim(dsn, records, namespace="n", key=KEY)
    assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == 0


async def test_a_claim_publishes_through_the_outbox_on_psycopg(dsn: str, pool: Any) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
        async with aconn.transaction():
            got = await dedup.claim(aconn, [record(0, {"id": "r1"})], namespace="n", key=KEY)
            first = await got.publish(aconn, "refunds", {"id": "r1"}, source=got.fresh[0])
    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.transaction():
            got = dedup.sync.claim(conn, [record(1, {"id": "r2"})], namespace="n", key=KEY)
            second = dedup.sync.publish(
                got, conn, "refunds", b"r2", source=got.fresh[0], key="r2", headers={"h": "v"}
            )
        with pytest.raises(RuntimeError), conn.transaction():
            got = dedup.sync.claim(conn, [record(2, {"id": "r3"})], namespace="n", key=KEY)
            dedup.sync.publish(got, conn, "refunds", b"r3", source=got.fresh[0])
            raise RuntimeError("rolled back: the record goes with the claim")
    rows = await pool.fetch(
        "SELECT key, destination, message_key, value, header_names, header_values, source, token"
        " FROM dedup.outbox ORDER BY id"
    )
    assert (first, second) == ("n:r1:0", "n:r2:0")
    assert [tuple(r) for r in rows] == [
        ("n:r1:0", "refunds", None, b'{"id":"r1"}', [], [], "n:r1", 0),
        ("n:r2:0", "refunds", b"r2", b"r2", ["h"], [b"v"], "n:r2", 0),
    ]


async def test_each_statement_is_a_client_span_naming_the_server(
    dsn: str, pool: Any, spans: InMemorySpanExporter
) -> None:
    tracer = trace.get_tracer("test")
    with psycopg.connect(dsn, autocommit=True) as conn:
        host, port = conn.info.host, conn.info.port
        with tracer.start_as_current_span("batch"), conn.transaction():
            dedup.sync.claim(conn, RECORDS[:2] + RECORDS[6:7], namespace="n", key=KEY)
    database = await pool.fetchval("SELECT current_database()")
    client = [s for s in spans.get_finished_spans() if s.kind is trace.SpanKind.CLIENT]
    assert [s.name for s in client] == [
        "INSERT dedup.processed",
        "UPDATE dedup.processed",
        "INSERT dedup.dead_letters",
        "INSERT dedup.events",
    ]
    for span in client:
        attrs = span.attributes or {}
        assert attrs["db.namespace"] == f"{database}|dedup"
        assert (attrs["server.address"], attrs["server.port"]) == (host, port)
    (batch,) = [s for s in spans.get_finished_spans() if s.name == "batch"]
    assert {e.name for e in batch.events} >= {"dedup.claimed", "dedup.conflict"}


async def test_a_database_error_is_psycopgs_own(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.UndefinedTable, match=r'"elsewhere\.processed"'):
            with conn.transaction():
                dedup.sync.claim(conn, RECORDS[:1], namespace="n", key=KEY, schema="elsewhere")


async def test_dedups_cursors_read_json_as_text_and_leave_the_connections_loaders_alone(
    dsn: str,
) -> None:
    from dedup.data import _psycopg as psycopg_

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        adapter = psycopg_.AsyncAdapter(conn)
        row = await adapter.fetchrow(
            """SELECT '{"a": 1}'::jsonb AS j, '[1]'::json AS k, $1::text || '%' AS t""", "50"
        )
        assert row is not None
        assert (row["j"], row[1], row["t"], len(row)) == ('{"a": 1}', "[1]", "50%", 3)
        assert dict(row.items()) == {"j": '{"a": 1}', "k": "[1]", "t": "50%"}
        assert await adapter.fetchval("SELECT 1 WHERE false") is None
        assert await adapter.fetch("SELECT 1 WHERE false") == []
        assert await adapter.execute("CREATE TEMP TABLE x (v int)") == "CREATE TABLE"
        await adapter.executemany("INSERT INTO x VALUES ($1)", [(1,), (2,)])
        assert await adapter.execute("UPDATE x SET v = v + $1", 1) == "UPDATE 2"
        cursor = await conn.execute("SELECT '{\"a\": 1}'::jsonb")
        assert await cursor.fetchone() == ({"a": 1},), "the connection's own loaders"


def produced_by_librdkafka(bootstrap_servers: str, topic: str) -> None:
    """:data:`RECORDS`, as librdkafka produces them: same partitions, keys and headers."""
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap_servers})
    failed: list[Any] = []
    for r in RECORDS:
        producer.produce(
            topic,
            value=r.value,
            key=r.key,
            partition=r.partition,
            headers=list(r.headers) or None,
            timestamp=r.timestamp,
            on_delivery=lambda err, _msg: failed.append(err) if err else None,
        )
    assert producer.flush(30) == 0 and not failed, failed


def consumed_by_librdkafka(bootstrap_servers: str, topic: str) -> list[Any]:
    """Every record of ``topic``'s two partitions, then each partition's end-of-partition event,
    as a confluent-kafka loop polls them."""
    consumer = confluent_kafka.Consumer(
        {
            "bootstrap.servers": bootstrap_servers,
            "group.id": f"g-{topic}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,  # an event at each partition's end: msg.error() set
        }
    )
    consumer.assign(
        [confluent_kafka.TopicPartition(topic, p, confluent_kafka.OFFSET_BEGINNING) for p in (0, 1)]
    )
    found: list[Any] = []
    try:
        while sum(1 for m in found if m.error()) < 2:
            msg = consumer.poll(30)
            assert msg is not None, f"no record nor end of {topic} in 30 s"
            found.append(msg)
    finally:
        consumer.close()
    return found


async def test_confluent_kafka_messages_leave_the_rows_aiokafka_records_leave(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics
) -> None:
    topic = await topics.create(partitions=2)
    await asyncio.to_thread(produced_by_librdkafka, bootstrap_servers, topic)
    by_aiokafka = await kafka_support.read_topic(bootstrap_servers, topic)
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            expected = await dedup.claim(conn, by_aiokafka, namespace="aiokafka", key=KEY)
    finally:
        await conn.close()

    polled = await asyncio.to_thread(consumed_by_librdkafka, bootstrap_servers, topic)
    events = [m for m in polled if m.error()]
    # The first copy of a key in a batch is the one applied: the same order as aiokafka's.
    messages = sorted(
        (m for m in polled if not m.error()), key=lambda m: (m.partition(), m.offset())
    )
    with psycopg.connect(dsn, autocommit=True) as sync_conn:
        with pytest.raises(dedup.ConfigurationError) as refused, sync_conn.transaction():
            dedup.sync.claim(sync_conn, messages + events[:1], namespace="confluent", key=KEY)
        with sync_conn.transaction():
            got = dedup.sync.claim(sync_conn, messages, namespace="confluent", key=KEY)

    assert str(refused.value).startswith(
        "a confluent_kafka.Message with an error is no record to claim: "
        f"{events[0].error()} (at {topic}:{events[0].partition()}); skip such messages"
    )
    assert "_PARTITION_EOF" in str(refused.value)
    assert len(messages) == len(RECORDS)
    assert outcome(got) == outcome(expected)
    assert outcome(got)[0] == [(0, 0), (0, 2), (0, 4)]
    rows = await table_rows(pool, "confluent")
    assert rows == await table_rows(pool, "aiokafka")
    assert len(rows["dead_letters"]) == 3
    assert rows["dead_letters"][0]["timestamp_ms"] == RECORDS[6].timestamp  # the conflict


PSYCOPG_PREPARES_AFTER = 5
"""psycopg's default ``prepare_threshold``: runs of a statement before it prepares it by name."""


async def test_through_pgbouncer_in_transaction_mode_with_prepare_threshold_none(
    pgbouncer_dsn: str, pool: Any
) -> None:
    # More claims on one connection than psycopg runs a statement unprepared.
    with psycopg.connect(pgbouncer_dsn, autocommit=True, prepare_threshold=None) as conn:
        for i in range(PSYCOPG_PREPARES_AFTER + 2):
            with conn.transaction():
                got = dedup.sync.claim(conn, [record(i, {"id": f"k{i}"})], namespace="n", key=KEY)
            assert where(got.fresh) == [(0, i)]
    assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == PSYCOPG_PREPARES_AFTER + 2
