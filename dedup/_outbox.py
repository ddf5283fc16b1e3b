"""The outbox: a message written in the transaction that decides it, sent after the COMMIT.

:func:`add` writes a row in the caller's transaction, under a key that names
what the message is once (the daily sweep's alert: ``reconcile:TASK:DATE``):
a second ``add`` of the same key writes nothing, so a sweep that runs twice
alerts once.  :func:`send` takes the pending rows no other sender holds
(``FOR UPDATE SKIP LOCKED``), POSTs each with the key as ``Idempotency-Key``
and marks it in the same transaction:

- a 2xx answer: ``sent``;
- another 4xx than 408, 425 and 429: ``failed``, it will never be accepted;
- anything else (5xx, 408, 425, 429, a timeout, no connection): still ``pending``,
  with the error, for the next :func:`send`.

A sender that dies between its POST and its COMMIT leaves the row pending and
the next send posts it again, with the same ``Idempotency-Key``: delivery is
at least once, and a receiver that keeps the keys it has handled acts once.
The transaction stays open while the POSTs are in flight (``post_timeout`` each):
the HTTP sink carries a sweep's few alerts, not a stream.

The Kafka sink carries the stream.  :func:`publish` writes a record (topic,
key, value, headers) in the transaction that applies its source, under a row
key named after that source (``tx.publish`` in a handler, ``run.publish`` in
a task, ``ClaimResult.publish`` after :func:`dedup.claim`); the relay
(:mod:`dedup._relay`) publishes the pending records in ``id`` order with the
row key as the ``dedup-key`` header and the source's fencing token as
``dedup-token``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import logging
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from typing import Any

import asyncpg
import orjson
from opentelemetry import propagate

from dedup import _errors as errors
from dedup.data import _sql as sql

log = logging.getLogger("dedup.outbox")

HTTP = "http"
"""The sink that POSTs a row's payload, as JSON, to the URL in its destination."""
KAFKA = "kafka"
"""The sink the relay publishes: a Kafka record to the topic in its destination."""
KEY_HEADER = "dedup-key"
"""The header that carries a published record's row key: a downstream consumer's
``keys.header("dedup-key")`` applies it once however often the relay sends it."""
TOKEN_HEADER = "dedup-token"  # noqa: S105 - a header name, not a secret
"""The header that carries the fencing token its source was applied under."""
Headers = Mapping[str, bytes | str | None] | Iterable[tuple[str, bytes | str | None]]
RETRIED = frozenset({408, 425, 429})
"""4xx answers that say "later", not "never" (every HTTP sender of the outbox)."""


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
    conn: asyncpg.Connection,
    schema: str,
    urls: list[str],
    *,
    limit: int = 100,
    post_timeout: float = 10.0,
) -> list[Sent]:
    """POST up to ``limit`` pending rows whose destination is one of ``urls``, oldest first,
    and mark each; what happened to each."""
    q = sql.Queries(schema)
    done = []
    async with conn.transaction():
        for row in await q.outbox_due.fetch(conn, destinations=urls, limit=limit):
            found = await asyncio.to_thread(
                _post, row["destination"], row["key"], row["payload"].encode(), post_timeout
            )
            sent = Sent(row["key"], row["destination"], *found)
            await q.outbox_mark.execute(conn, id=row["id"], status=sent.status, error=sent.error)
            if sent.error:
                log.warning("outbox %s to %s: %s (%s)", sent.key, sent.destination, *found)
            done.append(sent)
    return done


