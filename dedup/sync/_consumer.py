"""``dedup.sync.Consumer``: the idempotent consumer without asyncio, on confluent-kafka and
psycopg.

The async consumer's model (:mod:`dedup.consumer._consumer`), with threads for tasks:

1. **one thread polls**: ``consume()`` asks confluent-kafka for up to
   ``batch_size`` records (waiting at most :data:`FETCH_WAIT` seconds) and
   queues each partition's records on it; while the partitions hold
   :data:`QUEUED_TURNS` turns' worth for every lane, it waits for a lane to
   take some before it polls again;
2. **``concurrency`` lanes**, each a thread with a psycopg connection of its
   own and the partitions placed on it (:func:`dedup.consumer._lanes.place`),
   each the async consumer's lane (:class:`dedup.consumer._lanes.Lane`): a
   **turn** takes up to ``batch_size`` records of its partitions and applies
   them in **one transaction** (:mod:`dedup.consumer._turn`, the same
   statements as :class:`dedup.IdempotentConsumer`'s): ``BEGIN``; one
   ``fence_and_claim`` for every partition of the turn (each partition's
   offset moves in Postgres under its fencing token, the keys are claimed);
   the handler on the fresh messages, on ``tx.conn``; dead letters and
   events; the session reset and ``COMMIT``.  A partition's records are
   applied in offset order, by its one lane; the lanes run side by side;
3. **a failure** is read by the consumer's table (:mod:`dedup.consumer._retry`),
   applied by the lane: a refused fence drops its partition's records until
   Kafka assigns it again, a failing handler splits the turn until its
   message stands alone, which gets ``max_attempts`` and is then
   dead-lettered, a lost connection runs the transaction again on a new one;
4. **Kafka** hears the offsets Postgres holds every ``kafka_commit_interval``
   seconds (an asynchronous commit, for lag tools; Postgres is the authority).

On an assignment (confluent-kafka's ``on_assign``, called inside ``consume()``
on the polling thread) the partitions are taken in Postgres with new fencing
tokens (``partition_acquired`` events), on the polling thread's connection,
placed on lanes, and assigned from the offsets stored there
(``incremental_assign`` under a cooperative assignor); a revoke waits for the
turns of its lanes in flight (each turn holds its lane's lock), commits the
offsets to Kafka and drops them.  Elsewhere the polling thread adds and drops
partitions without waiting for a turn: a lane's map of its partitions is
replaced, never changed in place, and a turn in flight with a partition
dropped meanwhile finds it closed, or its fence refused.  The rules are the async consumer's own
code, run to their end on the blocking connections
(:func:`dedup.sync._drive.run`): nothing here decides what a failure means.

``stop()``, SIGTERM or SIGINT set a flag; the lanes end after their
transactions in flight (a blocking handler can't be cut), then the offsets
are committed to Kafka and the group left.  A second signal raises
``KeyboardInterrupt`` at once: the transactions in flight roll back as the
process ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import signal
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from aiokafka.structs import TopicPartition

from dedup import _config as config_
from dedup import _errors as errors
from dedup import _leases as leases
from dedup import _limits as limits
from dedup import _message as message_
from dedup import _store as store
from dedup import _telemetry as telemetry
from dedup import keys
from dedup.consumer import _consumer as consumer_
from dedup.consumer import _lanes as lanes
from dedup.consumer import _partitions as partitions_
from dedup.consumer import _retry as retry
from dedup.consumer import _turn as turn
from dedup.data import _conninfo as conninfo
from dedup.data import _db as db
from dedup.data import _migrations as migrations
from dedup.data import _sql as sql
from dedup.sync import _drive as drive
from dedup.sync import _handler as sync_handler

if TYPE_CHECKING:
    import psycopg

    from dedup.data import _psycopg as psycopg_

log = logging.getLogger("dedup.consumer")

FETCH_WAIT = 0.25
"""Most seconds one ``consume()`` waits for records (or the poll for a lane to take some);
a stop is seen within it."""
QUEUED_TURNS = 2
"""Turns' worth of records (``batch_size`` each) queued for every lane before the poll waits:
enough that a lane finds its next turn waiting, few enough to bound the memory."""
KAFKA_TIMEOUT = 10.0
"""Seconds to wait for Kafka's answer when starting (the topics' metadata) and for the
offsets committed at a revoke or a stop."""
_WHAT = "dedup.sync.Consumer"
_EXTRAS = "pip install 'dedup-kafka[confluent,psycopg]'"
_OURS = {
    "enable.auto.commit": False,  # Postgres holds the offsets
    "enable.auto.offset.store": False,
}
_DEFAULTS = {
    # Records of aborted producer transactions are never applied.
    "isolation.level": "read_committed",
    "auto.offset.reset": config_.DEFAULT_AUTO_OFFSET_RESET,
}


class Consumer:
    """Consume Kafka topics with confluent-kafka and apply each message's effect in Postgres
    exactly once, through psycopg, without asyncio.

    ``handler`` is ``def handler(msg: dedup.Message, tx: dedup.sync.Tx) -> object``,
    called once per fresh message with ``tx.conn`` the ``psycopg.Connection``
    inside the batch's transaction; or a batch handler ``def handler(msgs:
    list[dedup.Message], tx: dedup.sync.Tx) -> None`` (``batch=True``, or a
    ``list[...]`` annotation on its first parameter) that receives the fresh
    messages of one transaction in offset order.

    ``config`` is confluent-kafka's consumer configuration (``bootstrap.servers``,
    security settings, ``partition.assignment.strategy``, ...). dedup sets
    ``group.id`` (from ``group_id``) and turns offset auto-commit off; it
    defaults ``isolation.level`` to ``read_committed`` and
    ``auto.offset.reset`` to ``earliest``, and ``client.id`` to the holder.

    ``concurrency`` lanes apply the partitions side by side, each a thread
    with a connection of its own; a partition is applied by one lane at a
    time, in offset order.  By default :class:`dedup.IdempotentConsumer`'s:
    4 for a batch handler or ``batch_size=1``, else 1.

    Postgres: ``dsn=`` (dedup opens a connection per lane and one for taking
    partitions, with ``connect_options`` for ``psycopg.connect``, and opens
    a new one when one is lost) or ``connection=``, a ``psycopg.Connection``
    outside a transaction that the consumer then owns, for its one lane
    (it turns autocommit on and sends its own ``BEGIN``; once lost,
    ``run()`` raises).  The other settings are
    :class:`dedup.IdempotentConsumer`'s, by the same names.
    """

    def __init__(
        self,
        handler: Callable[..., object],
        *,
        topics: Sequence[str],
        group_id: str,
        config: Mapping[str, Any],
        dsn: str | None = None,
        connection: Any = None,
        key: keys.Strategy = config_.DEFAULT_KEY,
        namespace: str | None = None,
        schema: str = sql.DEFAULT_SCHEMA,
        batch_size: int = config_.DEFAULT_BATCH_SIZE,
        batch: bool | None = None,
        concurrency: int | None = None,
        holder: str | None = None,
        on_missing_key: str = message_.OnMissingKey.DEAD_LETTER,
        on_conflict: str = message_.OnConflict.DEAD_LETTER,
        max_attempts: int = config_.DEFAULT_MAX_ATTEMPTS,
        handler_timeout: float = config_.DEFAULT_HANDLER_TIMEOUT,
        kafka_commit_interval: float = 1.0,
        install_signal_handlers: bool = True,
        connect_options: Mapping[str, Any] | None = None,
    ) -> None:
        if (dsn is None) == (connection is None):
            raise errors.ConfigurationError(f"{_WHAT}: pass exactly one of dsn= or connection=")
        _check_handler(handler)
        missing_key, conflict = config_.policies(on_missing_key, on_conflict)
        self.holder = holder or leases.default_holder()
        """This consumer's name with its tokens and events."""
        self.topics = list(topics) if not isinstance(topics, str) else topics
        self.group_id = group_id
        self.namespace = namespace or group_id
        config_.check_group(
            topics=self.topics, group_id=group_id, namespace=self.namespace, holder=self.holder
        )
        config_.check_key(key)
        config_.check_handling(
            batch_size=batch_size, max_attempts=max_attempts, handler_timeout=handler_timeout
        )
        config_.check_commit_interval(kafka_commit_interval)
        self._kafka_config = _kafka_config(config, group_id, self.holder)
        self._kafka_config.setdefault("logger", logging.getLogger("dedup.kafka"))
        self._kafka_config.setdefault("error_cb", self._on_kafka_error)
        self.batch_handler = config_.is_batch_handler(handler) if batch is None else batch
        """True when ``handler`` takes a batch of messages."""
        self.handler = handler
        self.concurrency = _concurrency(concurrency, connection, self.batch_handler, batch_size)
        """How many lanes apply the partitions side by side."""
        self.store = store.Store(  # validates the schema name
            schema=schema, namespace=self.namespace, on_conflict=conflict
        )
        self._key, self._on_missing_key = key, missing_key
        self._batch_size, self._max_attempts = batch_size, max_attempts
        self._handler_timeout = float(handler_timeout)
        self._commit_interval = float(kafka_commit_interval)
        self._signals = install_signal_handlers
        self._db = _Connection(dsn, connection, connect_options)
        """The polling thread's connection (taking partitions, the owner look); with
        ``connection=``, lane 0's."""
        self._dsn, self._connect_options = dsn, connect_options
        self._secrets = frozenset(conninfo.passwords(dsn) | _secrets(self._kafka_config))
        self._stats = dict.fromkeys(consumer_.STAT_NAMES, 0)
        self._owned: dict[TopicPartition, lanes.Partition] = {}
        self._lanes: list[_Lane] = []
        self._placed: dict[TopicPartition, int] = {}  # each partition's last lane
        self._room = threading.Event()  # a lane took records: the poll may go on
        self._settings: turn.Settings | None = None
        self._kafka: Any = None
        self._stop = threading.Event()
        self._failure: BaseException | None = None  # raised in a rebalance callback
        self._running = False
        self._last_kafka_commit = 0.0
        self._last_owner_look = 0.0
        self._gauges = _Gauges(self)

    @property
    def stats(self) -> Mapping[str, int]:
        """Counters since start, :attr:`dedup.IdempotentConsumer.stats`'s (all lanes')."""
        total = dict(self._stats)
        for lane in list(self._lanes):
            for name, n in list(lane.counts.items()):
                total[name] += n
        return types.MappingProxyType(total)

    @property
    def assignment(self) -> set[tuple[str, int]]:
        """The partitions this consumer holds a current token for."""
        owned = list(self._owned.values())
        return {(p.tp.topic, p.tp.partition) for p in owned if p.state is lanes.State.OWNED}

    # ------------------------------------------------------------ lifecycle --

    def run(self) -> None:
        """Consume until :meth:`stop`, SIGTERM or SIGINT; a clean exit commits what was handled.

        A handler's ``SystemExit`` or ``KeyboardInterrupt`` rolls its transaction back
        and ends ``run()`` with it, after the same shutdown.
        """
        if self._running:
            raise errors.ConfigurationError(f"this {_WHAT} is already running")
        self._running = True
        restore = self._install_signals()
        try:
            self._start()
            self._consume()
        finally:
            try:
                self._shutdown()
            finally:
                restore()
                self._running = False

    def stop(self) -> None:
        """Stop after the transaction in flight: :meth:`run` then commits the offsets to
        Kafka, leaves the group and returns.  Safe from any thread and from the handler."""
        self._stop.set()

    def _install_signals(self) -> Callable[[], None]:
        """SIGTERM and SIGINT stop the consumer (in the main thread, when asked); returns what
        puts the previous handlers back."""
        if not self._signals or threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.signal(sig, self._on_signal) for sig in _SIGNALS}

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

        return restore

    def _on_signal(self, signum: int, frame: types.FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._stop.is_set():
            log.warning("%s again: stopping now; the transaction in flight rolls back", name)
            raise KeyboardInterrupt
        log.info("%s: stopping after the transaction in flight (%s again cuts it)", name, name)
        self._stop.set()

    def _start(self) -> None:
        ck = _confluent()
        conn = self._db.open()
        drive.run(migrations.check(conn, schema=self.store.schema), _WHAT)
        database = drive.run(self.store.queries.current_database.fetchval(conn), _WHAT)
        self._settings = turn.Settings(
            group_id=self.group_id,
            namespace=self.namespace,
            holder=self.holder,
            store=self.store,
            handler=self.handler,
            batch_handler=self.batch_handler,
            key=self._key,
            on_missing_key=self._on_missing_key,
            batch_size=self._batch_size,
            max_attempts=self._max_attempts,
            handler_timeout=self._handler_timeout,
            # Set in each transaction by its first statement, as the async consumer does.
            idle_timeout=self._handler_timeout + consumer_.IDLE_MARGIN,
            database=str(database),
            secrets=self._secrets,
            run_handler=sync_handler.run,
            sleep=self._sleep,
            message=_as_it_is,
        )
        self._lanes = [
            _Lane(i, self, self._db if self._db.given else self._lane_connection())
            for i in range(self.concurrency)
        ]
        for lane in self._lanes:
            lane.start()
        try:
            self._kafka = ck.Consumer(dict(self._kafka_config))
        except ck.KafkaException as exc:
            raise errors.ConfigurationError(f"{_WHAT}: config: {exc.args[0].str()}") from exc
        self._check_topics(ck)
        self._kafka.subscribe(
            self.topics, on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
        )
        for topic in self.topics:
            # Series at 0 from the start, before anything is assigned or fetched.
            telemetry.counting(turn.counted(self._settings, topic))
        telemetry.watch(self._gauges)
        log.info("consumer %s started on %s (group %s)", self.holder, self.topics, self.group_id)

    def _check_topics(self, ck: Any) -> None:
        servers = self._kafka_config.get("bootstrap.servers")
        try:
            present = self._kafka.list_topics(timeout=KAFKA_TIMEOUT).topics
        except ck.KafkaException as exc:
            raise errors.ServiceUnavailableError(
                f"Kafka at {servers} did not answer within {KAFKA_TIMEOUT:g}s "
                f"({exc.args[0].str()}); check bootstrap.servers"
            ) from exc
        missing = [t for t in self.topics if t not in present or present[t].error is not None]
        if missing:
            raise errors.ConfigurationError(
                f"topics: {', '.join(map(repr, missing))} not found on {servers}; create them first"
            )

    def _lane_connection(self) -> _Connection:
        return _Connection(self._dsn, None, self._connect_options)

    def _shutdown(self) -> None:
        self._stop.set()
        telemetry.unwatch(self._gauges)
        for lane in self._lanes:
            lane.stop()
        for lane in self._lanes:
            lane.join()  # after its turn in flight
        kafka, self._kafka = self._kafka, None
        if kafka is not None:
            ck = _confluent()
            try:
                self._commit_kafka(kafka, self._owned.values(), wait=True)
                kafka.close()  # leaves the group: the revoke drops our partitions
            except (ck.KafkaException, RuntimeError) as exc:
                log.warning("leaving the Kafka group failed (%r); the broker will time us out", exc)
        for p in list(self._owned.values()):
            self._drop(p)
        for lane in self._lanes:
            lane.db.close()
        self._db.close()
        log.info("consumer %s stopped: %s", self.holder, dict(self._stats))

    # ----------------------------------------------------------------- loop --

    def _consume(self) -> None:
        kafka = self._kafka
        ck = _confluent()
        while not self._stop.is_set():
            if self._backed_up():
                self._room.wait(FETCH_WAIT)
            else:
                self._feed(ck, kafka.consume(num_messages=self._batch_size, timeout=FETCH_WAIT))
            if self._failure is not None:
                break
            self._settle(ck)
            self._follow_positions(ck)
            self._look_at_owners()
            if time.monotonic() - self._last_kafka_commit >= self._commit_interval:
                self._commit_kafka(kafka, self._owned.values())
        if self._failure is not None:
            raise self._failure

    def _backed_up(self) -> bool:
        """True while the partitions hold :data:`QUEUED_TURNS` turns' worth for every lane
        (then the poll waits for a lane to take some)."""
        self._room.clear()
        queued = sum(len(p.records) for p in list(self._owned.values()))
        return queued >= QUEUED_TURNS * self._batch_size * self.concurrency

    def _feed(self, ck: Any, messages: list[Any]) -> None:
        """Hand each partition its records, as messages (the lane takes them as they are)."""
        fed: dict[tuple[str, int], list[message_.Message]] = {}
        from_confluent = message_.Message.from_confluent
        for m in messages:
            error = m.error()
            if error is not None:
                self._kafka_error(ck, error)
                continue
            msg = from_confluent(m)
            where = (msg.topic, msg.partition)
            records = fed.get(where)
            if records is None:
                records = fed[where] = []
            records.append(msg)
        for where, records in fed.items():
            p = self._owned.get(TopicPartition(*where))
            if p is not None and p.state is lanes.State.OWNED:  # else revoked or taken since
                p.feed(records)

    def _on_kafka_error(self, error: Any) -> None:
        """confluent-kafka's ``error_cb`` (unless the config has one): a fatal error stops the
        consumer; the others are librdkafka's news (it retries on its own)."""
        if error.fatal():
            self._failed(errors.DedupError(f"Kafka: {error.str()}"))
        else:
            log.warning("kafka: %s", error.str())

    def _kafka_error(self, ck: Any, error: Any) -> None:
        """A message that is an error: fatal ones stop the consumer, the rest are librdkafka's
        news (it retries on its own)."""
        if error.code() == ck.KafkaError._PARTITION_EOF:
            return
        if error.fatal():
            raise errors.DedupError(f"Kafka: {error.str()}")
        log.warning("kafka: %s", error.str())

    async def _sleep(self, seconds: float) -> None:
        """A lane's backoff, blocking its thread; a stop meanwhile cancels the turn (its records
        are given back, as at the async consumer's shutdown)."""
        if self._stop.wait(seconds):
            raise asyncio.CancelledError

    # ----------------------------------------------------------- partitions --

    def _on_assign(self, kafka: Any, assigned: list[Any]) -> None:
        """confluent-kafka's ``on_assign``: take the partitions in Postgres, assign them from
        the offsets stored there."""
        ck = _confluent()
        try:
            wanted = sorted({(cp.topic, cp.partition) for cp in assigned})
            with telemetry.tracer.start_as_current_span(
                "dedup assign", attributes={"messaging.consumer.group.name": self.group_id}
            ):
                taken = self._take(wanted)
            starts = []
            tps = [TopicPartition(topic, part) for topic, part in wanted]
            placed = lanes.place(tps, self._lanes, self._placed)
            for tp in tps:
                token, stored = taken[(tp.topic, tp.partition)]
                self._own(tp, token, stored, placed[tp])
                at = ck.OFFSET_INVALID if stored is None else stored  # None: Kafka's, or the reset
                starts.append(ck.TopicPartition(tp.topic, tp.partition, at))
            if _cooperative(self._kafka_config):
                kafka.incremental_assign(starts)
            else:
                kafka.assign(starts)
            # One paused once another member had it (State.TAKEN) is ours again.
            kafka.resume(starts)
            log.info("consumer %s took %s", self.holder, wanted)
        except BaseException as exc:
            self._failed(exc)

    def _on_revoke(self, kafka: Any, revoked: list[Any]) -> None:
        """confluent-kafka's ``on_revoke``: tell Kafka where Postgres stands, drop them.

        It waits for the turns in flight on their lanes: what Kafka hears is what they left.
        """
        try:
            gone = self._held(revoked)
            ck = _confluent()
            with self._between_turns(p.lane for p in gone):
                try:
                    self._commit_kafka(kafka, gone, wait=True)
                except ck.KafkaException as exc:
                    log.info("kafka offset commit at the revoke skipped: %r", exc)
                self._give_up(gone)
        except BaseException as exc:
            self._failed(exc)

    def _on_lost(self, kafka: Any, lost: list[Any]) -> None:
        """confluent-kafka's ``on_lost``: the group went on without us; drop them."""
        gone = self._held(lost)
        with self._between_turns(p.lane for p in gone):
            self._give_up(gone)

    def _held(self, partitions: list[Any]) -> list[lanes.Partition]:
        found = (self._owned.get(TopicPartition(cp.topic, cp.partition)) for cp in partitions)
        return [p for p in found if p is not None]

    def _give_up(self, gone: list[lanes.Partition]) -> None:
        for p in gone:
            self._drop(p)
            telemetry.transition(
                "partition_revoked",
                {"resource": f"{self.group_id}:{p.tp.topic}:{p.tp.partition}", "token": p.token},
            )
        if gone:
            log.info("consumer %s gave up %s", self.holder, [str(p.tp) for p in gone])

    def _took(self, _: TopicPartition | None) -> None:
        """A lane took records: the poll, if it waits for room, goes on."""
        self._room.set()

    def _failed(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self._stop.set()  # the loop raises it after consume() returns

    def _own(
        self, tp: TopicPartition, token: int, stored: int | None, lane: lanes.Lane
    ) -> lanes.Partition:
        assert self._settings is not None  # noqa: S101 - started
        old = self._owned.get(tp)
        if old is not None:
            self._drop(old)
        p = lanes.Partition(tp, token, stored, self._settings)
        self._owned[tp] = p
        lane.add(p)
        return p

    def _drop(self, p: lanes.Partition) -> None:
        """Drop ``p`` without waiting for its lane: a turn in flight with it finds it closed
        (or its fence refused), and the next turn goes without it.  Its queue is left as it
        is, for such a turn to take from; it goes with the partition."""
        if p.state is lanes.State.OWNED:
            p.state = lanes.State.CLOSED
        if p.lane is not None:
            p.lane.remove(p)
        if self._owned.get(p.tp) is p:
            del self._owned[p.tp]

    @contextlib.contextmanager
    def _between_turns(self, of: Iterable[lanes.Lane | None]) -> Iterator[None]:
        """Hold the locks of the lanes ``of`` (in their order, so two callers never wait on
        each other): their turns in flight end first, the next wait (a revoke: what Kafka
        hears is what they left)."""
        with contextlib.ExitStack() as held:
            for lane in sorted({x for x in of if isinstance(x, _Lane)}, key=lambda x: x.index):
                held.enter_context(lane.lock)
            yield

    @contextlib.contextmanager
    def _control(self) -> Iterator[None]:
        """Use of the polling thread's connection: with ``connection=`` it is lane 0's, used
        between its turns."""
        with self._between_turns(self._lanes[:1] if self._db.given else []):
            yield

    def _take(self, wanted: list[tuple[str, int]]) -> dict[tuple[str, int], tuple[int, int | None]]:
        """Take ``wanted`` with new tokens in a transaction of its own, again while Postgres is
        away (unless stopping)."""
        tries = 0
        while True:
            try:
                with self._control():
                    return drive.run(self._taking(wanted), _WHAT)
            except Exception as exc:
                if not db.is_retriable(exc) or self._stop.is_set():
                    raise
                tries += 1
                self._stats["retries"] += 1
                telemetry.retries.add(1, {"messaging.consumer.group.name": self.group_id})
                log.warning("taking partitions %s failed (%r); retrying", wanted, exc)
            if self._stop.wait(retry.backoff(tries, 0.1)):
                raise errors.ServiceUnavailableError(
                    f"stopped while taking partitions {wanted} in Postgres"
                )

    async def _taking(
        self, wanted: list[tuple[str, int]]
    ) -> dict[tuple[str, int], tuple[int, int | None]]:
        conn = await self._db.acquire()
        await db.queries().begin.execute(conn)
        try:
            await db.set_local(
                conn,
                {
                    "lock_timeout": partitions_.TAKEOVER_LOCK_TIMEOUT,
                    "idle_in_transaction_session_timeout": str(
                        round((self._handler_timeout + consumer_.IDLE_MARGIN) * 1000)
                    ),
                },
            )
            taken = await self.store.take_partitions(conn, self.group_id, self.holder, wanted)
            await turn.commit(conn, None)
        except BaseException:
            await turn.roll_back(conn, self.store.schema, traced=False)
            raise
        return taken

    def _settle(self, ck: Any) -> None:
        """Between the turns: drop what another consumer took; take back what an operator moved
        or Postgres forgot (:class:`dedup.consumer._lanes.State`)."""
        for p in list(self._owned.values()):
            if p.state is lanes.State.TAKEN:
                self._drop(p)
                self._kafka.pause([ck.TopicPartition(p.tp.topic, p.tp.partition)])
            elif p.state in (lanes.State.MOVED, lanes.State.FORGOTTEN):
                self._retake(ck, p)

    def _retake(self, ck: Any, p: lanes.Partition) -> None:
        found = p.found
        assert found is not None  # noqa: S101 - MOVED and FORGOTTEN say where
        log.info(
            "consumer %s: %s stands at offset %s (taken by %r); taking it back",
            self.holder,
            p.tp,
            found.next_offset,
            found.holder,
        )
        lane = p.lane
        self._drop(p)
        where = (p.tp.topic, p.tp.partition)
        token, stored = self._take([where])[where]
        assert lane is not None  # noqa: S101 - a partition we held was on a lane
        self._own(p.tp, token, stored, lane)
        at = stored if stored is not None else found.next_offset  # no row: where we began
        if at is not None:
            self._kafka.seek(ck.TopicPartition(*where, at))

    def _follow_positions(self, ck: Any) -> None:
        """Have idle partitions store Kafka's position where it passed records never handed out
        (transaction markers, aborted transactions), as the async consumer does."""
        idle = [p for p in self._owned.values() if p.idle and p.state is lanes.State.OWNED]
        if not idle:
            return
        asked = [ck.TopicPartition(p.tp.topic, p.tp.partition) for p in idle]
        for p, cp in zip(idle, self._kafka.position(asked), strict=True):
            if cp.offset >= 0 and (p.expected is None or cp.offset > p.expected):
                p.follow(cp.offset)

    def _look_at_owners(self) -> None:
        """Every ``kafka_commit_interval``, look for partitions of ours taken in Postgres (by
        ``dedup offsets``, another consumer, a failover), as the async consumer does."""
        now = time.monotonic()
        if not self._owned or now - self._last_owner_look < self._commit_interval:
            return
        self._last_owner_look = now
        owned = dict(self._owned)
        idle = {tp: (p.token, p.expected) for tp, p in owned.items()}
        wanted = [(tp.topic, tp.partition) for tp in owned]
        try:
            with self._control():
                conn = drive.run(self._db.acquire(), _WHAT)
                stored = drive.run(self.store.positions(conn, self.group_id, wanted), _WHAT)
        except Exception as exc:
            if not db.is_retriable(exc):
                raise
            log.warning("checking partition owners failed (%r); trying again", exc)
            return
        # A turn that begins meanwhile finds out from its fence, as in the async consumer.
        lanes.read_positions(owned, stored, idle, self.holder)

    def _commit_kafka(self, kafka: Any, held: Any, *, wait: bool = False) -> None:
        """Tell Kafka where Postgres stands for ``held``, for lag tools (asynchronously unless
        ``wait``); Postgres stays authoritative."""
        self._last_kafka_commit = time.monotonic()
        due = [
            (p, p.expected)
            for p in held
            if p.expected is not None and p.expected != p.committed_to_kafka
        ]
        if not due:
            return
        ck = _confluent()
        offsets = [ck.TopicPartition(p.tp.topic, p.tp.partition, at) for p, at in due]
        try:
            kafka.commit(offsets=offsets, asynchronous=not wait)
        except ck.KafkaException as exc:
            log.info("kafka offset commit skipped: %r", exc)
            return
        for p, at in due:
            p.committed_to_kafka = at


class _Gauges:
    """What the lag gauges read of a running :class:`Consumer` (:func:`dedup._telemetry.watch`),
    maybe from the SDK reader's thread: read, never wait."""

    def __init__(self, consumer: Consumer) -> None:
        self._c = consumer

    def lag(self) -> list[tuple[int, dict[str, Any]]]:
        """Per partition held: Kafka's log-end offset (as last fetched, no round trip) minus
        the offset stored in Postgres."""
        c = self._c
        kafka = c._kafka
        found: list[tuple[int, dict[str, Any]]] = []
        if kafka is None or c._stop.is_set():
            return found
        ck = _confluent()
        for tp, p in list(c._owned.items()):
            stored = p.expected
            try:
                _, end = kafka.get_watermark_offsets(
                    ck.TopicPartition(tp.topic, tp.partition), cached=True
                )
            except (ck.KafkaException, RuntimeError):
                continue
            if stored is not None and end is not None and end >= 0:
                found.append((max(end - stored, 0), telemetry.partition_attributes(c.group_id, tp)))
        return found

    def oldest_unapplied(self, now: float) -> list[tuple[float, dict[str, Any]]]:
        """Per partition held: seconds since the oldest record fetched, not committed (0: none)."""
        c = self._c
        return [] if c._stop.is_set() else lanes.ages(c._owned, now, c.group_id)


_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _as_it_is(msg: message_.Message) -> message_.Message:
    """The lane's record as a message: :meth:`Consumer._feed` queued it built."""
    return msg


class _Lane(lanes.Lane):
    """A lane of :class:`Consumer`: the async consumer's lane, its loop a thread of its own
    (``dedup lane N``) on a connection of its own."""

    def __init__(self, index: int, consumer: Consumer, connection: _Connection) -> None:
        assert consumer._settings is not None  # noqa: S101 - started
        self.counts = dict.fromkeys(consumer_.STAT_NAMES, 0)
        """This lane's share of :attr:`Consumer.stats` (each lane counts its own)."""
        super().__init__(index, connection, consumer._settings, self.counts, consumer._took)
        self.db = connection
        self.lock = threading.RLock()
        """Held for each turn: a revoke waits for it (and, with ``connection=``, a use of the
        polling thread's connection, which is this lane's)."""
        self._consumer = consumer
        self._woken = threading.Event()
        self._halted = False
        self._thread = threading.Thread(target=self._serve, name=f"dedup lane {index}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._woken.set()

    def stop(self) -> None:
        """Take no further turn; the one in flight goes on."""
        self._halted = True
        self._woken.set()

    def join(self) -> None:
        if self._thread.ident is not None:
            self._thread.join()

    def _serve(self) -> None:
        try:
            while not self._halted:
                self._woken.wait()
                self._woken.clear()
                while not self._halted:
                    with self.lock:
                        more = drive.run(self.turn(), _WHAT)
                    self._consumer._took(None)
                    if not more:
                        break
        except asyncio.CancelledError:
            pass  # stopped during a backoff: the turn gave its records back
        except BaseException as exc:  # run() raises it, a handler's SystemExit too
            self._consumer._failed(exc)


class _Connection:
    """A psycopg connection of the consumer's, handed to a lane as a pool hands one."""

    def __init__(self, dsn: str | None, given: Any, options: Mapping[str, Any] | None) -> None:
        if given is not None and options:
            raise errors.ConfigurationError(
                "connect_options configure the connection dedup opens for dsn=; with "
                "connection=, pass them to psycopg.connect yourself"
            )
        self._dsn = dsn
        self._given = given
        self._options = dict(options or {})
        self._raw: psycopg.Connection[Any] | None = None
        self._adapter: psycopg_.SyncAdapter | None = None

    @property
    def given(self) -> bool:
        """True for the caller's connection (``connection=``)."""
        return self._given is not None

    def open(self) -> psycopg_.SyncAdapter:
        """The connection, opened (again, with ``dsn=``) when there is none or it was lost."""
        if self._adapter is not None and not self._adapter.is_closed():
            return self._adapter
        import psycopg
        from psycopg import pq

        from dedup.data import _psycopg as psycopg_

        if self._given is not None:
            if self._raw is not None or self._given.closed:
                raise errors.ConfigurationError(
                    f"{_WHAT}: the connection given (connection=) was lost; give dsn= to "
                    "have dedup open a new one"
                )
            if not isinstance(self._given, psycopg.Connection):
                raise errors.ConfigurationError(
                    f"{_WHAT}: connection={self._given!r}: expected a psycopg.Connection "
                    "(an async one runs on dedup.IdempotentConsumer with asyncpg)"
                )
            if self._given.info.transaction_status != pq.TransactionStatus.IDLE:
                raise errors.ConfigurationError(
                    f"{_WHAT}: the connection given is inside a transaction; the consumer "
                    "runs its own: give it a connection of its own, outside any transaction"
                )
            self._given.autocommit = True  # dedup sends its own BEGIN and COMMIT
            raw = self._given
        else:
            assert self._dsn is not None  # noqa: S101 - one of the two
            raw = _connect(self._dsn, self._options)
        self._raw = raw
        self._adapter = psycopg_.SyncAdapter(raw)
        return self._adapter

    async def acquire(self) -> psycopg_.SyncAdapter:
        """The lane's ``pool.acquire()``."""
        return self.open()

    async def release(self, conn: Any, **_: Any) -> None:
        """The lane's ``pool.release()``, after a lost connection: one that is not idle and
        open is closed, and the next acquire opens a new one."""
        from psycopg import pq

        adapter = self._adapter
        if adapter is None or conn is not adapter:
            return
        status = adapter.raw.info.transaction_status
        if adapter.is_closed() or status != pq.TransactionStatus.IDLE:
            self._adapter = None
            adapter.raw.close()

    def close(self) -> None:
        """Close the connection dedup opened (a given one stays open)."""
        raw, self._raw, self._adapter = self._raw, None, None
        if raw is not None and self._given is None:
            raw.close()


def _connect(dsn: str, options: Mapping[str, Any]) -> psycopg.Connection[Any]:
    """A connection of dedup's for ``dsn``: autocommit on (the consumer sends its own
    ``BEGIN``), psycopg's other settings from ``options``."""
    import psycopg

    settings = {
        "autocommit": True,  # dedup sends its own BEGIN and COMMIT
        "application_name": "dedup",
        "connect_timeout": round(db.DEFAULT_CONNECT_TIMEOUT),
        **options,
    }
    try:
        conn = psycopg.connect(conninfo.to_url(dsn), **settings)
    except psycopg.Error as exc:
        raise db.connect_error(dsn, exc) from exc
    if not conn.autocommit:
        conn.close()
        raise errors.ConfigurationError(
            "connect_options: autocommit must stay on; the consumer sends its own BEGIN"
        )
    return conn


def _concurrency(given: int | None, connection: Any, batch_handler: bool, batch_size: int) -> int:
    """The lanes to run: ``given``, else the async consumer's default; one on the caller's
    connection, which is one."""
    if given is None:
        return (
            1 if connection is not None else config_.default_concurrency(batch_handler, batch_size)
        )
    limits.check_number("concurrency", given, 1, 64, whole=True)
    if connection is not None and given != 1:
        raise errors.ConfigurationError(
            f"concurrency={given!r}: the lanes run on connections of their own; with "
            "connection= there is one: give dsn= for more lanes"
        )
    return given


def _confluent() -> Any:
    try:
        import confluent_kafka
    except ImportError as exc:
        raise errors.ConfigurationError(f"{_WHAT} runs on confluent-kafka: {_EXTRAS}") from exc
    return confluent_kafka


def _check_handler(handler: Any) -> None:
    """Refuse, at construction, a handler that is not a plain callable (and a missing extra)."""
    target = handler.func if isinstance(handler, functools.partial) else handler
    if not callable(handler):
        raise errors.ConfigurationError(
            f"handler={handler!r} is not callable: expected `def handler(msg, tx)`"
        )
    if inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(
        getattr(target, "__call__", None)  # noqa: B004 - an object with an async __call__
    ):
        raise errors.ConfigurationError(
            f"handler={handler!r} is async: {_WHAT} calls a blocking `def handler(msg, tx)`; "
            "an async handler runs on dedup.IdempotentConsumer"
        )
    try:
        import psycopg  # noqa: F401
    except ImportError as exc:
        raise errors.ConfigurationError(f"{_WHAT} runs on psycopg: {_EXTRAS}") from exc
    _confluent()


def _kafka_config(given: Mapping[str, Any], group_id: str, holder: str) -> dict[str, Any]:
    """confluent-kafka's configuration: the caller's, with the offsets left to Postgres."""
    if not isinstance(given, Mapping):
        raise errors.ConfigurationError(
            f"config={given!r}: expected confluent-kafka's configuration, a dict such as "
            "{'bootstrap.servers': 'localhost:9092'}"
        )
    if not given.get("bootstrap.servers"):
        raise errors.ConfigurationError("config: set 'bootstrap.servers' (the Kafka brokers)")
    if given.get("group.id", group_id) != group_id:
        raise errors.ConfigurationError(
            f"config: 'group.id' is {given['group.id']!r} but group_id={group_id!r}; "
            "leave 'group.id' out"
        )
    for name in _OURS:
        if given.get(name) not in (None, False, "false"):
            raise errors.ConfigurationError(
                f"config: {name!r}={given[name]!r}: dedup stores offsets in Postgres; leave it off"
            )
    return {**_DEFAULTS, "client.id": holder, **given, **_OURS, "group.id": group_id}


def _cooperative(config: Mapping[str, Any]) -> bool:
    """Whether the group hands partitions out incrementally (``incremental_assign``)."""
    strategy = str(config.get("partition.assignment.strategy", ""))
    return "cooperative" in strategy or str(config.get("group.protocol", "")) == "consumer"


def _secrets(config: Mapping[str, Any]) -> set[str]:
    """The passwords in confluent-kafka's configuration, masked wherever an error quotes them."""
    return {
        value
        for name, value in config.items()
        if isinstance(value, str) and value and ("password" in name or "secret" in name)
    }
