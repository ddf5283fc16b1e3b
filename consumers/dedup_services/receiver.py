"""receiver: a downstream HTTP service that takes each notification once.

A stand-in for the system an outbox delivers to (an e-mail or push gateway),
small enough to read: asyncio and the standard library, state in its own
Postgres schema (``receiver``).  ``POST /notifications`` with the headers

- ``Idempotency-Key``: the notification's key, handled once, ever;
- ``X-Fencing-Token``: the sender's fencing token; the receiver keeps the
  highest it has seen for the key and refuses a lower one;

answers 201 (delivered: a ``receiver.notifications`` row), 200 (a repeat of a
handled key with a token not lower: ignored), 409 (a token lower than one seen
for the key: refused, the sender is stale) or 400.  Every request is logged in
``receiver.requests``.  ``GET /health`` answers 200.

``--fail-first N`` answers 503 to the first N requests of each key, to watch a
dispatcher retry with backoff.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import sys
from typing import Any

import asyncpg
import orjson
from opentelemetry import propagate, trace

from dedup_services import service

log = logging.getLogger(__name__)
tracer = trace.get_tracer("dedup_services.receiver")

PATH = "/notifications"
MAX_BODY = 1 << 20
REASONS = {
    200: "OK",
    201: "Created",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    413: "Payload Too Large",
    503: "Service Unavailable",
}

DELIVER = """
INSERT INTO receiver.notifications (idempotency_key, recipient, payload, first_token, last_token)
VALUES ($1, $2, $3::text::jsonb, $4, $4)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING true
"""
HIGHEST_SEEN = """
SELECT last_token FROM receiver.notifications WHERE idempotency_key = $1 FOR UPDATE
"""
REPEAT = """
UPDATE receiver.notifications SET repeats = repeats + 1, last_token = $2
 WHERE idempotency_key = $1
"""
STALE = "UPDATE receiver.notifications SET stale = stale + 1 WHERE idempotency_key = $1"
LOG = """
INSERT INTO receiver.requests (idempotency_key, token, status, outcome) VALUES ($1, $2, $3, $4)
"""


class Receiver:
    """The HTTP server and its rules (see the module docstring)."""

    def __init__(self, pool: Any, *, fail_first: int = 0) -> None:
        self.pool = pool
        """asyncpg pool on the receiver's database."""
        self.fail_first = fail_first
        """Answer 503 to this many requests of each key before handling it."""
        self.url = ""
        """Where notifications go, once started."""
        self._failed: collections.Counter[str] = collections.Counter()
        self._server: asyncio.Server | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host:port`` (0: any free port); return the notifications URL."""
        self._server = await asyncio.start_server(self._serve, host, port)
        bound_host, bound_port = self._server.sockets[0].getsockname()[:2]
        self.url = f"http://{bound_host}:{bound_port}{PATH}"
        return self.url

    async def close(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> Receiver:
        if self._server is None:
            await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def deliver(self, key: str, token: int, body: bytes) -> tuple[int, str]:
        """Handle one notification: (HTTP status, outcome)."""
        try:
            notification = orjson.loads(body)
        except orjson.JSONDecodeError:
            return await self._log(key, token, 400, "invalid JSON")
        if not isinstance(notification, dict):
            return await self._log(key, token, 400, "not a JSON object")
        if self._failed[key] < self.fail_first:
            self._failed[key] += 1
            return await self._log(key, token, 503, "unavailable")
        recipient = notification.get("recipient")
        recipient = recipient if isinstance(recipient, str) else None
        async with self.pool.acquire() as conn, conn.transaction():
            if await conn.fetchval(DELIVER, key, recipient, body.decode(), token):
                status, outcome = 201, "delivered"
            elif token < (last := await conn.fetchval(HIGHEST_SEEN, key)):
                await conn.execute(STALE, key)
                status, outcome = 409, f"stale: token {token} < {last}"
            else:
                await conn.execute(REPEAT, key, token)
                status, outcome = 200, "duplicate"
            await conn.execute(LOG, key, token, status, outcome)
        log.info("%s (token %s): %s", key, token, outcome)
        return status, outcome

    async def _log(
        self, key: str | None, token: int | None, status: int, outcome: str
    ) -> tuple[int, str]:
        await self.pool.execute(LOG, key, token, status, outcome)
        return status, outcome

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            status, outcome = await asyncio.wait_for(self._request(reader), 30)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            status, outcome = 400, "incomplete request"
        except ValueError as exc:  # a bad Content-Length, a body that is not UTF-8
            status, outcome = 400, f"bad request: {exc}"
        except (OSError, asyncpg.PostgresError) as exc:
            log.warning("request failed: %r", exc)
            status, outcome = 503, f"{type(exc).__name__}"
        answer = orjson.dumps({"outcome": outcome})
        head = (
            f"HTTP/1.1 {status} {REASONS.get(status, '')}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(answer)}\r\nConnection: close\r\n\r\n"
        )
        with contextlib.suppress(OSError):
            writer.write(head.encode("latin-1") + answer)
            await writer.drain()
            writer.close()
            await writer.wait_closed()

    async def _request(self, reader: asyncio.StreamReader) -> tuple[int, str]:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        request_line, *lines = head.split("\r\n")
        method, _, rest = request_line.partition(" ")
        target = rest.partition(" ")[0]
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if target == "/health":
            return 200, "ok"
        if target != PATH:
            return 404, f"no {target}; POST {PATH}"
        if method != "POST":
            return 405, f"{method} {target}: use POST"
        length = int(headers.get("content-length", "0") or 0)
        if not 0 <= length <= MAX_BODY:
            return 413, f"a body of {length} bytes"
        body = await reader.readexactly(length)
        key = headers.get("idempotency-key", "")
        token = headers.get("x-fencing-token", "")
        # The sender's trace continues here (W3C traceparent).
        with tracer.start_as_current_span(
            f"POST {PATH}",
            context=propagate.extract(headers),
            kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": "POST", "url.path": PATH, "dedup.key": key},
        ) as span:
            if not key or not token.isdigit():
                status, outcome = await self._log(
                    key or None,
                    None,
                    400,
                    "Idempotency-Key and X-Fencing-Token (an integer) needed",
                )
            else:
                status, outcome = await self.deliver(key, int(token), body)
            span.set_attribute("http.response.status_code", status)
            return status, outcome


def parser() -> argparse.ArgumentParser:
    """The receiver's flags."""
    p = service.parser("receiver", __doc__ or "", dedup_tables=False)
    group = p.add_argument_group("receiver")
    service.option(group, "--host", env="RECEIVER_HOST", default="127.0.0.1", help="listen on")
    service.option(
        group, "--port", env="RECEIVER_PORT", default=8080, type=int, help="0: any free port"
    )
    service.option(
        group,
        "--fail-first",
        env="RECEIVER_FAIL_FIRST",
        default=0,
        type=int,
        help="answer 503 to the first N requests of each key",
    )
    return p


async def main(argv: list[str]) -> int:
    """``dedup run dedup_services.receiver [options]``: serve until SIGTERM or SIGINT."""
    args = parser().parse_args(argv)
    async with service.started(args, "receiver", ("receiver",)) as go_on:
        if not go_on:
            return 0
        pool = await service.connect(args.dsn)
        try:
            receiver = Receiver(pool, fail_first=args.fail_first)
            url = await receiver.start(args.host, args.port)
            # On stdout, for whoever starts it: the URL to give the dispatcher.
            print(f"receiver listening on {url}", flush=True)
            with service.stop_signals() as stop:
                await stop.wait()
            await receiver.close()
        finally:
            await pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
