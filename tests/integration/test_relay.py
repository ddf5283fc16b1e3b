"""``tx.publish`` and the relay, on the real Kafka and Postgres: each applied message tells once.

A pipeline as users build it: a ``payments`` consumer writes its effect and
publishes ``payment-applied`` in the same transaction; a relay publishes the
outbox; a downstream consumer keyed by the ``dedup-key`` header writes a ledger.
The oracle compares the outbox rows, the output topic and the ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

import dedup
from dedup import _faults as faults
from dedup import _relay
from dedup_dev import effects as support
from dedup_dev import helpers
from dedup_dev import kafka as kafka_support
from dedup_dev.kafka import Topics
from tests.integration.test_tracing import counter_totals, points

LEDGER = "CREATE TABLE ledger (dedup_key text, payment_id text, amount int)"


def payment(pid: str, amount: int = 10, **extra: Any) -> bytes:
    return orjson.dumps({"payment_id": pid, "amount": amount, **extra})


def publishing(output: str) -> Any:
    async def apply_payment(msg: dedup.Message, tx: dedup.Tx) -> None:
        p = msg.json()
        await tx.conn.execute(
            "INSERT INTO effects (key, payload, token, \"partition\", \"offset\")"
            " VALUES ($1, $2, $3, $4, $5)",
            msg.idempotency_key, p, tx.token, msg.partition, msg.offset,
        )  # fmt: skip
        await tx.publish(output, {"payment_id": p["payment_id"], "amount": p["amount"]},
                         key=p["payment_id"], headers={"origin": "payments"})  # fmt: skip
        if p.get("explode"):
            raise RuntimeError("a handler bug after its publish")

    return apply_payment


async def record_in_ledger(msg: dedup.Message, tx: dedup.Tx) -> None:
    p = msg.json()
    await tx.conn.execute(
        "INSERT INTO ledger VALUES ($1, $2, $3)", msg.idempotency_key, p["payment_id"], p["amount"]
    )


def consumer(handler: Any, topic: str, bootstrap_servers: str, pool: Any, **kw: Any) -> Any:
    return dedup.IdempotentConsumer(
        handler,
        topics=[topic],
        group_id=f"g-{topic}",
        bootstrap_servers=bootstrap_servers,
        pool=pool,
        auto_offset_reset="earliest",
        install_signal_handlers=False,
        max_attempts=1,
        **{"namespace": "payments", **kw},
    )


@contextlib.asynccontextmanager
async def relaying(relay: dedup.Relay) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(relay.run())
    try:
        yield task
    finally:
        await relay.stop()
        await asyncio.wait_for(task, 30)


async def pending(pool: Any) -> int:
    return int(
        await pool.fetchval(
            "SELECT count(*) FROM dedup.outbox WHERE sink = 'kafka' AND status = 'pending'"
        )
    )


async def outbox_rows(pool: Any) -> list[Any]:
    return list(await pool.fetch("SELECT * FROM dedup.outbox WHERE sink = 'kafka' ORDER BY id"))


async def applied_payments(
    bootstrap_servers: str, topics: Topics, pool: Any, n: int
) -> tuple[str, str]:
    """n payments (every third sent twice, one that fails after its publish) consumed; the
    payments topic and the output topic."""
    source, output = await topics.create(partitions=2), await topics.create(partitions=2)
    await pool.execute(support.EFFECTS)
    records = [(None, payment(f"p{i}")) for i in range(n)]
    records += [(None, payment(f"p{i}")) for i in range(0, n, 3)]
    records.append((None, payment("boom", explode=True)))
    await helpers.produce(bootstrap_servers, source, records)
    payments = consumer(
        publishing(output), source, bootstrap_servers, pool,
        key=dedup.keys.json_field("payment_id"),
    )  # fmt: skip
    async with support.running(payments):
        await helpers.wait_for(lambda: support.handled(payments, len(records)), what="payments")
    return source, output


async def test_a_record_is_written_if_and_only_if_its_message_was_applied(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    await applied_payments(bootstrap_servers, topics, pool, 12)

    rows = await outbox_rows(pool)
    # One per payment applied; none for the copies, none for the one that failed after it.
    assert sorted(r["key"] for r in rows) == sorted(f"payments:p{i}:0" for i in range(12))
    effects = await pool.fetch("SELECT key, token FROM effects")
    assert {r["key"]: r["token"] for r in effects} == {
        r["source"].removeprefix("payments:"): r["token"] for r in rows
    }, "each row carries its source and the token it was applied under"
    assert all(r["status"] == "pending" and r["token"] > 0 for r in rows)
    assert {orjson.loads(r["value"])["payment_id"] for r in rows} == {f"p{i}" for i in range(12)}
    [letter] = await pool.fetch("SELECT idempotency_key FROM dedup.dead_letters")
    assert letter["idempotency_key"] == "boom"


@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
async def test_the_relay_publishes_each_record_once_with_its_key_and_token_and_the_ledger_once(
    mode: _relay.Mode, bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    _, output = await applied_payments(bootstrap_servers, topics, pool, 30)
    relay = dedup.Relay(
        pool=pool, bootstrap_servers=bootstrap_servers, mode=mode, name=f"r-{output}"
    )
    async with relaying(relay):
        await helpers.wait_for(
            lambda: helpers.equal(pending(pool), 0), what="every record published"
        )

    rows = {r["key"]: r for r in await outbox_rows(pool)}
    assert {r["status"] for r in rows.values()} == {"sent"}
    published = await kafka_support.read_topic(
        bootstrap_servers, output, read_committed=mode == "exactly_once"
    )
    headers = [dict(r.headers) for r in published]
    assert Counter(h["dedup-key"].decode() for h in headers) == dict.fromkeys(rows, 1)
    for record, h in zip(published, headers, strict=True):
        row = rows[h["dedup-key"].decode()]
        assert (record.key, record.value) == (row["message_key"], row["value"])
        assert (h["dedup-token"], h["origin"]) == (str(row["token"]).encode(), b"payments")
    assert relay.stats.published == 30
    batches = await pool.fetch(
        "SELECT holder, token, detail FROM dedup.events WHERE kind = 'published'"
    )
    assert sum(b["detail"]["published"] for b in batches) == 30
    assert {b["holder"] for b in batches} == {relay.holder}

    # Downstream, keyed by the header: one ledger row per payment.
    await pool.execute(LEDGER)
    ledger = consumer(
        record_in_ledger, output, bootstrap_servers, pool,
        key=dedup.keys.header("dedup-key"), namespace="ledger",
    )  # fmt: skip
    async with support.running(ledger):
        await helpers.wait_for(lambda: support.handled(ledger, len(published)), what="ledger")
    assert await pool.fetchval("SELECT count(DISTINCT payment_id) FROM ledger") == 30
    assert await pool.fetchval("SELECT count(*) FROM ledger") == 30


async def test_a_second_relay_of_the_name_waits_and_takes_over_when_the_first_stops(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    _, output = await applied_payments(bootstrap_servers, topics, pool, 6)
    name = f"r-{output}"
    first = dedup.Relay(pool=pool, bootstrap_servers=bootstrap_servers, name=name, holder="a")
    second = dedup.Relay(
        pool=pool, bootstrap_servers=bootstrap_servers, name=name, holder="b", lease_ttl=2
    )
    async with relaying(first):
        await helpers.wait_for(lambda: helpers.equal(pending(pool), 0), what="first relay")
        async with relaying(second):
            await helpers.wait_for(lambda: _true(second.stats.waited), what="b to find a's lease")
            await applied_more(bootstrap_servers, pool, output, topics)
            await helpers.wait_for(lambda: helpers.equal(pending(pool), 0), what="a publishes")
            assert second.stats.published == 0, "b waited while a held the lease"
            await first.stop()
            await applied_more(bootstrap_servers, pool, output, topics, start=100)
            await helpers.wait_for(lambda: helpers.equal(pending(pool), 0), what="b takes over")
    assert (first.stats.published, second.stats.published) == (12, 6)
    assert second.stats.takeovers == 1


async def _true(value: int) -> bool:
    return bool(value)


async def applied_more(
    bootstrap_servers: str, pool: Any, output: str, topics: Topics, start: int = 50
) -> None:
    """Six more payments applied (their records written to the outbox)."""
    source = await topics.create()
    await helpers.produce(
        bootstrap_servers, source, [(None, payment(f"p{i}")) for i in range(start, start + 6)]
    )
    payments = consumer(
        publishing(output), source, bootstrap_servers, pool,
        key=dedup.keys.json_field("payment_id"), namespace=f"more{start}",
    )  # fmt: skip
    async with support.running(payments):
        await helpers.wait_for(lambda: support.handled(payments, 6), what="more payments")


class Crash(BaseException):
    """The relay's process dying at a fault point (nothing after it runs)."""


