"""The idempotent Kafka consumer, and ``wrap`` for hand-written aiokafka loops.

One Postgres transaction per batch of one partition (see :mod:`dedup.store`):
fence + claim, handler on the fresh keys, dead letters and events, COMMIT; the
offset lives in Postgres in that same transaction.  Kafka offsets are committed
afterwards, every ``kafka_commit_interval`` seconds, for lag tools only: on
assignment the consumer seeks to the offset stored in Postgres, and once after
each assignment it writes that offset to Kafka, whatever Kafka held.

The stored offset follows Kafka's fetch position, not just the last record
handled: Kafka hands out no transaction markers and, under ``read_committed``,
no records of aborted transactions, yet its position moves past them; when it
does, the stored offset moves there too (under the fence), so a caught-up group
shows no lag.  ``dedup offsets rewind|skip`` moves a partition by taking it with
a new token; the consumer finds that within ``kafka_commit_interval`` and takes
the partition back from the offset the operator set.

Partitions are independent, so up to ``concurrency`` of them run their
transactions at once, each on a connection of its own (a *lane*); a partition's
batches stay in offset order on one lane.

Failure handling, in order of preference:

- a transient error (lost connection, serialization failure, deadlock, broker
  hiccup) retries the same batch with backoff, for as long as it takes;
- a handler error splits the batch in halves until the failing message stands
  alone (no SAVEPOINT per message on the happy path), retries it
  ``max_attempts`` times, then dead-letters it whole; the partition moves on;
- a stale fencing token (another owner took the partition) rolls the batch
  back and stops work on that partition until Kafka assigns it again; when the
  newer token is an operator's (``dedup offsets``), the consumer takes the
  partition back at once, from the offset the operator set.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
import socket
import time
import types
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiokafka
import aiokafka.errors
import asyncpg
from aiokafka.structs import TopicPartition

from dedup import db, decoding, errors, events, keys, offsets, store, telemetry
from dedup import message as message_

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 500
DEFAULT_CONCURRENCY = 4
DEFAULT_ISOLATION_LEVEL = "read_committed"
"""Records of aborted transactions are skipped (aiokafka's own default is read_uncommitted)."""
DEFAULT_KEY = keys.first(keys.header("idempotency-key"), keys.kafka_key())
"""The ``idempotency-key`` header if present, else the Kafka record key."""

STAT_NAMES = (
    "messages",
    "processed",
    "duplicates",
    "conflicts",
    "dead_lettered",
    "stale",
    "retries",
    "batches",
)

# A takeover waits at most this long for an old owner's open transaction; an old
# owner that is paused is cut off sooner by db.IDLE_IN_TRANSACTION_TIMEOUT_MS.
TAKEOVER_LOCK_TIMEOUT = "15s"
MAX_BACKOFF = 5.0

_AIOKAFKA_OPTIONS = frozenset(inspect.signature(aiokafka.AIOKafkaConsumer.__init__).parameters) - {
    "self",
    "topics",
}


class _Lane:
    """A connection of the consumer's, kept from one transaction to the next."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._conn: asyncpg.Connection | None = None

    async def connection(self) -> asyncpg.Connection:
        if self._conn is None or not _usable(self._conn):
            await self.release()
            self._conn = await self._pool.acquire()
        return self._conn

    async def release(self) -> None:
        """Give the connection back (after a transient failure: start again on a fresh one)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await self._pool.release(conn, timeout=5)


@dataclass(slots=True)
class _Partition:
    """What this consumer holds for one assigned partition."""

    token: int
    expected: int | None  # next_offset in Postgres as we last left it
    committed_to_kafka: int | None = None


def _is_batch_handler(handler: Callable[..., Any]) -> bool:
    """True when the handler's first parameter is annotated as a list or sequence."""
    try:
        params = list(inspect.signature(handler).parameters.values())
    except (TypeError, ValueError):
        return False
    if not params or params[0].annotation is inspect.Parameter.empty:
        return False
    text = str(params[0].annotation).replace("typing.", "").replace("collections.abc.", "")
    return text.startswith(("list[", "List[", "Sequence[", "<class 'list'>"))


def _default_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def _take_key(
    strategy: keys.Strategy, on_missing_key: str, msg: message_.Message
) -> store.DeadLetter | None:
    """Set ``msg.idempotency_key``; return a dead letter when there is none to set."""
    try:
        msg.idempotency_key = keys.extract(strategy, msg)
    except errors.KeyExtractionError as exc:
        if on_missing_key == "offset":
            msg.idempotency_key = msg.where
            return None
        return store.DeadLetter(msg, f"no idempotency key: {exc}")
    return None


class IdempotentConsumer:
    """Consume Kafka topics and apply each message's effect in Postgres exactly once.

    ``handler`` is ``async (msg: Message, tx: Tx) -> object``, called once per
    fresh message with ``tx.conn`` inside the batch's transaction; or a batch
    handler ``async (msgs: list[Message], tx: Tx) -> None`` that receives the
    fresh messages of one transaction in offset order (chosen with
    ``batch=True``, or found from a ``list[...]`` annotation on its first
    parameter).

    Keyword options that aiokafka's consumer knows (``auto_offset_reset``,
    ``session_timeout_ms``, ``security_protocol``, ``ssl_context``, SASL
    settings, ...) pass through under aiokafka's names.  Offsets are never
    auto-committed: Postgres holds them.  ``isolation_level`` defaults to
    ``"read_committed"``: records of aborted producer transactions are never
    applied.

    A record batch that cannot be decoded stops :meth:`run` with
    :class:`dedup.UndecodableBatchError`, naming the partition and offset.
    """

    def __init__(
        self,
        handler: Callable[..., Awaitable[object]],
        *,
        topics: Sequence[str],
        group_id: str,
        bootstrap_servers: str | Sequence[str],
        dsn: str | None = None,
        pool: Any = None,
        key: keys.Strategy = DEFAULT_KEY,
        namespace: str | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        concurrency: int = DEFAULT_CONCURRENCY,
        batch: bool | None = None,
        schema: str = "dedup",
        holder: str | None = None,
        on_missing_key: str = "dead_letter",
        on_conflict: str = "dead_letter",
        max_attempts: int = 3,
        install_signal_handlers: bool = True,
        shutdown_timeout: float = 30.0,
        kafka_commit_interval: float = 1.0,
        **options: Any,
    ) -> None:
        if (dsn is None) == (pool is None):
            raise errors.ConfigurationError("pass exactly one of dsn= or pool=")
        if isinstance(topics, str) or not topics:
            raise errors.ConfigurationError("topics must be a non-empty list of topic names")
        if not group_id:
            raise errors.ConfigurationError("group_id must be set")
        if not 1 <= batch_size <= 100_000:
            raise errors.ConfigurationError(f"batch_size={batch_size}: expected 1 to 100000")
        if not 1 <= concurrency <= 64:
            raise errors.ConfigurationError(f"concurrency={concurrency}: expected 1 to 64")
        if max_attempts < 1:
            raise errors.ConfigurationError(f"max_attempts={max_attempts}: expected 1 or more")
        if on_missing_key not in ("dead_letter", "offset"):
            raise errors.ConfigurationError(
                f"on_missing_key={on_missing_key!r}: expected 'dead_letter' or 'offset'"
            )
        unknown = sorted(set(options) - _AIOKAFKA_OPTIONS)
        if unknown:
            raise errors.ConfigurationError(
                f"unknown option(s) {', '.join(unknown)}: not a dedup setting nor an "
                "aiokafka consumer option"
            )
        if options.get("enable_auto_commit"):
            raise errors.ConfigurationError(
                "enable_auto_commit=True: dedup stores offsets in Postgres; leave it off"
            )
        options.pop("enable_auto_commit", None)
        # Records of aborted transactions must never be applied: read only what
        # producers committed, unless the caller says otherwise.
        options.setdefault("isolation_level", DEFAULT_ISOLATION_LEVEL)
        if options["isolation_level"] not in ("read_committed", "read_uncommitted"):
            raise errors.ConfigurationError(
                f"isolation_level={options['isolation_level']!r}: expected 'read_committed' "
                "(the default) or 'read_uncommitted'"
            )

        self.handler = handler
        self.topics = list(topics)
        self.group_id = group_id
        self.bootstrap_servers = bootstrap_servers
        self.namespace = namespace or group_id
        self.batch_size = batch_size
        self.concurrency = concurrency
        self.batch_handler = _is_batch_handler(handler) if batch is None else batch
        self.holder = holder or _default_holder()
        self.key = key
        self.on_missing_key = on_missing_key
        self.max_attempts = max_attempts
        self.install_signal_handlers = install_signal_handlers
        self.shutdown_timeout = shutdown_timeout
        self.kafka_commit_interval = kafka_commit_interval
        self.store = store.Store(  # validates the schema name and the conflict policy
            schema_name=schema, namespace=self.namespace, conflict_policy=on_conflict
        )
        self._dsn = dsn
        self._pool = pool
        self._own_pool = pool is None
        self._options = options
        self._stats = dict.fromkeys(STAT_NAMES, 0)
        self._owned: dict[TopicPartition, _Partition] = {}
        self._work = asyncio.Lock()
        self._stopping = asyncio.Event()
        self._stopped = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._kafka: Any = None
        self._lanes: list[_Lane] = []
        self._idle: asyncio.Queue[_Lane] = asyncio.Queue()
        self._last_kafka_commit = 0.0
        self._last_owner_check = 0.0
        self._database = ""

    @property
    def stats(self) -> Mapping[str, int]:
        """Counters since start.

        ``messages`` (records committed, whatever their outcome), ``processed``
        (applied), ``duplicates``, ``conflicts``, ``dead_lettered`` (conflicts
        included under the default policy), ``stale`` (batches refused by the
        fence), ``retries``, ``batches`` (transactions committed).
        """
        return types.MappingProxyType(self._stats)

    @property
    def assignment(self) -> set[tuple[str, int]]:
        """The partitions this consumer holds a current token for."""
        return {(tp.topic, tp.partition) for tp in self._owned}

    # ------------------------------------------------------------ lifecycle --

    async def run(self) -> None:
        """Consume until :meth:`stop`, SIGTERM or SIGINT; a clean exit commits what was handled."""
        if self._task is not None:
            raise errors.ConfigurationError("this consumer is already running")
        self._task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if self.install_signal_handlers else ()
        for sig in signals:
            loop.add_signal_handler(sig, self._stopping.set)
        try:
            await self._start()
            while not self._stopping.is_set():
                await self._poll_once()
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
            await self._shutdown()
            self._stopped.set()

    async def stop(self) -> None:
        """Finish or roll back the batch in flight, commit what was handled, and return.

        Waits up to ``shutdown_timeout`` seconds, then cancels the batch in flight
        (its transaction rolls back, so its messages will be delivered again).
        """
        self._stopping.set()
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._stopped.wait()), self.shutdown_timeout)
        except TimeoutError:
            log.warning(
                "consumer %s did not stop in %.0fs; cancelling", self.holder, self.shutdown_timeout
            )
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stopped.wait()

    async def _start(self) -> None:
        if self._dsn is not None:
            self._pool = await db.create_pool(self._dsn, min_size=1, max_size=self.concurrency)
        # A lane keeps its connection while the consumer runs.  In a pool of the
        # caller's, one connection stays free for the caller's own code.
        lanes = self.concurrency
        if not self._own_pool:
            lanes = max(1, min(lanes, _pool_size(self._pool) - 1))
        self._lanes = [_Lane(self._pool) for _ in range(lanes)]
        for lane in self._lanes:
            self._idle.put_nowait(lane)
        await self._check_schema()
        self._database = await self._pool.fetchval("SELECT current_database()")
        self._kafka = aiokafka.AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap_servers,
            group_id=self.group_id,
            enable_auto_commit=False,
            **self._options,
        )
        try:
            await self._kafka.start()
            present = await self._kafka.topics()
        except aiokafka.errors.KafkaError as exc:
            await self._kafka.stop()
            raise errors.ServiceUnavailableError(
                f"cannot reach Kafka at bootstrap_servers={self.bootstrap_servers!r}: {exc}"
            ) from exc
        missing = [t for t in self.topics if t not in present]
        if missing:
            await self._kafka.stop()
            raise errors.ConfigurationError(
                f"topics: {', '.join(map(repr, missing))} not found on {self.bootstrap_servers}; "
                "create them first"
            )
        self._kafka.subscribe(self.topics, listener=_Rebalance(self))
        log.info("consumer %s started on %s (group %s)", self.holder, self.topics, self.group_id)

    async def _check_schema(self) -> None:
        name = self.store.schema_name
        found = await self._pool.fetchval("SELECT to_regclass($1)", f'"{name}".processed')
        if found is None:
            raise errors.ConfigurationError(
                f"no dedup tables in schema {name!r}: run `dedup migrate --dsn ...` first"
            )

    async def _shutdown(self) -> None:
        if self._kafka is not None:
            with contextlib.suppress(aiokafka.errors.KafkaError):
                await self._commit_kafka(force=True)
            # Leaving the group revokes our partitions (the listener needs the DB).
            await self._kafka.stop()
            self._kafka = None
        for lane in self._lanes:
            await lane.release()
        if self._own_pool and self._pool is not None:
            await self._pool.close()
            self._pool = None
        log.info("consumer %s stopped: %s", self.holder, dict(self._stats))

    # ----------------------------------------------------------------- loop --

    async def _poll_once(self) -> None:
        try:
            fetched = await self._kafka.getmany(timeout_ms=250, max_records=self.batch_size)
            # getmany fills max_records from one partition after another; ask each
            # other partition for what the fetcher already holds, so that every
            # lane has a batch.  aiokafka's fetch buffers bound the memory.
            if fetched and len(self._lanes) > 1:
                for tp in self._owned.keys() - fetched.keys():
                    fetched.update(
                        await self._kafka.getmany(tp, timeout_ms=0, max_records=self.batch_size)
                    )
        except Exception as exc:
            failure = decoding.locate(exc)
            if failure is not None or isinstance(exc, decoding.ERRORS):
                # aiokafka has already moved other partitions past records it
                # dropped with this error: going on would skip them.
                raise await decoding.error(exc, failure, self._kafka, self.group_id) from exc
            if not isinstance(exc, aiokafka.errors.KafkaError) or not exc.retriable:
                raise
            log.warning("kafka fetch failed, retrying: %r", exc)
            await self._sleep(1.0)
            return
        # A rebalance waits (self._work) until every partition's batch in flight
        # has committed or rolled back.
        async with self._work:
            if len(fetched) == 1 or len(self._lanes) == 1:
                for tp, records in fetched.items():
                    await self._process_partition(tp, records)
            else:
                try:
                    async with asyncio.TaskGroup() as group:
                        for tp, records in fetched.items():
                            group.create_task(self._process_partition(tp, records))
                except BaseExceptionGroup as failed:
                    raise failed.exceptions[0] from None
            # Nothing is in flight now: every record fetched is applied.
            await self._follow_fetch_positions()
            await self._check_owners()
        await self._commit_kafka()

    async def _process_partition(self, tp: TopicPartition, records: Sequence[Any]) -> None:
        part = self._owned.get(tp)
        if part is None or self._stopping.is_set():  # revoked or lost since the fetch
            return
        floor = part.expected if part.expected is not None else -1
        msgs = [message_.Message.from_record(r) for r in records if r.offset >= floor]
        lane = await self._idle.get()
        try:
            for start in range(0, len(msgs), self.batch_size):
                keyed, dead = [], []
                for msg in msgs[start : start + self.batch_size]:
                    letter = _take_key(self.key, self.on_missing_key, msg)
                    if letter is None:
                        keyed.append(msg)
                    else:
                        dead.append(letter)
                if not await self._apply_retrying(lane, tp, part, keyed, dead):
                    return
        finally:
            self._idle.put_nowait(lane)

    async def _apply_retrying(
        self,
        lane: _Lane,
        tp: TopicPartition,
        part: _Partition,
        msgs: list[message_.Message],
        dead: list[store.DeadLetter],
    ) -> bool:
        """Apply one batch, retrying transient failures; False when the partition is gone."""
        delay = 0.1
        while True:
            try:
                try:
                    await self._apply_isolating(lane, tp, part, msgs, dead)
                except errors.StaleTokenError as exc:
                    if not await self._refused(lane, tp, part, exc):
                        return False
                else:
                    return True
                # Our own earlier COMMIT went through though its answer was lost:
                # carry on from where it left the partition.
                landed = part.expected
                assert landed is not None  # noqa: S101 (_refused set it)
                msgs = [m for m in msgs if m.offset >= landed]
                dead = [d for d in dead if d.msg.offset >= landed]
                if not msgs and not dead:
                    return True
            except Exception as exc:
                if not db.is_retriable(exc):
                    raise
                self._stats["retries"] += 1
                telemetry.transition("retried", {"error": store.describe(exc)})
                log.warning("batch of %s failed (%r); retrying in %.1fs", tp, exc, delay)
                await lane.release()
                if not await self._sleep(delay):
                    return False  # stopping: the batch rolled back and will be redelivered
                delay = min(delay * 2, MAX_BACKOFF)

    async def _refused(
        self, lane: _Lane, tp: TopicPartition, part: _Partition, exc: errors.StaleTokenError
    ) -> bool:
        """The fence refused a write: True if ``tp`` is still ours from ``part.expected``.

        A fence fails for one of three reasons:

        - a COMMIT of ours succeeded on the server but its answer never came
          back, so the retry fenced on the old offset: our token still holds
          the partition, at a later offset (True, ``part.expected`` moved there);
        - an operator's ``dedup offsets`` moved the partition while Kafka still
          assigns it to us: take it back from the offset it set (False: the
          records fetched before belong to the old position);
        - another consumer took it: stop until Kafka assigns it to us again.
        """
        conn = await lane.connection()
        now = await self.store.position(conn, self.group_id, tp.topic, tp.partition)
        if now is None:
            await self._lose(lane, tp, part, exc)
            return False
        if now.token == part.token:
            if now.next_offset is not None and (
                part.expected is None or now.next_offset > part.expected
            ):
                log.info("%s: a write in doubt had landed; resuming at %d", tp, now.next_offset)
                part.expected = now.next_offset
                return True
        elif offsets.is_operator(now.holder) and tp in self._kafka.assignment():
            await self._retake(lane, tp, now)
            return False
        await self._lose(lane, tp, part, exc)
        return False

    async def _follow_fetch_positions(self) -> None:
        """Store Kafka's fetch position where it passed records we were never handed.

        Transaction markers, records of aborted transactions (under
        ``read_committed``) and compacted gaps move aiokafka's position without
        reaching ``getmany``'s answer, sometimes in a fetch of their own.  Called
        when no batch is in flight, so every record fetched is applied and a
        position beyond ``part.expected`` holds nothing to apply.  On a topic
        without transactions the position equals ``part.expected``: no round trip.
        """
        if self._stopping.is_set():
            return
        for tp, part in list(self._owned.items()):
            position = _fetch_position(self._kafka, tp)
            if position is None or (part.expected is not None and position <= part.expected):
                continue
            lane = await self._idle.get()
            try:
                await self._advance(lane, tp, part, position)
            finally:
                self._idle.put_nowait(lane)

    async def _advance(self, lane: _Lane, tp: TopicPartition, part: _Partition, to: int) -> None:
        """Store ``to`` as ``tp``'s offset under the fence; on failure the next poll tries again."""
        fence = store.Fence(self.group_id, part.token, part.expected)
        try:
            try:
                conn = await lane.connection()
                await self.store.advance(conn, fence, tp.topic, tp.partition, to)
            except errors.StaleTokenError as exc:
                await self._refused(lane, tp, part, exc)
                return
        except Exception as exc:
            if not db.is_retriable(exc):
                raise
            log.warning("moving the offset of %s to %d failed (%r); trying again", tp, to, exc)
            await lane.release()
            return
        log.debug("%s: offset moves past records not handed out, to %d", tp, to)
        part.expected = to

    async def _check_owners(self) -> None:
        """Every ``kafka_commit_interval``, look for partitions of ours taken in Postgres.

        A busy partition learns of a newer token from its next batch's fence; an
        idle one would not until a message came, so an operator's ``dedup
        offsets rewind`` would wait for traffic.  One statement for all partitions.
        """
        now = time.monotonic()
        if not self._owned or now - self._last_owner_check < self.kafka_commit_interval:
            return
        self._last_owner_check = now
        lane = await self._idle.get()
        try:
            conn = await lane.connection()
            stored = await self.store.positions(
                conn, self.group_id, [(tp.topic, tp.partition) for tp in self._owned]
            )
            for tp, part in list(self._owned.items()):
                found = stored.get((tp.topic, tp.partition))
                if found is not None and found.token != part.token:
                    resource = f"{self.group_id}:{tp.topic}:{tp.partition}"
                    stale = errors.StaleTokenError(resource, part.token)
                    await self._refused(lane, tp, part, stale)
        except Exception as exc:
            if not db.is_retriable(exc):
                raise
            log.warning("checking partition owners failed (%r); trying again", exc)
            await lane.release()
        finally:
            self._idle.put_nowait(lane)

    async def _apply_isolating(
        self,
        lane: _Lane,
        tp: TopicPartition,
        part: _Partition,
        msgs: list[message_.Message],
        dead: list[store.DeadLetter],
    ) -> None:
        """Apply a batch; on a handler error, split it to find and dead-letter the culprit."""
        failure = await self._try_transaction(lane, tp, part, msgs, dead)
        if failure is None:
            return
        if len(msgs) > 1:
            half = len(msgs) // 2
            left, right = msgs[:half], msgs[half:]
            split_at = right[0].offset
            log.info("handler failed on a batch of %d from %s; splitting", len(msgs), tp)
            await self._apply_isolating(
                lane, tp, part, left, [d for d in dead if d.msg.offset < split_at]
            )
            await self._apply_isolating(
                lane, tp, part, right, [d for d in dead if d.msg.offset >= split_at]
            )
            return
        msg = msgs[0]
        for attempt in range(2, self.max_attempts + 1):
            self._stats["retries"] += 1
            telemetry.transition("retried", {"key": msg.idempotency_key, "attempt": attempt})
            await self._sleep(min(0.05 * 2**attempt, MAX_BACKOFF))
            failure = await self._try_transaction(lane, tp, part, [msg], dead)
            if failure is None:
                return
        log.warning(
            "dead-lettering %s after %d attempts: %s",
            msg.where,
            self.max_attempts,
            type(failure).__name__,
        )
        letter = store.DeadLetter(
            msg,
            f"handler failed {self.max_attempts} times",
            error=store.describe(failure),
            attempts=self.max_attempts,
        )
        await self._transaction(lane, tp, part, [], [*dead, letter])

    async def _try_transaction(
        self,
        lane: _Lane,
        tp: TopicPartition,
        part: _Partition,
        msgs: list[message_.Message],
        dead: list[store.DeadLetter],
    ) -> Exception | None:
        """Run one transaction; return the handler's error, raise anything retriable or stale."""
        try:
            await self._transaction(lane, tp, part, msgs, dead)
        except errors.StaleTokenError:
            raise
        except Exception as exc:
            if db.is_retriable(exc) or not msgs:
                raise
            return exc
        return None

    async def _transaction(
        self,
        lane: _Lane,
        tp: TopicPartition,
        part: _Partition,
        msgs: list[message_.Message],
        dead: list[store.DeadLetter],
    ) -> None:
        batch = len(msgs) + len(dead)
        attributes: dict[str, Any] = {
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": tp.topic,
            "messaging.destination.partition.id": str(tp.partition),
            "messaging.consumer.group.name": self.group_id,
            "messaging.kafka.offset": (msgs or [d.msg for d in dead])[0].offset,
            "messaging.batch.message_count": batch,
            "dedup.namespace": self.namespace,
            "dedup.token": part.token,
        }
        if batch == 1 and msgs and msgs[0].key is not None:
            key = telemetry.key_attribute(msgs[0].key)
            if key is not None:
                attributes["messaging.kafka.message.key"] = key
        links, dropped = telemetry.producer_links(m.raw_headers for m in msgs)
        if dropped:
            attributes["dedup.links.dropped"] = dropped
        started = time.perf_counter()
        with telemetry.consumer_span(f"process {tp.topic}", attributes, links):
            conn = await lane.connection()
            with telemetry.client_span(
                f"BATCH {self.store.schema_name}.processed",
                {
                    "db.operation.name": "BATCH",
                    "db.collection.name": "processed",
                    "db.namespace": self._database,
                    "db.operation.batch.size": batch,
                },
            ):
                async with conn.transaction():
                    result = await self.store.apply(
                        conn,
                        msgs,
                        handler=self.handler,
                        batch_handler=self.batch_handler,
                        fence=store.Fence(self.group_id, part.token, part.expected),
                        dead=dead,
                    )
        part.expected = result.next_offset
        self._count(result, batch, time.perf_counter() - started, tp)

    def _count(
        self, result: store.BatchResult, batch: int, elapsed: float, tp: TopicPartition
    ) -> None:
        stats = self._stats
        stats["batches"] += 1
        stats["messages"] += batch
        stats["processed"] += len(result.applied)
        stats["duplicates"] += len(result.duplicates)
        stats["conflicts"] += len(result.conflicts)
        stats["dead_lettered"] += len(result.dead_letters)
        attrs = {"messaging.destination.name": tp.topic, "dedup.namespace": self.namespace}
        telemetry.processed.add(len(result.applied), attrs)
        if result.duplicates:
            telemetry.duplicates.add(len(result.duplicates), attrs)
        if result.conflicts:
            telemetry.conflicts.add(len(result.conflicts), attrs)
        if result.dead_letters:
            telemetry.dead_lettered.add(len(result.dead_letters), attrs)
        telemetry.batch_size.record(batch, attrs)
        telemetry.transaction_duration.record(elapsed, attrs)
        if result.applied:
            lag = time.time() - result.applied[-1].timestamp / 1000
            telemetry.end_to_end_lag.record(max(lag, 0.0), attrs)

    # ------------------------------------------------------------ ownership --

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        if not assigned:
            return
        wanted = sorted((tp.topic, tp.partition) for tp in assigned)
        with telemetry.tracer.start_as_current_span(
            "dedup assign", attributes={"messaging.consumer.group.name": self.group_id}
        ):
            await self._take(assigned, wanted)
        log.info("consumer %s took %s", self.holder, wanted)

    async def _take(self, assigned: set[TopicPartition], wanted: list[tuple[str, int]]) -> None:
        async with self._work:
            delay = 0.1
            while True:
                try:
                    taken = await self._take_rows(self._lanes[0], wanted)  # no batch runs now
                    break
                except Exception as exc:
                    if not db.is_retriable(exc) or self._stopping.is_set():
                        raise
                    self._stats["retries"] += 1
                    log.warning("taking partitions %s failed (%r); retrying", wanted, exc)
                    await self._lanes[0].release()
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, MAX_BACKOFF)
            for tp in assigned:
                self._own(tp, *taken[(tp.topic, tp.partition)])

    async def _take_rows(
        self, lane: _Lane, wanted: list[tuple[str, int]]
    ) -> dict[tuple[str, int], tuple[int, int | None]]:
        conn = await lane.connection()
        async with conn.transaction():
            await conn.execute(f"SET LOCAL lock_timeout = '{TAKEOVER_LOCK_TIMEOUT}'")
            return await self.store.take_partitions(conn, self.group_id, self.holder, wanted)

    def _own(self, tp: TopicPartition, token: int, next_offset: int | None) -> None:
        """Hold ``tp`` under ``token`` from the stored offset; Kafka gets it at the next commit."""
        self._owned[tp] = _Partition(token, next_offset)
        if next_offset is not None:
            self._kafka.seek(tp, next_offset)
        if tp in self._kafka.paused():
            self._kafka.resume(tp)

    async def _retake(self, lane: _Lane, tp: TopicPartition, moved: store.Position) -> None:
        """``dedup offsets`` moved ``tp``: take it with a new token, from the offset it set."""
        log.info(
            "consumer %s: %s was moved to offset %s by %r; taking it back",
            self.holder,
            tp,
            moved.next_offset,
            moved.holder,
        )
        taken = await self._take_rows(lane, [(tp.topic, tp.partition)])
        self._own(tp, *taken[(tp.topic, tp.partition)])

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        async with self._work:  # waits for the batch in flight to commit or roll back
            with contextlib.suppress(aiokafka.errors.KafkaError):
                await self._commit_kafka(force=True)
            gone = [(tp, self._owned.pop(tp)) for tp in revoked if tp in self._owned]
        for tp, part in gone:
            telemetry.transition(
                "partition_revoked",
                {"resource": f"{self.group_id}:{tp.topic}:{tp.partition}", "token": part.token},
            )
        if gone:
            log.info("consumer %s gave up %s", self.holder, [str(tp) for tp, _ in gone])

    async def _lose(
        self, lane: _Lane, tp: TopicPartition, part: _Partition, exc: errors.StaleTokenError
    ) -> None:
        """A newer owner holds ``tp``: stop working on it until Kafka assigns it to us again."""
        self._owned.pop(tp, None)
        self._kafka.pause(tp)
        self._stats["stale"] += 1
        telemetry.stale_rejections.add(1, {"messaging.destination.name": tp.topic})
        log.warning("consumer %s: %s", self.holder, exc)
        event = events.Event(
            "partition",
            "stale_rejected",
            namespace=self.namespace,
            resource=exc.resource,
            holder=self.holder,
            token=part.token,
            detail={"expected_offset": part.expected},
        )
        try:
            with telemetry.tracer.start_as_current_span(
                "dedup stale", attributes={"messaging.consumer.group.name": self.group_id}
            ):
                conn = await lane.connection()
                await events.record(conn, self.store.schema_name, [event])
        except Exception as record_exc:
            if not db.is_retriable(record_exc):
                raise
            log.warning("could not record stale_rejected for %s: %r", tp, record_exc)

    async def _commit_kafka(self, *, force: bool = False) -> None:
        """Tell Kafka where Postgres stands, for lag tools; Postgres stays authoritative."""
        now = time.monotonic()
        if not force and now - self._last_kafka_commit < self.kafka_commit_interval:
            return
        self._last_kafka_commit = now
        due = {
            tp: (part, part.expected)
            for tp, part in self._owned.items()
            if part.expected is not None and part.expected != part.committed_to_kafka
        }
        if not due:
            return
        try:
            await self._kafka.commit({tp: offset for tp, (_, offset) in due.items()})
        except (aiokafka.errors.CommitFailedError, aiokafka.errors.IllegalStateError) as exc:
            log.info("kafka offset commit skipped: %r", exc)
            return
        for part, offset in due.values():
            # A partition taken again meanwhile is a new _Partition: its commit is still due.
            part.committed_to_kafka = offset

    # ------------------------------------------------------------- plumbing --

    async def _sleep(self, seconds: float) -> bool:
        """Sleep unless asked to stop; True if the full time passed."""
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except TimeoutError:
            return True
        return False


