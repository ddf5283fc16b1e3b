"""The idempotent Kafka consumer: its lifecycle and its fetch loop.

- **assignment** (:mod:`dedup.consumer._partitions`): the rebalance listener takes the
  assigned partitions in Postgres with fresh fencing tokens, seeks to the
  offsets stored there, and places each on one of ``concurrency`` lanes;
- **fetching** (this module): the loop asks aiokafka for the partitions that
  want records and feeds each partition's records to its lane; a partition
  with a turn's worth queued is left out of the fetch (paused when none wants
  more), so aiokafka's buffer holds the rest and fetching overlaps the
  transactions;
- **applying** (:mod:`dedup.consumer._lanes`, :mod:`dedup.consumer._turn`): each lane takes what
  its partitions fetched, up to ``batch_size``, and applies it in one
  transaction: one fence-and-claim statement for all of them, the handler,
  COMMIT; lanes run side by side, so a slow or hung handler holds up only its
  own lane's partitions;
- **offsets** (``Partitions.commit_kafka``, ``follow_fetch_positions``,
  ``check_owners``): Postgres holds the authoritative offset, moved in each
  turn's own transaction.  Kafka's committed offset follows it every
  ``kafka_commit_interval`` seconds, for lag tools only, and once after every
  assignment whatever Kafka held.  The stored offset follows Kafka's fetch
  position where that passes records never handed out (transaction markers,
  aborted transactions), so a caught-up group shows no lag.  ``dedup offsets
  rewind|skip`` moves a partition by taking it with a new token; the consumer
  finds that within ``kafka_commit_interval`` (or at its next turn's fence)
  and takes the partition back from the offset the operator set.

A fetch error means: a position outside the partition's log, resolved by
:mod:`dedup.consumer._out_of_range`; a partition with no offset anywhere, started where
``auto_offset_reset`` says; a batch that cannot be decoded, whose readable
records are applied before the consumer stops (:mod:`dedup.consumer._decoding`); a
retriable Kafka error, logged, and fetched again after :data:`RETRY_WAIT`.

Shutdown is bounded: SIGTERM, SIGINT or :meth:`IdempotentConsumer.stop` let the
turns in flight finish for ``shutdown_timeout`` seconds, then cancel them
(they roll back and will be delivered again); a second signal cancels at once.

The settings are checked in :mod:`dedup._config`; ``wrap`` and ``claim``, for
hand-written aiokafka loops, live in :mod:`dedup._wrap`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import time
import types
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiokafka
import aiokafka.errors
from aiokafka.structs import TopicPartition

from dedup import _config as config
from dedup import _errors as errors
from dedup import _kafka_client as kafka_client
from dedup import _kafka_logs as kafka_logs
from dedup import _leases as leases
from dedup import _message as message_
from dedup import _store as store
from dedup import _telemetry as telemetry
from dedup import keys
from dedup.consumer import _decoding as decoding
from dedup.consumer import _out_of_range as out_of_range
from dedup.consumer import _partitions as partitions
from dedup.consumer import _rebalance as rebalance
from dedup.consumer import _turn as turn
from dedup.data import _conninfo as conninfo
from dedup.data import _db as db
from dedup.data import _migrations as migrations
from dedup.data import _sql as sql

log = logging.getLogger("dedup.consumer")

STAT_NAMES = (
    "messages",
    "processed",
    "duplicates",
    "conflicts",
    "dead_lettered",
    "stale",
    "retries",
    "deadlocks",
    "batches",
)

IDLE_MARGIN = 2.0
"""Seconds the server's idle-in-transaction timeout leaves beyond ``handler_timeout``."""
FETCH_WAIT_MS = 250
"""Most milliseconds one fetch waits for records; a stop is seen within it."""
RETRY_WAIT = 1.0
"""Seconds before fetching again after a retriable Kafka error (unless stopping)."""


