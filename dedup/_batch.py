"""One consumer batch's transaction: its spans, the store's work, COMMIT, its counts.

:class:`dedup._worker.PartitionWorker` decides what to try and what to do
when it fails; this module runs one try.  The fault points ``BEFORE_COMMIT``
and ``AFTER_COMMIT`` (:mod:`dedup._faults`) sit here, around the COMMIT.
"""

from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiokafka.structs import TopicPartition

from dedup import _db as db
from dedup import _db_telemetry as db_telemetry
from dedup import _errors as errors
from dedup import _faults as faults
from dedup import _lanes as lanes
from dedup import _message as message_
from dedup import _semconv as semconv
from dedup import _store as store
from dedup import _telemetry as telemetry
from dedup import keys

if TYPE_CHECKING:
    from dedup import _worker as worker

log = logging.getLogger("dedup.worker")

SHARED_HANDLER_TIMEOUT = 0.25
"""Seconds the handlers of a transaction shared by several partitions' batches may take
in all.

Riders are for a live stream's quick work: their handlers run one after
another, where lanes would run them side by side, and a hung one holds up
every partition in the transaction.  Past this the transaction is cut, every
batch runs alone (each handler with the full ``handler_timeout``), and nobody
rides for a while (:meth:`dedup._lanes.Lanes.riders_too_slow`)."""
SHARED_LOCK_WAIT = 0.01
"""Seconds a transaction shared by several partitions' batches waits for a row lock.

Its handler calls each write in their own order, so two transactions can
take the same rows in different orders even where every handler sorts its
writes.  It gives way early, before any other transaction waits long enough
to count as contention (:data:`dedup._lanes.LOCK_WAIT`), and every batch runs
alone."""


@dataclass
class Part:
    """One partition's batch in a transaction: its messages and dead letters, under its fence."""

    tp: TopicPartition
    fence: store.Fence
    msgs: list[message_.Message]
    dead: list[store.DeadLetter]


async def transaction(
    lane: lanes.Lane,
    settings: worker.Settings,
    turn: lanes.Turn | None,
    parts: Sequence[Part],
    stats: MutableMapping[str, int],
) -> list[store.BatchResult]:
    """Apply ``parts`` in one transaction on ``lane``, each under its fence; their results.

    Usually one partition's batch; a lane's transaction may carry the small
    batches of several partitions (:meth:`dedup._lanes.Lanes.gather`), each
    fenced, claimed and handled as if alone, then one COMMIT for all.
    ``turn``: the lanes deadlocked lately, so the handler waits for its turn
    (:mod:`dedup._lanes`).  Raises what the store raises.

    Traced as the conventions have it: a CONSUMER span ``process <topic>`` for
    the batch, an INTERNAL span ``dedup transaction`` for the transaction (the
    handler runs in it), and a CLIENT span per statement dedup sends, BEGIN and
    COMMIT included.
    """
    s = settings
    attributes = _process_attributes(s, parts)
    links, dropped = telemetry.producer_links(m.raw_headers for p in parts for m in p.msgs)
    if dropped:
        attributes["dedup.links.dropped"] = dropped
    measured = [{**_messaging(s, p.tp), "messaging.operation.name": "process"} for p in parts]
    started = time.perf_counter()
    try:
        with telemetry.consumer_span(f"process {parts[0].tp.topic}", attributes, links):
            conn = await lane.connection()
            results, elapsed = await _transaction(lane, conn, s, turn, parts)
    except BaseException as exc:
        for m in measured:
            m["error.type"] = semconv.error_type(exc)
        raise
    finally:
        for m in measured:
            telemetry.record(telemetry.process_duration, time.perf_counter() - started, m)
    for part, result in zip(parts, results, strict=True):
        _count(stats, s, part.tp, result, len(part.msgs) + len(part.dead), elapsed)
    return results


