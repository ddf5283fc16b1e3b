"""``FastStreamDedup``: exactly-once FastStream subscribers, as a FastStream middleware.

FastStream (``dedup[faststream]``) owns the consumer, the group and the offsets
it commits to Kafka; this middleware owns one Postgres transaction per
delivery.  In it the record's key is claimed with :func:`dedup.claim` and, when
fresh, the subscriber runs with that transaction at hand, through FastStream's
own context (``tx: dedup.Tx = Context("dedup_tx")``), so the claim and the
handler's writes commit or roll back together.  Duplicates return before the
handler runs and FastStream acknowledges them as usual; each suppressed copy
is logged on FastStream's own logger, between its ``Received`` and
``Processed`` lines, so the log tells a duplicate from work.

There is no partition lease: Kafka's offsets are FastStream's, so nothing here
can refuse a zombie member's transaction (``tx.token`` is 0).  The key claim
alone keeps every effect inside Postgres to once (docs/howto/faststream.md,
"What is fenced").

FastStream is imported only when a subscriber first uses the middleware, so
``import dedup`` works without the extra.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

import asyncpg

from dedup import _config as config
from dedup import _errors as errors
from dedup import _guard as guard
from dedup import _handler as handler_
from dedup import _limits as limits
from dedup import _message as message_
from dedup import _store as store
from dedup import _wrap as wrap_
from dedup import keys
from dedup.data import _conninfo as conninfo
from dedup.data import _db as db

log = logging.getLogger("dedup.faststream")

TX = "dedup_tx"
"""The name of the transaction in FastStream's context: ``Context("dedup_tx")``."""
MAX_RETRY_BACKOFF = 60.0
"""Seconds, the longest ``retry_backoff``: the retries hold up FastStream's poll loop, and a
member that stops polling for aiokafka's ``max_poll_interval_ms`` (5 minutes) leaves the group."""


