"""dedup_services.notifications, the outbox dispatcher and the receiver: each notification once.

The receiver's ``receiver.notifications`` table is the end-to-end effect: one
row per notification, however many copies Kafka delivered, however many
dispatchers ran, and with a dispatcher killed between its send and marking
the row sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from typing import Any

import orjson
from dedup_services import notifications, receiver, service
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import dedup
from dedup import _outbox as outbox
from dedup_dev import effects as consumer_support
from dedup_dev import helpers
from dedup_dev import service_process as service_support
from dedup_dev.kafka import Topics

DAY = "2026-11-30"


def notification(nid: str, recipient: str = "u1@example.com") -> dict[str, Any]:
    return {"notification_id": nid, "recipient": recipient, "template": "paid", "date": DAY}


STREAM = [notification(f"n{i}") for i in range(5)]


@contextlib.asynccontextmanager
async def dispatching(
    pool: Any, url: str, holder: str | None = None, **options: Any
) -> AsyncIterator[dedup.Dispatcher]:
    """An in-process dispatcher of the notifications, stopped (its sends finished) on the way
    out."""
    dispatcher = dedup.Dispatcher(
        pool=pool,
        destinations={notifications.DESTINATION: url},
        holder=holder,
        **{"retry_base": 0.05, "poll_interval": 0.05, **options},
    )
    task = asyncio.create_task(dispatcher.run())
    try:
        yield dispatcher
    finally:
        await dispatcher.stop()
        await task


def key_of(nid: str) -> str:
    """The outbox row key (and the receiver's Idempotency-Key) of notification ``nid``."""
    return f"notifications:{nid}:0"


NOTIFICATIONS = "FROM dedup.outbox WHERE destination = 'notifications'"


async def delivered(pool: Any) -> dict[str, tuple[int, int, int, int]]:
    """key -> (first token, last token, repeats, stale) at the receiver."""
    rows = await pool.fetch(
        "SELECT idempotency_key, first_token, last_token, repeats, stale"
        " FROM receiver.notifications"
    )
    return {r[0]: tuple(r[1:]) for r in rows}


async def all_sent(pool: Any, n: int) -> bool:
    return bool(await pool.fetchval(f"SELECT count(*) = $1 {NOTIFICATIONS} AND status = 'sent'", n))


async def test_duplicates_replays_and_two_dispatchers_deliver_each_once(
    bootstrap_servers: str, topics: Topics, pool: Any, spans: InMemorySpanExporter
) -> None:
    topic = await topics.create(partitions=2)
    await notifications.SERVICE.migrate(pool)
    await service.migrate(pool, ("receiver",), schema=None)
    sent = await service_support.produce_events(
        bootstrap_servers, topic, [*STREAM, *STREAM[:2]], key="notification_id"
    )
    consumer = notifications.SERVICE.consumer(
        topic=topic, bootstrap_servers=bootstrap_servers, pool=pool, install_signal_handlers=False
    )
    # The receiver is flaky: it answers 503 to the first request of each key.
    async with (
        receiver.Receiver(pool, fail_first=1) as downstream,
        consumer_support.running(consumer),
        dispatching(pool, downstream.url, holder="d1") as first,
        dispatching(pool, downstream.url, holder="d2") as second,
    ):
        await helpers.wait_for(lambda: service_support.handled(consumer, sent), what="all sent")
        sent += await service_support.produce_events(
            bootstrap_servers, topic, STREAM, key="notification_id"
        )
        await helpers.wait_for(lambda: service_support.handled(consumer, sent), what="replay")
        await helpers.wait_for(lambda: all_sent(pool, len(STREAM)), what="the outbox sent")

    assert consumer.stats["processed"] == len(STREAM)
    assert await pool.fetchval(f"SELECT count(*) {NOTIFICATIONS}") == len(STREAM)
    # Each delivered once, under its second claim (the first got a 503 and was retried).
    assert await delivered(pool) == {key_of(n["notification_id"]): (2, 2, 0, 0) for n in STREAM}
    rows = await pool.fetch(f"SELECT attempts, claim_token, response_status {NOTIFICATIONS}")
    assert {tuple(r) for r in rows} == {(2, 2, 201)}
    stats = first.stats + second.stats
    assert (stats["sent"], stats["retried"], stats["failed"]) == (5, 5, 0)
    report = await dedup.reconcile(pool, notifications.RECONCILE, DAY)
    assert report.ok and report.result.rows == len(STREAM)
    # Each send is a CLIENT span; the receiver's SERVER span continues its trace.
    finished = spans.get_finished_spans()
    sends = {s.context.span_id: s for s in finished if s.name == "POST"}
    served = [s for s in finished if s.name == "POST /notifications"]
    assert len(sends) == len(served) == 2 * len(STREAM)
    assert all(s.parent is not None and s.parent.span_id in sends for s in served)
    assert {sends[s.parent.span_id].attributes["dedup.token"] for s in served} == {1, 2}


async def test_a_dispatcher_killed_between_send_and_mark_does_not_deliver_twice(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    topic = await topics.create()
    await service.migrate(pool, ("receiver",), schema=None)
    env = service_support.environment(dsn, bootstrap_servers, NOTIFICATIONS_TOPIC=topic)
    async with receiver.Receiver(pool) as downstream:
        # The consumer, as a service: it fills the outbox.
        async with service_support.child(
            "run", "dedup_services.notifications", env=env
        ) as consumer:
            await service_support.produce_events(
                bootstrap_servers, topic, STREAM + STREAM, key="notification_id"
            )
            await helpers.wait_for(lambda: outbox_rows(pool, len(STREAM)), what="the outbox")
            assert await consumer.stop() == 0, await consumer.stderr()

        # A dispatcher sends one row, then hangs before marking it: kill it there.
        hold = {notifications.HOLD_AFTER_SEND: "1"}
        dispatcher_args = (
            *("run", "dedup_services.notifications", "--dispatcher", "--dispatch-batch", "1"),
            *("--receiver-url", downstream.url, "--claim-ttl", "1", "--timeout", "0.5"),
        )
        async with service_support.child(*dispatcher_args, env={**env, **hold}) as doomed:
            _, key, token, status = (await doomed.expect("HELD"))[1].split()
            assert (token, status) == ("1", "201")
            await doomed.stop(signal.SIGKILL)
        assert await delivered(pool) == {key: (1, 1, 0, 0)}
        row = await pool.fetchrow(f"SELECT status, claimed_by {NOTIFICATIONS} AND key = $1", key)
        assert row["status"] == "pending" and row["claimed_by"], "sent, but never marked"

        # Another dispatcher finishes the outbox; the killed one's claim expires first.
        async with dispatching(pool, downstream.url, claim_ttl=1.0, timeout=0.5) as rescuer:
            await helpers.wait_for(lambda: all_sent(pool, len(STREAM)), what="the outbox sent")

    receipts = await delivered(pool)
    assert sorted(receipts) == sorted(key_of(n["notification_id"]) for n in STREAM)
    # The killed send's row went again under the next token; the receiver ignored it.
    assert receipts.pop(key) == (1, 2, 1, 0)
    assert set(receipts.values()) == {(1, 1, 0, 0)}
    answers = await pool.fetch(
        "SELECT token, status, outcome FROM receiver.requests WHERE idempotency_key = $1"
        " ORDER BY id",
        key,
    )
    assert [tuple(a) for a in answers] == [(1, 201, "delivered"), (2, 200, "duplicate")]
    assert rescuer.stats["sent"] == len(STREAM)


async def outbox_rows(pool: Any, n: int) -> bool:
    if await pool.fetchval("SELECT to_regclass('notifications.written')") is None:
        return False  # the service has not applied its migration yet
    return bool(await pool.fetchval(f"SELECT count(*) = $1 {NOTIFICATIONS}", n))


async def test_the_receiver_refuses_a_lower_token_and_ignores_repeats(pool: Any) -> None:
    await service.migrate(pool, ("receiver",), schema=None)
    body = orjson.dumps(notification("k"))

    async def send(token: str | None, key: str = "k") -> int:
        headers = {"Idempotency-Key": key, **({"X-Fencing-Token": token} if token else {})}
        return await asyncio.to_thread(outbox.http_post, downstream.url, body, headers, 5.0)

    async with receiver.Receiver(pool) as downstream:
        assert [await send(t) for t in ("2", "1", "2", "3", "1", None)] == [
            201,
            409,
            200,
            200,
            409,
            400,
        ]
    assert await delivered(pool) == {"k": (2, 3, 2, 2)}
    assert await pool.fetchval("SELECT payload FROM receiver.notifications") == orjson.loads(body)
