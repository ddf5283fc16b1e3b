"""One partition's worker: its records, its batches, its transactions, in offset order.

The consumer (:mod:`dedup.consumer`) fetches and hands each partition's records
to that partition's :class:`PartitionWorker`, which applies them batch after
batch on a lane (:mod:`dedup.lanes`).  Workers run side by side, so a slow or
hung handler holds up only its own partition: its worker stops taking records,
the consumer pauses the partition in the fetcher, and the others keep flowing.
Small batches of several partitions ride in one transaction (a live stream's:
:meth:`dedup._lanes.Lanes.gather`); if it fails, each runs alone as below.

Failure handling, in order of preference:

- a transient error (lost connection, serialization failure, broker hiccup)
  retries the same batch with backoff, for as long as it takes; a deadlock
  retries it at once, its handler waiting for its turn (:mod:`dedup._lanes`);
- a handler error (an exception, ``handler_timeout`` passed, a cancellation, a
  transaction it tried to end) splits the batch in halves until the failing
  message stands alone (no SAVEPOINT per message on the happy path), retries
  it ``max_attempts`` times, then dead-letters it whole; the partition moves on;
- a stale fencing token (another owner took the partition) rolls the batch
  back and stops the worker; the consumer drops the partition until Kafka
  assigns it again.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import asyncpg
from aiokafka.structs import TopicPartition

from dedup import _batch as batch
from dedup import _db as db
from dedup import _errors as errors
from dedup import _handler as handler_
from dedup import _lanes as lanes
from dedup import _message as message_
from dedup import _offsets as offsets
from dedup import _refusal as refusal
from dedup import _store as store
from dedup import _telemetry as telemetry
from dedup import keys

log = logging.getLogger("dedup.worker")

MAX_BACKOFF = 5.0
MIN_QUEUED = 64
"""Records a worker may hold besides its batch in flight, however small ``batch_size`` is."""

Msgs = list[message_.Message]
Dead = list[store.DeadLetter]


@dataclass(frozen=True)
class Settings:
    """What every worker of one consumer shares."""

    group_id: str
    namespace: str
    holder: str
    store: store.Store
    handler: Callable[..., Any]
    batch_handler: bool
    key: keys.Strategy
    on_missing_key: str
    batch_size: int
    max_attempts: int
    handler_timeout: float
    idle_timeout: float
    """The server's idle_in_transaction_session_timeout in each batch's transaction, in seconds."""
    database: str


class HandlerExit(BaseException):
    """A handler raised ``SystemExit`` or ``KeyboardInterrupt``: the worker's task ends
    with this (asyncio would stop the event loop at once on the original), and the
    consumer stops as on SIGTERM, then raises ``exit`` from :meth:`IdempotentConsumer.run`.
    """

    def __init__(self, exit: SystemExit | KeyboardInterrupt) -> None:
        super().__init__(exit)
        self.exit = exit


class PartitionWorker:
    """Applies one owned partition's records under its fencing token."""

    def __init__(
        self,
        tp: TopicPartition,
        token: int,
        next_offset: int | None,
        *,
        settings: Settings,
        lanes: lanes.Lanes,
        stats: MutableMapping[str, int],
        on_room: Callable[[TopicPartition], None],
    ) -> None:
        self.tp = tp
        self.token = token
        self.expected = next_offset
        """The partition's next_offset in Postgres as this worker last left it."""
        self.began = next_offset
        """Where this worker began: the stored offset, or else the first record it was fed."""
        self.committed_to_kafka: int | None = None
        """What Kafka last heard from us (None: tell it, whatever it holds)."""
        self.lost: errors.StaleTokenError | None = None
        """Set when a newer owner took the partition."""
        self.moved: store.Position | None = None
        """Set when ``dedup offsets`` moved the partition (the consumer takes it back)."""
        self.in_flight: list[int] = []
        """Offsets of the batch being applied now."""
        self._s = settings
        self._lanes = lanes
        self._stats = stats
        self._on_room = on_room
        self._records: collections.deque[Any] = collections.deque()
        self._follow_to: int | None = None
        self._more = asyncio.Event()
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._oldest_in_flight: int | None = None  # a timestamp (ms), for the age gauge
        # Exits counted across restarts (``_starts``): a mark before the first batch,
        # and before each message of a stretch where an earlier holder died.
        self._watching = True
        self._single = False
        self._marked: int | None = None  # the offset marked, until committed past
        self._counted = telemetry.counting(batch.counted(settings, tp.topic))
        self._consumed = batch.consumed(settings, tp)

    # ------------------------------------------------------------ lifecycle --

    def start(self) -> None:
        """Start applying records as they are fed."""
        self._task = asyncio.create_task(self._run(), name=f"dedup worker {self.tp}")

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The worker's task (done when it stopped, with the exception that stopped it)."""
        return self._task

    @property
    def busy(self) -> bool:
        """True while a batch is being applied."""
        return bool(self.in_flight)

    def feed(self, records: list[Any]) -> None:
        """Queue fetched records (the consumer feeds only a worker that wants records)."""
        floor = self.expected if self.expected is not None else -1
        self._records.extend(r for r in records if r.offset >= floor)
        if self.began is None and self._records:
            self.began = self._records[0].offset
        self._more.set()
        telemetry.consumed.add(len(records), self._consumed)

    @property
    def closing(self) -> bool:
        """True once :meth:`stop` was called."""
        return self._closing.is_set()

    @property
    def idle(self) -> bool:
        """True when every record fed has been applied and nothing else is asked of it."""
        return not self.in_flight and not self._records and self._follow_to is None

    def follow(self, position: int) -> None:
        """Store ``position`` as the partition's offset: Kafka's fetch position passed records
        it never handed out (transaction markers, aborted transactions).  Records fed later
        all lie at or beyond it, and the worker moves the offset before applying them.
        """
        self._follow_to = position
        self._more.set()

    def taken_over(self, now: store.Position) -> None:
        """The partition's row shows a newer token (found by the consumer's periodic look)."""
        if offsets.is_operator(now.holder):
            self.moved = now
        else:
            self.lost = errors.StaleTokenError(
                f"{self._s.group_id}:{self.tp.topic}:{self.tp.partition}", self.token
            )
        self.stop()

    @property
    def wants_records(self) -> bool:
        """True while less than a batch (or MIN_QUEUED records) waits behind the one in flight."""
        room = max(self._s.batch_size, MIN_QUEUED)
        return not self._closing.is_set() and len(self._records) < room

    def stop(self) -> None:
        """Take no further batch; the one in flight goes on (the consumer bounds how long)."""
        self._closing.set()
        self._more.set()

    def oldest_unapplied(self) -> int | None:
        """Timestamp (ms) of the oldest record fed, not committed (None: none); reads only."""
        first = next(iter(self._records), None)  # one step: safe from the reader's thread
        fed = int(first.timestamp) if first is not None else None
        return fed if self._oldest_in_flight is None else self._oldest_in_flight

    @property
    def in_flight_range(self) -> str:
        """``first-last`` offsets of the batch in flight, for the log of a shutdown that cuts it."""
        return f"{min(self.in_flight)}-{max(self.in_flight)}" if self.in_flight else "none"

    # ----------------------------------------------------------------- loop --

    async def _run(self) -> None:
        try:
            await self._loop()
        except (SystemExit, KeyboardInterrupt) as exc:
            # The batch rolled back on the way here; its mark stays, so the exit
            # counts against the message across restarts (_starts).
            log.warning("the handler of %s ended the process (%r); stopping", self.tp, exc)
            raise HandlerExit(exc) from exc
        except asyncio.CancelledError:
            if self._marked is not None:
                await self._unmark(self._marked)  # a clean stop or a revoke: no death
            raise

    async def _unmark(self, offset: int) -> None:
        try:
            async with self._lanes.lane() as lane:
                conn = await lane.connection()
                await self._s.store.unmark_start(
                    conn, self.fence(), self.tp.topic, self.tp.partition, offset
                )
        except Exception as exc:  # the next holder counts one attempt too many, no more
            log.info("taking back the mark of %s at %d failed (%r)", self.tp, offset, exc)

    async def _loop(self) -> None:
        while True:
            await self._more.wait()
            if self._closing.is_set():
                return
            if self._follow_to is not None:
                to, self._follow_to = self._follow_to, None
                if not await self._advance(to):
                    return
            exits = await self._starts() if self._watching and self._records else 0
            limit = 1 if self._single else self._s.batch_size
            batch = [self._records.popleft() for _ in range(min(limit, len(self._records)))]
            if not self._records:
                self._more.clear()
            self._on_room(self.tp)
            if batch and not await self._apply(batch, exits):
                return
            if self._marked is not None and (self.expected or 0) > self._marked:
                self._marked = None  # committed past the mark

    async def _starts(self) -> int:
        """Mark where the next batch starts; how often the process ended handling it before.

        A message whose handling ends the process (``SystemExit`` from a handler,
        a signal, an OOM kill) rolls its batch back, and the restart meets it
        again: nothing in memory survives to count with.  So before its first
        batch a holder records, committed on its own, where that batch starts
        (``mark_start``).  Finding that an earlier holder started there and died,
        it applies the next ``batch_size`` offsets one message at a time, marking
        each, so the next death names its message.  A message that ended the
        process ``max_attempts`` times is dead-lettered unhandled (:meth:`_apply`)
        and the partition moves on.  A clean stop that cuts a batch counts too.
        """
        head = self._records[0].offset
        try:
            async with self._lanes.lane() as lane:
                conn = await lane.connection()
                marked = await self._s.store.mark_start(
                    conn,
                    self.fence(),
                    self.tp.topic,
                    self.tp.partition,
                    offset=head,
                    stretch=self._s.batch_size,
                )
        except Exception as exc:
            if not db.is_retriable(exc):
                raise
            log.warning("marking where %s starts failed (%r); applying unmarked", self.tp, exc)
            return 0
        if marked is None:
            return 0  # not ours any more: the batch's fence finds out who has it
        self._marked = head
        starts, single = marked
        if single and not self._single:
            log.warning(
                "%s: the process ended while handling offset %d or the batch it began; "
                "applying one message at a time from there",
                self.tp,
                head,
            )
        self._single = self._watching = single
        return starts - 1

    async def _apply(self, records: list[Any], exits: int = 0) -> bool:
        """Apply the records of one batch; False when the partition is lost.

        ``exits``: how often the process ended while handling the batch's first
        message (see :meth:`_starts`); past ``max_attempts`` it is dead-lettered.
        """
        floor = self.expected if self.expected is not None else -1
        keyed: list[message_.Message] = []
        dead: list[store.DeadLetter] = []
        for record in records:
            if record.offset < floor:
                continue
            msg = message_.Message.from_record(record)
            letter = batch.take_key(self._s.key, self._s.on_missing_key, msg)
            if letter is None and exits >= self._s.max_attempts:
                letter = store.DeadLetter(
                    msg,
                    f"the process ended {exits} times while handling it",
                    error="the process ended (SystemExit or KeyboardInterrupt from the handler, "
                    "a signal, an out-of-memory kill?); see the consumer's log",
                    attempts=exits,
                )
                log.error("dead-lettering %s: %s", msg.where, letter.reason)
            if letter is None:
                keyed.append(msg)
            else:
                dead.append(letter)
        if not keyed and not dead:
            return True
        self.in_flight = [m.offset for m in keyed] + [d.msg.offset for d in dead]
        self._oldest_in_flight = int(records[0].timestamp)
        try:
            return await self._apply_retrying(keyed, dead)
        finally:
            self.in_flight = []
            self._oldest_in_flight = None

    async def _apply_retrying(self, msgs: Msgs, dead: Dead) -> bool:
        """Apply one batch, retrying transient failures; False when the partition is gone."""
        # Small batches ride together (Lanes.gather); one whose shared transaction
        # failed runs alone from then on.
        size = len(msgs) + len(dead)
        small = size * lanes.RIDER_SHARE <= self._s.batch_size
        rider = lanes.Rider((self, msgs, dead), size) if small else None
        delay = 0.1
        shared = waited = False
        while True:
            if self.expected is not None:
                # Tried again after part of the batch committed (a split that went
                # half way, or a COMMIT whose answer was lost): only what is left.
                msgs = [m for m in msgs if m.offset >= self.expected]
                dead = [d for d in dead if d.msg.offset >= self.expected]
                if not msgs and not dead:
                    return True
            try:
                async with self._lanes.lane_or_ride(rider) as lane:
                    if lane is None:
                        assert rider is not None  # noqa: S101 - only a rider rides
                        if await rider.seat:
                            return True  # committed in the transaction it rode in
                        rider = None
                        continue
                    shared = lane.shared
                    if rider is not None:
                        rider = None
                        riders = await self._lanes.gather(
                            self._s.batch_size - len(msgs) - len(dead)
                        )
                        if riders and await self._apply_together(lane, msgs, dead, riders):
                            return True
                    try:
                        await self._apply_isolating(lane, msgs, dead)
                    except errors.StaleTokenError as exc:
                        # True: our own COMMIT had landed; go on from where it left us.
                        if not await self._refused(lane, exc):
                            return False
                    except Exception as exc:
                        if db.is_retriable(exc):
                            await lane.release()  # start again on a fresh connection
                        raise
                    else:
                        return True
            except Exception as exc:
                if not db.is_retriable(exc):
                    raise
                self._stats["retries"] += 1
                telemetry.retries.add(1, self._counted)
                if lanes.contended(exc, shared):
                    # Run it again at once: once the lanes are serial its handler waits
                    # for its turn and meets no other turn's rows (one retry).
                    waited = self._contended(exc, again=waited)
                    continue
                telemetry.transition("retried", {"error": handler_.describe(exc)})
                log.warning("batch of %s failed (%r); retrying in %.1fs", self.tp, exc, delay)
                if not await self._sleep(delay):
                    return False  # closing: the batch rolled back and will be redelivered
                delay = min(delay * 2, MAX_BACKOFF)

    async def _apply_together(
        self, lane: lanes.Lane, msgs: Msgs, dead: Dead, riders: list[lanes.Rider]
    ) -> bool:
        """Apply this batch and the riders' in one transaction; False: each runs alone."""
        crew = [(self, msgs, dead), *(rider.batch for rider in riders)]
        return await batch.together(self._lanes, lane, self._s, crew, riders, self._stats)

    def _contended(self, exc: Exception, again: bool = False) -> bool:
        """The batch ran into another lane's row locks: count it; the lanes may turn serial
        (at once for a deadlock or a batch that waits ``again``).  True: it was a lock wait."""
        deadlock = isinstance(exc, asyncpg.DeadlockDetectedError)
        self._stats["deadlocks" if deadlock else "lock_waits"] += 1
        metric = telemetry.deadlocks if deadlock else telemetry.lock_waits
        metric.add(1, self._counted)
        if deadlock or again:
            self._lanes.deadlocked()
        else:
            self._lanes.waited()
        log.info(
            "batch of %s %s; retrying it%s",
            self.tp,
            "deadlocked with another lane" if deadlock else "waited too long on a lock",
            " under a turn" if self._lanes.serial else "",
        )
        return not deadlock

    async def _refused(self, lane: lanes.Lane, exc: errors.StaleTokenError) -> bool:
        """The fence refused a write: True if the partition is still ours from ``self.expected``
        (what the partition's row says happened: :mod:`dedup._refusal`)."""
        conn = await lane.connection()
        now = await self._s.store.position(conn, self._s.group_id, self.tp.topic, self.tp.partition)
        verdict = refusal.judge(now, self.token, self.expected)
        if verdict == refusal.LANDED and now is not None and now.next_offset is not None:
            log.info("%s: a write in doubt had landed; resuming at %d", self.tp, now.next_offset)
            self.expected = now.next_offset
            return True
        if verdict == refusal.MOVED:
            self.moved = now
            return False
        if verdict == refusal.FORGOTTEN:
            self.moved = refusal.resume_at(now, self, self._s.holder)
            return False
        await self._lose(lane, exc)
        return False

    async def _advance(self, to: int) -> bool:
        """Store ``to`` as the offset under the fence; False when the partition is not ours."""
        if self.expected is not None and to <= self.expected:
            return True
        fence = self.fence()
        async with self._lanes.lane() as lane:
            try:
                try:
                    conn = await lane.connection()
                    await self._s.store.advance(conn, fence, self.tp.topic, self.tp.partition, to)
                except errors.StaleTokenError as exc:
                    return await self._refused(lane, exc)
            except Exception as exc:
                if not db.is_retriable(exc):
                    raise
                # The consumer asks again once the worker is idle.
                log.warning("moving the offset of %s to %d failed (%r)", self.tp, to, exc)
                await lane.release()
                return True
        log.debug("%s: offset moves past records not handed out, to %d", self.tp, to)
        self.expected = to
        return True

    async def _apply_isolating(self, lane: lanes.Lane, msgs: Msgs, dead: Dead) -> None:
        """Apply a batch; on a handler error, split it to find and dead-letter the culprit."""
        failure = await self._try_transaction(lane, msgs, dead)
        if failure is None:
            return
        if len(msgs) > 1:
            log.info("handler failed on a batch of %d from %s; splitting", len(msgs), self.tp)
            for part, part_dead in batch.split(msgs, dead, handler_.failed_offset(failure)):
                await self._apply_isolating(lane, part, part_dead)
            return
        msg = msgs[0]
        for attempt in range(2, self._s.max_attempts + 1):
            self._stats["retries"] += 1
            telemetry.retries.add(1, self._counted)
            telemetry.transition("retried", {"key": msg.idempotency_key, "attempt": attempt})
            await self._sleep(min(0.05 * 2**attempt, MAX_BACKOFF))
            failure = await self._try_transaction(lane, [msg], dead)
            if failure is None:
                return
        log.warning(
            "dead-lettering %s after %d attempts: %s",
            msg.where,
            self._s.max_attempts,
            handler_.describe(failure),
        )
        letter = store.DeadLetter(
            msg,
            f"handler failed {self._s.max_attempts} times",
            error=handler_.describe(failure),
            attempts=self._s.max_attempts,
        )
        await self._transaction(lane, [], [*dead, letter])

    async def _try_transaction(self, lane: lanes.Lane, msgs: Msgs, dead: Dead) -> Exception | None:
        """Run one transaction; return the handler's error, raise anything retriable or stale."""
        started = time.monotonic()
        try:
            await self._transaction(lane, msgs, dead)
        except errors.StaleTokenError:
            raise
        except Exception as exc:
            if not msgs:
                raise
            if db.is_retriable(exc):
                if not db.session_timed_out(exc, time.monotonic() - started, self._s.idle_timeout):
                    raise
                await lane.release()
                return errors.HandlerError(
                    "the server ended the session after idle_in_transaction_session_timeout="
                    f"{self._s.idle_timeout:g}s: the handler kept the transaction idle that long "
                    "(blocking code in an async handler?)"
                )
            return exc
        return None

    def fence(self) -> store.Fence:
        """The fence of this partition's next batch: its token, and its offset as last stored."""
        return store.Fence(self._s.group_id, self.token, self.expected)

    async def _transaction(self, lane: lanes.Lane, msgs: Msgs, dead: Dead) -> None:
        fence = self.fence()
        turn = self._lanes.turn(self._s.group_id)  # after a deadlock, handlers take turns
        stats = self._stats
        part = batch.Part(self.tp, fence, msgs, dead)
        [result] = await batch.transaction(lane, self._s, turn, [part], stats)
        self.expected = result.next_offset

    async def _lose(self, lane: lanes.Lane, exc: errors.StaleTokenError) -> None:
        """A newer owner holds the partition: record it and stop."""
        self.lost = exc
        self._stats["stale"] += 1
        telemetry.stale_rejections.add(1, self._counted)
        log.warning("consumer %s: %s", self._s.holder, exc)
        await refusal.record_stale(lane, self._s, exc, self.token, self.expected)

    async def _sleep(self, seconds: float) -> bool:
        """Sleep unless the worker is closing; True if the full time passed."""
        try:
            await asyncio.wait_for(self._closing.wait(), seconds)
        except TimeoutError:
            return True
        return False