class FastStreamDedup:
    """A FastStream middleware that makes a Kafka subscriber exactly-once.

    Put it on a ``KafkaRouter`` (or the ``KafkaBroker``: FastStream 0.7 takes
    middlewares there, not per subscriber), and take the transaction from
    FastStream's context::

        exactly_once = dedup.FastStreamDedup(dsn=DSN, namespace="orders",
                                             key=dedup.keys.json_field("id"))
        router = KafkaRouter(middlewares=[exactly_once])

        @router.subscriber("orders", group_id="orders", ack_policy=AckPolicy.NACK_ON_ERROR)
        async def handle(order: dict, tx: dedup.Tx = Context("dedup_tx")) -> None:
            await tx.conn.execute("INSERT ...")

    For each delivery (one record, or a batch subscriber's records) it opens one
    transaction on ``pool`` (or a pool it makes from ``dsn`` on first use) and
    claims the keys (:func:`dedup.claim`): a delivery with no fresh key is
    acknowledged without running the subscriber; a batch subscriber receives
    only its fresh records.  A subscriber error rolls the transaction back and
    is retried ``max_attempts`` times ``retry_backoff`` seconds apart (a failing
    batch is first split into single records); the record that still fails is
    dead-lettered whole, in ``dead_letters``, and acknowledged, so the
    partition moves on.  Errors reaching Postgres itself (a lost connection, a
    serialization failure) are not the record's fault: they propagate, so
    FastStream's ``NACK_ON_ERROR`` redelivers the delivery.
    """

    def __init__(
        self,
        *,
        namespace: str,
        pool: Any = None,
        dsn: str | None = None,
        key: keys.Strategy = config.DEFAULT_KEY,
        schema: str = "dedup",
        max_attempts: int = 3,
        retry_backoff: float = 0.1,
        on_missing_key: str = message_.OnMissingKey.DEAD_LETTER,
        on_conflict: str = message_.OnConflict.DEAD_LETTER,
    ) -> None:
        db.require_one(dsn, pool)
        limits.check_number("max_attempts", max_attempts, 1, 1000, whole=True)
        limits.check_number("retry_backoff", retry_backoff, 0, MAX_RETRY_BACKOFF, whole=False)
        self.namespace = namespace
        self.key = key
        self.schema = schema
        self.max_attempts = max_attempts
        self.retry_backoff = float(retry_backoff)
        # Checks key and policies now, at import time of the app, not on the first record.
        self._store, self._missing_key = wrap_._claimer(
            key, schema, namespace, on_missing_key, on_conflict
        )
        self._claim_options: dict[str, Any] = {
            "namespace": namespace,
            "key": key,
            "schema": schema,
            "on_missing_key": on_missing_key,
            "on_conflict": on_conflict,
        }
        self._pool = pool
        self._dsn = dsn
        self._own_pool = False
        self._opening = asyncio.Lock()

    def __call__(self, msg: Any, /, *, context: Any) -> Any:
        """FastStream's middleware factory: one middleware object per delivery."""
        return _middleware_class()(msg, context=context, owner=self)

    async def close(self) -> None:
        """Close the pool made from ``dsn`` (call it from the app's ``after_shutdown``)."""
        if self._own_pool and self._pool is not None:
            await self._pool.close()
            self._pool = None
            self._own_pool = False

    async def _get_pool(self) -> Any:
        if self._pool is None:
            async with self._opening:
                if self._pool is None:
                    self._pool = await db.create_pool(str(self._dsn))  # require_one: set
                    self._own_pool = True
        return self._pool

    async def consume(
        self, call_next: Callable[[Any], Awaitable[Any]], msg: Any, context: Any
    ) -> Any:
        """Run one delivery: claim, call the subscriber, retry, isolate, dead-letter."""
        delivery = _Delivery(call_next, msg, context)
        raw = msg.raw_message
        if not isinstance(raw, tuple):
            return await self._attempts(delivery, [raw], False)
        try:
            return await self._once(delivery, list(raw), batch=True)
        except _HandlerFailed as failed:
            if len(raw) == 1:
                return await self._attempts(delivery, [*raw], True, failed)
            log.info("batch of %d failed (%s); retrying its records one by one", len(raw), failed)
        for record in raw:
            await self._attempts(delivery, [record], True)
        return None

    async def _attempts(
        self,
        delivery: _Delivery,
        records: list[Any],
        batch: bool,
        failed: _HandlerFailed | None = None,
    ) -> Any:
        """Up to ``max_attempts`` transactions (``failed``: the first already failed so)."""
        for attempt in range(1, self.max_attempts + 1):
            if attempt > 1:
                await asyncio.sleep(self.retry_backoff)
            if attempt > 1 or failed is None:
                try:
                    return await self._once(delivery, records, batch=batch)
                except _HandlerFailed as exc:
                    failed = exc
            log.warning(
                "handler failed on %s (attempt %d of %d): %s",
                _where(records),
                attempt,
                self.max_attempts,
                failed.cause,
            )
        assert failed is not None  # noqa: S101 - max_attempts >= 1, checked at construction
        await self._dead_letter(records, failed.cause, self.max_attempts)
        return None

    async def _once(self, delivery: _Delivery, records: list[Any], *, batch: bool) -> Any:
        pool = await self._get_pool()
        async with pool.acquire() as conn:
            try:
                async with db.around_handler(conn):
                    return await self._claim_and_call(delivery, conn, records, batch=batch)
            except (errors.HandlerError, asyncpg.IntegrityConstraintViolationError) as exc:
                # The COMMIT's: the subscriber left the transaction aborted, or its writes
                # broke a deferred constraint.  The subscriber's failures, as its errors are.
                raise _HandlerFailed(exc) from exc

    async def _claim_and_call(
        self, delivery: _Delivery, conn: Any, records: list[Any], *, batch: bool
    ) -> Any:
        """Claim the keys; call the subscriber with the fresh records, in ``conn``'s transaction."""
        call_next, msg, context = delivery
        claimed = await wrap_.claim(conn, records, **self._claim_options)
        _log_suppressed(context, claimed)
        if not claimed.fresh:
            return None
        fresh = _narrowed(msg, records, claimed.fresh) if batch else msg
        guarded = guard.GuardedConnection(conn)
        tx = message_.Tx(
            conn=guarded,
            token=0,
            namespace=claimed.namespace,
            schema=claimed.schema,
            source=None if batch else claimed.fresh[0],
        )
        try:
            # "message" too: a batch subscriber's Context("message") is the narrowed one.
            with context.scopes(((TX, tx), ("message", fresh))):
                result = await call_next(fresh)
            guarded.check_done()
        except Exception as exc:
            if db.is_retriable(exc):
                raise  # Postgres's trouble, not the record's: FastStream redelivers
            raise _HandlerFailed(exc) from exc
        return result

    async def _dead_letter(
        self, records: Sequence[Any], cause: BaseException, attempts: int
    ) -> None:
        # The cause as a dead letter shows it, credentials masked (the DSN's passwords too).
        secrets = conninfo.passwords(self._dsn)
        letters = []
        for record in records:
            msg = message_.Message.from_record(record)
            store.take_key(self.key, self._missing_key, msg)
            letters.append(handler_.failed_letter(msg, cause, attempts, secrets))
        pool = await self._get_pool()
        async with pool.acquire() as conn, conn.transaction():
            await self._store.claim(conn, [], dead=letters)
        log.error(
            "dead-lettered %s after %d attempts: %s", _where(records), attempts, letters[0].error
        )