async def _transaction(
    lane: lanes.Lane,
    conn: Any,
    s: worker.Settings,
    turn: lanes.Turn | None,
    parts: Sequence[Part],
) -> tuple[list[store.BatchResult], float]:
    """The transaction itself, under its INTERNAL span; its results and how long it took."""
    schema = s.store.schema
    attributes: dict[str, Any] = {"dedup.namespace": s.namespace, "dedup.serial": turn is not None}
    if len(parts) == 1:
        attributes["dedup.token"] = parts[0].fence.token
    with telemetry.internal_span("dedup transaction", attributes):
        started = time.perf_counter()
        tx = conn.transaction()
        with db_telemetry.db_call(conn, db_telemetry.Call("BEGIN", "BEGIN", schema)):
            await tx.start()
        try:
            try:
                cut_at = time.monotonic() + SHARED_HANDLER_TIMEOUT if len(parts) > 1 else None
                results = [await _apply(lane, conn, s, turn, p, cut_at) for p in parts]
            except BaseException:
                # As asyncpg's `async with conn.transaction()` does: roll back, and a
                # failed rollback raises in place of the batch's error (chained to it).
                rollback = db_telemetry.Call("ROLLBACK", "ROLLBACK", schema)
                with db_telemetry.db_call(conn, rollback):
                    await tx.rollback()
                raise
            with db_telemetry.db_call(conn, db_telemetry.Call("COMMIT", "COMMIT", schema)):
                await tx.commit()
        finally:
            if turn is not None:
                turn.end()  # the transaction ended, the group's turn with it
            # Whatever the handler set on the session ends with its transaction.
            lane.used()
        elapsed = time.perf_counter() - started
        for p, result in zip(parts, results, strict=True):
            await faults.point(
                faults.Point.AFTER_COMMIT, fence=p.fence, msgs=p.msgs, dead=p.dead, result=result
            )
    return results, elapsed


async def _apply(
    lane: lanes.Lane,
    conn: Any,
    s: worker.Settings,
    turn: lanes.Turn | None,
    part: Part,
    cut_at: float | None,
) -> store.BatchResult:
    """One partition's statements between BEGIN and COMMIT (``cut_at``: the monotonic time
    a shared transaction's handlers must be done by)."""
    timeout = s.handler_timeout
    if cut_at is not None:
        timeout = min(timeout, max(cut_at - time.monotonic(), 0.001))
    result = await s.store.apply(
        conn,
        part.msgs,
        handler=s.handler,
        batch_handler=s.batch_handler,
        fence=part.fence,
        dead=part.dead,
        handler_timeout=timeout,
        idle_timeout=s.idle_timeout,
        lock_timeout=(SHARED_LOCK_WAIT if cut_at else lanes.LOCK_WAIT) if lane.shared else None,
        turn=turn,
    )
    await faults.point(
        faults.Point.BEFORE_COMMIT,
        conn=conn,
        fence=part.fence,
        msgs=part.msgs,
        dead=part.dead,
        result=result,
    )
    return result


async def together(
    all_lanes: lanes.Lanes,
    lane: lanes.Lane,
    settings: worker.Settings,
    crew: Sequence[tuple[worker.PartitionWorker, list[message_.Message], list[store.DeadLetter]]],
    riders: list[lanes.Rider],
    stats: MutableMapping[str, int],
) -> bool:
    """Apply a gathering worker's batch and its riders' (``crew``) in one transaction.

    True when it committed: each worker's offset moves on, and the riders are
    told.  Else it rolled back, counted as a retry, and the riders are told to
    run their batches alone, as the caller does its own, where a handler's
    error, a stale token or a lost COMMIT answer is handled as for any batch
    (this try is not one of a message's attempts).  A lock wait here is not a
    sign of hot rows (:data:`SHARED_LOCK_WAIT`): the lanes stay as they are.
    """
    parts = [Part(owner.tp, owner.fence(), msgs, dead) for owner, msgs, dead in crew]
    started = time.monotonic()
    try:
        results = await transaction(lane, settings, None, parts, stats)
    except BaseException as exc:
        lanes.tell(riders, False)
        if not isinstance(exc, Exception):
            raise
        if time.monotonic() - started >= SHARED_HANDLER_TIMEOUT:
            all_lanes.riders_too_slow()
        if db.is_retriable(exc):
            await lane.release()
        log.info("a transaction of %d partitions failed (%r); each runs alone", len(parts), exc)
        stats["retries"] += 1
        telemetry.retries.add(1, counted(settings, parts[0].tp.topic))
        return False
    for (owner, _, _), result in zip(crew, results, strict=True):
        owner.expected = result.next_offset
    lanes.tell(riders, True)
    return True


def _messaging(s: worker.Settings, tp: TopicPartition) -> dict[str, Any]:
    """The messaging attributes every span and metric of a partition's batch carries."""
    return {
        "messaging.system": "kafka",
        "messaging.consumer.group.name": s.group_id,
        "messaging.destination.name": tp.topic,
        "messaging.destination.partition.id": str(tp.partition),
    }


