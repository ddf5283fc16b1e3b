"""The partition tool: a proxy passes, blackholes and resets, and it really cuts its client.

Against a plain TCP echo server first (what each mode does to bytes, closes and
new connections), then a Postgres client through a proxy (a query held
mid-stream, a transaction the server ends behind a cut), then a Kafka consumer
bootstrapped through a proxy slot of the chaos broker: every connection it
opens leads through the proxy, and cutting the proxy cuts its fetches and its
group membership, which the broker ends after the session timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import aiokafka
import asyncpg
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from dedup_dev import helpers, kafka, proxy
from tests.chaos import services
from tests.chaos.services import ChaosServices

pytestmark = pytest.mark.chaos

WATCHED = 1.0
"""Seconds a cut connection is watched not to move (a cut is only ever seen as nothing
happening; this is how long nothing must happen)."""
WITHIN = 10.0
"""Seconds for what must happen once a proxy passes again."""
IDLE_TIMEOUT_MS = 1000
"""The idle_in_transaction_session_timeout of the cut transaction (milliseconds)."""
SESSION_TIMEOUT_MS = 3000
"""The Kafka consumer's session timeout: the broker drops a cut member after it."""
BIG_ROWS = 200_000
"""Rows of the query held mid-stream: a few MB, many proxy chunks."""


