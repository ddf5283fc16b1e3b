"""dedup_services.payments on real Kafka and Postgres: each payment deducts once, or is rejected.

In process for the duplicates, the replays and the fence; once as
``dedup run dedup_services.payments`` with the console span exporter.
"""

from __future__ import annotations

import signal
from typing import Any

import orjson
import pytest
from dedup_services import payments

import dedup
from dedup_dev import effects as consumer_support
from dedup_dev import helpers
from dedup_dev import service_process as service_support
from dedup_dev.kafka import Topics

DAY = "2026-11-30"


def payment(pid: str, account: str, amount: int) -> dict[str, Any]:
    return {"payment_id": pid, "account": account, "amount": amount, "date": DAY}


STREAM = [
    payment("p1", "acc-1", 300),
    payment("p2", "acc-1", 200),
    payment("p3", "acc-2", 150),  # more than acc-2 has: rejected
    payment("p4", "acc-2", 60),
    payment("p5", "acc-9", 10),  # no such account: rejected
    payment("p6", "acc-1", -5),  # not positive: rejected
]


async def open_accounts(pool: Any, **balances: int) -> None:
    await payments.SERVICE.migrate(pool)
    await pool.executemany(
        "INSERT INTO payments.accounts (account, balance) VALUES ($1, $2)",
        [(account.replace("_", "-"), balance) for account, balance in balances.items()],
    )


async def balances(pool: Any) -> dict[str, int]:
    rows = await pool.fetch("SELECT account, balance FROM payments.accounts")
    return {r["account"]: r["balance"] for r in rows}