def _fetch_position(kafka: Any, tp: TopicPartition) -> int | None:
    """aiokafka's fetch position of ``tp`` when it knows it, else None; never waits.

    ``AIOKafkaConsumer.position()`` waits (up to ``request_timeout_ms``) while
    the position is looked up after an assignment or a reset, and the poll loop
    must not; so this reads the subscription state ``position()`` reads.
    """
    try:
        state = kafka._subscription.subscription.assignment.state_value(tp)
    except AttributeError:  # not assigned (subscription or assignment is None)
        return None
    if state is None or not state.has_valid_position:
        return None
    return int(state.position)


def _pool_size(pool: Any) -> int:
    """How many connections ``pool`` may open (asyncpg pools say; others count as two)."""
    get_max_size = getattr(pool, "get_max_size", None)
    return int(get_max_size()) if get_max_size is not None else 2


def _usable(conn: asyncpg.Connection) -> bool:
    # asyncpg detaches a pooled connection that the server closed; asking a
    # detached proxy anything raises InterfaceError.
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:
        return False


class _Rebalance(aiokafka.ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, consumer: IdempotentConsumer) -> None:
        self.consumer = consumer

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.consumer._on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self.consumer._on_assigned(assigned)


def wrap(
    handler: Callable[..., Awaitable[object]],
    *,
    pool: Any,
    namespace: str,
    key: keys.Strategy = DEFAULT_KEY,
    schema: str = "dedup",
    on_missing_key: str = "dead_letter",
    on_conflict: str = "dead_letter",
) -> Callable[[Any], Awaitable[message_.Outcome]]:
    """Make ``handler`` idempotent inside your own aiokafka loop.

    Returns ``async (record: aiokafka.ConsumerRecord) -> Outcome``: claims the
    record's key and runs ``handler(msg, tx)`` in one transaction when the key is
    fresh.  There is no partition lease here (``tx.token`` is 0): your loop owns
    offsets, and the key claim alone makes redelivery harmless.  A handler error
    rolls back and propagates, so your loop decides whether to retry.
    """
    writes = store.Store(schema_name=schema, namespace=namespace, conflict_policy=on_conflict)

    async def handle(record: Any) -> message_.Outcome:
        msg = message_.Message.from_record(record)
        letter = _take_key(key, on_missing_key, msg)
        async with pool.acquire() as conn, conn.transaction():
            result = await writes.apply(
                conn,
                [msg] if letter is None else [],
                handler=handler,
                batch_handler=False,
                fence=None,
                dead=[letter] if letter else [],
            )
        if result.applied:
            return message_.Outcome.PROCESSED
        if result.conflicts:
            return message_.Outcome.CONFLICT
        if result.dead_letters:
            return message_.Outcome.DEAD_LETTERED
        return message_.Outcome.DUPLICATE

    return handle