@contextlib.asynccontextmanager
async def echo_server() -> AsyncIterator[int]:
    """A server on 127.0.0.1 that sends back what it receives, and closes when its client does."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, proxy.HOST, 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def nothing_within(awaitable: asyncio.Future[object] | asyncio.Task[object]) -> None:
    """``awaitable`` does not complete within WATCHED seconds (it keeps running)."""
    done, _ = await asyncio.wait([awaitable], timeout=WATCHED)
    assert not done, f"completed through a cut proxy: {awaitable}"


async def test_pass_forwards_both_ways_and_the_close() -> None:
    async with echo_server() as port, proxy.Proxy("echo", port) as p:
        reader, writer = await asyncio.open_connection(proxy.HOST, p.port)
        writer.write(b"hello")
        assert await reader.readexactly(5) == b"hello"
        writer.write_eof()
        assert await reader.read() == b""  # the echo server's close came through
        writer.close()
        assert (p.traffic.connections, p.traffic.to_service, p.traffic.to_client) == (1, 5, 5)


async def test_a_blackhole_holds_an_open_stream_and_delivers_it_in_order_on_heal() -> None:
    async with echo_server() as port, proxy.Proxy("echo", port) as p:
        reader, writer = await asyncio.open_connection(proxy.HOST, p.port)
        writer.write(b"before|")
        assert await reader.readexactly(7) == b"before|"
        p.cut()
        writer.write(b"during|")
        writer.write_eof()  # a close during the cut is held too
        read = asyncio.ensure_future(reader.read())
        await nothing_within(read)
        assert p.traffic.to_service == 7  # nothing of it reached the server
        p.heal()
        assert await asyncio.wait_for(read, WITHIN) == b"during|"
        writer.close()


async def test_a_one_way_cut_delivers_the_request_and_holds_its_answer() -> None:
    async with echo_server() as port, proxy.Proxy("echo", port) as p:
        reader, writer = await asyncio.open_connection(proxy.HOST, p.port)
        p.cut(to_service=False)
        writer.write(b"request")

        async def arrived() -> bool:
            return p.traffic.to_service == 7

        await helpers.wait_for(arrived, within=WITHIN, interval=0.01, what="the request")
        answer = asyncio.ensure_future(reader.readexactly(7))
        await nothing_within(answer)
        p.heal()
        assert await asyncio.wait_for(answer, WITHIN) == b"request"
        writer.close()


async def test_a_cut_after_a_marker_lets_that_request_through_and_holds_its_answer() -> None:
    async with echo_server() as port, proxy.Proxy("echo", port) as p:
        reader, writer = await asyncio.open_connection(proxy.HOST, p.port)
        p.cut_after(b"COMMIT")
        writer.write(b"SELECT")
        assert await asyncio.wait_for(reader.readexactly(6), WITHIN) == b"SELECT"
        writer.write(b"COMMIT")
        await asyncio.wait_for(p.tripped.wait(), WITHIN)
        answer = asyncio.ensure_future(reader.readexactly(6))
        await nothing_within(answer)
        assert p.traffic.to_service == 12  # the COMMIT arrived
        p.heal()
        assert await asyncio.wait_for(answer, WITHIN) == b"COMMIT"
        writer.close()


async def test_a_blackhole_accepts_a_new_connection_and_never_answers_until_healed() -> None:
    async with echo_server() as port, proxy.Proxy("echo", port) as p:
        p.cut()
        reader, writer = await asyncio.open_connection(proxy.HOST, p.port)  # accepted
        writer.write(b"anyone?")
        answer = asyncio.ensure_future(reader.readexactly(7))
        await nothing_within(answer)
        p.heal()
        assert await asyncio.wait_for(answer, WITHIN) == b"anyone?"
        writer.close()


async def test_reset_resets_open_connections_and_every_new_one() -> None:
    async with echo_server() as port, proxy.Proxy("echo", port) as p:
        reader, writer = await asyncio.open_connection(proxy.HOST, p.port)
        writer.write(b"x")
        assert await reader.readexactly(1) == b"x"
        p.reset()
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(), WITHIN)
        writer.close()
        reader, writer = await asyncio.open_connection(proxy.HOST, p.port)
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(), WITHIN)
        writer.close()
        p.heal()
        reader, writer = await asyncio.open_connection(proxy.HOST, p.port)
        writer.write(b"y")
        assert await asyncio.wait_for(reader.readexactly(1), WITHIN) == b"y"
        writer.close()
        assert p.traffic.resets == 2


def pg_port(dsn: str) -> int:
    return int(dsn.split("@", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])


async def test_a_postgres_query_stalls_mid_stream_and_completes_on_heal(
    chaos_services: ChaosServices,
) -> None:
    async with proxy.Proxy("postgres", pg_port(chaos_services.dsn)) as p:
        conn = await asyncpg.connect(proxy.with_port(chaos_services.dsn, p.port))
        try:
            assert await conn.fetchval("SELECT 1") == 1
            before = p.traffic.to_client
            query = asyncio.ensure_future(
                conn.fetch("SELECT i, repeat('x', 20) FROM generate_series(1, $1) AS i", BIG_ROWS)
            )

            async def streaming() -> bool:
                return p.traffic.to_client > before + proxy.CHUNK_BYTES

            await helpers.wait_for(streaming, within=WITHIN, interval=0.001, what="rows flowing")
            p.cut()
            held_at = p.traffic.to_client
            await nothing_within(query)
            assert p.traffic.to_client == held_at, "bytes reached the client through a cut"
            p.heal()
            rows = await asyncio.wait_for(query, WITHIN)
            assert [r[0] for r in rows] == list(range(1, BIG_ROWS + 1))
        finally:
            await conn.close()


async def test_the_server_ends_a_transaction_cut_off_behind_the_proxy(
    chaos_services: ChaosServices,
) -> None:
    """The cut client's open transaction holds its row lock until the server's idle timeout
    ends the session; the client learns it only once the proxy passes again."""
    name = f"cut-{uuid.uuid4().hex[:8]}"
    direct = await asyncpg.connect(chaos_services.dsn)
    async with proxy.Proxy("postgres", pg_port(chaos_services.dsn)) as p:
        cut = await asyncpg.connect(
            proxy.with_port(chaos_services.dsn, p.port),
            server_settings={
                "application_name": name,
                "idle_in_transaction_session_timeout": str(IDLE_TIMEOUT_MS),
            },
        )
        try:
            await direct.execute("CREATE TEMP TABLE held (id int PRIMARY KEY)")
            await cut.execute("BEGIN")
            await cut.execute("SELECT pg_advisory_xact_lock(4242)")
            p.cut()
            t0 = time.monotonic()

            async def gone() -> bool:
                return not await direct.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name
                )

            await helpers.wait_for(gone, within=WITHIN, what="the server to end the session")
            took = time.monotonic() - t0
            assert took >= IDLE_TIMEOUT_MS / 1000 * 0.9, took
            assert await direct.fetchval("SELECT pg_try_advisory_lock(4242)")  # the lock is free
            commit = asyncio.ensure_future(cut.execute("COMMIT"))
            await nothing_within(commit)
            p.heal()
            with pytest.raises((asyncpg.PostgresConnectionError, asyncpg.InterfaceError)):
                await asyncio.wait_for(commit, WITHIN)
        finally:
            cut.terminate()
            await direct.close()


async def test_a_kafka_consumer_through_its_slot_is_cut_off_from_every_broker_connection(
    chaos_services: ChaosServices,
) -> None:
    topic = f"proxy-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=chaos_services.bootstrap_servers)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        await admin.close()
    producer = aiokafka.AIOKafkaProducer(bootstrap_servers=chaos_services.bootstrap_servers)
    await producer.start()
    slot = services.KAFKA_SLOTS - 1
    p = proxy.Proxy(
        "kafka", services.kafka_listener_port(slot), port=services.kafka_proxy_port(slot)
    )
    await p.start()
    consumer = aiokafka.AIOKafkaConsumer(
        topic,
        bootstrap_servers=p.address,
        group_id=topic,
        auto_offset_reset="earliest",
        session_timeout_ms=SESSION_TIMEOUT_MS,
        heartbeat_interval_ms=SESSION_TIMEOUT_MS // 6,
        request_timeout_ms=SESSION_TIMEOUT_MS * 2,
    )
    try:
        await consumer.start()
        # The broker's metadata names the proxy, not itself: nothing bypasses the proxy.
        assert {(b.host, b.port) for b in consumer._client.cluster.brokers()} == {
            (proxy.HOST, p.port)
        }

        async def fetched(n: int) -> int:
            got = await consumer.getmany(timeout_ms=200)
            return sum(len(v) for v in got.values())

        await producer.send_and_wait(topic, b"before")

        async def got_one() -> bool:
            return await fetched(1) == 1

        await helpers.wait_for(got_one, within=WITHIN, what="the record before the cut")
        assert p.traffic.to_client > 0

        p.cut()
        t0 = time.monotonic()
        await producer.send_and_wait(topic, b"during")
        held_at = p.traffic.to_client
        assert await fetched(1) == 0  # within one fetch wait: nothing comes
        # The broker drops the member it no longer hears from.

        async def dropped() -> bool:
            return await kafka.group_state(chaos_services.bootstrap_servers, topic) == "Empty"

        await helpers.wait_for(
            dropped, within=SESSION_TIMEOUT_MS / 1000 + WITHIN, what="the member dropped"
        )
        assert time.monotonic() - t0 >= SESSION_TIMEOUT_MS / 1000 * 0.9
        assert p.traffic.to_client == held_at, "bytes reached the consumer through a cut"

        p.heal()
        await helpers.wait_for(got_one, within=WITHIN * 3, what="the record sent during the cut")
    finally:
        await consumer.stop()
        await producer.stop()
        await p.close()
