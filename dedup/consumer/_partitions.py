"""The partitions one consumer holds: taken in Postgres, placed on lanes, reported to Kafka.

Kafka assigns partitions; Postgres decides who may write to them.  On an
assignment the partitions are taken with fresh fencing tokens, each gets a
:class:`dedup.consumer._lanes.Partition` from the offset stored there, and is placed on
a lane (:func:`dedup.consumer._lanes.place`, sticky across rebalances).  A partition the
fence or the periodic look found ``MOVED`` or ``FORGOTTEN`` is taken back from
the offset stored; one ``TAKEN`` is dropped until Kafka assigns it again.
Kafka's committed offset follows Postgres every ``kafka_commit_interval``, for
lag tools only.

A stored offset outside the partition's log is resolved by :mod:`dedup.consumer._out_of_range`:
resumed at the log start (the loss recorded) or held until ``dedup offsets`` moves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import aiokafka.errors
from aiokafka.structs import TopicPartition

from dedup import _errors as errors
from dedup import _handler as handler_
from dedup import _telemetry as telemetry
from dedup.consumer import _lanes as lanes
from dedup.consumer import _out_of_range as out_of_range
from dedup.consumer import _retry as retry
from dedup.consumer import _turn as turn
from dedup.data import _db as db
from dedup.data import _events as events

log = logging.getLogger("dedup.consumer")
T = TypeVar("T")

# A takeover waits at most this long for an old owner's open transaction; an old
# owner that is paused is cut off sooner by the idle-in-transaction timeout.
TAKEOVER_LOCK_TIMEOUT = "15s"
CANCEL_GRACE = 3.0
"""Seconds a cut turn gets to roll back before its connection is closed under it."""
OWNER_LOOK_TIMEOUT = 5.0
"""Seconds the periodic owner look may wait for a connection, and then for its one
statement (its connection is closed after that); past it the look is skipped until
the next interval.  It
runs in the fetch loop, which also sees a stop request and keeps the member polling
Kafka: a Postgres cut off by the network, its connections hanging, must not hold
those up until it heals."""


class Partitions:
    """The partitions of one running consumer, on its lanes."""

    def __init__(
        self,
        kafka: Any,
        *,
        pool: Any,
        concurrency: int,
        settings: turn.Settings,
        stats: dict[str, int],
        commit_interval: float,
        stopping: asyncio.Event,
        hurry: asyncio.Event,
    ) -> None:
        self.owned: dict[TopicPartition, lanes.Partition] = {}
        """The partitions held under a current token, by Kafka's name for them."""
        self.paused: set[TopicPartition] = set()
        """Paused in the fetcher while none of the partitions wanted records."""
        self.beyond_end: dict[TopicPartition, int] = {}
        """Held at their stored offset (the value), beyond the log end, until moved back."""
        self.lanes = [
            lanes.Lane(i, pool, settings, stats, self.has_room) for i in range(concurrency)
        ]
        self._pool = pool  # for what runs beside the lanes: takes, owner looks, events
        self._placed: dict[TopicPartition, int] = {}  # the lane each partition had last
        self._kafka = kafka
        self._settings = settings
        self._stats = stats
        self._commit_interval = commit_interval
        self._stopping = stopping  # no more retries of a takeover
        self._hurry = hurry  # a second signal: cut what is in flight now
        self._last_kafka_commit = 0.0
        self._last_owner_check = 0.0
        for lane in self.lanes:
            lane.start()
        telemetry.watch(self)

    # ------------------------------------------------------------ ownership --

    async def assign(self, assigned: set[TopicPartition]) -> None:
        """Take what Kafka assigned, in Postgres, and place each partition on a lane."""
        if not assigned:
            return
        # Nothing of these partitions may reach a lane before they are taken
        # (with the token and offset from Postgres).
        self._kafka.pause(*assigned)
        wanted = sorted((tp.topic, tp.partition) for tp in assigned)
        with telemetry.tracer.start_as_current_span(
            "dedup assign", attributes={"messaging.consumer.group.name": self._settings.group_id}
        ):
            taken = await self._take(wanted)
        placed = lanes.place(sorted(assigned), self.lanes, self._placed)
        for tp in assigned:
            self._own(tp, placed[tp], *taken[(tp.topic, tp.partition)])
        log.info("consumer %s took %s", self._settings.holder, wanted)

    async def revoke(self, revoked: set[TopicPartition], grace: float) -> None:
        """Let the turns in flight of ``revoked`` end (for ``grace`` s), tell Kafka, drop them."""
        gone = [self.owned[tp] for tp in revoked if tp in self.owned]
        if not gone:
            return
        # The turns in flight commit or roll back before another member may start
        # on these partitions (the new owner's token fences them anyway).
        await self.settle(gone, grace)
        with contextlib.suppress(aiokafka.errors.KafkaError):
            await self.commit_kafka(force=True)
        for p in gone:
            self._drop(p)
            telemetry.transition(
                "partition_revoked",
                {
                    "resource": f"{self._settings.group_id}:{p.tp.topic}:{p.tp.partition}",
                    "token": p.token,
                },
            )
        log.info("consumer %s gave up %s", self._settings.holder, [str(p.tp) for p in gone])

    def _own(self, tp: TopicPartition, lane: lanes.Lane, token: int, stored: int | None) -> None:
        """Work on ``tp`` under ``token`` from the stored offset, on ``lane``."""
        p = lanes.Partition(tp, token, stored, self._settings)
        old = self.owned.get(tp)
        if old is not None:
            self._drop(old)
        self.owned[tp] = p
        lane.add(p)
        self.beyond_end.pop(tp, None)  # taken (back) from an offset that may be in the log now
        if stored is not None:
            self._kafka.seek(tp, stored)
        self._kafka.resume(tp)

    def _drop(self, p: lanes.Partition) -> None:
        if p.state is lanes.State.OWNED:
            p.state = lanes.State.CLOSED
        if p.lane is not None:
            p.lane.remove(p)
        if self.owned.get(p.tp) is p:
            del self.owned[p.tp]
        self.paused.discard(p.tp)
        self.beyond_end.pop(p.tp, None)

    async def _retake(self, p: lanes.Partition) -> None:
        """``tp`` was moved, or Postgres lost our last commits: take it with a new token, from
        the offset stored."""
        tp, found = p.tp, p.found
        assert found is not None  # noqa: S101 - MOVED and FORGOTTEN say where
        log.info(
            "consumer %s: %s stands at offset %s (taken by %r); taking it back",
            self._settings.holder,
            tp,
            found.next_offset,
            found.holder,
        )
        self._kafka.pause(tp)  # records fetched from the old position must not reach a lane
        lane = p.lane
        self._drop(p)
        taken = await self._take([(tp.topic, tp.partition)])
        token, stored = taken[(tp.topic, tp.partition)]
        assert lane is not None  # noqa: S101 - placed when owned
        self._own(tp, lane, token, stored)
        if stored is None and found.next_offset is not None:
            # Postgres lost the partition's row: back to where we began.
            self._kafka.seek(tp, found.next_offset)

    async def _take(
        self, wanted: list[tuple[str, int]]
    ) -> dict[tuple[str, int], tuple[int, int | None]]:
        s = self._settings
        return await self._retrying(
            f"taking partitions {wanted}",
            lambda conn: s.store.take_partitions(conn, s.group_id, s.holder, wanted),
            {
                "lock_timeout": TAKEOVER_LOCK_TIMEOUT,
                "idle_in_transaction_session_timeout": str(round(s.idle_timeout * 1000)),
            },
        )

    async def _retrying(
        self,
        what: str,
        step: Callable[[Any], Awaitable[T]],
        settings: Mapping[str, str] | None = None,
    ) -> T:
        """``step`` in a transaction of its own, tried again while Postgres is away.

        On a connection of the pool's own, not a lane's: a lane may be in a turn.
        """
        tries = 0
        while True:
            try:
                async with self._pool.acquire() as conn, db.transaction(conn, settings):
                    return await step(conn)
            except Exception as exc:
                if not db.is_retriable(exc) or self._stopping.is_set():
                    raise
                tries += 1
                self._stats["retries"] += 1
                telemetry.retries.add(1, {"messaging.consumer.group.name": self._settings.group_id})
                log.warning("%s failed (%r); retrying", what, exc)
            await asyncio.sleep(retry.backoff(tries, 0.1))

    # ---------------------------------------------------------------- lanes --

    def ready(self) -> list[TopicPartition]:
        """The partitions that want records; when none does, pause them all in the fetcher.

        The caller waits inside getmany all the same (aiokafka counts time
        outside it against max_poll_interval_ms); a lane that takes records
        resumes their partition (:meth:`has_room`).
        """
        stuck, paused = self.beyond_end, self.paused
        ready = [
            tp
            for tp, p in self.owned.items()
            if p.wants_records and tp not in stuck and tp not in paused
        ]
        if self.owned and not ready:
            busy = set(self.owned) - self.paused
            self._kafka.pause(*busy)
            self.paused |= busy
        return ready

    def room(self, ready: list[TopicPartition]) -> int:
        """The records ``ready`` partitions take in all."""
        return sum(self.owned[tp].room for tp in ready)

    def has_room(self, tp: TopicPartition) -> None:
        """A lane took ``tp``'s queue down to half its room: fetch for it again."""
        if tp in self.paused:
            self.paused.discard(tp)
            if tp not in self.beyond_end:
                self._kafka.resume(tp)

    def feed(self, fetched: Mapping[TopicPartition, list[Any]]) -> None:
        """Hand fetched records to their partitions (and so to their lanes)."""
        for tp, records in fetched.items():
            p = self.owned.get(tp)
            if p is not None and p.state is lanes.State.OWNED:  # else revoked or lost since
                p.feed(records)

    async def check(self) -> None:
        """Take back the partitions found moved or forgotten, drop those taken; raise what
        stopped a lane."""
        for lane in self.lanes:
            task = lane.task
            if task is None or not task.done():
                continue
            if task.cancelled():
                raise errors.DedupError(f"lane {lane.index} was cancelled")
            failure = task.exception()
            if isinstance(failure, handler_.HandlerExit):
                raise failure.exit  # run() stops as on SIGTERM, then raises it on
            if failure is not None:
                raise failure
            if not self._stopping.is_set():
                raise errors.DedupError(f"lane {lane.index} stopped")
        for p in list(self.owned.values()):
            if p.state in (lanes.State.MOVED, lanes.State.FORGOTTEN) and not p.busy:
                if p.tp in self._kafka.assignment():
                    await self._retake(p)
                else:
                    self._drop(p)
            elif p.state is lanes.State.TAKEN and not p.busy:
                self._drop(p)
                self._kafka.pause(p.tp)  # until Kafka assigns it again

    async def apply_first(
        self, readable: Mapping[TopicPartition, list[Any]], tp: TopicPartition | None, within: float
    ) -> int | None:
        """Have the lanes apply ``readable`` (for ``within`` s at most); ``tp``'s offset after."""
        self.feed(readable)
        waiting = [p for p in self.owned.values() if p.records or p.busy]
        await self._wait_idle(waiting, within)
        return self.owned[tp].expected if tp in self.owned else None

    async def _wait_idle(self, waiting: list[lanes.Partition], within: float) -> bool:
        """Wait until none of ``waiting`` has records in flight, nor queued while it is
        owned; True if so."""
        deadline = time.monotonic() + within
        owned = lanes.State.OWNED
        while any(p.busy or (p.records and p.state is owned) for p in waiting):
            left = deadline - time.monotonic()
            if left <= 0 or self._hurry.is_set():
                return False
            busy = {p.lane for p in waiting if p.lane is not None and not p.lane.rested.is_set()}
            if busy:
                await self._until(
                    [asyncio.ensure_future(lane.rested.wait()) for lane in busy], left
                )
            else:
                await asyncio.sleep(0)  # records queued: their lane takes them next
        return True

    async def _until(self, futures: list[asyncio.Future[Any]], within: float) -> None:
        """Wait up to ``within`` s for any of ``futures``, or for a second signal."""
        hurry = asyncio.ensure_future(self._hurry.wait())
        try:
            await asyncio.wait(
                [*futures, hurry], timeout=within, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for future in [*futures, hurry]:
                future.cancel()

    async def out_of_range(self, positions: Mapping[TopicPartition, int]) -> None:
        """aiokafka found these fetch positions outside their logs (``_out_of_range``)."""
        s = self._settings
        tokens = {tp: p.token for tp, p in self.owned.items()}
        owner = out_of_range.Owner(s.group_id, s.namespace, s.holder, tokens, self.beyond_end)
        found = await out_of_range.resolve(self._kafka, positions, owner)
        for tp, offset in found.beyond_end.items():
            self._kafka.pause(tp)
            self.beyond_end[tp] = offset
        if found.events:
            await self._retrying(
                "recording " + found.events[0].kind,
                lambda conn: events.record(conn, s.store.schema, found.events),
            )

    async def settle(self, gone: list[lanes.Partition], grace: float) -> bool:
        """Close ``gone``: their lanes finish the turn in flight for ``grace`` s, else it is cut.

        A cut turn rolls back (its records are given back, and delivered again
        to whoever owns them next); the lane starts again.  True when a handler
        ignored its cancellation (its connection was closed under it).
        """
        for p in gone:
            p.state = lanes.State.CLOSED
        busy = {p.lane for p in gone if p.lane is not None and p.busy}
        if not busy:
            return False
        await self._wait_idle(gone, grace)
        cut = [lane for lane in busy if not lane.rested.is_set()]
        if not cut:
            return False
        log.warning(
            "cutting the batches in flight of %s; they roll back and will be delivered again",
            ", ".join(f"{p.tp} (offsets {p.in_flight_range})" for p in gone if p.lane in cut),
        )
        stuck = await self._cut(cut)
        if not self._stopping.is_set():
            for lane in cut:
                lane.start()
        return stuck

    async def _cut(self, cut: list[lanes.Lane]) -> bool:
        """Cancel the lanes' tasks; close the connections of those that ignore it."""
        tasks = [lane.task for lane in cut if lane.task is not None and not lane.task.done()]
        for task in tasks:
            task.cancel()
        _, stuck = await asyncio.wait(tasks, timeout=CANCEL_GRACE) if tasks else (set(), set())
        for lane in cut:
            if lane.task in stuck:
                log.error(
                    "a handler on lane %d ignored its cancellation; closing its connection",
                    lane.index,
                )
                lane.terminate()
        return bool(stuck)

    async def close(self, grace: float) -> bool:
        """Stop every lane: the turns in flight get ``grace`` s, then are cut.

        True when a handler ignored its cancellation (its connection was closed).
        """
        for lane in self.lanes:
            lane.stop()
        stuck = await self.settle(list(self.owned.values()), grace)
        await self._cut(self.lanes)
        telemetry.unwatch(self)
        return stuck

    async def release(self) -> None:
        """Give the lanes' connections back to the pool, side by side (each within its
        lane's release timeout)."""
        await asyncio.gather(*(lane.release() for lane in self.lanes))

    # ---------------------------------------------------------------- gauges --

    def lag(self) -> list[tuple[int, dict[str, Any]]]:
        """Per partition held: Kafka's log-end offset minus the offset stored in Postgres.

        Both are known without a round trip: aiokafka keeps the highwater mark
        of each fetch response, the partition the offset its last turn stored.
        A partition whose highwater or offset is not known yet is left out.
        Called by the SDK's metric reader, maybe from another thread.
        """
        found: list[tuple[int, dict[str, Any]]] = []
        if self._stopping.is_set():
            return found  # a stopped consumer reports nothing
        for tp, p in list(self.owned.items()):
            try:
                end = self._kafka.highwater(tp)
            except (AssertionError, AttributeError, aiokafka.errors.IllegalStateError):
                continue  # not assigned any more
            stored = p.expected
            if end is not None and stored is not None:
                found.append((max(end - stored, 0), self._gauge_attributes(tp)))
        return found

    def oldest_unapplied(self, now: float) -> list[tuple[float, dict[str, Any]]]:
        """Per partition held: seconds since the oldest record fetched, not committed (0: none)."""
        if self._stopping.is_set():
            return []
        return lanes.ages(self.owned, now, self._settings.group_id)

    def _gauge_attributes(self, tp: TopicPartition) -> dict[str, Any]:
        return telemetry.partition_attributes(self._settings.group_id, tp)

    # -------------------------------------------------------------- offsets --

    def follow_fetch_positions(self) -> None:
        """Have idle partitions store Kafka's fetch position where it passed records never
        handed out.

        Transaction markers and records of aborted transactions (under
        ``read_committed``) move aiokafka's position without reaching
        ``getmany``'s answer.  An idle partition has applied every record
        fetched, so a position beyond its offset holds nothing to apply.  On a
        topic without transactions the two are equal: no round trip.
        """
        for tp, p in self.owned.items():
            if not p.idle or p.state is not lanes.State.OWNED:
                continue
            position = _fetch_position(self._kafka, tp)
            if position is not None and (p.expected is None or position > p.expected):
                p.follow(position)

    async def check_owners(self) -> None:
        """Every ``kafka_commit_interval``, look for partitions of ours taken in Postgres.

        A busy partition learns of a newer token from its next turn's fence; an
        idle one would not until a message came, so an operator's ``dedup
        offsets rewind`` would wait for traffic.  One statement for all partitions,
        given :data:`OWNER_LOOK_TIMEOUT`.
        """
        now = time.monotonic()
        if not self.owned or now - self._last_owner_check < self._commit_interval:
            return
        self._last_owner_check = now
        # Where each idle partition stood before the look: only those still there after
        # it can tell that Postgres forgot their last commits (a failover).
        idle = {tp: (p.token, p.expected) for tp, p in self.owned.items() if not p.busy}
        try:
            async with self._pool.acquire(timeout=OWNER_LOOK_TIMEOUT) as conn:
                try:
                    async with asyncio.timeout(OWNER_LOOK_TIMEOUT):
                        stored = await self._settings.store.positions(
                            conn,
                            self._settings.group_id,
                            [(tp.topic, tp.partition) for tp in self.owned],
                        )
                except TimeoutError:
                    # Its statement went nowhere; a release would wait for the
                    # cancellation to get through as long.
                    conn.terminate()
                    raise
        except Exception as exc:
            if not db.is_retriable(exc):
                raise
            log.warning("checking partition owners failed (%r); trying again", exc)
            return
        lanes.read_positions(self.owned, stored, idle, self._settings.holder)

    async def commit_kafka(self, *, force: bool = False) -> None:
        """Tell Kafka where Postgres stands, for lag tools; Postgres stays authoritative."""
        now = time.monotonic()
        if not force and now - self._last_kafka_commit < self._commit_interval:
            return
        self._last_kafka_commit = now
        due = {
            tp: (p, p.expected)
            for tp, p in self.owned.items()
            if p.expected is not None and p.expected != p.committed_to_kafka
        }
        if not due:
            return
        try:
            await self._kafka.commit({tp: offset for tp, (_, offset) in due.items()})
        except (aiokafka.errors.CommitFailedError, aiokafka.errors.IllegalStateError) as exc:
            log.info("kafka offset commit skipped: %r", exc)
            return
        for p, offset in due.values():
            # A partition taken again meanwhile has a new Partition: its commit is still due.
            p.committed_to_kafka = offset


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