async def test_duplicates_and_replays_deduct_each_payment_once(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create(partitions=2)
    await open_accounts(pool, acc_1=1000, acc_2=100)
    sent = await service_support.produce_events(
        bootstrap_servers, topic, [*STREAM, *STREAM[:3], STREAM[0]], key="account"
    )
    consumer = payments.SERVICE.consumer(
        topic=topic, bootstrap_servers=bootstrap_servers, pool=pool, install_signal_handlers=False
    )
    async with consumer_support.running(consumer):
        await helpers.wait_for(lambda: service_support.handled(consumer, sent), what="all sent")
        # The producer replays the whole stream.
        sent += await service_support.produce_events(
            bootstrap_servers, topic, STREAM, key="account"
        )
        await helpers.wait_for(lambda: service_support.handled(consumer, sent), what="replay")
    # A new deployment under another group reads the topic again from the start.
    again = payments.SERVICE.consumer(
        topic=topic,
        bootstrap_servers=bootstrap_servers,
        pool=pool,
        group_id=f"new-{topic}",
        install_signal_handlers=False,
    )
    async with consumer_support.running(again):
        await helpers.wait_for(lambda: service_support.handled(again, sent), what="a re-read")

    assert consumer.stats["processed"] == len(STREAM)
    assert consumer.stats["duplicates"] == sent - len(STREAM)
    assert (again.stats["processed"], again.stats["duplicates"]) == (0, sent)
    assert await balances(pool) == {"acc-1": 500, "acc-2": 40}
    decided = await pool.fetch(
        "SELECT payment_id, status, reason, balance_after FROM payments.payments"
        " ORDER BY payment_id"
    )
    assert [tuple(r) for r in decided] == [
        ("p1", "applied", None, 700),
        ("p2", "applied", None, 500),
        ("p3", "rejected", "insufficient funds: balance 100 < amount 150", 100),
        ("p4", "applied", None, 40),
        ("p5", "rejected", "unknown account", None),
        ("p6", "rejected", "amount must be positive", None),
    ]
    postings = await pool.fetch(
        "SELECT payment_id, count(*) AS n, sum(amount) AS amount FROM payments.postings"
        " GROUP BY payment_id ORDER BY payment_id"
    )
    assert [tuple(r) for r in postings] == [("p1", 1, 300), ("p2", 1, 200), ("p4", 1, 60)]
    # Rejections are outcomes, not errors: nothing was retried or dead-lettered.
    assert consumer.stats["dead_lettered"] == consumer.stats["retries"] == 0
    assert await pool.fetchval("SELECT count(*) FROM dedup.dead_letters") == 0
    report = await dedup.reconcile(pool, payments.RECONCILE, DAY)
    assert report.ok and (report.result.rows, report.result.total) == (3, 560)


def message(pid: str, account: str, amount: int, partition: int) -> dedup.Message:
    return dedup.Message(
        topic="payments",
        partition=partition,
        offset=0,
        key=account.encode(),
        value=orjson.dumps(payment(pid, account, amount)),
        headers={},
        timestamp=0,
        idempotency_key=pid,
    )


async def test_a_deduction_under_an_older_token_of_the_partition_is_refused(pool: Any) -> None:
    await open_accounts(pool, acc_1=1000)
    handler = payments.Deductions("g")
    async with pool.acquire() as conn:
        async with conn.transaction():
            await handler(message("p1", "acc-1", 100, partition=0), dedup.Tx(conn, 5))
        # Token 4 of the same partition lease: a paused, superseded owner.
        with pytest.raises(dedup.StaleTokenError, match="fencing token 5 of g:payments:0"):
            async with conn.transaction():
                await handler(message("p2", "acc-1", 100, partition=0), dedup.Tx(conn, 4))
        # Token 1 of another partition's lease is not comparable; its own lease guards it.
        async with conn.transaction():
            await handler(message("p3", "acc-1", 30, partition=1), dedup.Tx(conn, 1))
    assert await balances(pool) == {"acc-1": 870}
    rows = await pool.fetch("SELECT payment_id FROM payments.payments ORDER BY payment_id")
    assert [r["payment_id"] for r in rows] == ["p1", "p3"]
    fence = await pool.fetchrow("SELECT fence_resource, fence_token FROM payments.accounts")
    assert tuple(fence) == ("g:payments:1", 1)


async def test_a_malformed_payment_is_dead_lettered_and_the_partition_moves_on(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create()
    await open_accounts(pool, acc_1=100)
    records = [
        (b"acc-1", orjson.dumps({"payment_id": "bad", "account": "acc-1", "amount": "ten"})),
        (b"acc-1", orjson.dumps(payment("ok", "acc-1", 10))),
    ]
    await helpers.produce(bootstrap_servers, topic, records)
    consumer = payments.SERVICE.consumer(
        topic=topic,
        bootstrap_servers=bootstrap_servers,
        pool=pool,
        install_signal_handlers=False,
        max_attempts=1,
    )
    async with consumer_support.running(consumer):
        await helpers.wait_for(lambda: service_support.handled(consumer, 2), what="2 messages")
    letter = await pool.fetchrow("SELECT idempotency_key, error FROM dedup.dead_letters")
    assert letter["idempotency_key"] == "bad"
    assert "amount must be an integer" in letter["error"]
    assert await balances(pool) == {"acc-1": 90}


async def test_dedup_run_consumers_payments(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    topic = await topics.create()
    env = service_support.environment(
        dsn,
        bootstrap_servers,
        PAYMENTS_TOPIC=topic,
        OTEL_TRACES_EXPORTER="console",
        OTEL_SERVICE_NAME="payments-under-test",
    )
    async with service_support.child("run", "dedup_services.payments", env=env) as service:
        # It applies its migration at start; then the account can be opened.
        await helpers.wait_for(
            lambda: pool.fetchval("SELECT to_regclass('payments.accounts') IS NOT NULL"),
            what="the payments migration",
        )
        await pool.execute("INSERT INTO payments.accounts VALUES ('acc-1', 100)")
        events = [payment("c1", "acc-1", 30)] * 3 + [payment("c2", "acc-1", 80)]
        await service_support.produce_events(bootstrap_servers, topic, events, key="account")
        await helpers.wait_for(
            lambda: pool.fetchval("SELECT count(*) = 2 FROM payments.payments"),
            what="both payments decided",
        )
        assert await service.stop(signal.SIGTERM) == 0, await service.stderr()
    assert await balances(pool) == {"acc-1": 70}
    assert await pool.fetchval("SELECT status FROM payments.payments WHERE payment_id = 'c2'") == (
        "rejected"
    )
    # The SDK was installed from OTEL_*: the consumer's spans went to the console.
    assert f'"name": "process {topic}"' in service.stdout
    assert '"service.name": "payments-under-test"' in service.stdout
    applied = await pool.fetchval(
        "SELECT count(*) FROM dedup.migrations WHERE component = 'payments'"
    )
    assert applied == 1


async def test_dedup_run_help_names_flags_and_variables() -> None:
    code, out, _ = await service_support.run(
        "run", "dedup_services.payments", "--help", env=service_support.environment("")
    )
    assert code == 0
    for text in ("--topic", "$PAYMENTS_TOPIC", "$KAFKA_BOOTSTRAP_SERVERS", "OTEL_TRACES_EXPORTER"):
        assert text in out
