"""The partitions one consumer holds: taken in Postgres, worked on, and reported to Kafka.

Kafka assigns partitions; Postgres decides who may write to them.  On an
assignment the partitions are taken with fresh fencing tokens and each gets a
worker (:mod:`dedup.worker`) that starts from the offset stored there.  A
partition moved by ``dedup offsets`` is taken back from where the operator set
it.  Kafka's committed offset follows Postgres every ``kafka_commit_interval``,
for lag tools only.

A stored offset outside the partition's log is resolved by :mod:`dedup._out_of_range`:
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

from dedup import _db as db
from dedup import _errors as errors
from dedup import _events as events
from dedup import _lanes as lanes
from dedup import _out_of_range as out_of_range
from dedup import _refusal as refusal
from dedup import _store as store
from dedup import _telemetry as telemetry
from dedup import _worker as worker

log = logging.getLogger("dedup.consumer")
T = TypeVar("T")

# A takeover waits at most this long for an old owner's open transaction; an old
# owner that is paused is cut off sooner by the idle-in-transaction timeout.
TAKEOVER_LOCK_TIMEOUT = "15s"
CANCEL_GRACE = 3.0
"""Seconds a cancelled batch gets to roll back before its connection is closed under it."""
DRAIN_POLL = 0.05
"""Seconds between looks at workers applying what came with an undecodable batch (rare)."""


class Partitions:
    """The partitions of one running consumer, each with its worker."""

    def __init__(
        self,
        kafka: Any,
        *,
        lanes: lanes.Lanes,
        settings: worker.Settings,
        stats: dict[str, int],
        commit_interval: float,
        stopping: asyncio.Event,
        hurry: asyncio.Event,
    ) -> None:
        self.workers: dict[TopicPartition, worker.PartitionWorker] = {}
        """The partitions held under a current token, by Kafka's name for them."""
        self.held: set[TopicPartition] = set()
        """Paused in the fetcher while every worker was busy."""
        self.beyond_end: dict[TopicPartition, int] = {}
        """Held at their stored offset (the value), beyond the log end, until moved back."""
        self._kafka = kafka
        self._lanes = lanes
        self._settings = settings
        self._stats = stats
        self._commit_interval = commit_interval
        self._stopping = stopping  # no more retries of a takeover
        self._hurry = hurry  # a second signal: cut what is in flight now
        self._last_kafka_commit = 0.0
        self._last_owner_check = 0.0
        telemetry.watch(self)

    # ------------------------------------------------------------ ownership --

    async def assign(self, assigned: set[TopicPartition]) -> None:
        """Take what Kafka assigned, in Postgres, and start a worker for each."""
        if not assigned:
            return
        # Nothing of these partitions may reach the fetch loop before their
        # workers exist (with the token and offset from Postgres).
        self._kafka.pause(*assigned)
        wanted = sorted((tp.topic, tp.partition) for tp in assigned)
        with telemetry.tracer.start_as_current_span(
            "dedup assign", attributes={"messaging.consumer.group.name": self._settings.group_id}
        ):
            taken = await self._take(wanted)
        for tp in assigned:
            self._own(tp, *taken[(tp.topic, tp.partition)])
        log.info("consumer %s took %s", self._settings.holder, wanted)

    async def revoke(self, revoked: set[TopicPartition], grace: float) -> None:
        """Let the workers of ``revoked`` finish (for ``grace`` s), tell Kafka, and drop them."""
        gone = [self.workers[tp] for tp in revoked if tp in self.workers]
        if not gone:
            return
        # The batches in flight commit or roll back before another member may
        # start on these partitions (the new owner's token fences them anyway).
        await self.close(gone, grace)
        with contextlib.suppress(aiokafka.errors.KafkaError):
            await self.commit_kafka(force=True)
        for owner in gone:
            # The fetch loop may have dropped it meanwhile (it lost the partition).
            if self.workers.get(owner.tp) is owner:
                del self.workers[owner.tp]
            self.held.discard(owner.tp)
            self.beyond_end.pop(owner.tp, None)
            telemetry.transition(
                "partition_revoked",
                {
                    "resource": f"{self._settings.group_id}:{owner.tp.topic}:{owner.tp.partition}",
                    "token": owner.token,
                },
            )
        log.info("consumer %s gave up %s", self._settings.holder, [str(w.tp) for w in gone])

    def _own(self, tp: TopicPartition, token: int, next_offset: int | None) -> None:
        """Work on ``tp`` under ``token`` from the stored offset (Kafka hears of it next commit)."""
        owner = worker.PartitionWorker(
            tp,
            token,
            next_offset,
            settings=self._settings,
            lanes=self._lanes,
            stats=self._stats,
            on_room=self.has_room,
        )
        self.workers[tp] = owner
        self.beyond_end.pop(tp, None)  # taken (back) from an offset that may be in the log now
        if next_offset is not None:
            self._kafka.seek(tp, next_offset)
        self._kafka.resume(tp)
        owner.start()

    async def _retake(self, tp: TopicPartition, moved: store.Position) -> None:
        """``dedup offsets`` moved ``tp`` (or Postgres lost our last commits, and with them the
        offset): take it with a new token, from the offset stored."""
        log.info(
            "consumer %s: %s was moved to offset %s by %r; taking it back",
            self._settings.holder,
            tp,
            moved.next_offset,
            moved.holder,
        )
        self._kafka.pause(tp)  # records fetched from the old position must not reach a worker
        taken = await self._take([(tp.topic, tp.partition)])
        token, stored = taken[(tp.topic, tp.partition)]
        self._own(tp, token, stored)
        if stored is None and moved.next_offset is not None:
            # Postgres lost the partition's row: back to where our worker began.
            self._kafka.seek(tp, moved.next_offset)

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
        """``step`` in a transaction of its own, tried again while Postgres is away."""
        s, delay = self._settings, 0.1
        while True:
            async with self._lanes.lane() as lane:
                try:
                    conn = await lane.connection()
                    async with db.transaction(conn, settings):
                        return await step(conn)
                except Exception as exc:
                    if not db.is_retriable(exc) or self._stopping.is_set():
                        raise
                    await lane.release()
                    self._stats["retries"] += 1
                    telemetry.retries.add(1, {"messaging.consumer.group.name": s.group_id})
                    log.warning("%s failed (%r); retrying", what, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, worker.MAX_BACKOFF)

    # -------------------------------------------------------------- workers --

    def ready(self) -> list[TopicPartition]:
        """The partitions whose worker wants records; when none does, pause the busy ones.

        The caller waits inside getmany all the same (aiokafka counts time
        outside it against max_poll_interval_ms); a worker with room resumes
        its own partition (:meth:`has_room`).
        """
        stuck = self.beyond_end
        ready = [tp for tp, w in self.workers.items() if w.wants_records and tp not in stuck]
        if self.workers and not ready:
            busy = set(self.workers) - self.held
            self._kafka.pause(*busy)
            self.held |= busy
        return ready

    def has_room(self, tp: TopicPartition) -> None:
        """A worker took a batch off its queue: fetch for it again."""
        if tp in self.held:
            self.held.discard(tp)
            if tp not in self.beyond_end:
                self._kafka.resume(tp)

    async def check_workers(self) -> None:
        """Drop the workers whose partition was taken (taking it back from an operator);
        raise what stopped any other."""
        for tp, owner in list(self.workers.items()):
            task = owner.task
            if task is None or not task.done():
                continue
            if owner.moved is not None or owner.lost is not None:
                if self.workers.get(tp) is not owner:
                    continue  # revoked meanwhile
                del self.workers[tp]
                self.held.discard(tp)
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
            if isinstance(failure, worker.HandlerExit):
                raise failure.exit  # run() stops as on SIGTERM, then raises it on
            if failure is not None:
                raise failure

    async def apply_first(
        self, readable: Mapping[TopicPartition, list[Any]], tp: TopicPartition | None, within: float
    ) -> int | None:
        """Have the workers apply ``readable`` (for ``within`` s at most); ``tp``'s offset after."""
        for part, records in readable.items():
            if part in self.workers:  # else revoked or lost since the fetch
                self.workers[part].feed(records)
        deadline = time.monotonic() + within
        while not self._hurry.is_set() and time.monotonic() < deadline:
            tasks = [w.task for w in self.workers.values() if not w.idle]
            if not any(task is not None and not task.done() for task in tasks):
                break
            await asyncio.sleep(DRAIN_POLL)
        return self.workers[tp].expected if tp in self.workers else None

    async def out_of_range(self, positions: Mapping[TopicPartition, int]) -> None:
        """aiokafka found these fetch positions outside their logs (dedup._out_of_range)."""
        s = self._settings
        tokens = {tp: w.token for tp, w in self.workers.items()}
        owner = out_of_range.Owner(s.group_id, s.namespace, s.holder, tokens, self.beyond_end)
        found = await out_of_range.resolve(self._kafka, positions, owner)
        for tp, offset in found.held.items():
            self._kafka.pause(tp)
            self.beyond_end[tp] = offset
        if found.events:
            await self._retrying(
                "recording " + found.events[0].kind,
                lambda conn: events.record(conn, s.store.schema, found.events),
            )

    async def close(self, workers: list[worker.PartitionWorker], grace: float) -> bool:
        """Let ``workers`` finish their batch in flight for ``grace`` s, then cancel them.

        True when a handler ignored its cancellation (its connection must be closed).
        """
        for w in workers:
            w.stop()
        running: dict[asyncio.Future[Any], worker.PartitionWorker] = {
            w.task: w for w in workers if w.task is not None and not w.task.done()
        }
        await self._wait(set(running), grace)
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

    async def _wait(self, pending: set[asyncio.Future[Any]], grace: float) -> None:
        """Wait for ``pending`` up to ``grace`` seconds, or until a second signal."""
        hurry = asyncio.ensure_future(self._hurry.wait())
        try:
            deadline = time.monotonic() + grace
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

    # ---------------------------------------------------------------- gauges --

    def lag(self) -> list[tuple[int, dict[str, Any]]]:
        """Per partition held: Kafka's log-end offset minus the offset stored in Postgres.

        Both are known without a round trip: aiokafka keeps the highwater mark
        of each fetch response, the worker the offset its last batch stored.
        A partition whose highwater or offset is not known yet is left out.
        Called by the SDK's metric reader, maybe from another thread.
        """
        found: list[tuple[int, dict[str, Any]]] = []
        if self._stopping.is_set():
            return found  # a stopped consumer reports nothing
        for tp, owner in list(self.workers.items()):
            try:
                end = self._kafka.highwater(tp)
            except (AssertionError, AttributeError, aiokafka.errors.IllegalStateError):
                continue  # not assigned any more
            stored = owner.expected
            if end is not None and stored is not None:
                found.append((max(end - stored, 0), self._gauge_attributes(tp)))
        return found

    def oldest_unapplied(self, now: float) -> list[tuple[float, dict[str, Any]]]:
        """Per partition held: seconds since the oldest record fetched, not committed (0: none)."""
        found: list[tuple[float, dict[str, Any]]] = []
        if self._stopping.is_set():
            return found
        for tp, owner in list(self.workers.items()):
            oldest = owner.oldest_unapplied()
            age = 0.0 if oldest is None else max(now - oldest / 1000, 0.0)
            found.append((age, self._gauge_attributes(tp)))
        return found

    def _gauge_attributes(self, tp: TopicPartition) -> dict[str, Any]:
        return telemetry.partition_attributes(self._settings.group_id, tp)

    # -------------------------------------------------------------- offsets --

    def follow_fetch_positions(self) -> None:
        """Have idle workers store Kafka's fetch position where it passed records never handed out.

        Transaction markers and records of aborted transactions (under
        ``read_committed``) move aiokafka's position without reaching
        ``getmany``'s answer.  An idle worker has applied every record fetched,
        so a position beyond its offset holds nothing to apply.  On a topic
        without transactions the two are equal: no round trip.
        """
        for tp, owner in self.workers.items():
            if not owner.idle:
                continue
            position = _fetch_position(self._kafka, tp)
            if position is not None and (owner.expected is None or position > owner.expected):
                owner.follow(position)

    async def check_owners(self) -> None:
        """Every ``kafka_commit_interval``, look for partitions of ours taken in Postgres.

        A busy partition learns of a newer token from its next batch's fence; an
        idle one would not until a message came, so an operator's ``dedup
        offsets rewind`` would wait for traffic.  One statement for all partitions.
        """
        now = time.monotonic()
        if not self.workers or now - self._last_owner_check < self._commit_interval:
            return
        self._last_owner_check = now
        # Where each idle worker stood before the look: only those still there after it
        # can tell that Postgres forgot their last commits (a failover).
        idle = {tp: (o.token, o.expected) for tp, o in self.workers.items() if not o.busy}
        async with self._lanes.lane() as lane:
            try:
                conn = await lane.connection()
                stored = await self._settings.store.positions(
                    conn,
                    self._settings.group_id,
                    [(tp.topic, tp.partition) for tp in self.workers],
                )
            except Exception as exc:
                if not db.is_retriable(exc):
                    raise
                log.warning("checking partition owners failed (%r); trying again", exc)
                await lane.release()
                return
        for tp, owner in self.workers.items():
            found = stored.get((tp.topic, tp.partition))
            # Tokens only grow.  A worker with a batch in flight finds out from
            # its fence, which refuses the write and records it (stale_rejected).
            if found is not None and found.token > owner.token and not owner.busy:
                owner.taken_over(found)
            elif not owner.busy and idle.get(tp) == (owner.token, owner.expected):
                if refusal.judge(found, owner.token, owner.expected) == refusal.FORGOTTEN:
                    owner.moved = refusal.resume_at(found, owner, self._settings.holder)
                    owner.stop()

    async def commit_kafka(self, *, force: bool = False) -> None:
        """Tell Kafka where Postgres stands, for lag tools; Postgres stays authoritative."""
        now = time.monotonic()
        if not force and now - self._last_kafka_commit < self._commit_interval:
            return
        self._last_kafka_commit = now
        due = {
            tp: (owner, owner.expected)
            for tp, owner in self.workers.items()
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