class IdempotentConsumer:
    """Consume Kafka topics and apply each message's effect in Postgres exactly once.

    ``handler`` is ``async (msg: Message, tx: Tx) -> object``, called once per
    fresh message with ``tx.conn`` inside the batch's transaction; or a batch
    handler ``async (msgs: list[Message], tx: Tx) -> None`` that receives the
    fresh messages of one transaction in offset order (chosen with
    ``batch=True``, or found from a ``list[...]`` annotation on its first
    parameter).

    Keyword options that aiokafka's consumer knows (``session_timeout_ms``,
    ``security_protocol``, ``ssl_context``, SASL settings, ...) pass through under
    aiokafka's names.  Offsets are never auto-committed: Postgres holds them.
    ``isolation_level`` defaults to ``"read_committed"``: records of aborted
    producer transactions are never applied.  ``auto_offset_reset`` says where a
    partition that has no offset stored starts: ``"earliest"`` (the default: its
    log start, nothing skipped), ``"latest"`` (its end: what it already holds is
    never applied) or ``"none"`` (``run()`` stops, naming it).  A stored offset
    below the log start (retention deleted unapplied records) resumes at the log
    start and records the loss (an ``offsets_lost_to_retention`` event); one beyond
    the log end (a recreated topic) holds that partition until ``dedup offsets
    rewind`` moves it (an ``offsets_beyond_log_end`` event).

    With ``dsn=``, ``pool_options`` go to ``asyncpg.create_pool`` for the pool
    dedup opens, e.g. ``{"statement_cache_size": 0}`` behind pgbouncer in
    transaction mode (docs/operations.md).

    A record batch that cannot be decoded stops :meth:`run` with
    :class:`dedup.UndecodableBatchError`, naming the partition and the batch, once the
    readable records fetched before it are applied.
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
        key: keys.Strategy = config.DEFAULT_KEY,
        namespace: str | None = None,
        batch_size: int = config.DEFAULT_BATCH_SIZE,
        concurrency: int | None = None,
        batch: bool | None = None,
        schema: str = "dedup",
        holder: str | None = None,
        on_missing_key: str = message_.OnMissingKey.DEAD_LETTER,
        on_conflict: str = message_.OnConflict.DEAD_LETTER,
        max_attempts: int = config.DEFAULT_MAX_ATTEMPTS,
        install_signal_handlers: bool = True,
        shutdown_timeout: float = 30.0,
        handler_timeout: float = config.DEFAULT_HANDLER_TIMEOUT,
        kafka_commit_interval: float = 1.0,
        pool_options: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        db.require_one(dsn, pool)
        config.check_handler(handler)
        missing_key, conflict = config.policies(on_missing_key, on_conflict)
        holder = holder or leases.default_holder()
        batch_handler = config.is_batch_handler(handler) if batch is None else batch
        self.config = config.Config(
            topics=topics,
            group_id=group_id,
            bootstrap_servers=bootstrap_servers,
            # The holder names this process in Kafka's group tools too.
            kafka_options=config.consumer_options({"client_id": holder, **options}),
            schema=schema,
            pool_options=db.check_pool_options(pool_options, pool=pool),
            concurrency=(
                config.default_concurrency(batch_handler, batch_size)
                if concurrency is None
                else concurrency
            ),
            namespace=namespace or group_id,
            key=key,
            on_missing_key=missing_key,
            on_conflict=conflict,
            batch_handler=batch_handler,
            batch_size=batch_size,
            max_attempts=max_attempts,
            handler_timeout=handler_timeout,
            holder=holder,
            install_signal_handlers=install_signal_handlers,
            shutdown_timeout=shutdown_timeout,
            kafka_commit_interval=kafka_commit_interval,
        )
        """The settings, checked."""
        out_of_range.check_reset(self.config.kafka_options["auto_offset_reset"])
        self.handler = handler
        self.holder = self.config.holder
        """This consumer's name with its tokens and events."""
        self.batch_handler = self.config.batch_handler
        """True when ``handler`` takes a batch of messages."""
        self.store = store.Store(  # validates the schema name
            schema=schema, namespace=self.config.namespace, on_conflict=conflict
        )
        self._dsn = dsn
        self._pool = pool
        self._own_pool = pool is None
        self._stats = dict.fromkeys(STAT_NAMES, 0)
        self._partitions: partitions.Partitions | None = None  # while running
        self._failure: Exception | None = None  # raised by the rebalance listener
        self._stopping = asyncio.Event()
        self._hurry = asyncio.Event()  # a second signal: cut what is in flight now
        self._stop_deadline: float | None = None
        self._stopped = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._kafka: Any = None
        self._offset_reset = config.DEFAULT_AUTO_OFFSET_RESET  # the user's (aiokafka's: none)

    @property
    def stats(self) -> Mapping[str, int]:
        """Counters since start.

        ``messages`` (records committed, whatever their outcome), ``processed``
        (applied), ``duplicates``, ``conflicts``, ``dead_lettered`` (conflicts
        included under the default policy), ``stale`` (batches refused by the
        fence), ``retries`` (transactions run again: deadlocks, outages, a
        handler's further attempts), ``deadlocks`` (transactions that deadlocked
        with another and ran again after a backoff), ``batches`` (partitions'
        batches committed; a lane's transaction commits one per partition in it).
        """
        return types.MappingProxyType(self._stats)

    @property
    def assignment(self) -> set[tuple[str, int]]:
        """The partitions this consumer holds a current token for."""
        held = self._partitions.owned if self._partitions is not None else {}
        return {(tp.topic, tp.partition) for tp in held}

    # ------------------------------------------------------------ lifecycle --

    async def run(self) -> None:
        """Consume until :meth:`stop`, SIGTERM or SIGINT; a clean exit commits what was handled."""
        if self._task is not None:
            raise errors.ConfigurationError("this consumer is already running")
        self._task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if self.config.install_signal_handlers else ()
        for sig in signals:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            await self._start()
            await self._consume()
        finally:
            try:
                await self._shutdown()
            finally:
                for sig in signals:
                    loop.remove_signal_handler(sig)
                self._stopped.set()

    async def stop(self) -> None:
        """Finish or roll back the batches in flight, commit what was handled, and return.

        Waits up to ``shutdown_timeout`` seconds for the batches in flight, then
        cancels them (their transactions roll back, so their messages will be
        delivered again).
        """
        self._request_stop()
        if self._task is None:
            return
        most = self.config.shutdown_timeout + 2 * partitions.CANCEL_GRACE + 10
        try:
            await asyncio.wait_for(asyncio.shield(self._stopped.wait()), most)
        except TimeoutError:
            log.warning("consumer %s did not stop in time; cancelling it", self.holder)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stopped.wait()

    def _request_stop(self) -> None:
        if not self._stopping.is_set():
            self._stop_deadline = time.monotonic() + self.config.shutdown_timeout
            self._stopping.set()

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._stopping.is_set():
            log.warning("%s again: cutting the batches in flight now", sig.name)
            self._hurry.set()
            return
        log.info(
            "%s: stopping; batches in flight get %.0fs (%s again cuts them now)",
            sig.name,
            self.config.shutdown_timeout,
            sig.name,
        )
        self._request_stop()

    async def _start(self) -> None:
        c = self.config
        if self._dsn is not None:
            # A connection per lane, and one for what runs beside them (takes, looks).
            self._pool = await db.create_pool(
                self._dsn, min_size=1, max_size=c.concurrency + 1, **c.pool_options
            )
        # A lane keeps its connection while the consumer runs.  In a pool of the
        # caller's, one connection stays free for the rest.
        size = c.concurrency
        if not self._own_pool:
            size = max(1, min(size, _pool_size(self._pool) - 1))
        await migrations.check(self._pool, schema=c.schema)
        settings = await self._turn_settings()
        kafka_logs.install()
        options = kafka_client.client_options(c.kafka_options)
        # aiokafka must say when a position is out of range, not jump silently:
        # dedup resets where nothing is stored, and records what an offset outside
        # the log means (dedup.consumer._out_of_range).
        self._offset_reset = options.pop("auto_offset_reset", config.DEFAULT_AUTO_OFFSET_RESET)
        self._kafka = aiokafka.AIOKafkaConsumer(
            bootstrap_servers=c.bootstrap_servers,
            group_id=c.group_id,
            enable_auto_commit=False,
            auto_offset_reset="none",
            **options,
        )
        self._partitions = partitions.Partitions(
            self._kafka,
            pool=self._pool,
            concurrency=size,
            settings=settings,
            stats=self._stats,
            commit_interval=c.kafka_commit_interval,
            stopping=self._stopping,
            hurry=self._hurry,
        )
        await self._start_kafka(self._partitions)
        for topic in c.topics:
            # Series at 0 from the start, before anything is assigned or fetched.
            telemetry.counting(turn.counted(settings, topic))
        log.info("consumer %s started on %s (group %s)", self.holder, c.topics, c.group_id)

    async def _turn_settings(self) -> turn.Settings:
        """What every turn shares: most of it is this consumer's settings, by the same names."""
        assert self._pool is not None  # noqa: S101 - started
        shared = {
            field.name: getattr(self.config, field.name)
            for field in dataclasses.fields(turn.Settings)
            if hasattr(self.config, field.name)
        }
        return turn.Settings(
            **shared,
            store=self.store,
            handler=self.handler,
            # Set in each of the consumer's transactions, whatever the pool says: the
            # server never cuts the session of a handler still within its deadline.
            idle_timeout=self.config.handler_timeout + IDLE_MARGIN,
            database=await self._current_database(),
            secrets=frozenset(
                conninfo.passwords(self._dsn) | kafka_client.secrets(self.config.kafka_options)
            ),
        )

    async def _current_database(self) -> str:
        assert self._pool is not None  # noqa: S101 - started
        query = sql.Queries(self.config.schema).current_database
        return str(await query.fetchval(self._pool))

    async def _start_kafka(self, held: partitions.Partitions) -> None:
        """Join the group, once Kafka is reachable and has every topic."""
        c = self.config
        try:
            await self._kafka.start()
            present = await self._kafka.topics()
        except aiokafka.errors.KafkaError as exc:
            await self._kafka.stop()
            self._kafka = None
            options = kafka_client.client_options(c.kafka_options)
            raise await kafka_client.unreachable(
                c.bootstrap_servers, options, exc, what=f"consumer of group {c.group_id!r}"
            ) from exc
        missing = [t for t in c.topics if t not in present]
        if missing:
            await self._kafka.stop()
            self._kafka = None
            raise errors.ConfigurationError(
                f"topics: {', '.join(map(repr, missing))} not found on {c.bootstrap_servers}; "
                "create them first"
            )
        listener = rebalance.Listener(held, self._revoke_grace, self._rebalance_failed)
        self._kafka.subscribe(list(c.topics), listener=listener)

    async def _shutdown(self) -> None:
        """Stop within ``shutdown_timeout`` (plus a few seconds), whatever the handlers do."""
        self._request_stop()
        held = self._partitions
        cut = held is not None and await held.close(self._time_left())
        if self._kafka is not None:
            assert held is not None  # noqa: S101 - made with the Kafka consumer
            with contextlib.suppress(aiokafka.errors.KafkaError, TimeoutError):
                async with asyncio.timeout(5):
                    await held.commit_kafka(force=True)
            # Leaving the group revokes our partitions; their lanes are done.
            try:
                async with asyncio.timeout(max(self._time_left(), 5.0)):
                    await self._kafka.stop()
            except TimeoutError:
                log.warning("leaving the Kafka group took too long; the broker will time us out")
            self._kafka = None
        if held is not None:
            await held.release()
        if self._own_pool and self._pool is not None:
            if cut:
                self._pool.terminate()
            else:
                await self._pool.close()
            self._pool = None
        log.info("consumer %s stopped: %s", self.holder, dict(self._stats))

    def _time_left(self) -> float:
        if self._hurry.is_set() or self._stop_deadline is None:
            return 0.0
        return max(self._stop_deadline - time.monotonic(), 0.0)

    # ----------------------------------------------------------------- loop --

    def _rebalance_failed(self, exc: Exception) -> None:
        if self._failure is None:
            self._failure = exc
        self._request_stop()  # the fetch loop sees it within FETCH_WAIT_MS and raises it

    async def _consume(self) -> None:
        held = self._partitions
        assert held is not None  # noqa: S101 - started
        while not self._stopping.is_set():
            await held.check()
            held.feed(await self._fetch(held))
            held.follow_fetch_positions()
            await held.check_owners()
            await held.commit_kafka()
        if self._failure is not None:
            raise self._failure

    async def _fetch(self, held: partitions.Partitions) -> dict[TopicPartition, list[Any]]:
        """The records fetched for the partitions that want them, by partition (maybe none)."""
        ready = held.ready()
        fetched: dict[TopicPartition, list[Any]] = {}
        c = self.config
        try:
            # One call takes what the ready partitions have room for, filled from
            # one partition after another; a full one is left out of the next.
            # Without partitions, getmany also runs the rebalance that gives us the
            # first ones, and takes a turn's worth of theirs at once.
            most = held.room(ready) if ready else c.batch_size
            fetched.update(
                await self._kafka.getmany(*ready, timeout_ms=FETCH_WAIT_MS, max_records=most)
            )
        except aiokafka.errors.OffsetOutOfRangeError as exc:
            await self._resolving(held.out_of_range(exc.args[0]))
        except aiokafka.errors.NoOffsetForPartitionError as exc:
            reset = out_of_range.reset(self._kafka, exc.args[0], self._offset_reset, c.group_id)
            await self._resolving(reset)
        except Exception as exc:
            failure = decoding.locate(exc)
            if failure is not None or isinstance(exc, decoding.ERRORS):
                # aiokafka has already moved partitions past records it dropped with
                # this error: apply them, then stop (going on would skip the batch).
                readable = {**fetched, **decoding.salvage(exc)}
                tp = failure.tp if failure is not None else None
                stands_at = await held.apply_first(readable, tp, self._revoke_grace())
                raise decoding.error(exc, failure, c.group_id, stands_at) from exc
            await self._retry_later(exc)
        return fetched

    async def _resolving(self, step: Awaitable[None]) -> None:
        """Run ``step``, which asks Kafka where a partition's log lies."""
        try:
            await step
        except aiokafka.errors.KafkaError as exc:
            await self._retry_later(exc)

    async def _retry_later(self, exc: Exception) -> None:
        """Raise ``exc`` unless it is a retriable Kafka error; then wait RETRY_WAIT."""
        if not isinstance(exc, aiokafka.errors.KafkaError) or not exc.retriable:
            raise exc
        log.warning("kafka fetch failed, retrying: %r", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), RETRY_WAIT)

    def _revoke_grace(self) -> float:
        """How long the batches in flight of revoked partitions may take to finish."""
        return self._time_left() if self._stopping.is_set() else self.config.shutdown_timeout


def _pool_size(pool: Any) -> int:
    """How many connections ``pool`` may open (asyncpg pools say; others count as two)."""
    get_max_size = getattr(pool, "get_max_size", None)
    return int(get_max_size()) if get_max_size is not None else 2
