"""The relay: the outbox's Kafka records published once each, on any number of machines.

Handlers write records with ``tx.publish`` in the transaction that applies
their source (:func:`dedup._outbox.publish`); a :class:`Relay` publishes the
pending ones in ``id`` order.  Every relay of a name competes for one lease
(``relay:NAME``, database clock, fencing token, renewed by a watchdog): the
holder publishes, the others wait for it to end.  Each record goes out with the
row key as its ``dedup-key`` header and its source's token as ``dedup-token``.

Two modes:

``at_least_once``
    An idempotent producer (``enable_idempotence``, ``acks=all``).  A batch's
    rows are marked ``sent`` in Postgres, fenced by the lease, after the
    broker acknowledged every record of it.  A relay that dies in between
    leaves them pending and the next sends them again: the downstream
    consumer's claim of ``dedup-key`` absorbs the copy.
``exactly_once``
    A transactional producer whose ``transactional_id`` is the relay's (one
    per database, schema and name): the holder's ``init_transactions`` fences
    every producer of an earlier holder, a zombie's included.  Each batch is
    one Kafka transaction holding its records and a record of the batch's
    row ids on the compacted state topic (keyed by the ``transactional_id``).
    After the commit the rows are marked sent.  A relay that takes over reads
    the state topic ``read_committed`` and marks the last committed batch's
    rows before it publishes anything, so no row is published twice: a
    ``read_committed`` reader of the output topics sees each record once.

A record the broker refuses for good (too large, an invalid topic) is marked
``failed`` with the reason and the rest go on; anything else (a broker down, a
topic not there yet, a lost leader) holds the batch back, retried with a
backoff, and the writers are never held up: they only insert rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import aiokafka.errors
import asyncpg
import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from opentelemetry import trace

from dedup import _errors as errors
from dedup import _faults as faults
from dedup import _kafka_client as kafka_client
from dedup import _leases as leases
from dedup import _limits as limits
from dedup import _outbox as outbox
from dedup import _telemetry as telemetry
from dedup.data import _db as db
from dedup.data import _events as events
from dedup.data import _migrations as migrations
from dedup.data import _sql as sql

log = logging.getLogger("dedup.relay")

Mode = Literal["at_least_once", "exactly_once"]
MODES: tuple[Mode, ...] = ("at_least_once", "exactly_once")
DEFAULT_STATE_TOPIC = "dedup-relay-state"
"""The compacted topic where an exactly-once relay records each batch's row ids."""
DEFAULT_LEASE_TTL = 10.0
"""Seconds a relay's lease lasts unrenewed: how long a dead holder's rows wait."""
DEFAULT_BATCH_SIZE = 500
"""Rows read, published and marked per batch: one Postgres read and one mark per batch."""
DEFAULT_POLL_INTERVAL = 0.1
"""Seconds between looks for new rows when there were none."""
BACKLOG_EVERY = 5.0
"""Seconds between reads of the backlog for ``dedup.outbox.pending`` and its age."""
MAX_BACKOFF = 5.0
"""Seconds a held-back batch waits at most before it is tried again (0.1 doubling)."""
PERMANENT = (
    aiokafka.errors.MessageSizeTooLargeError,
    aiokafka.errors.RecordTooLargeError,
    aiokafka.errors.InvalidTopicError,
)
"""What a broker (or the client) will never accept of a record: the row is marked failed."""


@dataclasses.dataclass
class RelayStats:
    """What a relay did since it started."""

    published: int = 0
    batches: int = 0
    failed: int = 0
    takeovers: int = 0
    """Times this relay took the lease."""
    waited: int = 0
    """Times it found another relay holding the lease."""
    held_back: int = 0
    """Batches held back by Kafka or Postgres (retried after a backoff)."""
    recovered: int = 0
    """Rows an exactly-once relay found published by the previous holder and marked sent."""


