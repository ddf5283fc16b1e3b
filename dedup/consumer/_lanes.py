"""Lanes: a connection, a task and a fixed set of partitions each; one transaction per turn.

The consumer has ``concurrency`` lanes.  At each assignment every partition it
takes is placed on a lane (:func:`place`: a partition stays on its lane across
rebalances where it can) and gets a :class:`Partition`, which holds its token,
its offset as this holder last stored it, and the records fetched for it.
The fetch loop (:mod:`dedup.consumer._consumer`) feeds each partition's records and
wakes its lane.

A lane's loop takes a **turn** whenever its partitions hold records: up to
``batch_size`` records in all, each partition's in offset order (the partition
served first rotates, so none waits behind a busy neighbour), and applies them
in one transaction (:mod:`dedup.consumer._turn`).  Its partitions wait while it runs;
the other lanes' don't.  A hung handler holds up only its own lane, for
``handler_timeout`` per attempt.

When a turn fails, the policy of :mod:`dedup.consumer._retry` says what to do: run it
again (a deadlock, an outage), drop a partition the fence refused, or split
it to find the message whose handler fails, which gets ``max_attempts`` and
is then dead-lettered.

A partition's :class:`State` is one value: ``OWNED`` while its records are
applied; ``MOVED`` (``dedup offsets`` moved it), ``FORGOTTEN`` (Postgres lost
commits of ours) and ``TAKEN`` (another consumer has it) once the fence, or
the periodic look of :mod:`dedup.consumer._partitions`, found that; ``CLOSED`` after a
revoke or at shutdown.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from aiokafka.structs import TopicPartition

from dedup import _errors as errors
from dedup import _handler as handler_
from dedup import _message as message_
from dedup import _results as results
from dedup import _store as store
from dedup import _telemetry as telemetry
from dedup.consumer import _refusal as refusal
from dedup.consumer import _retry as retry
from dedup.consumer import _turn as turn
from dedup.operations import _offsets as offsets

log = logging.getLogger("dedup.consumer")

MIN_QUEUED = 64
"""Records a partition may hold besides those in flight, however small ``batch_size`` is."""
RELEASE_TIMEOUT = 5.0
"""Seconds a lane's connection may take to go back to the pool (its reset); past it the
connection is closed instead."""


class State(enum.Enum):
    """Where a partition held by this consumer stands."""

    OWNED = "owned"
    """Ours under a current token: its records are applied."""
    MOVED = "moved"
    """``dedup offsets`` moved it: the consumer takes it back from the offset set."""
    FORGOTTEN = "forgotten"
    """Postgres lost commits of ours (a failover): taken back from the offset stored."""
    TAKEN = "taken"
    """Another consumer holds a newer token: dropped until Kafka assigns it again."""
    CLOSED = "closed"
    """Revoked, or the consumer is stopping: no further turn takes its records."""


class Partition:
    """One partition held under a token: its records, and its offset as last stored."""

    def __init__(
        self,
        tp: TopicPartition,
        token: int,
        next_offset: int | None,
        settings: turn.Settings,
    ) -> None:
        self.tp = tp
        self.token = token
        self.expected = next_offset
        """The partition's next_offset in Postgres as this holder last left it."""
        self.began = next_offset
        """Where this holder began: the stored offset, or else the first record fed."""
        self.state = State.OWNED
        self.found: results.Position | None = None
        """The row that showed it MOVED or FORGOTTEN: where to take it back from."""
        self.committed_to_kafka: int | None = None
        """What Kafka last heard from us (None: tell it, whatever it holds)."""
        self.records: collections.deque[Any] = collections.deque()
        self.in_flight: list[int] = []
        """Offsets of this partition in the turn running now."""
        self.follow_to: int | None = None
        # Exits counted across restarts (Lane._mark): a mark before the first turn,
        # and before each message of a stretch where an earlier holder died.
        self.watching = True
        self.single = False
        self.marked: int | None = None
        self.exits = 0
        """How often the process ended at the marked offset before (``Lane._mark``)."""
        self.lane: Lane | None = None
        self._room = max(settings.batch_size, MIN_QUEUED)
        self.counted = telemetry.counting(turn.counted(settings, tp.topic))
        self._consumed = {
            **turn.messaging(settings, tp.topic, tp.partition),
            "messaging.operation.name": "poll",
            "messaging.operation.type": "receive",
        }

    def feed(self, records: list[Any]) -> None:
        """Queue fetched records and wake the lane."""
        floor = self.expected if self.expected is not None else -1
        if records and records[0].offset >= floor:
            self.records.extend(records)  # in offset order: all past the floor
        else:
            self.records.extend(r for r in records if r.offset >= floor)
        if self.began is None and self.records:
            self.began = self.records[0].offset
        telemetry.consumed.add(len(records), self._consumed)
        if self.lane is not None:
            self.lane.wake()

    @property
    def room(self) -> int:
        """How many more records it takes: up to ``batch_size`` (or MIN_QUEUED) wait."""
        return max(0, self._room - len(self.records)) if self.state is State.OWNED else 0

    @property
    def wants_records(self) -> bool:
        """True while it has room."""
        return self.room > 0

    @property
    def drained(self) -> bool:
        """True once at most half its room is queued: time to fetch for it again.

        A partition paused in the fetcher resumes only then, so one that a lane
        takes a record at a time from is not paused and resumed for each record.
        """
        return len(self.records) <= self._room // 2

    @property
    def busy(self) -> bool:
        """True while a turn applies records of it."""
        return bool(self.in_flight)

    @property
    def idle(self) -> bool:
        """True when every record fed has been applied and nothing else is asked of it."""
        return not self.in_flight and not self.records and self.follow_to is None

    def follow(self, position: int) -> None:
        """Store ``position`` as the offset: Kafka's fetch position passed records it never
        handed out (transaction markers, aborted transactions)."""
        self.follow_to = position
        if self.lane is not None:
            self.lane.wake()

    def fence(self) -> results.Fence:
        """The fence of this partition's next transaction."""
        return results.Fence(self.lane.group_id if self.lane else "", self.token, self.expected)

    def taken_over(self, now: results.Position) -> None:
        """The partition's row shows a newer token (found by the periodic look)."""
        self.found = now
        self.state = State.MOVED if offsets.is_operator(now.holder) else State.TAKEN

    def oldest_unapplied(self) -> int | None:
        """Timestamp (ms) of the oldest record fed, not committed (None: none); reads only."""
        first = next(iter(self.records), None)  # one step: safe from the reader's thread
        return int(first.timestamp) if first is not None else None

    @property
    def in_flight_range(self) -> str:
        """``first-last`` offsets in flight, for the log of a shutdown that cuts them."""
        return f"{min(self.in_flight)}-{max(self.in_flight)}" if self.in_flight else "none"


