"""The idempotent Kafka consumer; ``wrap`` and ``claim`` for hand-written aiokafka loops.

The consumer has three jobs, each in one place:

- **assignment and fetching** (this module): the rebalance listener takes the
  assigned partitions in Postgres with fresh fencing tokens and seeks to the
  offsets stored there; the fetch loop hands each partition's records to its
  worker, and fetches only for the workers that have room (a busy partition's
  records wait in aiokafka's fetch buffer; when every worker is busy, the
  partitions are paused in the fetcher until one has room);
- **applying** (:mod:`dedup.worker`): one worker per owned partition applies
  its records batch after batch, one Postgres transaction each (see
  :mod:`dedup.store`), on a connection lent by :mod:`dedup.lanes`; workers run
  side by side, so one partition's slow or hung handler never holds up another;
- **offsets** (``_commit_kafka``, ``_follow_fetch_positions``,
  ``_check_owners``): Postgres holds the authoritative offset, moved in each
  batch's own transaction.  Kafka's committed offset follows it every
  ``kafka_commit_interval`` seconds, for lag tools only, and once after every
  assignment whatever Kafka held.  The stored offset follows Kafka's fetch
  position where that passes records never handed out (transaction markers,
  aborted transactions), so a caught-up group shows no lag.  ``dedup offsets
  rewind|skip`` moves a partition by taking it with a new token; the consumer
  finds that within ``kafka_commit_interval`` (or at its next batch's fence)
  and takes the partition back from the offset the operator set.

Shutdown is bounded: SIGTERM, SIGINT or :meth:`IdempotentConsumer.stop` let the
batches in flight finish for ``shutdown_timeout`` seconds, then cancel them
(they roll back and will be delivered again); a second signal cancels at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import signal
import socket
import time
import types
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import aiokafka
import aiokafka.errors
from aiokafka.structs import TopicPartition

from dedup import _db as db
from dedup import _decoding as decoding
from dedup import _drivers as drivers
from dedup import _errors as errors
from dedup import _lanes as lanes
from dedup import _message as message_
from dedup import _migrations as migrations
from dedup import _store as store
from dedup import _telemetry as telemetry
from dedup import _worker as worker
from dedup import keys

log = logging.getLogger("dedup.consumer")

DEFAULT_BATCH_SIZE = 500
DEFAULT_CONCURRENCY = 4
DEFAULT_HANDLER_TIMEOUT = 30.0
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
    "deadlocks",
    "lock_waits",
    "batches",
)

IDLE_MARGIN = 2.0
"""Seconds the server's idle-in-transaction timeout leaves beyond ``handler_timeout``."""
# A takeover waits at most this long for an old owner's open transaction; an old
# owner that is paused is cut off sooner by the idle-in-transaction timeout.
TAKEOVER_LOCK_TIMEOUT = "15s"
CANCEL_GRACE = 3.0
"""Seconds a cancelled batch gets to roll back before its connection is closed under it."""
FETCH_WAIT_MS = 250

_AIOKAFKA_OPTIONS = frozenset(inspect.signature(aiokafka.AIOKafkaConsumer.__init__).parameters) - {
    "self",
    "topics",
}
_KEY_FACTORIES = {
    keys.header: "dedup.keys.header('name')",
    keys.json_field: "dedup.keys.json_field('field')",
    keys.kafka_key: "dedup.keys.kafka_key()",
    keys.offset: "dedup.keys.offset()",
    keys.first: "dedup.keys.first(...)",
}


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


def _check_handler(handler: Any) -> None:
    """Refuse, at construction, a handler that can't be awaited."""
    target = handler.func if isinstance(handler, functools.partial) else handler
    if inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(
        getattr(target, "__call__", None)  # noqa: B004 - an object with an async __call__
    ):
        return
    what = "not callable" if not callable(handler) else "a function that is not async"
    raise errors.ConfigurationError(
        f"handler={handler!r} is {what}: expected `async def handler(msg, tx)` (or a batch "
        "handler `async def handler(msgs: list[dedup.Message], tx)`); run blocking code "
        "with asyncio.to_thread inside it"
    )


