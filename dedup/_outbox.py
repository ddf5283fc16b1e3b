"""The outbox: a message written in the transaction that decides it, sent after the COMMIT.

:func:`add` writes a row in the caller's transaction, under a key that names
what the message is once (the daily sweep's alert: ``reconcile:TASK:DATE``):
a second ``add`` of the same key writes nothing, so a sweep that runs twice
alerts once.  :func:`send` takes the pending rows no other sender holds
(``FOR UPDATE SKIP LOCKED``), POSTs each with the key as ``Idempotency-Key``
and marks it in the same transaction:

- a 2xx answer: ``sent``;
- another 4xx than 408 and 429: ``failed``, it will never be accepted;
- anything else (5xx, 408, 429, a timeout, no connection): still ``pending``,
  with the error, for the next :func:`send`.

A sender that dies between its POST and its COMMIT leaves the row pending and
the next send posts it again, with the same ``Idempotency-Key``: delivery is
at least once, and a receiver that keeps the keys it has handled acts once.
The transaction stays open while the POSTs are in flight (``post_timeout`` each):
the outbox carries a sweep's few alerts, not a stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import urllib.error
import urllib.request
from typing import Any

import asyncpg
import orjson

from dedup.data import _sql as sql

log = logging.getLogger("dedup.outbox")

HTTP = "http"
"""The sink that POSTs a row's payload, as JSON, to the URL in its destination."""
RETRIED = frozenset({408, 429})
"""4xx answers that say "later", not "never"."""


@dataclasses.dataclass(frozen=True)
class Sent:
    """What one :func:`send` did with one row."""

    key: str
    destination: str
    status: str
    """``sent``, ``failed`` or ``pending`` (to be tried again)."""
    error: str | None = None

    def line(self) -> str:
        return f"alert {self.key}: {self.status}" + (f" ({self.error})" if self.error else "")


async def add(
    conn: asyncpg.Connection,
    schema: str,
    *,
    key: str,
    destination: str,
    payload: dict[str, Any],
    sink: str = HTTP,
) -> bool:
    """Write a message in ``conn``'s transaction; False when ``key`` was written before."""
    added = await sql.Queries(schema).outbox_add.fetchval(
        conn,
        key=key,
        sink=sink,
        destination=destination,
        payload=orjson.dumps(payload).decode(),
    )
    return added is not None


async def send(
    conn: asyncpg.Connection, schema: str, *, limit: int = 100, post_timeout: float = 10.0
) -> list[Sent]:
    """Send up to ``limit`` pending rows, oldest first, and mark each; what happened to each."""
    q = sql.Queries(schema)
    done = []
    async with conn.transaction():
        for row in await q.outbox_due.fetch(conn, limit=limit):
            found = await asyncio.to_thread(
                _post, row["destination"], row["key"], row["payload"].encode(), post_timeout
            )
            sent = Sent(row["key"], row["destination"], *found)
            await q.outbox_mark.execute(conn, id=row["id"], status=sent.status, error=sent.error)
            if sent.error:
                log.warning("outbox %s to %s: %s (%s)", sent.key, sent.destination, *found)
            done.append(sent)
    return done


def _post(url: str, key: str, body: bytes, timeout: float) -> tuple[str, str | None]:
    """POST ``body`` as JSON; (status, error) for the row (blocking: run it in a thread)."""
    request = urllib.request.Request(  # noqa: S310 - the URL is the operator's configuration
        url,
        data=body,
        headers={"Content-Type": "application/json", "Idempotency-Key": key},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            response.read()
            return "sent", None
    except urllib.error.HTTPError as exc:
        exc.read()
        if 400 <= exc.code < 500 and exc.code not in RETRIED:
            return "failed", f"HTTP {exc.code}: never accepted"
        return "pending", f"HTTP {exc.code}"
    except urllib.error.URLError as exc:  # no connection, no such host
        return "pending", str(exc.reason)
    except (OSError, ValueError) as exc:  # a timeout, a URL urllib can't use
        return "pending", f"{type(exc).__name__}: {exc}"
