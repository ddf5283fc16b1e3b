"""The outbox's HTTP sink: dispatchers that POST each message once to its destination.

A handler's ``tx.post(destination, payload)`` writes an ``http`` row of the
outbox in the transaction that applies its source
(:func:`dedup._outbox.post`).  A :class:`Dispatcher` serves destination names,
each a URL; any number run side by side, and each loops:

1. **claim** up to ``batch_size`` due rows of its destinations with ``FOR
   UPDATE SKIP LOCKED`` (so dispatchers neither wait for nor take each
   other's rows); each row gets the next claim token and is the dispatcher's
   for ``claim_ttl`` seconds of database time.  The claim commits at once: no
   transaction stays open while the POSTs are in flight;
2. **send** each: ``POST`` the payload with ``Idempotency-Key`` (the row key)
   and ``X-Fencing-Token`` (the claim token) headers and the trace context;
3. **mark** it, only while the row still carries this claim's token: a 2xx
   answer marks it sent; 409 (the receiver has seen a newer token for the key,
   so a later claim delivers it) leaves it alone; another 4xx than 408, 425
   and 429 marks it failed (it will never be accepted); anything else (a 5xx,
   those three, a timeout, no connection) makes it due again after
   ``retry_base * 2**(attempts - 1)`` seconds (at most ``retry_max``), and
   failed once ``max_attempts`` claims are spent.

A dispatcher that dies between 2 and 3 leaves a claim that expires; the next
claim sends again with a higher token, and a receiver that handles each key
once answers without doing it again.  Delivery is at least once; the effect
at the receiver, once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import http.client
import logging
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import propagate, trace

from dedup import _errors as errors
from dedup import _faults as faults
from dedup import _leases as leases
from dedup import _limits as limits
from dedup import _outbox as outbox
from dedup import _telemetry as telemetry
from dedup.data import _db as db
from dedup.data import _migrations as migrations
from dedup.data import _sql as sql

log = logging.getLogger("dedup.dispatcher")


@dataclass(frozen=True)
class Delivery:
    """One claimed outbox row."""

    id: int
    key: str
    """Its row key: the ``Idempotency-Key``."""
    destination: str
    payload: str
    """The message, as JSON text."""
    token: int
    """The fencing token of this claim: the ``X-Fencing-Token``."""
    attempts: int
    """Claims so far, this one included."""


class Dispatcher:
    """POSTs the outbox's HTTP messages of ``destinations`` (name -> URL), once each.

    Give it ``dsn`` (or an asyncpg ``pool``).  ``claim_ttl`` is how long a
    claim lasts (seconds, database clock) and must exceed ``timeout``, a
    send's longest; ``max_attempts`` claims of a row before it is failed;
    ``retry_base`` and ``retry_max`` the backoff; ``poll_interval`` seconds
    between looks when nothing is due; ``batch_size`` rows claimed at once.
    :meth:`run` dispatches until :meth:`stop`.
    """

    def __init__(
        self,
        *,
        destinations: Mapping[str, str],
        dsn: str | None = None,
        pool: Any = None,
        holder: str | None = None,
        schema: str = sql.DEFAULT_SCHEMA,
        claim_ttl: float = 30.0,
        timeout: float = 10.0,
        max_attempts: int = 8,
        retry_base: float = 1.0,
        retry_max: float = 60.0,
        poll_interval: float = 0.5,
        batch_size: int = 10,
        pool_options: Mapping[str, Any] | None = None,
    ) -> None:
        db.require_one(dsn, pool)
        if not destinations:
            raise errors.ConfigurationError("a dispatcher needs destinations: {name: url}")
        for name, url in destinations.items():
            parts = urllib.parse.urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise errors.ConfigurationError(
                    f"destination {name!r}: {url!r} is not an http(s)://host[:port]/path URL"
                )
        limits.check_number("timeout", timeout, 0.001, 3600, whole=False)
        limits.check_number("claim_ttl", claim_ttl, 0.01, 86400, whole=False)
        if timeout >= claim_ttl:
            raise errors.ConfigurationError(
                f"the send timeout ({timeout}s) must be shorter than the claim ({claim_ttl}s): "
                "a send must end before another dispatcher may claim the row"
            )
        limits.check_number("max_attempts", max_attempts, 1, 1000, whole=True)
        limits.check_number("retry_base", retry_base, 0, 86400, whole=False)
        limits.check_number("retry_max", retry_max, 0, 86400, whole=False)
        limits.check_number("poll_interval", poll_interval, 0.001, 3600, whole=False)
        limits.check_number("batch_size", batch_size, 1, 10_000, whole=True)
        self.destinations = dict(destinations)
        self.holder = limits.check_text(
            "holder", holder or leases.default_holder(), limits.MAX_NAME_BYTES
        )
        """This dispatcher's name in ``claimed_by``."""
        self.schema = schema
        self.claim_ttl = claim_ttl
        self.timeout = timeout
        self.max_attempts = max_attempts
        self.retry_base = retry_base
        self.retry_max = retry_max
        self.poll_interval = poll_interval
        self.batch_size = batch_size
        self.stats: collections.Counter[str] = collections.Counter()
        """Deliveries by outcome: sent, stale, retried, failed."""
        self._dsn = dsn
        self._pool = pool
        self._pool_options = dict(pool_options or {})
        self._active: Any = pool
        """The pool in use: the one given, or the one :meth:`run` opened on ``dsn``."""
        self._q = sql.Queries(schema)
        self._stopping = asyncio.Event()

    def retry_delay(self, attempts: int) -> float:
        """Seconds before a row claimed ``attempts`` times is due again."""
        return min(self.retry_base * 2.0 ** (attempts - 1), self.retry_max)

    async def stop(self) -> None:
        """Make :meth:`run` return once the sends in flight are marked."""
        self._stopping.set()

    async def run(self) -> None:
        """Claim, send and mark until :meth:`stop`."""
        self._stopping.clear()
        async with db.pool_for(
            self._dsn, self._pool, **{"min_size": 1, "max_size": 2, **self._pool_options}
        ) as pool:
            await migrations.check(pool, schema=self.schema)
            self._active = pool
            try:
                while not self._stopping.is_set():
                    try:
                        if await self.dispatch_once():
                            continue
                    except db.DATABASE_ERRORS as exc:
                        if not db.is_retriable(exc):
                            raise
                        log.warning("dispatcher %s: Postgres unreachable: %r", self.holder, exc)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stopping.wait(), self.poll_interval)
            finally:
                self._active = self._pool

    async def dispatch_once(self) -> int:
        """Claim one batch of due rows, send and mark them; how many were claimed."""
        rows = await self._q.outbox_http_claim.fetch(
            self._active,
            holder=self.holder,
            destinations=list(self.destinations),
            limit=self.batch_size,
            ttl=float(self.claim_ttl),
        )
        batch = [
            Delivery(
                r["id"], r["key"], r["destination"], r["payload"], r["claim_token"], r["attempts"]
            )
            for r in rows
        ]
        await asyncio.gather(*(self._deliver(d) for d in batch))
        return len(batch)

    async def _deliver(self, delivery: Delivery) -> None:
        url = self.destinations[delivery.destination]
        headers = {
            "Content-Type": "application/json",
            "Idempotency-Key": delivery.key,
            "X-Fencing-Token": str(delivery.token),
        }
        attributes: dict[str, str | int] = {
            "http.request.method": "POST",
            "url.full": url,
            "dedup.key": delivery.key,
            "dedup.token": delivery.token,
            "dedup.attempt": delivery.attempts,
        }
        with telemetry.tracer.start_as_current_span(
            "POST", kind=trace.SpanKind.CLIENT, attributes=attributes
        ) as span:
            propagate.inject(headers)
            try:
                status = await asyncio.to_thread(
                    outbox.http_post, url, delivery.payload.encode(), headers, self.timeout
                )
            except (OSError, http.client.HTTPException, ValueError) as exc:
                span.set_attribute("error.type", type(exc).__name__)
                await self._retry(delivery, None, f"{type(exc).__name__}: {exc}")
                return
            span.set_attribute("http.response.status_code", status)
            await faults.point(
                faults.Point.DISPATCH_AFTER_POST,
                key=delivery.key, token=delivery.token, status=status,
            )  # fmt: skip
            if 200 <= status < 300:
                await self._q.outbox_http_sent.execute(
                    self._active, id=delivery.id, token=delivery.token, status=status
                )
                self._count("sent")
            elif status == 409:
                log.info("%s: the receiver has a newer token than %s", delivery.key, delivery.token)
                self._count("stale")
            elif 400 <= status < 500 and status not in outbox.RETRIED:
                span.set_attribute("error.type", str(status))
                await self._q.outbox_http_fail.execute(
                    self._active, id=delivery.id, token=delivery.token, status=status,
                    error=f"HTTP {status}",
                )  # fmt: skip
                log.warning("%s: the receiver refused it (%s); marked failed", delivery.key, status)
                self._count("failed")
            else:
                span.set_attribute("error.type", str(status))
                await self._retry(delivery, status, f"HTTP {status}")

    async def _retry(self, delivery: Delivery, status: int | None, error: str) -> None:
        delay = self.retry_delay(delivery.attempts)
        outcome = await self._q.outbox_http_retry.fetchval(
            self._active, id=delivery.id, token=delivery.token, max_attempts=self.max_attempts,
            delay=float(delay), status=status, error=error,
        )  # fmt: skip
        if outcome == "failed":
            log.warning("%s: %s; no attempts left, marked failed", delivery.key, error)
            self._count("failed")
        else:
            log.info("%s: %s; retrying in %.1fs", delivery.key, error, delay)
            self._count("retried")

    def _count(self, outcome: str) -> None:
        self.stats[outcome] += 1
        telemetry.outbox_deliveries.add(1, {"dedup.outcome": outcome})