@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
async def test_a_relay_that_dies_after_the_broker_took_a_batch_loses_nothing(
    mode: _relay.Mode, bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    _, output = await applied_payments(bootstrap_servers, topics, pool, 10)
    name = f"r-{output}"

    async def die(**_: Any) -> None:
        raise Crash

    dying = dedup.Relay(pool=pool, bootstrap_servers=bootstrap_servers, name=name, mode=mode,
                        holder="dies", lease_ttl=1, batch_size=4)  # fmt: skip
    with faults.install(faults.Point.RELAY_AFTER_SEND, die), pytest.raises(Crash):
        await dying.run()
    assert await pending(pool) == 10, "the dead relay marked nothing"

    taking_over = dedup.Relay(pool=pool, bootstrap_servers=bootstrap_servers, name=name,
                              mode=mode, holder="next")  # fmt: skip
    async with relaying(taking_over):
        await helpers.wait_for(lambda: helpers.equal(pending(pool), 0), what="the next relay")

    keys = Counter(
        dict(r.headers)["dedup-key"]
        for r in await kafka_support.read_topic(
            bootstrap_servers, output, read_committed=mode == "exactly_once"
        )
    )
    assert len(keys) == 10, "every record published"
    if mode == "exactly_once":
        assert set(keys.values()) == {1}, "read_committed sees the dead relay's batch once"
        assert taking_over.stats.recovered == 4
    else:
        assert sum(keys.values()) == 14, "at least once: the dead relay's batch went out twice"


async def test_teeth_a_relay_that_marks_before_the_broker_acknowledged_loses_records(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    """The oracle (outbox rows against the topic) must catch a relay that marks too early."""
    _, output = await applied_payments(bootstrap_servers, topics, pool, 10)

    async def mark_then_die(*, pool: Any, ids: list[int], **_: Any) -> None:
        await pool.execute("UPDATE dedup.outbox SET status = 'sent' WHERE id = ANY($1)", ids)
        raise Crash

    broken = dedup.Relay(pool=pool, bootstrap_servers=bootstrap_servers, name=f"r-{output}",
                         lease_ttl=1, batch_size=4)  # fmt: skip
    with faults.install(faults.Point.RELAY_BEFORE_SEND, mark_then_die), pytest.raises(Crash):
        await broken.run()
    fixed = dedup.Relay(pool=pool, bootstrap_servers=bootstrap_servers, name=f"r-{output}")
    async with relaying(fixed):
        await helpers.wait_for(lambda: helpers.equal(pending(pool), 0), what="the fixed relay")

    published = {
        dict(r.headers)["dedup-key"].decode()
        for r in await kafka_support.read_topic(bootstrap_servers, output)
    }
    sent = {r["key"] for r in await outbox_rows(pool) if r["status"] == "sent"}
    assert len(sent - published) == 4, "the oracle sees the four rows marked and never sent"


async def test_a_broker_that_refuses_holds_records_back_and_loses_none(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    # The output topic does not exist yet (and is not auto-created): records wait.
    await pool.execute(support.EFFECTS)
    missing = f"not-yet-{(await topics.create()).rsplit('-', 1)[1]}"
    source = await topics.create()
    await helpers.produce(bootstrap_servers, source, [(None, payment(f"p{i}")) for i in range(5)])
    payments = consumer(
        publishing(missing), source, bootstrap_servers, pool,
        key=dedup.keys.json_field("payment_id"),
    )  # fmt: skip
    relay = dedup.Relay(pool=pool, bootstrap_servers=bootstrap_servers, name=f"r-{missing}",
                        producer_options={"request_timeout_ms": 2000})  # fmt: skip
    async with support.running(payments), relaying(relay):
        await helpers.wait_for(lambda: support.handled(payments, 5), what="payments applied")
        await helpers.wait_for(lambda: _true(relay.stats.held_back), what="a refused batch")
        assert await pending(pool) == 5, "held back, not lost"
        await topics.create(name=missing)
        await helpers.wait_for(
            lambda: helpers.equal(pending(pool), 0), within=60, what="published once it exists"
        )
    assert len(await kafka_support.read_topic(bootstrap_servers, missing)) == 5


async def test_each_batch_is_a_producer_span_linked_to_the_handlers_and_counted(
    bootstrap_servers: str,
    topics: Topics,
    pool: Any,
    spans: InMemorySpanExporter,
    metric_reader: InMemoryMetricReader,
) -> None:
    _, output = await applied_payments(bootstrap_servers, topics, pool, 9)
    handlers = {
        s.context.trace_id for s in spans.get_finished_spans() if s.kind == SpanKind.CONSUMER
    }
    before = counter_totals(metric_reader)["dedup.outbox.published"]
    relay = dedup.Relay(pool=pool, bootstrap_servers=bootstrap_servers, name=f"r-{output}")

    async def backlog_gauge() -> float | None:
        """What dedup.outbox.pending shows for this relay now."""
        found = {
            point.attributes["dedup.relay"]: point.value
            for name, _, point in points(metric_reader)
            if name == "dedup.outbox.pending"
        }
        return found.get(relay.name)

    async with relaying(relay):
        await helpers.wait_for(lambda: helpers.equal(pending(pool), 0), what="published")
        # The gauge shows the backlog the relay last saw: none, once it finds no more rows.
        await helpers.wait_for(lambda: helpers.equal(backlog_gauge(), 0), what="the gauge at 0")

    batches = [s for s in spans.get_finished_spans() if s.name == f"publish {relay.name}"]
    assert batches and {s.kind for s in batches} == {SpanKind.PRODUCER}
    linked = {link.context.trace_id for s in batches for link in s.links}
    assert len(linked) >= 1 and linked <= handlers, "each batch links to the handlers' traces"
    assert sum(s.attributes["messaging.batch.message_count"] for s in batches) == 9
    assert counter_totals(metric_reader)["dedup.outbox.published"] == before + 9


async def test_a_task_run_and_a_claim_publish_in_their_own_transactions(pool: Any) -> None:
    async def job(run: dedup.TaskRun) -> None:
        async with run.transaction() as conn:
            await run.publish(conn, "statements-sent", {"day": run.business_key})
            await run.complete(conn)

    runner = dedup.TaskRunner(pool=pool, holder="cron")
    await runner.run("statements", "2026-11-30", job)
    await runner.run("statements", "2026-11-30", job, force=True)  # an audited rerun
    record = dedup.Message(
        topic="payments", partition=0, offset=7, key=None, value=b'{"payment_id": "p1"}',
        headers={}, timestamp=0,
    )  # fmt: skip
    async with pool.acquire() as conn:
        async with conn.transaction():
            claimed = await dedup.claim(
                conn, [record], namespace="refunds", key=dedup.keys.json_field("payment_id")
            )
            await claimed.publish(conn, "refund-issued", b"p1", source=claimed.fresh[0])
        with contextlib.suppress(RuntimeError):
            async with conn.transaction():  # rolled back: its claim and its record go
                again = await dedup.claim(
                    conn, [record], namespace="chargebacks",
                    key=dedup.keys.json_field("payment_id"),
                )  # fmt: skip
                await again.publish(conn, "chargeback", b"p1", source=again.fresh[0])
                raise RuntimeError("the caller's write failed")

    rows = await outbox_rows(pool)
    assert [(r["key"], r["destination"], r["source"], r["token"]) for r in rows] == [
        ("task:statements:2026-11-30:1:0", "statements-sent", "task:statements:2026-11-30", 1),
        ("task:statements:2026-11-30:2:0", "statements-sent", "task:statements:2026-11-30", 2),
        ("refunds:p1:0", "refund-issued", "refunds:p1", 0),
    ]


async def test_publish_and_post_refuse_what_they_cannot_send_naming_it(pool: Any) -> None:
    msg = dedup.Message(
        topic="t", partition=0, offset=0, key=None, value=b"{}", headers={}, timestamp=0,
        idempotency_key="k",
    )  # fmt: skip
    async with pool.acquire() as conn, conn.transaction():
        batch = dedup.Tx(conn, 1, namespace="n")
        with pytest.raises(dedup.ConfigurationError, match="source=msg"):
            await batch.publish("out", b"v")
        tx = dedup.Tx(conn, 1, namespace="n", source=msg)
        with pytest.raises(dedup.ConfigurationError, match="not bytes, text or JSON"):
            await tx.publish("out", {1, 2})
        with pytest.raises(dedup.ConfigurationError, match="header name 'dedup-key'"):
            await tx.publish("out", b"v", headers={"dedup-key": b"mine"})
        with pytest.raises(dedup.ConfigurationError, match="topic must be a topic name"):
            await tx.publish("", b"v")
        with pytest.raises(dedup.ConfigurationError, match="payload is not JSON"):
            await tx.post("receiver", b"not json")
        with pytest.raises(dedup.ConfigurationError, match="destination must be"):
            await tx.post("", {"a": 1})
        with pytest.raises(dedup.ConfigurationError, match=r"source=msg"):
            await batch.post("receiver", {"a": 1})
    async with pool.acquire() as conn:
        with pytest.raises(dedup.ConfigurationError, match="inside the transaction"):
            await dedup.Tx(conn, 1, namespace="n", source=msg).publish("out", b"v")
    assert await outbox_rows(pool) == []