class Relay:
    """Publishes the outbox's Kafka records, once each, while it holds the relay's lease.

    Give it ``dsn`` (or an asyncpg ``pool``) and ``bootstrap_servers``;
    ``name`` names the lease (relays of one name take turns); ``mode`` is
    ``at_least_once`` or ``exactly_once`` (see the module).  :meth:`run`
    publishes until :meth:`stop`.
    """

    def __init__(
        self,
        *,
        bootstrap_servers: str | Sequence[str],
        dsn: str | None = None,
        pool: Any = None,
        name: str = "relay",
        mode: Mode = "at_least_once",
        holder: str | None = None,
        schema: str = sql.DEFAULT_SCHEMA,
        lease_ttl: float = DEFAULT_LEASE_TTL,
        batch_size: int = DEFAULT_BATCH_SIZE,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        state_topic: str = DEFAULT_STATE_TOPIC,
        kafka_options: Mapping[str, Any] | None = None,
        producer_options: Mapping[str, Any] | None = None,
        pool_options: Mapping[str, Any] | None = None,
    ) -> None:
        db.require_one(dsn, pool)
        if mode not in MODES:
            raise errors.ConfigurationError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.name = limits.check_text("relay name", name, limits.MAX_NAME_BYTES)
        self.holder = limits.check_text(
            "holder", holder or leases.default_holder(), limits.MAX_NAME_BYTES
        )
        limits.check_number(
            "lease_ttl", lease_ttl, limits.MIN_LEASE_TTL, limits.MAX_LEASE_TTL, whole=False
        )
        limits.check_number("batch_size", batch_size, 1, 100_000, whole=True)
        limits.check_number("poll_interval", poll_interval, 0.001, 60, whole=False)
        self.mode: Mode = mode
        self.schema = schema
        self.lease_ttl = float(lease_ttl)
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self.state_topic = state_topic
        self.bootstrap_servers = bootstrap_servers
        self.stats = RelayStats()
        self._kafka = kafka_client.client_options(kafka_options or {})
        self._producer_options = dict(producer_options or {})
        self._dsn = dsn
        self._pool = pool
        self._pool_options = dict(pool_options or {})
        self._q = sql.Queries(schema)
        self._stopping = asyncio.Event()
        self._lost = asyncio.Event()
        self._transactional_id: str | None = None
        self._backlog_at = 0.0

    @property
    def resource(self) -> str:
        """The lease every relay of this name competes for."""
        return f"relay:{self.name}"

    async def stop(self) -> None:
        """Make :meth:`run` return after the batch in flight (its lease released)."""
        self._stopping.set()

    async def run(self) -> None:
        """Wait for the lease, publish while holding it, and wait again; until :meth:`stop`."""
        self._stopping.clear()
        async with db.pool_for(
            self._dsn, self._pool, **{"min_size": 1, "max_size": 2, **self._pool_options}
        ) as pool:
            async with pool.acquire() as conn:
                await migrations.check(conn, schema=self.schema)
                database = await self._q.relay_database.fetchval(conn)
            self._transactional_id = f"dedup-relay.{database}.{self.schema}.{self.name}"
            book = leases.Leases(pool, schema=self.schema)
            try:
                while not self._stopping.is_set():
                    lease = await self._acquire(book)
                    if lease is not None:
                        await self._hold(pool, book, lease)
            finally:
                telemetry.outbox_backlog.pop(self.name, None)

    async def _acquire(self, book: leases.Leases) -> leases.Lease | None:
        """The lease, or None after waiting a while for its holder (or for stop())."""
        try:
            lease = await book.acquire(
                self.resource, self.holder, self.lease_ttl, namespace="relay", key=self.name
            )
        except db.DATABASE_ERRORS as exc:
            if not db.is_retriable(exc):
                raise
            log.warning("relay %s: Postgres unreachable, retrying: %r", self.name, exc)
            lease = None
        if lease is None:
            self.stats.waited += 1
            await self._pause(self.lease_ttl / 3)
        return lease

    async def _hold(self, pool: Any, book: leases.Leases, lease: leases.Lease) -> None:
        """Publish under ``lease`` until it is lost or the relay stops; then release it."""
        self._lost.clear()
        self.stats.takeovers += 1
        log.info("relay %s: %s holds the lease (token %s)", self.name, self.holder, lease.token)

        def lost(_: leases.Lease, error: errors.StaleTokenError) -> None:
            log.warning("relay %s: lease lost, publishing stops: %s", self.name, error)
            self._lost.set()

        try:
            async with book.watch(lease, lost) as watchdog:
                await self._publish_while_held(pool, book, watchdog)
        finally:
            if not self._lost.is_set():
                with contextlib.suppress(*db.DATABASE_ERRORS):
                    await book.release(lease)

    def _holding(self) -> bool:
        return not (self._stopping.is_set() or self._lost.is_set())

    async def _publish_while_held(
        self, pool: Any, book: leases.Leases, watchdog: leases.Watchdog
    ) -> None:
        backoff = 0.0
        producer: AIOKafkaProducer | None = None
        try:
            while self._holding():
                if backoff:
                    await self._pause(backoff)
                    if not self._holding():
                        return
                try:
                    if producer is None:
                        producer = await self._producer()
                        if self.mode == "exactly_once":
                            await self._recover(pool, book, watchdog.lease)
                    await self._observe_backlog(pool)
                    async with pool.acquire() as conn:
                        rows = await self._q.outbox_kafka_due.fetch(conn, limit=self.batch_size)
                    if not rows:
                        telemetry.outbox_backlog[self.name] = (0, 0.0)  # none pending now
                        backoff = 0.0
                        await self._pause(self.poll_interval)
                        continue
                    await self._publish(pool, book, watchdog.lease, producer, rows)
                    backoff = 0.0
                except errors.StaleTokenError:
                    self._lost.set()
                except aiokafka.errors.ProducerFenced:
                    log.warning("relay %s: a newer relay fenced this one's producer", self.name)
                    self._lost.set()
                except (aiokafka.errors.KafkaError, *db.DATABASE_ERRORS) as exc:
                    if isinstance(exc, asyncpg.PostgresError) and not db.is_retriable(exc):
                        raise
                    self.stats.held_back += 1
                    backoff = min(max(backoff * 2, 0.1), MAX_BACKOFF)
                    log.warning(
                        "relay %s: publishing held back, retrying in %.1fs: %r",
                        self.name, backoff, exc,
                    )  # fmt: skip
                    if producer is not None and self.mode == "exactly_once":
                        # A transactional producer in doubt starts over (and recovers).
                        await _close(producer)
                        producer = None
        finally:
            if producer is not None:
                await _close(producer)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)

    async def _producer(self) -> AIOKafkaProducer:
        options: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": self.holder,
            "acks": "all",
            "enable_idempotence": True,
            **self._kafka,
            **self._producer_options,
        }
        if self.mode == "exactly_once":
            await self._create_state_topic()
            options["transactional_id"] = self._transactional_id
        producer = AIOKafkaProducer(**options)
        try:
            await producer.start()  # a transactional producer's init_transactions fences
        except BaseException:
            await _close(producer)
            raise
        return producer

    async def _create_state_topic(self) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap_servers, **self._kafka)
        await admin.start()
        try:
            brokers = len((await admin.describe_cluster())["brokers"])
            topic = NewTopic(
                self.state_topic,
                num_partitions=1,
                replication_factor=min(3, brokers),
                topic_configs={"cleanup.policy": "compact", "segment.ms": "3600000"},
            )
            with contextlib.suppress(aiokafka.errors.TopicAlreadyExistsError):
                await admin.create_topics([topic])
        finally:
            await admin.close()

    async def _recover(self, pool: Any, book: leases.Leases, lease: leases.Lease) -> None:
        """Mark sent the rows of the last batch committed to Kafka (by any holder)."""
        ids = await self._last_committed_batch()
        if not ids:
            return
        async with pool.acquire() as conn, conn.transaction():
            marked = await self._q.outbox_kafka_mark.fetchval(
                conn, ids=ids, status="sent", error=None
            )
            await book.check(conn, lease)
        if marked:
            log.info("relay %s: %d rows the last holder published marked sent", self.name, marked)
            self.stats.recovered += marked

    async def _last_committed_batch(self) -> list[int]:
        """The row ids of the latest committed state record of this relay, read_committed."""
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap_servers,
            isolation_level="read_committed",
            enable_auto_commit=False,
            **self._kafka,
        )
        await consumer.start()
        try:
            tp = TopicPartition(self.state_topic, 0)
            consumer.assign([tp])
            end = (await consumer.end_offsets([tp]))[tp]
            back = 64
            while True:
                start = max(0, end - back)
                found = await _last_of(consumer, tp, start, end, self._transactional_id or "")
                if found is not None or start == 0:
                    return found or []
                back *= 4
        finally:
            await consumer.stop()

    async def _publish(
        self,
        pool: Any,
        book: leases.Leases,
        lease: leases.Lease,
        producer: AIOKafkaProducer,
        rows: Sequence[asyncpg.Record],
    ) -> None:
        links, _ = telemetry.producer_links(_headers(row) for row in rows)
        with telemetry.tracer.start_as_current_span(
            f"publish {self.name}",
            kind=trace.SpanKind.PRODUCER,
            links=links,
            attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "send",
                "messaging.batch.message_count": len(rows),
                "dedup.relay": self.name,
            },
        ):
            spot = {"pool": pool, "ids": [row["id"] for row in rows], "token": lease.token}
            await faults.point(faults.Point.RELAY_BEFORE_SEND, **spot)
            if self.mode == "exactly_once":
                sent, failed = await self._send_in_transaction(producer, rows)
            else:
                sent, failed = await self._send(producer, rows)
            await faults.point(faults.Point.RELAY_AFTER_SEND, **spot)
            await self._mark(pool, book, lease, rows, sent, failed)

    async def _send(
        self, producer: AIOKafkaProducer, rows: Sequence[asyncpg.Record]
    ) -> tuple[list[int], dict[int, str]]:
        """Send every row and wait for the broker's acknowledgements; (sent ids, failed ids)."""
        failed: dict[int, str] = {}
        pending = []
        for row in rows:
            try:
                pending.append((row["id"], await producer.send(**_record(row))))
            except PERMANENT as exc:
                failed[row["id"]] = repr(exc)
        sent = []
        for id_, future in pending:
            try:
                await future
            except PERMANENT as exc:
                failed[id_] = repr(exc)
            else:
                sent.append(id_)
        return sent, failed

    async def _send_in_transaction(
        self, producer: AIOKafkaProducer, rows: Sequence[asyncpg.Record]
    ) -> tuple[list[int], dict[int, str]]:
        """The rows and the batch's state record in one Kafka transaction, committed."""
        try:
            async with producer.transaction():
                sent, failed = await self._send(producer, rows)
                if failed:
                    # A record refused fails the transaction: abort it, mark the refused
                    # rows failed and send the others in the next one.
                    raise _Refused  # noqa: TRY301 - it aborts the transaction around it
                state = orjson.dumps({"ids": sent, "holder": self.holder})
                key = (self._transactional_id or "").encode()
                await producer.send(self.state_topic, state, key=key, partition=0)
        except _Refused:
            return [], failed
        return sent, failed

    async def _mark(
        self,
        pool: Any,
        book: leases.Leases,
        lease: leases.Lease,
        rows: Sequence[asyncpg.Record],
        sent: list[int],
        failed: Mapping[int, str],
    ) -> None:
        """The batch's rows marked in one transaction, fenced by the lease, with its event."""
        async with pool.acquire() as conn, conn.transaction():
            await self._q.outbox_kafka_mark.fetchval(conn, ids=sent, status="sent", error=None)
            for id_, why in failed.items():
                await self._q.outbox_kafka_mark.fetchval(
                    conn, ids=[id_], status="failed", error=why
                )
            topics = sorted({row["topic"] for row in rows})
            await events.record(
                conn,
                self.schema,
                [
                    events.Event(
                        subject="relay",
                        kind="published",
                        namespace="relay",
                        key=self.name,
                        resource=lease.resource,
                        holder=self.holder,
                        token=lease.token,
                        detail={
                            "published": len(sent),
                            "failed": len(failed),
                            "first_id": rows[0]["id"],
                            "last_id": rows[-1]["id"],
                            "topics": topics,
                            "mode": self.mode,
                        },
                    )
                ],
            )
            await book.check(conn, lease)
        self.stats.published += len(sent)
        self.stats.failed += len(failed)
        self.stats.batches += 1
        telemetry.outbox_published.add(len(sent), {"dedup.relay": self.name})
        for id_, why in failed.items():
            log.error("relay %s: outbox row %s refused for good: %s", self.name, id_, why)

    async def _observe_backlog(self, pool: Any) -> None:
        now = time.monotonic()
        if now - self._backlog_at < BACKLOG_EVERY:
            return
        self._backlog_at = now
        async with pool.acquire() as conn:
            row = await self._q.outbox_backlog.fetchrow(conn)
        telemetry.outbox_backlog[self.name] = (row["pending"], row["oldest"])