@dataclass
class Work:
    """A partition's records in one turn: the messages to claim, those to dead-letter."""

    partition: Partition
    records: list[Any]
    """The records taken off the partition's queue (given back if the turn is cut)."""
    msgs: list[message_.Message]
    dead: list[results.DeadLetter] = field(default_factory=list)
    next_offset: int = 0
    attempt: int = 1
    """The handler's attempt at this work (more than 1 only for a single message)."""

    def part(self) -> store.Part:
        """The part to send, under the partition's current fence; what committed before
        (a COMMIT whose answer was lost) is left out."""
        floor = self.partition.expected
        msgs, dead = self.msgs, self.dead
        if floor is not None:
            msgs = [m for m in msgs if m.offset >= floor]
            dead = [d for d in dead if d.msg.offset >= floor]
        p = self.partition
        return store.Part(p.tp.topic, p.tp.partition, p.fence(), msgs, dead, self.next_offset)

    @property
    def done(self) -> bool:
        """True when the partition's stored offset passed this work (or it isn't ours)."""
        p = self.partition
        if p.state is not State.OWNED:
            return True
        return p.expected is not None and p.expected >= self.next_offset


class Lane:
    """One connection, one task, and the partitions placed on it."""

    def __init__(
        self,
        index: int,
        pool: Any,
        settings: turn.Settings,
        stats: MutableMapping[str, int],
        on_room: Callable[[TopicPartition], None],
    ) -> None:
        self.index = index
        self.group_id = settings.group_id
        self.partitions: dict[TopicPartition, Partition] = {}
        self._pool = pool
        self._s = settings
        self._stats = stats
        self._on_room = on_room
        self._conn: asyncpg.Connection | None = None
        self._more = asyncio.Event()
        self._stopping = False
        self._next = 0  # the partition served first in the next turn
        self.task: asyncio.Task[None] | None = None
        self.rested = asyncio.Event()
        """Set while no turn runs (none began, or the last one ended)."""
        self.rested.set()

    # ------------------------------------------------------------ lifecycle --

    def start(self) -> None:
        """Start taking turns."""
        self._stopping = False
        self.task = asyncio.create_task(self._run(), name=f"dedup lane {self.index}")

    def wake(self) -> None:
        """Records (or an offset to follow) came for a partition of this lane."""
        self._more.set()

    def stop(self) -> None:
        """Take no further turn; the one running goes on (the caller bounds how long)."""
        self._stopping = True
        self._more.set()

    def add(self, partition: Partition) -> None:
        partition.lane = self
        # A new map, never one changed in place: ``dedup.sync.Consumer`` adds and removes
        # from its polling thread while the lane's thread reads the map it had.
        self.partitions = {**self.partitions, partition.tp: partition}
        if partition.records:
            self.wake()

    def remove(self, partition: Partition) -> None:
        if self.partitions.get(partition.tp) is partition:
            self.partitions = {tp: p for tp, p in self.partitions.items() if p is not partition}

    async def _run(self) -> None:
        try:
            await self._loop()
        except (SystemExit, KeyboardInterrupt) as exc:
            # The turn rolled back on the way here; its marks stay, so the exit
            # counts against the message across restarts (_mark).
            log.warning("a handler on lane %d ended the process (%r); stopping", self.index, exc)
            raise handler_.HandlerExit(exc) from exc

    async def _loop(self) -> None:
        while not self._stopping:
            await self._more.wait()
            if self._stopping:
                return
            if not await self.turn():
                self._more.clear()

    async def turn(self) -> bool:
        """Take one turn of what the lane's partitions hold and apply it; False if they hold
        nothing.

        The lane's task calls it while records come; ``dedup.sync.Consumer``, whose one
        lane has no task, after each poll, until it returns False.  A turn cancelled
        (a shutdown, a revoke; in ``dedup.sync.Consumer``, a stop during a backoff)
        gives its records back and takes back its marks.
        """
        work = self._take()
        if not work:
            return False
        self.rested.clear()
        try:
            if await self._marked(work):
                # A partition turned out to lie where an earlier holder died: it
                # runs alone, a message at a time, from the next turn on.
                self._give_back(work)
                return True
            await self._apply(work)
        except asyncio.CancelledError:
            self._give_back(work)
            await self._unmark(work)
            raise
        finally:
            self.rested.set()
            for w in work:
                w.partition.in_flight = []
        return True

    # ---------------------------------------------------------------- turns --

    def _take(self) -> list[Work]:
        """The next turn's work: up to ``batch_size`` records of this lane's partitions.

        A partition in a stretch where an earlier holder died runs alone, one
        message at a time (:meth:`_mark`).
        """
        owned = [p for p in self.partitions.values() if p.state is State.OWNED]
        if not owned:
            return []
        start = self._next % len(owned)
        order = owned[start:] + owned[:start]
        self._next += 1
        budget = self._s.batch_size
        work: list[Work] = []
        for p in order:
            if p.single and p.records:
                if work:
                    continue  # alone, in a turn of its own
                return [self._work(p, 1)]
            if budget <= 0:
                break
            if p.records:
                w = self._work(p, budget)
                budget -= len(w.records)
                work.append(w)
            elif p.follow_to is not None:
                to, p.follow_to = p.follow_to, None
                if p.expected is None or to > p.expected:
                    work.append(Work(p, [], [], next_offset=to))
        return work

    def _work(self, p: Partition, most: int) -> Work:
        """Take up to ``most`` records off ``p``'s queue; their keys, or why there is none."""
        queue = p.records
        records = [queue.popleft() for _ in range(min(most, len(queue)))]
        if p.drained:
            self._on_room(p.tp)
        floor = p.expected if p.expected is not None else -1
        msgs: list[message_.Message] = []
        dead: list[results.DeadLetter] = []
        # Once per record: the names looked up once.
        strategy, on_missing_key = self._s.key, self._s.on_missing_key
        from_record, take_key = self._s.message, store.take_key
        for record in records:
            if record.offset < floor:
                continue
            msg = from_record(record)
            letter = take_key(strategy, on_missing_key, msg)
            if letter is None:
                msgs.append(msg)
            else:
                dead.append(letter)
        p.in_flight = [r.offset for r in records]
        next_offset = max(records[-1].offset + 1, p.follow_to or 0)
        p.follow_to = None
        return Work(p, records, msgs, dead, next_offset)

    async def _apply(self, work: list[Work]) -> None:
        """Apply ``work`` in one transaction, as :mod:`dedup.consumer._retry` says when it fails."""
        tries = 0
        while True:
            work = [w for w in work if not w.done]
            if not work:
                return
            parts = [w.part() for w in work]
            try:
                conn = await self.connection()
                found = await turn.run(conn, self._s, parts, self._stats)
            except retry.Refused as exc:
                refused = [
                    w for w, p in zip(work, parts, strict=True) if any(p is r for r in exc.parts)
                ]
                try:
                    await self._refused(refused)
                except Exception as lost:
                    rule = retry.decide(lost, in_handler=False)
                    if rule.action is not retry.Action.AGAIN:
                        raise
                    tries += 1
                    await self._again(rule, lost, tries)
                continue
            except retry.HandlerFailed as exc:
                rule = retry.decide(exc.error, in_handler=True)
                if rule.action is retry.Action.SPLIT:
                    await self._isolate(work, parts, exc)
                    return
                tries += 1
                await self._again(rule, exc.error, tries)
            except Exception as exc:
                rule = retry.decide(exc, in_handler=False)
                if rule.action is retry.Action.STOP:
                    raise
                tries += 1
                await self._again(rule, exc, tries)
            else:
                for w, result in zip(work, found, strict=True):
                    w.partition.expected = result.next_offset
                    if (
                        w.partition.marked is not None
                        and (result.next_offset or 0) > w.partition.marked
                    ):
                        w.partition.marked = None  # committed past the mark
                return

    async def _again(self, rule: retry.Rule, exc: BaseException, tries: int) -> None:
        """Count a transient failure and wait before the turn runs again."""
        self._stats["retries"] += 1
        first = next(iter(self.partitions.values()), None)
        attributes = first.counted if first is not None else {}
        telemetry.retries.add(1, attributes)
        if rule.counted == "deadlocks":
            self._stats["deadlocks"] += 1
            telemetry.deadlocks.add(1, attributes)
        if rule.fresh_connection:
            await self.release()
        delay = retry.backoff(tries)
        telemetry.transition("retried", {"error": handler_.describe(exc, self._s.secrets)})
        log.warning(
            "lane %d: a transaction failed (%s: %r); running it again in %.2fs",
            self.index,
            rule.what,
            exc,
            delay,
        )
        await self._s.sleep(delay)

    async def _isolate(
        self, work: list[Work], parts: Sequence[store.Part], failure: retry.HandlerFailed
    ) -> None:
        """A handler failed: run the turn again in smaller pieces to find its message.

        Partition by partition first; then the failing partition's batch in
        halves, or around the message the per-message handler names; a single
        message gets ``max_attempts``, then is dead-lettered and its partition
        moves on.
        """
        if len(work) > 1:
            log.info("lane %d: a handler failed in a turn of %d partitions", self.index, len(work))
            failed = next(
                (w for w, p in zip(work, parts, strict=True) if p is failure.partition), None
            )
            for w in sorted(work, key=lambda w: w is failed):  # the failing one last
                await self._apply([w])
            return
        [w] = work
        if len(w.msgs) > 1:
            log.info(
                "handler failed on a batch of %d from %s; splitting", len(w.msgs), w.partition.tp
            )
            offsets_ = [m.offset for m in w.msgs]
            culprit = handler_.failed_offset(failure.error)
            for start, stop in retry.halves(offsets_, culprit):
                await self._apply([self._piece(w, start, stop)])
            return
        msg = w.msgs[0]
        if w.attempt < self._s.max_attempts:
            self._stats["retries"] += 1
            telemetry.retries.add(1, w.partition.counted)
            telemetry.transition("retried", {"key": msg.idempotency_key, "attempt": w.attempt + 1})
            await self._s.sleep(retry.backoff(w.attempt, retry.HANDLER_BACKOFF))
            await self._apply(
                [Work(w.partition, w.records, w.msgs, w.dead, w.next_offset, w.attempt + 1)]
            )
            return
        letter = handler_.failed_letter(msg, failure.error, self._s.max_attempts, self._s.secrets)
        log.warning(
            "dead-lettering %s after %d attempts: %s", msg.where, self._s.max_attempts, letter.error
        )
        await self._apply([Work(w.partition, w.records, [], [*w.dead, letter], w.next_offset)])

    def _piece(self, w: Work, start: int, stop: int) -> Work:
        """The messages ``start:stop`` of ``w``, with its dead letters up to the next piece."""
        msgs = w.msgs[start:stop]
        low = msgs[0].offset if start else None
        high = w.msgs[stop].offset if stop < len(w.msgs) else None
        dead = [
            d
            for d in w.dead
            if (low is None or d.msg.offset >= low) and (high is None or d.msg.offset < high)
        ]
        return Work(w.partition, w.records, msgs, dead, w.next_offset if high is None else high)

    async def _refused(self, refused: list[Work]) -> None:
        """The fence refused these partitions: what their rows say happened
        (:mod:`dedup.consumer._refusal`)."""
        conn = await self.connection()
        for w in refused:
            p = w.partition
            now = await self._s.store.position(conn, self._s.group_id, p.tp.topic, p.tp.partition)
            verdict = refusal.judge(now, p.token, p.expected)
            if verdict == refusal.LANDED and now is not None and now.next_offset is not None:
                log.info("%s: a write in doubt had landed; resuming at %d", p.tp, now.next_offset)
                p.expected = now.next_offset
            elif verdict == refusal.MOVED:
                p.found, p.state = now, State.MOVED
            elif verdict == refusal.FORGOTTEN:
                p.found, p.state = refusal.resume_at(now, p, self._s.holder), State.FORGOTTEN
            else:
                p.state = State.TAKEN
                exc = errors.StaleTokenError(
                    f"{self._s.group_id}:{p.tp.topic}:{p.tp.partition}", p.token
                )
                self._stats["stale"] += 1
                telemetry.stale_rejections.add(1, p.counted)
                log.warning("consumer %s: %s", self._s.holder, exc)
                await refusal.record_stale(conn, self._s, exc, p.token, p.expected)

    def _give_back(self, work: list[Work]) -> None:
        """A cut turn's records go back to their partitions' queues, first in line."""
        for w in work:
            p = w.partition
            if p.state is State.OWNED:
                floor = p.expected if p.expected is not None else -1
                p.records.extendleft(reversed([r for r in w.records if r.offset >= floor]))

    # ---------------------------------------------------------------- marks --

    async def _marked(self, work: list[Work]) -> bool:
        """Mark where each partition's turn starts, where it must (see :meth:`_mark`).

        True when a partition of a larger turn turned out to lie in a stretch to
        apply one message at a time: the turn must be taken again.
        """
        for w in work:
            p = w.partition
            if not p.watching or not w.records:
                continue
            head = w.records[0].offset
            was_single = p.single
            if p.marked != head:  # marked once per start offset, or it counts a death
                p.exits = await self._mark(p, head)
            if p.single and (not was_single or len(work) > 1 or len(w.records) > 1):
                return True
            if p.exits >= self._s.max_attempts and w.msgs and w.msgs[0].offset == head:
                self._dead_on_exit(w, p.exits)
        return False

    async def _mark(self, p: Partition, head: int) -> int:
        """Mark where the next turn of ``p`` starts; how often the process ended there before.

        A message whose handling ends the process (``SystemExit`` from a handler,
        a signal, an out-of-memory kill) rolls its turn back, and the restart
        meets it again: nothing in memory survives to count with.  So before its
        first turn a holder records, committed on its own, where that turn
        starts (``mark_start``).  Finding that an earlier holder started there
        and died, it applies the next ``batch_size`` offsets one message at a
        time, alone in its turn, marking each, so the next death names its
        message.  A message that ended the process ``max_attempts`` times is
        dead-lettered unhandled, and the partition moves on.
        """
        try:
            conn = await self.connection()
            fence = p.fence()
            marked = await self._s.store.mark_start(
                conn,
                fence,
                p.tp.topic,
                p.tp.partition,
                offset=head,
                stretch=self._s.batch_size,
            )
        except Exception as exc:
            if retry.decide(exc, in_handler=False).action is not retry.Action.AGAIN:
                raise
            log.warning("marking where %s starts failed (%r); applying unmarked", p.tp, exc)
            return 0
        if marked is None:
            return 0  # not ours any more: the turn's fence finds out who has it
        p.marked = head
        starts, single = marked
        if single and not p.single:
            log.warning(
                "%s: the process ended while handling offset %d or the batch it began; "
                "applying one message at a time from there",
                p.tp,
                head,
            )
        p.single = p.watching = single
        return starts - 1

    def _dead_on_exit(self, w: Work, exits: int) -> None:
        msg = w.msgs.pop(0)
        letter = results.DeadLetter(
            msg,
            f"the process ended {exits} times while handling it",
            error="the process ended (SystemExit or KeyboardInterrupt from the handler, "
            "a signal, an out-of-memory kill?); see the consumer's log",
            attempts=exits,
        )
        log.error("dead-lettering %s: %s", msg.where, letter.reason)
        w.dead.insert(0, letter)

    async def _unmark(self, work: list[Work]) -> None:
        """A clean stop or a revoke cut the turn: its marks were no death."""
        for w in work:
            p = w.partition
            if p.marked is None:
                continue
            try:
                conn = await self.connection()
                await self._s.store.unmark_start(
                    conn, p.fence(), p.tp.topic, p.tp.partition, p.marked
                )
            except Exception as exc:  # the next holder counts one attempt too many, no more
                log.info("taking back the mark of %s at %d failed (%r)", p.tp, p.marked, exc)

    # ----------------------------------------------------------- connection --

    async def connection(self) -> asyncpg.Connection:
        """The lane's connection, (re)acquired from the pool when it has none or lost it.

        Nothing is set on the session: each transaction sets what it needs for
        itself, and resets what the handler set before its COMMIT (:mod:`dedup.consumer._turn`).
        """
        if self._conn is None or not _usable(self._conn):
            await self.release()
            self._conn = await self._pool.acquire()
        return self._conn

    async def release(self) -> None:
        """Give the connection back (after a lost connection: start again on a fresh one)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await self._pool.release(conn, timeout=RELEASE_TIMEOUT)

    def terminate(self) -> None:
        """Close the connection at once: the server rolls back whatever it had open."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.terminate()


