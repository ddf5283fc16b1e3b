"""``deliver``: a handler run over records the way the consumer runs it, with no Kafka.

Records go, in the order given, in transactions of up to ``batch_size`` (default
1: one record per transaction).  Each transaction is the consumer's turn
without the partition lease (:mod:`dedup.consumer._turn`): ``BEGIN``; the keys
claimed with :func:`dedup.claim`; the handler on the fresh messages
(:func:`dedup._handler.run`: the guarded ``tx.conn``, ``handler_timeout``);
the session reset and ``COMMIT`` in one round trip (:func:`dedup.consumer._turn.commit`).

A handler's failure follows the consumer's rule (:mod:`dedup.consumer._lanes`,
``Lane._isolate``): a failing batch is split around the failing message (a
per-message handler names it) or in halves (:func:`dedup.consumer._retry.halves`)
until the message stands alone; it gets ``max_attempts`` attempts, then is
dead-lettered with the error (:func:`dedup._handler.failed_letter`).  What the
consumer would not count against ``max_attempts`` (a lost connection, a
deadlock, a serialization failure, a newer fencing token: the table of
:mod:`dedup.consumer._retry`) is raised: it is the test's database trouble, not
the record's.  Attempts follow each other at once; the consumer's backoff
between them is time, not behaviour.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import asyncpg

from dedup import _config as config
from dedup import _errors as errors
from dedup import _handler as handler_
from dedup import _limits as limits
from dedup import _message as message_
from dedup import _outbox as outbox
from dedup import _wrap as wrap_
from dedup import keys
from dedup.consumer import _retry as retry
from dedup.consumer import _turn as turn
from dedup.data import _conninfo as conninfo
from dedup.data import _db as db
from dedup.data import _migrations as migrations
from dedup.data import _sql as sql

DEFAULT_TOPIC = "test"
"""The topic of a record given as a bare value, or by :func:`record` without one."""
DEFAULT_BATCH_SIZE = 1
"""Records per transaction: one, so each record's outcome stands on its own."""

Value = bytes | bytearray | str | None | Mapping[str, Any] | list[Any] | int | float | bool
"""What a record's value may be given as: bytes as they are, text as UTF-8, None for a
tombstone, anything else JSON-encoded (orjson)."""
HeaderValue = bytes | str | None
Headers = Mapping[str, HeaderValue] | Iterable[tuple[str, HeaderValue]]


@dataclass(frozen=True, slots=True)
class Record:
    """A record as a producer sent it, to :func:`deliver`; made by :func:`record`."""

    value: bytes | None
    """The value's bytes; None for a tombstone."""
    key: bytes | None = None
    """The Kafka record key."""
    headers: tuple[tuple[str, bytes | None], ...] = ()
    """The headers, in order."""
    topic: str = DEFAULT_TOPIC
    partition: int = 0
    offset: int | None = None
    """Its offset; None: the next one of its partition in the delivery."""
    timestamp: int | None = None
    """Milliseconds since the epoch; None: when it is delivered."""


def record(
    value: Value,
    *,
    key: bytes | str | None = None,
    headers: Headers | None = None,
    topic: str = DEFAULT_TOPIC,
    partition: int = 0,
    offset: int | None = None,
    timestamp: int | None = None,
) -> Record:
    """A record for :func:`deliver`: ``value`` (bytes as they are, text as UTF-8, None for a
    tombstone, a dict or anything else as JSON), its Kafka ``key`` and ``headers`` (text as
    UTF-8), where it sits (``offset`` None: the next offset of its partition in the
    delivery) and its ``timestamp`` (ms; None: when it is delivered).

    Raises :class:`dedup.ConfigurationError` naming what it cannot use.
    """
    limits.check_text("topic", topic, limits.MAX_TOPIC_BYTES)
    limits.check_number("partition", partition, 0, 2**31 - 1, whole=True)
    if offset is not None:
        limits.check_number("offset", offset, 0, 2**63 - 1, whole=True)
    if timestamp is not None:
        limits.check_number("timestamp", timestamp, 0, 2**63 - 1, whole=True)
    return Record(
        outbox.encode(value, "record value"),
        outbox.as_bytes(key, "record key"),
        _headers(headers),
        topic,
        partition,
        offset,
        timestamp,
    )