def _check_key(key: Any) -> None:
    """Refuse, at construction, a ``key`` that is not a key strategy."""
    if key in _KEY_FACTORIES:
        raise errors.ConfigurationError(
            f"key={key.__name__}: that makes a strategy; call it, e.g. key={_KEY_FACTORIES[key]}"
        )
    if not callable(key):
        raise errors.ConfigurationError(
            f"key={key!r}: expected a key strategy, e.g. dedup.keys.json_field('id') or any "
            "callable (Message) -> str | None"
        )


def _check_missing_key(on_missing_key: Any) -> None:
    if on_missing_key not in ("dead_letter", "offset"):
        raise errors.ConfigurationError(
            f"on_missing_key={on_missing_key!r}: expected 'dead_letter' or 'offset'"
        )


def _check_number(name: str, value: Any, low: float, high: float, *, whole: bool) -> None:
    kinds = (int,) if whole else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        kind = "a whole number" if whole else "a number of seconds"
        raise errors.ConfigurationError(
            f"{name}={value!r}: expected {kind} from {low:g} to {high:g}"
        )


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

    With ``dsn=``, ``pool_options`` go to ``asyncpg.create_pool`` for the pool
    dedup opens, e.g. ``{"statement_cache_size": 0}`` behind pgbouncer in
    transaction mode (docs/operations.md).

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
        handler_timeout: float = DEFAULT_HANDLER_TIMEOUT,
        kafka_commit_interval: float = 1.0,
        pool_options: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        if (dsn is None) == (pool is None):
            raise errors.ConfigurationError("pass exactly one of dsn= or pool=")
        pool_options = db.check_pool_options(pool_options, pool=pool)
        if isinstance(topics, str) or not topics:
            raise errors.ConfigurationError("topics must be a non-empty list of topic names")
        if not group_id:
            raise errors.ConfigurationError("group_id must be set")
        _check_handler(handler)
        _check_key(key)
        _check_number("batch_size", batch_size, 1, 100_000, whole=True)
        _check_number("concurrency", concurrency, 1, 64, whole=True)
        _check_number("max_attempts", max_attempts, 1, 1000, whole=True)
        _check_number("handler_timeout", handler_timeout, 0.001, 86_400, whole=False)
        _check_number("shutdown_timeout", shutdown_timeout, 0, 86_400, whole=False)
        _check_number("kafka_commit_interval", kafka_commit_interval, 0, 3600, whole=False)
        _check_missing_key(on_missing_key)
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
        self.handler_timeout = handler_timeout
        self.kafka_commit_interval = kafka_commit_interval
        self.store = store.Store(  # validates the schema name and the conflict policy
            schema_name=schema, namespace=self.namespace, conflict_policy=on_conflict
        )
        self._dsn = dsn
        self._pool_options = pool_options
        self._pool = pool
        self._own_pool = pool is None
        self._options = options
        self._stats = dict.fromkeys(STAT_NAMES, 0)
        self._workers: dict[TopicPartition, worker.PartitionWorker] = {}
        self._held: set[TopicPartition] = set()  # paused while every worker was busy
        self._failure: Exception | None = None  # raised by the rebalance listener
        self._stopping = asyncio.Event()
        self._hurry = asyncio.Event()  # a second signal: cut what is in flight now
        self._stop_deadline: float | None = None
        self._stopped = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._kafka: Any = None
        self._lanes: lanes.Lanes | None = None
        self._settings: worker.Settings | None = None
        self._last_kafka_commit = 0.0
        self._last_owner_check = 0.0

    @property
    def stats(self) -> Mapping[str, int]:
        """Counters since start.

        ``messages`` (records committed, whatever their outcome), ``processed``
        (applied), ``duplicates``, ``conflicts``, ``dead_lettered`` (conflicts
        included under the default policy), ``stale`` (batches refused by the
        fence), ``retries``, ``deadlocks`` (batches that deadlocked with another
        partition's and ran again alone), ``lock_waits`` (batches that ran again
        alone after waiting past ``lanes.LOCK_WAIT`` for a row lock while other
        partitions' transactions ran), ``batches`` (transactions committed).
        """
        return types.MappingProxyType(self._stats)

    @property
    def assignment(self) -> set[tuple[str, int]]:
        """The partitions this consumer holds a current token for."""
        return {(tp.topic, tp.partition) for tp in self._workers}

    # ------------------------------------------------------------ lifecycle --

    async def run(self) -> None:
        """Consume until :meth:`stop`, SIGTERM or SIGINT; a clean exit commits what was handled."""
        if self._task is not None:
            raise errors.ConfigurationError("this consumer is already running")
        self._task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if self.install_signal_handlers else ()
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
        try:
            await asyncio.wait_for(
                asyncio.shield(self._stopped.wait()), self.shutdown_timeout + 2 * CANCEL_GRACE + 10
            )
        except TimeoutError:
            log.warning("consumer %s did not stop in time; cancelling it", self.holder)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stopped.wait()

    def _request_stop(self) -> None:
        if not self._stopping.is_set():
            self._stop_deadline = time.monotonic() + self.shutdown_timeout
            self._stopping.set()

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._stopping.is_set():
            log.warning("%s again: cutting the batches in flight now", sig.name)
            self._hurry.set()
            return
        log.info(
            "%s: stopping; batches in flight get %.0fs (%s again cuts them now)",
            sig.name,
            self.shutdown_timeout,
            sig.name,
        )
        self._request_stop()

    async def _start(self) -> None:
        if self._dsn is not None:
            self._pool = await db.create_pool(
                self._dsn, min_size=1, max_size=self.concurrency, **self._pool_options
            )
        # A lane keeps its connection while the consumer runs.  In a pool of the
        # caller's, one connection stays free for the caller's own code.
        size = self.concurrency
        if not self._own_pool:
            size = max(1, min(size, _pool_size(self._pool) - 1))
        self._lanes = lanes.Lanes(self._pool, size)
        # Set in each of the consumer's transactions, whatever the pool says: the
        # server never cuts the session of a handler still within its deadline.
        idle_timeout = self.handler_timeout + IDLE_MARGIN
        await self._check_schema()
        self._settings = worker.Settings(
            group_id=self.group_id,
            namespace=self.namespace,
            holder=self.holder,
            store=self.store,
            handler=self.handler,
            batch_handler=self.batch_handler,
            key=self.key,
            on_missing_key=self.on_missing_key,
            batch_size=self.batch_size,
            max_attempts=self.max_attempts,
            handler_timeout=self.handler_timeout,
            idle_timeout=idle_timeout,
            database=await self._pool.fetchval("SELECT current_database()"),
        )
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
            self._kafka = None
            raise errors.ServiceUnavailableError(
                f"cannot reach Kafka at bootstrap_servers={self.bootstrap_servers!r}: {exc}"
            ) from exc
        missing = [t for t in self.topics if t not in present]
        if missing:
            await self._kafka.stop()
            self._kafka = None
            raise errors.ConfigurationError(
                f"topics: {', '.join(map(repr, missing))} not found on {self.bootstrap_servers}; "
                "create them first"
            )
        self._kafka.subscribe(self.topics, listener=_Rebalance(self))
        log.info("consumer %s started on %s (group %s)", self.holder, self.topics, self.group_id)

    async def _check_schema(self) -> None:
        """Refuse a schema that lacks a migration this dedup needs (it names the migration)."""
        await migrations.check(self._pool, schema=self.store.schema_name)

    async def _shutdown(self) -> None:
        """Stop within ``shutdown_timeout`` (plus a few seconds), whatever the handlers do."""
        self._request_stop()
        cut = await self._close_workers(list(self._workers.values()), self._time_left())
        if self._kafka is not None:
            with contextlib.suppress(aiokafka.errors.KafkaError, TimeoutError):
                async with asyncio.timeout(5):
                    await self._commit_kafka(force=True)
            # Leaving the group revokes our partitions; their workers are done.
            try:
                async with asyncio.timeout(max(self._time_left(), 5.0)):
                    await self._kafka.stop()
            except TimeoutError:
                log.warning("leaving the Kafka group took too long; the broker will time us out")
            self._kafka = None
        if self._lanes is not None:
            if cut:
                self._lanes.terminate()  # a handler that ignored its cancellation
            await self._lanes.close()
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

    async def _close_workers(self, workers: list[worker.PartitionWorker], grace: float) -> bool:
        """Let ``workers`` finish their batch in flight for ``grace`` s, then cancel them.

        True when a handler ignored its cancellation (its connection must be closed).
        """
        for w in workers:
            w.stop()
        running: dict[asyncio.Future[Any], worker.PartitionWorker] = {
            w.task: w for w in workers if w.task is not None and not w.task.done()
        }
        hurry = asyncio.ensure_future(self._hurry.wait())
        try:
            deadline = time.monotonic() + grace
            pending = set(running)
            while pending and not self._hurry.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                _, pending = await asyncio.wait(
                    {*pending, hurry}, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                pending.discard(hurry)
        finally:
            hurry.cancel()
        cut = {task for task in running if not task.done()}
        if not cut:
            return False
        log.warning(
            "cutting the batches in flight of %s; they roll back and will be delivered again",
            ", ".join(f"{running[t].tp} (offsets {running[t].in_flight_range})" for t in cut),
        )
        for task in cut:
            task.cancel()
        _, stuck = await asyncio.wait(cut, timeout=CANCEL_GRACE)
        if stuck:
            log.error(
                "handlers of %s ignored their cancellation; closing their connections",
                ", ".join(str(running[t].tp) for t in stuck),
            )
        return bool(stuck)

    # ----------------------------------------------------------------- loop --

    def _rebalance_failed(self, exc: Exception) -> None:
        if self._failure is None:
            self._failure = exc
        self._request_stop()  # the fetch loop sees it within FETCH_WAIT_MS and raises the error

    async def _consume(self) -> None:
        while not self._stopping.is_set():
            await self._check_workers()
            fetched = await self._fetch()
            for tp, records in fetched.items():
                owner = self._workers.get(tp)
                if owner is not None:  # else revoked or lost since the fetch
                    owner.feed(records)
            self._follow_fetch_positions()
            await self._check_owners()
            await self._commit_kafka()
        if self._failure is not None:
            raise self._failure

    def _has_room(self, tp: TopicPartition) -> None:
        """A worker took a batch off its queue: fetch for it again."""
        if tp in self._held:
            self._held.discard(tp)
            self._kafka.resume(tp)

    async def _fetch(self) -> dict[TopicPartition, list[Any]]:
        ready = [tp for tp, owner in self._workers.items() if owner.wants_records]
        if self._workers and not ready:
            # Every worker has a batch waiting.  Wait inside getmany all the same
            # (aiokafka counts time outside it against max_poll_interval_ms), with
            # the partitions paused; a worker with room resumes its own.
            busy = set(self._workers) - self._held
            self._kafka.pause(*busy)
            self._held |= busy
        try:
            # Without partitions getmany also runs a rebalance that gives us the first ones.
            fetched: dict[TopicPartition, list[Any]] = await self._kafka.getmany(
                *ready, timeout_ms=FETCH_WAIT_MS, max_records=self.batch_size
            )
            # getmany fills max_records from one partition after another; ask each
            # other ready partition for what the fetcher already holds.
            if fetched and len(ready) > 1:
                for tp in ready:
                    if tp not in fetched and tp in self._workers:
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
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), 1.0)
            return {}
        return fetched

    async def _check_workers(self) -> None:
        """Drop the workers whose partition was taken (taking it back from an operator);
        raise what stopped any other."""
        for tp, owner in list(self._workers.items()):
            task = owner.task
            if task is None or not task.done():
                continue
            if owner.moved is not None or owner.lost is not None:
                if self._workers.get(tp) is not owner:
                    continue  # revoked meanwhile
                del self._workers[tp]
                self._held.discard(tp)
                if owner.moved is not None and tp in self._kafka.assignment():
                    await self._retake(tp, owner.moved)
                else:
                    self._kafka.pause(tp)  # until Kafka assigns it again
                continue
            if owner.closing:
                continue  # a revoke or the shutdown stopped it, and cleans up after it
            if task.cancelled():
                raise errors.DedupError(f"the worker of {tp} was cancelled")
            failure = task.exception()
            if failure is not None:
                raise failure

    def _follow_fetch_positions(self) -> None:
        """Have idle workers store Kafka's fetch position where it passed records never handed out.

        Transaction markers and records of aborted transactions (under
        ``read_committed``) move aiokafka's position without reaching
        ``getmany``'s answer.  An idle worker has applied every record fetched,
        so a position beyond its offset holds nothing to apply.  On a topic
        without transactions the two are equal: no round trip.
        """
        for tp, owner in self._workers.items():
            if not owner.idle:
                continue
            position = _fetch_position(self._kafka, tp)
            if position is not None and (owner.expected is None or position > owner.expected):
                owner.follow(position)

    async def _check_owners(self) -> None:
        """Every ``kafka_commit_interval``, look for partitions of ours taken in Postgres.

        A busy partition learns of a newer token from its next batch's fence; an
        idle one would not until a message came, so an operator's ``dedup
        offsets rewind`` would wait for traffic.  One statement for all partitions.
        """
        now = time.monotonic()
        if not self._workers or now - self._last_owner_check < self.kafka_commit_interval:
            return
        self._last_owner_check = now
        assert self._lanes is not None  # noqa: S101 - started
        async with self._lanes.lane() as lane:
            try:
                conn = await lane.connection()
                stored = await self.store.positions(
                    conn, self.group_id, [(tp.topic, tp.partition) for tp in self._workers]
                )
            except Exception as exc:
                if not db.is_retriable(exc):
                    raise
                log.warning("checking partition owners failed (%r); trying again", exc)
                await lane.release()
                return
        for tp, owner in self._workers.items():
            found = stored.get((tp.topic, tp.partition))
            # Tokens only grow.  A worker with a batch in flight finds out from
            # its fence, which refuses the write and records it (stale_rejected).
            if found is not None and found.token > owner.token and not owner.busy:
                owner.taken_over(found)

    # ------------------------------------------------------------ ownership --

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        if not assigned:
            return
        # Nothing of these partitions may reach the fetch loop before their
        # workers exist (with the token and offset from Postgres).
        self._kafka.pause(*assigned)
        wanted = sorted((tp.topic, tp.partition) for tp in assigned)
        with telemetry.tracer.start_as_current_span(
            "dedup assign", attributes={"messaging.consumer.group.name": self.group_id}
        ):
            taken = await self._take(wanted)
        for tp in assigned:
            self._own(tp, *taken[(tp.topic, tp.partition)])
        log.info("consumer %s took %s", self.holder, wanted)

    def _own(self, tp: TopicPartition, token: int, next_offset: int | None) -> None:
        """Work on ``tp`` under ``token`` from the stored offset (Kafka hears of it next commit)."""
        assert self._lanes is not None and self._settings is not None  # noqa: S101 - started
        owner = worker.PartitionWorker(
            tp,
            token,
            next_offset,
            settings=self._settings,
            lanes=self._lanes,
            stats=self._stats,
            on_room=self._has_room,
        )
        self._workers[tp] = owner
        if next_offset is not None:
            self._kafka.seek(tp, next_offset)
        self._kafka.resume(tp)
        owner.start()

    async def _retake(self, tp: TopicPartition, moved: store.Position) -> None:
        """``dedup offsets`` moved ``tp``: take it with a new token, from the offset it set."""
        log.info(
            "consumer %s: %s was moved to offset %s by %r; taking it back",
            self.holder,
            tp,
            moved.next_offset,
            moved.holder,
        )
        self._kafka.pause(tp)  # records fetched from the old position must not reach a worker
        taken = await self._take([(tp.topic, tp.partition)])
        self._own(tp, *taken[(tp.topic, tp.partition)])

    async def _take(
        self, wanted: list[tuple[str, int]]
    ) -> dict[tuple[str, int], tuple[int, int | None]]:
        assert self._lanes is not None  # noqa: S101 - started
        delay = 0.1
        while True:
            async with self._lanes.lane() as lane:
                try:
                    conn = await lane.connection()
                    async with db.transaction(conn, self._takeover_settings()):
                        return await self.store.take_partitions(
                            conn, self.group_id, self.holder, wanted
                        )
                except Exception as exc:
                    if not db.is_retriable(exc) or self._stopping.is_set():
                        raise
                    await lane.release()
                    self._stats["retries"] += 1
                    log.warning("taking partitions %s failed (%r); retrying", wanted, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, worker.MAX_BACKOFF)

    def _takeover_settings(self) -> dict[str, str]:
        assert self._settings is not None  # noqa: S101 - started
        return {
            "lock_timeout": TAKEOVER_LOCK_TIMEOUT,
            "idle_in_transaction_session_timeout": str(round(self._settings.idle_timeout * 1000)),
        }

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        gone = [self._workers[tp] for tp in revoked if tp in self._workers]
        if not gone:
            return
        # The batches in flight commit or roll back before another member may
        # start on these partitions (the new owner's token fences them anyway).
        await self._close_workers(
            gone, self._time_left() if self._stopping.is_set() else self.shutdown_timeout
        )
        with contextlib.suppress(aiokafka.errors.KafkaError):
            await self._commit_kafka(force=True)
        for owner in gone:
            # The fetch loop may have dropped it meanwhile (it lost the partition).
            if self._workers.get(owner.tp) is owner:
                del self._workers[owner.tp]
            self._held.discard(owner.tp)
            telemetry.transition(
                "partition_revoked",
                {
                    "resource": f"{self.group_id}:{owner.tp.topic}:{owner.tp.partition}",
                    "token": owner.token,
                },
            )
        log.info("consumer %s gave up %s", self.holder, [str(w.tp) for w in gone])

    async def _commit_kafka(self, *, force: bool = False) -> None:
        """Tell Kafka where Postgres stands, for lag tools; Postgres stays authoritative."""
        now = time.monotonic()
        if not force and now - self._last_kafka_commit < self.kafka_commit_interval:
            return
        self._last_kafka_commit = now
        due = {
            tp: (owner, owner.expected)
            for tp, owner in self._workers.items()
            if owner.expected is not None and owner.expected != owner.committed_to_kafka
        }
        if not due:
            return
        try:
            await self._kafka.commit({tp: offset for tp, (_, offset) in due.items()})
        except (aiokafka.errors.CommitFailedError, aiokafka.errors.IllegalStateError) as exc:
            log.info("kafka offset commit skipped: %r", exc)
            return
        for owner, offset in due.values():
            # A partition taken again meanwhile has a new worker: its commit is still due.
            owner.committed_to_kafka = offset


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