def http_post(url: str, body: bytes, headers: dict[str, str], timeout: float) -> int:
    """POST ``body``; the HTTP status (blocking: run it in a thread).  No connection, a
    timeout, a URL urllib can't use: ``OSError`` (``URLError``), ``ValueError``."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")  # noqa: S310
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        return int(exc.code)


def _post(url: str, key: str, body: bytes, timeout: float) -> tuple[str, str | None]:
    """POST ``body`` as JSON; (status, error) for the row (blocking: run it in a thread)."""
    headers = {"Content-Type": "application/json", "Idempotency-Key": key}
    try:
        code = http_post(url, body, headers, timeout)
    except urllib.error.URLError as exc:  # no connection, no such host
        return "pending", str(exc.reason)
    except (OSError, ValueError, http.client.HTTPException) as exc:  # a timeout, a bad URL
        return "pending", f"{type(exc).__name__}: {exc}"
    if 200 <= code < 300:
        return "sent", None
    if 400 <= code < 500 and code not in RETRIED:
        return "failed", f"HTTP {code}: never accepted"
    return "pending", f"HTTP {code}"


async def publish(
    conn: asyncpg.Connection,
    schema: str,
    *,
    row_key: str,
    topic: str,
    value: Any,
    key: bytes | str | None,
    headers: Headers | None,
    source: str,
    token: int,
) -> str:
    """Write a Kafka record to the outbox in ``conn``'s transaction; returns ``row_key``.

    ``value`` is bytes, text (UTF-8) or anything else orjson encodes (a
    dict, a list), or None for a tombstone.  The current trace context goes
    into the headers, so the downstream consumer's span links to the handler's.
    """
    if not isinstance(topic, str) or not topic:
        raise errors.ConfigurationError(f"publish: topic must be a topic name, not {topic!r}")
    if not conn.is_in_transaction():
        raise errors.ConfigurationError(
            "publish must run inside the transaction that applies its source"
        )
    names, values = _headers(headers)
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    for name, text in carrier.items():
        names.append(name)
        values.append(text.encode())
    await sql.Queries(schema).outbox_publish.fetchval(
        conn,
        key=row_key,
        topic=topic,
        message_key=as_bytes(key, "publish: key"),
        value=encode(value, "publish: value"),
        header_names=names,
        header_values=values,
        source=source,
        token=token,
    )
    return row_key


def encode(value: Any, what: str) -> bytes | None:
    """``value`` as a record's bytes: bytes as they are, text as UTF-8, None as None (a
    tombstone), anything else as JSON (orjson); ``what`` names it in the error (``publish:
    value``).  Also :func:`dedup.testing.record`'s."""
    if value is None or isinstance(value, bytes | bytearray | memoryview | str):
        return as_bytes(value, what)
    try:
        return orjson.dumps(value)
    except TypeError as exc:
        raise errors.ConfigurationError(
            f"{what} {value!r:.80} is not bytes, text or JSON ({exc})"
        ) from None


def as_bytes(value: bytes | bytearray | memoryview | str | None, what: str) -> bytes | None:
    """``value`` (bytes, or text as UTF-8; None as None) as bytes; ``what`` names it in the
    error (``publish: key``)."""
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise errors.ConfigurationError(f"{what} must be bytes or text, not {value!r:.80}")


def _headers(headers: Headers | None) -> tuple[list[str], list[bytes | None]]:
    pairs = headers.items() if isinstance(headers, Mapping) else (headers or ())
    names: list[str] = []
    values: list[bytes | None] = []
    for pair in pairs:
        name, value = pair
        if not isinstance(name, str) or name.lower() in (KEY_HEADER, TOKEN_HEADER):
            raise errors.ConfigurationError(
                f"publish: header name {name!r}: a text other than {KEY_HEADER} and "
                f"{TOKEN_HEADER}, which the relay sets"
            )
        names.append(name)
        values.append(as_bytes(value, f"publish: header {name!r}"))
    return names, values


async def post(
    conn: asyncpg.Connection,
    schema: str,
    *,
    row_key: str,
    destination: str,
    payload: Any,
    source: str,
    token: int,
) -> str:
    """Write an HTTP message for the dispatchers of ``destination``, in ``conn``'s transaction.

    ``payload`` is what is POSTed: anything orjson encodes (a dict, a list),
    or JSON as text or bytes.  Returns ``row_key``, the ``Idempotency-Key``.
    """
    if not isinstance(destination, str) or not destination:
        raise errors.ConfigurationError(
            f"post: destination must be a dispatcher's destination name, not {destination!r}"
        )
    if not conn.is_in_transaction():
        raise errors.ConfigurationError(
            "post must run inside the transaction that applies its source"
        )
    if isinstance(payload, bytes | bytearray | memoryview | str):
        text = bytes(payload).decode() if not isinstance(payload, str) else payload
        try:
            orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise errors.ConfigurationError(f"post: payload is not JSON ({exc})") from None
    else:
        try:
            text = orjson.dumps(payload).decode()
        except TypeError as exc:
            raise errors.ConfigurationError(
                f"post: payload {payload!r:.80} is not JSON ({exc})"
            ) from None
    await sql.Queries(schema).outbox_post.fetchval(
        conn, key=row_key, destination=destination, payload=text, source=source, token=token
    )
    return row_key