def _headers(headers: Headers | None) -> tuple[tuple[str, bytes | None], ...]:
    pairs = headers.items() if isinstance(headers, Mapping) else headers or ()
    made = []
    for name, value in pairs:
        if not isinstance(name, str):
            raise errors.ConfigurationError(f"record header name {name!r}: expected text")
        made.append((name, outbox.as_bytes(value, f"record header {name!r}")))
    return tuple(made)


@dataclass(frozen=True, slots=True)
class Delivered:
    """What :func:`deliver` did with one record."""

    msg: message_.Message
    """The record as the handler saw it: its topic, partition, offset and idempotency key."""
    outcome: message_.Outcome
    error: str | None = None
    """The handler's error when it failed ``max_attempts`` times and the record was
    dead-lettered (as ``dead_letters.error`` holds it); None otherwise."""


@dataclass(frozen=True, slots=True)
class Delivery:
    """What :func:`deliver` did with each record, in the order the records were given."""

    delivered: tuple[Delivered, ...]

    def __len__(self) -> int:
        return len(self.delivered)

    def __iter__(self) -> Iterator[Delivered]:
        return iter(self.delivered)

    def __getitem__(self, index: int) -> Delivered:
        return self.delivered[index]

    @property
    def outcomes(self) -> list[message_.Outcome]:
        """Each record's outcome."""
        return [d.outcome for d in self.delivered]

    @property
    def messages(self) -> list[message_.Message]:
        """Each record as delivered: give them to :func:`deliver` again to redeliver them
        (same topic, partition and offset)."""
        return [d.msg for d in self.delivered]

    @property
    def counts(self) -> dict[message_.Outcome, int]:
        """How many records had each outcome (every outcome is a key, 0 included)."""
        found = dict.fromkeys(message_.Outcome, 0)
        for d in self.delivered:
            found[d.outcome] += 1
        return found


async def deliver(
    handler: Callable[..., Awaitable[object]],
    records: Iterable[message_.Message | Record | Value],
    *,
    namespace: str,
    dsn: str | None = None,
    pool: Any = None,
    key: keys.Strategy = config.DEFAULT_KEY,
    schema: str = sql.DEFAULT_SCHEMA,
    batch: bool | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_attempts: int = config.DEFAULT_MAX_ATTEMPTS,
    handler_timeout: float = config.DEFAULT_HANDLER_TIMEOUT,
    on_missing_key: str = message_.OnMissingKey.DEAD_LETTER,
    on_conflict: str = message_.OnConflict.DEAD_LETTER,
) -> Delivery:
    """Run ``handler`` over ``records`` as :class:`dedup.IdempotentConsumer` would, with no Kafka.

    ``records`` are :class:`dedup.Message` objects (delivered where they sit:
    again, a redelivery), :class:`Record` objects from :func:`record`, or bare
    values (a new record each, as a producer's retry sends one again: the next
    offset of partition 0 of topic ``"test"``).  A record without an offset
    gets the offset after the previous record of its partition in ``records``
    (0 for the first).  Each goes through the key claim and ``handler`` in
    ``batch_size`` records per transaction on ``dsn`` (a pool of one
    connection, opened and closed here) or ``pool`` (an asyncpg pool, or a
    connection outside a transaction), in ``schema``, which must be migrated.
    ``key``, ``namespace``, ``batch``, ``max_attempts``, ``handler_timeout``,
    ``on_missing_key`` and ``on_conflict`` are the consumer's settings.

    A handler that raises is retried, then the record is dead-lettered
    (``DEAD_LETTERED``, with the error) and the next one goes on, as in the
    consumer; a lost connection or a deadlock is raised.  Returns each
    record's outcome, in order.
    """
    db.require_one(dsn, pool)
    config.check_handler(handler)
    config.check_handling(
        batch_size=batch_size, max_attempts=max_attempts, handler_timeout=handler_timeout
    )
    writes, _ = wrap_._claimer(key, schema, namespace, on_missing_key, on_conflict)
    msgs = _messages(records)
    run = _Run(
        handler=handler,
        batch_handler=config.is_batch_handler(handler) if batch is None else batch,
        claim_options={
            "namespace": namespace,
            "key": key,
            "schema": schema,
            "on_missing_key": on_missing_key,
            "on_conflict": on_conflict,
        },
        writes=writes.claim,
        max_attempts=max_attempts,
        handler_timeout=float(handler_timeout),
        secrets=frozenset(conninfo.passwords(dsn)),
    )
    async with _connection(dsn, pool) as conn:
        await migrations.check(conn, schema=schema)
        for start in range(0, len(msgs), batch_size):
            await run.apply(conn, msgs[start : start + batch_size])
    return Delivery(tuple(Delivered(m, run.outcomes[id(m)], run.failures.get(id(m))) for m in msgs))