def _record(row: asyncpg.Record) -> dict[str, Any]:
    """aiokafka's ``send`` arguments for an outbox row."""
    headers = [
        *_headers(row),
        (outbox.KEY_HEADER, row["key"].encode()),
        (outbox.TOKEN_HEADER, str(row["token"] or 0).encode()),
    ]
    return {
        "topic": row["topic"],
        "value": row["value"],
        "key": row["message_key"],
        "headers": headers,
    }


def _headers(row: asyncpg.Record) -> list[tuple[str, bytes | None]]:
    return list(zip(row["header_names"] or (), row["header_values"] or (), strict=True))


class _Refused(Exception):
    """A record of an exactly-once batch was refused for good: its transaction aborts."""


STATE_READ_TIMEOUT = 30.0
"""Seconds an exactly-once relay may take to read the state topic up to its end."""


async def _last_of(
    consumer: AIOKafkaConsumer, tp: TopicPartition, start: int, end: int, key: str
) -> list[int] | None:
    """The ids of the last record keyed ``key`` between offsets ``start`` and ``end``."""
    found = None
    if end <= start:
        return None
    consumer.seek(tp, start)
    deadline = time.monotonic() + STATE_READ_TIMEOUT
    while await consumer.position(tp) < end:
        if time.monotonic() > deadline:
            raise aiokafka.errors.KafkaTimeoutError(
                f"the state topic {tp.topic} was not read to offset {end} in {STATE_READ_TIMEOUT}s"
            )
        batch = await consumer.getmany(tp, timeout_ms=1000)
        for record in batch.get(tp, []):
            if record.offset < end and record.key == key.encode():
                found = orjson.loads(record.value)["ids"]
    return found


async def _close(producer: AIOKafkaProducer) -> None:
    with contextlib.suppress(Exception):
        await producer.stop()
