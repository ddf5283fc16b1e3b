"""The outbox dispatcher: sends ``notifications.outbox`` rows to the receiver over HTTP.

A dispatcher loops:

1. **claim** up to ``batch_size`` due rows with ``FOR UPDATE SKIP LOCKED`` (so
   several dispatchers neither wait for nor take each other's rows); each row
   gets the next claim token and is the dispatcher's for ``claim_ttl`` seconds
   of database time.  The claim commits at once: no transaction stays open
   while HTTP calls are in flight;
2. **send** each: ``POST`` the notification with ``Idempotency-Key`` (the
   outbox key) and ``X-Fencing-Token`` (the claim token) headers and the
   trace context;
3. **mark** it, only while the row still carries this claim's token: a 2xx
   answer marks it sent; 409 (the receiver has seen a newer token for the key,
   so a later claim delivers it) leaves it alone; another 4xx marks it failed
   (it will never be accepted); a 5xx, 408, 429, a timeout or no connection
   retries it after ``retry_base * 2**(attempts - 1)`` seconds (at most
   ``retry_max``), and marks it failed once ``max_attempts`` claims are spent.

A dispatcher that dies between 2 and 3 leaves a claim that expires; the next
claim sends again with a higher token, and the receiver, which has handled the
key, answers 200 without doing it again.  Delivery is at least once; the effect
at the receiver happens once.
"""

from __future__ import annotations

import asyncio
import collections
import http.client
import logging
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from opentelemetry import metrics, propagate, trace

import dedup

log = logging.getLogger(__name__)

T = TypeVar("T")

tracer = trace.get_tracer("dedup_services.outbox")
deliveries = metrics.get_meter("dedup_services.outbox").create_counter(
    "outbox.deliveries", unit="{notification}", description="outbox sends, by outcome"
)

CLAIM = """
WITH due AS (
    SELECT id FROM notifications.outbox
     WHERE status = 'pending' AND next_attempt_at <= now()
       AND (claimed_until IS NULL OR claimed_until < now())
     ORDER BY next_attempt_at, id
     LIMIT $2
       FOR UPDATE SKIP LOCKED
)
UPDATE notifications.outbox AS o
   SET claim_token = o.claim_token + 1, claimed_by = $1, attempts = o.attempts + 1,
       claimed_until = now() + make_interval(secs => $3)
  FROM due
 WHERE o.id = due.id
RETURNING o.id, o.idempotency_key, o.payload::text AS payload, o.claim_token, o.attempts
"""

SENT = """
UPDATE notifications.outbox
   SET status = 'sent', sent_at = now(), response_status = $3, last_error = NULL,
       claimed_by = NULL, claimed_until = NULL
 WHERE id = $1 AND claim_token = $2 AND status = 'pending'
"""

RETRY = """
UPDATE notifications.outbox
   SET status = CASE WHEN attempts >= $3 THEN 'failed' ELSE 'pending' END,
       next_attempt_at = now() + make_interval(secs => $4),
       response_status = $5, last_error = $6, claimed_by = NULL, claimed_until = NULL
 WHERE id = $1 AND claim_token = $2 AND status = 'pending'
RETURNING status
"""

FAIL = """
UPDATE notifications.outbox
   SET status = 'failed', response_status = $3, last_error = $4,
       claimed_by = NULL, claimed_until = NULL
 WHERE id = $1 AND claim_token = $2 AND status = 'pending'
"""

# Answers worth trying again later; any other 4xx never will be accepted.
RETRY_STATUSES = frozenset({408, 425, 429})


@dataclass(frozen=True)
class Delivery:
    """One claimed outbox row."""

    id: int
    """The outbox row."""
    key: str
    """Its idempotency key."""
    payload: str
    """The notification, as JSON text."""
    token: int
    """The fencing token of this claim."""
    attempts: int
    """Claims so far, this one included."""


AfterSend = Callable[[Delivery, int], Awaitable[None]]
"""Called with the delivery and the HTTP status after a send, before the row is marked."""