def _messages(records: Iterable[object]) -> list[message_.Message]:
    """A new message for each of ``records``, each record placed at its offset."""
    if isinstance(records, bytes | bytearray | str | Mapping | Record | message_.Message):
        raise errors.ConfigurationError(
            f"records={keys.shorten(repr(records))}: expected a list of records; "
            "one record goes in a list of one, [record]"
        )
    now = time.time_ns() // 1_000_000
    following: dict[tuple[str, int], int] = {}
    made = []
    for i, given in enumerate(records):
        if isinstance(given, message_.Message):
            msg = dataclasses.replace(given, idempotency_key="")
        else:
            try:
                found = given if isinstance(given, Record) else record(given)  # type: ignore[arg-type]
            except errors.ConfigurationError as exc:
                raise errors.ConfigurationError(f"records[{i}]: {exc}") from None
            where = (found.topic, found.partition)
            offset = following.get(where, 0) if found.offset is None else found.offset
            msg = message_.Message.from_record(
                message_.Record(
                    found.topic,
                    found.partition,
                    offset,
                    found.key,
                    found.value,
                    found.headers,
                    now if found.timestamp is None else found.timestamp,
                )
            )
        following[(msg.topic, msg.partition)] = msg.offset + 1
        made.append(msg)
    return made


@contextlib.asynccontextmanager
async def _connection(dsn: str | None, pool: Any) -> AsyncIterator[asyncpg.Connection]:
    """One connection for the whole delivery: from ``pool`` (or ``pool`` itself, a
    connection), or from a pool of one opened on ``dsn``, as the consumer opens its own."""
    if pool is not None:
        async with db.connection(pool) as conn:
            if conn.is_in_transaction():
                raise errors.ConfigurationError(
                    "dedup.testing.deliver runs a transaction per batch of records, as the "
                    "consumer does: give it a connection outside a transaction"
                )
            yield conn
        return
    async with db.pool_for(dsn, None, min_size=1, max_size=1) as opened, opened.acquire() as conn:
        yield conn


