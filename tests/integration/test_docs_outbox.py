"""Every snippet of docs/howto/outbox.md runs, in page order, against a fresh database.

The handler writes real outbox rows; the claim query is the dispatcher's own
and claims them; the dispatcher command delivers them to a receiver; the
receiver recipe refuses a lower token and ignores repeats; the operator's
queries show what the page says they show.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import orjson
from dedup_services import notifications, outbox, receiver, service

import dedup
from dedup_dev import docs as docs_support
from dedup_dev import helpers
from dedup_dev import service_process as service_support
from dedup_dev.services import ROOT

PAGE = ROOT / "docs" / "howto" / "outbox.md"


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


async def test_every_snippet_of_the_outbox_howto_works(dsn: str, pool: Any) -> None:
    blocks = docs_support.snippets(PAGE)
    assert [lang for lang, _ in blocks] == ["python", "sql", "sh", "sql", "python", "sql", "sql"]
    handler_code, claim, dispatch, table, accept_code, outbox_state, receiver_state = (
        body for _, body in blocks
    )
    await notifications.SERVICE.migrate(pool)
    await service.migrate(pool, ("receiver",), schema=None)

    # 1. The handler: one outbox row per key, under the batch's token.
    namespace: dict[str, Any] = {}
    exec(handler_code, namespace)  # noqa: S102 (the page's own code)
    async with pool.acquire() as conn:
        for nid in ("n1", "n2", "n3", "n1"):
            async with conn.transaction():
                await namespace["write"](message(nid), dedup.Tx(conn, 7))
    rows = await pool.fetch(
        "SELECT idempotency_key, source_token, status FROM notifications.outbox"
    )
    assert sorted(tuple(r) for r in rows) == [(f"n{i}", 7, "pending") for i in (1, 2, 3)]

    # 2. The claim query is the dispatcher's; it claims each row once.
    assert squeeze(claim) == squeeze(outbox.CLAIM)
    claimed = await pool.fetch(claim, "doc", 10, 30.0)
    assert sorted((r["idempotency_key"], r["claim_token"]) for r in claimed) == [
        ("n1", 1),
        ("n2", 1),
        ("n3", 1),
    ]
    assert await pool.fetch(claim, "doc", 10, 30.0) == [], "claimed rows are not due"
    # That claimer "died": its claims run out.
    await pool.execute("UPDATE notifications.outbox SET claimed_until = now() - interval '1s'")

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
    delivered = await pool.fetch("SELECT idempotency_key, first_token FROM receiver.notifications")
    assert sorted(tuple(r) for r in delivered) == [("n1", 2), ("n2", 2), ("n3", 2)]

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
        await namespace["write"](message("n4"), dedup.Tx(conn, 8))
    by_status, unsent = (q for q in outbox_state.split(";") if q.strip())
    assert [tuple(r) for r in await pool.fetch(by_status)] == [("pending", 1, 0), ("sent", 3, 2)]
    assert [(r["idempotency_key"], r["status"]) for r in await pool.fetch(unsent)] == [
        ("n4", "pending")
    ]
    receipts = await pool.fetch(receiver_state)
    assert sorted((r["idempotency_key"], r["repeats"], r["stale"]) for r in receipts) == [
        ("n1", 0, 0),
        ("n2", 0, 0),
        ("n3", 0, 0),
    ]


async def sent(pool: Any, n: int) -> bool:
    return bool(
        await pool.fetchval(
            "SELECT count(*) = $1 FROM notifications.outbox WHERE status = 'sent'", n
        )
    )
