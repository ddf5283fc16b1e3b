"""Every snippet of docs/howto/outbox.md runs, in page order, on the docs' database.

Sections 1-4: the page's handler publishes through a real consumer, its relay
command publishes to Kafka until SIGTERM, its downstream consumer applies each
record once, and its query shows the rows sent.  Section 5: the handler posts
real outbox rows; the claim query is dedup's own and claims them; the
dispatcher command delivers them to a receiver; the receiver recipe refuses a
lower token and ignores repeats; the operator's queries show what the page says
they show.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from dedup_services import notifications, receiver, service

import dedup
from dedup.data import _sql as sql
from dedup_dev import docs as docs_support
from dedup_dev import effects, helpers
from dedup_dev import kafka as kafka_support
from dedup_dev import service_process as service_support
from dedup_dev.kafka import Topics
from dedup_dev.services import ROOT

PAGE = ROOT / "docs" / "howto" / "outbox.md"

# This page runs on the run's one docs database, after the pages before it (tests/conftest.py).
pytestmark = pytest.mark.docs_page


def message(nid: str) -> dedup.Message:
    body = {"notification_id": nid, "recipient": f"{nid}@example.com", "template": "paid"}
    return dedup.Message(
        topic="notifications",
        partition=0,
        offset=0,
        key=None,
        value=orjson.dumps(body),
        headers={},
        timestamp=0,
        idempotency_key=nid,
    )


def squeeze(sql: str) -> str:
    return re.sub(r"\s+", " ", sql).strip()


KAFKA_SECTIONS = 5
"""The page's first five snippets are its Kafka sections (1-4); the rest, section 5's."""


async def test_the_kafka_sections_publish_relay_and_apply_once(
    dsn: str, bootstrap_servers: str, pool: Any, topics: Topics
) -> None:
    blocks = docs_support.snippets(PAGE)[:KAFKA_SECTIONS]
    assert [lang for lang, _ in blocks] == ["sql", "python", "sh", "python", "sql"]
    tables, handler_code, relay_command, ledger_code, state = (body for _, body in blocks)
    source, output = await topics.create(partitions=2), await topics.create(partitions=2)
    await pool.execute(tables)
    # 1. The handler, on 8 payments sent with copies.
    namespace: dict[str, Any] = {}
    exec(handler_code.replace('"payment-applied"', repr(output)), namespace)  # noqa: S102
    payments = [
        orjson.dumps({"payment_id": f"p{i}", "account": ("acme", "globex")[i % 2], "amount": 10})
        for i in range(8)
    ]
    await helpers.produce(bootstrap_servers, source, [(None, p) for p in payments + payments[:3]])
    consumer = dedup.IdempotentConsumer(
        namespace["apply_payment"], topics=[source], group_id=f"g-{source}",
        bootstrap_servers=bootstrap_servers, pool=pool, namespace="balances",
        key=dedup.keys.json_field("payment_id"), auto_offset_reset="earliest",
        install_signal_handlers=False,
    )  # fmt: skip
    async with effects.running(consumer):
        await helpers.wait_for(lambda: effects.handled(consumer, 11), what="the payments")
    assert await pool.fetchval("SELECT sum(balance) FROM balances") == 2000 - 80

    # 2. The relay command, until SIGTERM.
    assert "--bootstrap-servers 127.0.0.1:9092" in relay_command
    command = relay_command.strip().replace("127.0.0.1:9092", bootstrap_servers)
    env = {
        **service_support.environment(dsn),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    async with service_support.child("exec " + command, env=env, via_shell=True) as relay:
        await helpers.wait_for(lambda: kafka_sent(pool, 8), what="the records published")
        assert await relay.stop() == 0, await relay.stderr()
    published = await kafka_support.read_topic(bootstrap_servers, output, read_committed=True)
    assert sorted(dict(r.headers)["dedup-key"] for r in published) == sorted(
        f"balances:p{i}:0".encode() for i in range(8)
    )

    # 3. Downstream, keyed by dedup-key: once per payment.
    code = ledger_code.replace('["payment-applied"]', repr([output]))
    code = code.replace('"payment-ledger"', repr(f"ledger-{output}")).replace(
        "127.0.0.1:9092", bootstrap_servers
    )
    code = code.replace('"postgresql://postgres@127.0.0.1:5432/postgres"', repr(dsn))
    exec(code, {"dedup": dedup}, namespace)  # noqa: S102
    ledger = namespace["ledger"]
    async with effects.running(ledger):
        await helpers.wait_for(lambda: effects.handled(ledger, 8), what="the ledger")
    rows = await pool.fetch("SELECT payment_id FROM payment_ledger")
    assert sorted(r["payment_id"] for r in rows) == [f"p{i}" for i in range(8)]

    # 4. What you see.
    [(status, records, _)] = [tuple(r) for r in await pool.fetch(state)]
    assert (status, records) == ("sent", 8)


async def kafka_sent(pool: Any, n: int) -> bool:
    return bool(
        await pool.fetchval(
            "SELECT count(*) = $1 FROM dedup.outbox WHERE sink = 'kafka' AND status = 'sent'", n
        )
    )


async def test_every_snippet_of_the_outbox_howto_works(dsn: str, pool: Any) -> None:
    blocks = docs_support.snippets(PAGE)[KAFKA_SECTIONS:]
    assert [lang for lang, _ in blocks] == ["python", "sql", "sh", "sql", "python", "sql", "sql"]
    handler_code, claim, dispatch, table, accept_code, outbox_state, receiver_state = (
        body for _, body in blocks
    )
    await notifications.SERVICE.migrate(pool)
    await service.migrate(pool, ("receiver",), schema=None)
    # The notifications service's tables: the bundled services' page may have sent one before.
    by_status, unsent = (q for q in outbox_state.split(";") if q.strip())
    before = {r["status"]: r["notifications"] for r in await pool.fetch(by_status)}

    # 1. The handler: one outbox row per key, under the batch's token.
    namespace: dict[str, Any] = {}
    exec(handler_code, namespace)  # noqa: S102 (the page's own code)
    async with pool.acquire() as conn:
        for nid in ("n1", "n2", "n3", "n1"):
            async with conn.transaction():
                tx = dedup.Tx(conn, 7, namespace="notifications", source=message(nid))
                await namespace["write"](message(nid), tx)
    rows = await pool.fetch(f"SELECT key, token, status {NOTIFICATIONS} AND key = ANY($1)", OURS)
    assert sorted(tuple(r) for r in rows) == [(key_of(f"n{i}"), 7, "pending") for i in (1, 2, 3)]

    # 2. The claim query is the dispatcher's; it claims each row once.
    assert squeeze(claim) == squeeze(uncommented(sql._texts()["outbox_http_claim"]))
    claim_query = sql.Queries().outbox_http_claim
    due = {"holder": "doc", "destinations": ["notifications"], "limit": 10, "ttl": 30.0}
    claimed = await claim_query.fetch(pool, **due)
    assert sorted((r["key"], r["claim_token"]) for r in claimed) == [
        (key_of("n1"), 1),
        (key_of("n2"), 1),
        (key_of("n3"), 1),
    ]
    assert await claim_query.fetch(pool, **due) == [], "claimed rows are not due"
    # That claimer "died": its claims run out.
    await pool.execute("UPDATE dedup.outbox SET claimed_until = now() - interval '1s'")

    # 3. The dispatcher command delivers them, under the next claim token.
    async with receiver.Receiver(pool) as downstream:
        url = "http://127.0.0.1:8080/notifications"
        assert url in dispatch
        env = {
            **service_support.environment(dsn),
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        }
        command = "exec " + dispatch.strip().replace(url, downstream.url)
        async with service_support.child(command, env=env, via_shell=True) as dispatcher:
            await helpers.wait_for(lambda: sent(pool, 3), what="the outbox sent")
            assert await dispatcher.stop() == 0, await dispatcher.stderr()
    delivered = await pool.fetch(
        "SELECT idempotency_key, first_token FROM receiver.notifications"
        " WHERE idempotency_key = ANY($1)",
        OURS,
    )
    assert sorted(tuple(r) for r in delivered) == [(key_of(f"n{i}"), 2) for i in (1, 2, 3)]

    # 4. The receiver recipe.
    await pool.execute(table)
    exec(accept_code, namespace)  # noqa: S102
    accept = namespace["accept"]
    async with pool.acquire() as conn:
        answers = [await accept(conn, "k", token, '{"n": 1}') for token in (2, 1, 2, 3, 2)]
    assert answers == [201, 409, 200, 200, 409]
    assert tuple(await pool.fetchrow("SELECT token, payload FROM received")) == (3, {"n": 1})

    # 5. What you see: one more notification, not sent yet.
    async with pool.acquire() as conn, conn.transaction():
        tx = dedup.Tx(conn, 8, namespace="notifications", source=message("n4"))
        await namespace["write"](message("n4"), tx)
    assert [tuple(r) for r in await pool.fetch(by_status)] == [
        ("pending", 1, 0),
        ("sent", 3 + before.get("sent", 0), 2),
    ]
    assert [(r["key"], r["status"]) for r in await pool.fetch(unsent)] == [
        (key_of("n4"), "pending")
    ]
    receipts = [r for r in await pool.fetch(receiver_state) if r["idempotency_key"] in OURS]
    assert sorted((r["idempotency_key"], r["repeats"], r["stale"]) for r in receipts) == [
        (key_of(f"n{i}"), 0, 0) for i in (1, 2, 3)
    ]


NOTIFICATIONS = "FROM dedup.outbox WHERE destination = 'notifications'"


def key_of(nid: str) -> str:
    return f"notifications:{nid}:0"


OURS = [key_of(f"n{i}") for i in range(1, 5)]
"""This test's notifications' row keys."""


def uncommented(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))


async def sent(pool: Any, n: int) -> bool:
    return bool(
        await pool.fetchval(
            f"SELECT count(*) = $1 {NOTIFICATIONS} AND status = 'sent' AND key = ANY($2)", n, OURS
        )
    )