def _process_attributes(s: worker.Settings, parts: Sequence[Part]) -> dict[str, Any]:
    """The CONSUMER span's attributes (OpenTelemetry messaging conventions for Kafka).

    A batch of one is a single-message span (its offset, key and tombstone
    flag); a larger one a batch span (its message count).  A transaction that
    carries several partitions' batches names them all in ``dedup.partitions``
    (the partition id and token are each batch's own).
    """
    first = parts[0]
    count = sum(len(p.msgs) + len(p.dead) for p in parts)
    attributes: dict[str, Any] = {
        **_messaging(s, first.tp),
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "dedup.namespace": s.namespace,
    }
    if len(parts) > 1:
        del attributes["messaging.destination.partition.id"]
        if any(p.tp.topic != first.tp.topic for p in parts):
            del attributes["messaging.destination.name"]
        attributes["dedup.partitions"] = [f"{p.tp.topic}:{p.tp.partition}" for p in parts]
    else:
        attributes["dedup.token"] = first.fence.token
    if count > 1:
        attributes["messaging.batch.message_count"] = count
        return attributes
    single = (first.msgs or [d.msg for d in first.dead])[0]
    attributes["messaging.kafka.offset"] = single.offset
    if single.key is not None:
        key = telemetry.key_attribute(single.key)
        if key is not None:
            attributes["messaging.kafka.message.key"] = key
    if single.tombstone:
        attributes["messaging.kafka.message.tombstone"] = True
    return attributes


def _count(
    stats: MutableMapping[str, int],
    s: worker.Settings,
    tp: TopicPartition,
    result: store.BatchResult,
    count: int,
    elapsed: float,
) -> None:
    """Add a committed batch to the consumer's stats and metrics."""
    stats["batches"] += 1
    stats["messages"] += count
    stats["processed"] += len(result.applied)
    stats["duplicates"] += len(result.duplicates)
    stats["conflicts"] += len(result.conflicts)
    stats["dead_lettered"] += len(result.dead_letters)
    attrs = counted(s, tp.topic)
    telemetry.processed.add(len(result.applied), attrs)
    if result.duplicates:
        telemetry.duplicates.add(len(result.duplicates), attrs)
    if result.conflicts:
        telemetry.conflicts.add(len(result.conflicts), attrs)
    if result.dead_letters:
        telemetry.dead_lettered.add(len(result.dead_letters), attrs)
    for letter in result.dead_letters:
        # A handler's failures were logged as they happened; these were never tried.
        if letter.error is None:
            log.warning("dead-lettered %s: %s", letter.msg.where, letter.reason)
    telemetry.batch_size.record(count, attrs)
    telemetry.transaction_duration.record(elapsed, attrs)
    if result.applied:
        lag = time.time() - result.applied[-1].timestamp / 1000
        telemetry.end_to_end_lag.record(max(lag, 0.0), attrs)


def consumed(s: worker.Settings, tp: TopicPartition) -> dict[str, Any]:
    """The attributes of ``messaging.client.consumed.messages`` for one partition."""
    return {
        **_messaging(s, tp),
        "messaging.operation.name": "poll",
        "messaging.operation.type": "receive",
    }


def counted(s: worker.Settings, topic: str) -> dict[str, Any]:
    """The attributes of dedup's counters for one topic of a consumer."""
    return {
        "messaging.system": "kafka",
        "messaging.consumer.group.name": s.group_id,
        "messaging.destination.name": topic,
        "dedup.namespace": s.namespace,
    }


def split(
    msgs: list[message_.Message], dead: list[store.DeadLetter], culprit: int | None
) -> list[tuple[list[message_.Message], list[store.DeadLetter]]]:
    """The parts of a batch whose handler failed: halves, or (when the failing message is
    known) before it, it, after it; each with the dead letters from its first offset on."""
    at = next((i for i, m in enumerate(msgs) if m.offset == culprit), None)
    if at is None:
        half = len(msgs) // 2
        parts = [msgs[:half], msgs[half:]]
    else:
        parts = [part for part in (msgs[:at], msgs[at : at + 1], msgs[at + 1 :]) if part]
    # Each part takes the dead letters from its first offset up to the next part's.
    bounds = [p[0].offset for p in parts[1:]]
    found = []
    for i, part in enumerate(parts):
        low = bounds[i - 1] if i else None
        high = bounds[i] if i < len(bounds) else None
        part_dead = [
            d
            for d in dead
            if (low is None or d.msg.offset >= low) and (high is None or d.msg.offset < high)
        ]
        found.append((part, part_dead))
    return found


def take_key(
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