def post(url: str, body: bytes, headers: dict[str, str], timeout: float) -> int:
    """POST ``body``; the HTTP status (blocking: run it in a thread)."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")  # noqa: S310
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        return int(exc.code)


def _setting(default: T, meaning: str) -> T:
    """A :class:`Settings` field: its default and what it means (the service's help)."""
    return field(default=default, metadata={"help": meaning})


@dataclass(frozen=True)
class Settings:
    """How a :class:`Dispatcher` claims, sends and retries (a field's ``metadata["help"]`` says)."""

    claim_ttl: float = _setting(30.0, "seconds a claim lasts (database clock)")
    timeout: float = _setting(10.0, "seconds a send may take (< --claim-ttl)")
    max_attempts: int = _setting(8, "claims of a row before it is failed")
    retry_base: float = _setting(1.0, "seconds before the first retry; doubles")
    retry_max: float = _setting(60.0, "longest wait between retries")
    poll_interval: float = _setting(0.5, "seconds between looks when idle")
    batch_size: int = _setting(10, "rows claimed and sent at once")

    def __post_init__(self) -> None:
        if not 0 < self.timeout < self.claim_ttl:
            raise ValueError(
                f"the send timeout ({self.timeout}s) must be shorter than the claim "
                f"({self.claim_ttl}s): a send must end before another dispatcher may claim the row"
            )

    def retry_delay(self, attempts: int) -> float:
        """Seconds before a row claimed ``attempts`` times is due again."""
        return min(self.retry_base * 2.0 ** (attempts - 1), self.retry_max)


class Dispatcher:
    """Delivers the outbox to one receiver URL (see the module docstring)."""

    def __init__(
        self,
        pool: Any,
        *,
        receiver_url: str,
        holder: str | None = None,
        settings: Settings | None = None,
        after_send: AfterSend | None = None,
    ) -> None:
        parsed = urllib.parse.urlsplit(receiver_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"receiver URL {receiver_url!r}: expected http(s)://host[:port]/path")
        self.pool = pool
        """asyncpg pool on the database of the outbox."""
        self.receiver_url = receiver_url
        self.holder = holder or dedup.default_holder()
        """This dispatcher's name in ``claimed_by``."""
        self.settings = settings or Settings()
        self.after_send = after_send
        self.stats: collections.Counter[str] = collections.Counter()
        """Deliveries by outcome: sent, stale, retried, failed."""

    async def run(self, stop: asyncio.Event) -> None:
        """Dispatch until ``stop`` is set; the sends in flight finish and are marked."""
        while not stop.is_set():
            if await self.dispatch_once():
                continue
            try:
                await asyncio.wait_for(stop.wait(), self.settings.poll_interval)
            except TimeoutError:
                pass

    async def dispatch_once(self) -> int:
        """Claim one batch of due rows, send and mark them; return how many were claimed."""
        limits = self.settings
        rows = await self.pool.fetch(CLAIM, self.holder, limits.batch_size, limits.claim_ttl)
        batch = [
            Delivery(r["id"], r["idempotency_key"], r["payload"], r["claim_token"], r["attempts"])
            for r in rows
        ]
        await asyncio.gather(*(self._deliver(d) for d in batch))
        return len(batch)

    async def _deliver(self, delivery: Delivery) -> None:
        headers = {
            "Content-Type": "application/json",
            "Idempotency-Key": delivery.key,
            "X-Fencing-Token": str(delivery.token),
        }
        attributes: dict[str, str | int] = {
            "http.request.method": "POST",
            "url.full": self.receiver_url,
            "dedup.key": delivery.key,
            "dedup.token": delivery.token,
            "dedup.attempt": delivery.attempts,
        }
        with tracer.start_as_current_span(
            "POST", kind=trace.SpanKind.CLIENT, attributes=attributes
        ) as span:
            propagate.inject(headers)
            try:
                status = await asyncio.to_thread(
                    post,
                    self.receiver_url,
                    delivery.payload.encode(),
                    headers,
                    self.settings.timeout,
                )
            except (OSError, http.client.HTTPException) as exc:
                span.set_attribute("error.type", type(exc).__name__)
                await self._retry(delivery, None, f"{type(exc).__name__}: {exc}")
                return
            span.set_attribute("http.response.status_code", status)
            if self.after_send is not None:
                await self.after_send(delivery, status)
            if 200 <= status < 300:
                await self.pool.execute(SENT, delivery.id, delivery.token, status)
                self._count("sent")
            elif status == 409:
                log.info("%s: the receiver has a newer token than %s", delivery.key, delivery.token)
                self._count("stale")
            elif 400 <= status < 500 and status not in RETRY_STATUSES:
                span.set_attribute("error.type", str(status))
                await self.pool.execute(FAIL, delivery.id, delivery.token, status, f"HTTP {status}")
                log.warning("%s: the receiver refused it (%s); marked failed", delivery.key, status)
                self._count("failed")
            else:
                span.set_attribute("error.type", str(status))
                await self._retry(delivery, status, f"HTTP {status}")

    async def _retry(self, delivery: Delivery, status: int | None, error: str) -> None:
        delay = self.settings.retry_delay(delivery.attempts)
        outcome = await self.pool.fetchval(
            RETRY, delivery.id, delivery.token, self.settings.max_attempts, delay, status, error
        )
        if outcome == "failed":
            log.warning("%s: %s; no attempts left, marked failed", delivery.key, error)
            self._count("failed")
        else:
            log.info("%s: %s; retrying in %.1fs", delivery.key, error, delay)
            self._count("retried")

    def _count(self, outcome: str) -> None:
        self.stats[outcome] += 1
        deliveries.add(1, {"outcome": outcome})