class _Rebalance(aiokafka.ConsumerRebalanceListener):  # type: ignore[misc]
    """Hands aiokafka's rebalance calls to the consumer.

    aiokafka only logs what a listener raises; the consumer would then hold
    partitions it never works on.  So an error is kept, and the fetch loop
    raises it from :meth:`IdempotentConsumer.run`.
    """

    def __init__(self, consumer: IdempotentConsumer) -> None:
        self.consumer = consumer

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        try:
            await self.consumer._on_revoked(revoked)
        except Exception as exc:
            self.consumer._rebalance_failed(exc)
            raise

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        try:
            await self.consumer._on_assigned(assigned)
        except Exception as exc:
            self.consumer._rebalance_failed(exc)
            raise


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
    _check_handler(handler)
    _check_key(key)
    writes = store.Store(schema_name=schema, namespace=namespace, conflict_policy=on_conflict)

    async def handle(record: Any) -> message_.Outcome:
        msg = message_.Message.from_record(record)
        letter = worker.take_key(key, on_missing_key, msg)
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


async def claim(
    conn: Any,
    records: Iterable[Any],
    *,
    namespace: str,
    key: keys.Strategy = DEFAULT_KEY,
    schema: str = "dedup",
    on_missing_key: str = "dead_letter",
    on_conflict: str = "dead_letter",
) -> message_.ClaimResult:
    """Claim the idempotency keys of ``records`` inside your own open transaction.

    ``conn`` is an asyncpg connection inside a transaction, or an SQLAlchemy
    ``AsyncConnection`` / ``AsyncSession`` (asyncpg dialect) inside one; dedup
    writes on its driver connection, so the claims commit or roll back with
    your writes.  ``records`` are aiokafka ``ConsumerRecord`` objects or
    :class:`dedup.Message` objects, from any topics and partitions.  Apply
    ``result.fresh`` in the same transaction; duplicates and conflicts are
    counted on the key's row and recorded (conflict events) as the consumer
    does, conflicts and keyless records dead-lettered by default.  Offsets stay
    yours: commit them to Kafka after your transaction commits.

    Raises :class:`dedup.ConfigurationError` outside a transaction.
    """
    _check_key(key)
    _check_missing_key(on_missing_key)
    writes = store.Store(schema_name=schema, namespace=namespace, conflict_policy=on_conflict)
    driver = await drivers.in_transaction(conn, "dedup.claim")
    msgs: list[message_.Message] = []
    dead: list[store.DeadLetter] = []
    for record in records:
        msg = (
            record if isinstance(record, message_.Message) else message_.Message.from_record(record)
        )
        letter = worker.take_key(key, on_missing_key, msg)
        if letter is None:
            msgs.append(msg)
        else:
            dead.append(letter)
    result = await writes.claim(driver, msgs, dead=dead)
    return message_.ClaimResult(
        fresh=result.applied,
        duplicates=result.duplicates,
        conflicts=result.conflicts,
        dead_lettered=[d.msg for d in result.dead_letters],
    )