def ages(
    owned: Mapping[TopicPartition, Partition], now: float, group_id: str
) -> list[tuple[float, dict[str, Any]]]:
    """Per partition of ``owned``: seconds since its oldest record fetched, not committed
    (0: none), with the gauge's attributes; for the SDK's reader, maybe on another thread."""
    found: list[tuple[float, dict[str, Any]]] = []
    for tp, p in list(owned.items()):
        oldest = p.oldest_unapplied()
        age = 0.0 if oldest is None else max(now - oldest / 1000, 0.0)
        found.append((age, telemetry.partition_attributes(group_id, tp)))
    return found


def read_positions(
    owned: Mapping[TopicPartition, Partition],
    stored: Mapping[tuple[str, int], results.Position],
    idle: Mapping[TopicPartition, tuple[int, int | None]],
    holder: str,
) -> None:
    """What the periodic owner look found: ``stored`` (each partition's row) against the
    partitions ``owned``; ``idle``, where each partition without a turn in flight stood
    before the look.

    A newer token: ``TAKEN`` (or ``MOVED``, an operator's).  Where an idle partition
    stood still, a row behind it: ``FORGOTTEN`` (Postgres lost our commits).
    """
    for tp, p in owned.items():
        if p.state is not State.OWNED or p.busy:
            continue  # a turn in flight finds out from its fence
        found = stored.get((tp.topic, tp.partition))
        # Tokens only grow.
        if found is not None and found.token > p.token:
            p.taken_over(found)
        elif idle.get(tp) == (p.token, p.expected):
            if refusal.judge(found, p.token, p.expected) == refusal.FORGOTTEN:
                p.found = refusal.resume_at(found, p, holder)
                p.state = State.FORGOTTEN


def place(
    partitions: Sequence[TopicPartition],
    lanes: Sequence[Lane],
    before: MutableMapping[TopicPartition, int],
) -> dict[TopicPartition, Lane]:
    """The lane of each partition: the one it had ``before`` where that keeps the lanes even,
    else the lane with the fewest partitions (sticky across rebalances)."""
    load = {lane.index: len(lane.partitions) for lane in lanes}
    most = -(-(sum(load.values()) + len(partitions)) // len(lanes))  # ceiling
    placed: dict[TopicPartition, Lane] = {}
    rest = []
    for tp in sorted(partitions):
        index = before.get(tp)
        if index is not None and index < len(lanes) and load[index] < most:
            placed[tp] = lanes[index]
            load[index] += 1
        else:
            rest.append(tp)
    for tp in rest:
        index = min(load, key=lambda i: (load[i], i))
        placed[tp] = lanes[index]
        load[index] += 1
    for tp, lane in placed.items():
        before[tp] = lane.index
    return placed


def _usable(conn: asyncpg.Connection) -> bool:
    # asyncpg detaches a pooled connection that the server closed; asking a
    # detached proxy anything raises InterfaceError.
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:
        return False