class _Delivery(NamedTuple):
    """What FastStream hands the middleware for one delivery."""

    call_next: Callable[[Any], Awaitable[Any]]
    msg: Any
    context: Any


class _HandlerFailed(Exception):
    """The subscriber raised inside the transaction (which then rolled back)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _log_suppressed(context: Any, claimed: message_.ClaimResult) -> None:
    """One line per copy not handed to the subscriber, on FastStream's logger (else dedup's)."""
    logger = context.get_local("logger") or log
    extra = context.get_local("log_context", {})
    dead = {(m.topic, m.partition, m.offset) for m in claimed.dead_lettered}
    for msg in claimed.duplicates:
        logger.info(
            "duplicate of key %r suppressed: applied before, subscriber not run",
            msg.idempotency_key,
            extra=extra,
        )
    for msg in claimed.conflicts:
        where = (msg.topic, msg.partition, msg.offset)
        fate = "dead-lettered" if where in dead else "recorded"
        dead.discard(where)
        logger.warning(
            "conflict on key %r: applied before with another payload; %s, subscriber not run",
            msg.idempotency_key,
            fate,
            extra=extra,
        )
    for _ in dead:
        logger.warning("record without a key: dead-lettered, subscriber not run", extra=extra)


def _where(records: Sequence[Any]) -> str:
    first = records[0]
    if len(records) == 1:
        return f"{first.topic}:{first.partition}:{first.offset}"
    return f"{len(records)} records from {first.topic}:{first.partition}:{first.offset}"


def _narrowed(msg: Any, records: list[Any], fresh: list[message_.Message]) -> Any:
    """A batch delivery holding only ``fresh``'s records (FastStream decodes ``raw_message``)."""
    wanted = {(m.topic, m.partition, m.offset) for m in fresh}
    kept = tuple(r for r in records if (r.topic, r.partition, r.offset) in wanted)
    if kept == tuple(msg.raw_message):
        return msg
    narrow = copy.copy(msg)  # StreamMessage's copy forgets the decoded body
    narrow.raw_message = kept
    narrow.body = [r.value or b"" for r in kept]
    narrow.batch_headers = [{k: v.decode() for k, v in r.headers} for r in kept]
    return narrow


@functools.cache
def _middleware_class() -> type[Any]:
    try:
        from faststream import BaseMiddleware
    except ImportError as exc:
        raise errors.ConfigurationError(
            "dedup.FastStreamDedup needs FastStream: pip install 'dedup-kafka[faststream]'"
        ) from exc

    class DedupMiddleware(BaseMiddleware):
        """One delivery's middleware: its transaction is :class:`FastStreamDedup`'s."""

        def __init__(self, msg: Any, /, *, context: Any, owner: FastStreamDedup) -> None:
            super().__init__(msg, context=context)
            self.owner = owner

        async def consume_scope(self, call_next: Any, msg: Any) -> Any:
            return await self.owner.consume(call_next, msg, self.context)

    return DedupMiddleware