@dataclass
class _Run:
    """One delivery: its settings, and each message's outcome so far (by ``id``)."""

    handler: Callable[..., Awaitable[object]]
    batch_handler: bool
    claim_options: dict[str, Any]
    writes: Callable[..., Awaitable[Any]]
    """``Store.claim``: writes a dead letter as the claim path writes them."""
    max_attempts: int
    handler_timeout: float
    secrets: frozenset[str]
    outcomes: dict[int, message_.Outcome] = dataclasses.field(default_factory=dict)
    failures: dict[int, str] = dataclasses.field(default_factory=dict)
    """The handler's error of each message dead-lettered after ``max_attempts``."""

    async def apply(self, conn: asyncpg.Connection, msgs: list[message_.Message]) -> None:
        """``msgs`` in one transaction; a handler failure isolates the failing message."""
        try:
            claimed = await self._transaction(conn, msgs)
        except retry.HandlerFailed as failed:
            await self._isolate(conn, msgs, failed.error)
            return
        self._file(claimed)

    async def _isolate(
        self, conn: asyncpg.Connection, msgs: list[message_.Message], error: BaseException
    ) -> None:
        """The consumer's rule: split until the failing message stands alone; it gets
        ``max_attempts`` attempts (the one that failed alone is the first), then its
        dead letter."""
        if len(msgs) > 1:
            culprit = _culprit(msgs, error)
            for start, stop in retry.halves(list(range(len(msgs))), culprit):
                await self.apply(conn, msgs[start:stop])
            return
        [msg] = msgs
        for _ in range(2, self.max_attempts + 1):
            try:
                claimed = await self._transaction(conn, msgs)
            except retry.HandlerFailed as failed:
                error = failed.error
                continue
            self._file(claimed)
            return
        letter = handler_.failed_letter(msg, error, self.max_attempts, self.secrets)
        async with conn.transaction():
            await self.writes(conn, [], dead=[letter])
        self.outcomes[id(msg)] = message_.Outcome.DEAD_LETTERED
        self.failures[id(msg)] = letter.error or ""

    async def _transaction(
        self, conn: asyncpg.Connection, msgs: list[message_.Message]
    ) -> message_.ClaimResult:
        """The consumer's transaction for ``msgs``, without the fence; raises
        :class:`dedup.consumer._retry.HandlerFailed` for the handler's failures."""
        schema = self.claim_options["schema"]
        await db.queries().begin.execute(conn)
        try:
            claimed = await wrap_.claim(conn, msgs, **self.claim_options)
            if claimed.fresh:
                await self._handle(conn, claimed)
            await turn.commit(conn, None)
        except BaseException:
            await turn.roll_back(conn, schema, traced=False)
            raise
        return claimed

    async def _handle(self, conn: asyncpg.Connection, claimed: message_.ClaimResult) -> None:
        try:
            await handler_.run(
                self.handler,
                batch_handler=self.batch_handler,
                msgs=claimed.fresh,
                conn=conn,
                token=0,
                deadline_s=self.handler_timeout,
                namespace=claimed.namespace,
                schema=claimed.schema,
            )
        except Exception as exc:
            if isinstance(exc, errors.StaleTokenError) or handler_.lost_connection(conn, exc):
                raise
            if retry.decide(exc, in_handler=True).action is not retry.Action.SPLIT:
                raise  # a deadlock, a serialization failure: the consumer runs it again
            raise retry.HandlerFailed(exc, None) from exc

    def _file(self, claimed: message_.ClaimResult) -> None:
        """Each message's outcome, as the claim found it (a conflict dead-lettered too is a
        conflict)."""
        for outcome, found in (
            (message_.Outcome.PROCESSED, claimed.fresh),
            (message_.Outcome.DUPLICATE, claimed.duplicates),
            (message_.Outcome.CONFLICT, claimed.conflicts),
        ):
            for msg in found:
                self.outcomes[id(msg)] = outcome
        conflicts = {id(m) for m in claimed.conflicts}
        for msg in claimed.dead_lettered:
            if id(msg) not in conflicts:
                self.outcomes[id(msg)] = message_.Outcome.DEAD_LETTERED


def _culprit(msgs: list[message_.Message], error: BaseException) -> int | None:
    """The index of the message a per-message handler failed on (None: not known)."""
    offset, where = handler_.failed_offset(error), handler_.failed_partition(error)
    for i, msg in enumerate(msgs):
        if (msg.topic, msg.partition) == where and msg.offset == offset:
            return i
    return None
