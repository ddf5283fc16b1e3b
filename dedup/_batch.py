"""One consumer batch's transaction: its spans, the store's work, COMMIT, its counts.

:class:`dedup._worker.PartitionWorker` decides what to try and what to do
when it fails; this module runs one try.  The fault points ``BEFORE_COMMIT``
and ``AFTER_COMMIT`` (:mod:`dedup._faults`) sit here, around the COMMIT.
"""

from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

from aiokafka.structs import TopicPartition

from dedup import _faults as faults
from dedup import _lanes as lanes
from dedup import _message as message_
from dedup import _store as store
from dedup import _telemetry as telemetry

if TYPE_CHECKING:
    from dedup import _worker as worker

log = logging.getLogger("dedup.worker")


async def transaction(
    lane: lanes.Lane,
    settings: worker.Settings,
    serial: bool,
    tp: TopicPartition,
    fence: store.Fence,
    msgs: list[message_.Message],
    dead: list[store.DeadLetter],
    stats: MutableMapping[str, int],
) -> store.BatchResult:
    """Apply ``msgs`` and write ``dead`` in one transaction on ``lane``, under ``fence``.

    ``serial``: the lanes deadlocked lately, so the transaction first waits
    for every other serial batch of the group.  Raises what the store raises.
    """
    s = settings
    count = len(msgs) + len(dead)
    attributes = _process_attributes(s, tp, fence.token, msgs, dead)
    links, dropped = telemetry.producer_links(m.raw_headers for m in msgs)
    if dropped:
        attributes["dedup.links.dropped"] = dropped
    started = time.perf_counter()
    with telemetry.consumer_span(f"process {tp.topic}", attributes, links):
        conn = await lane.connection()
        with telemetry.client_span(
            f"BATCH {s.store.schema}.processed",
            {
                "db.operation.name": "BATCH",
                "db.collection.name": "processed",
                "db.namespace": s.database,
                "db.operation.batch.size": count,
            },
        ):
            async with conn.transaction():
                if serial:
                    # Deadlocked lately: one transaction at a time in the group too.
                    await s.store.serialize(conn, s.group_id)
                result = await s.store.apply(
                    conn,
                    msgs,
                    handler=s.handler,
                    batch_handler=s.batch_handler,
                    fence=fence,
                    dead=dead,
                    handler_timeout=s.handler_timeout,
                    idle_timeout=s.idle_timeout,
                    lock_timeout=lanes.LOCK_WAIT if lane.shared else None,
                )
                await faults.point(
                    faults.Point.BEFORE_COMMIT,
                    conn=conn,
                    fence=fence,
                    msgs=msgs,
                    dead=dead,
                    result=result,
                )
            await faults.point(
                faults.Point.AFTER_COMMIT, fence=fence, msgs=msgs, dead=dead, result=result
            )
    _count(stats, s.namespace, tp, result, count, time.perf_counter() - started)
    return result


def _process_attributes(
    s: worker.Settings,
    tp: TopicPartition,
    token: int,
    msgs: list[message_.Message],
    dead: list[store.DeadLetter],
) -> dict[str, Any]:
    """The CONSUMER span's attributes (OpenTelemetry messaging conventions for Kafka)."""
    count = len(msgs) + len(dead)
    attributes: dict[str, Any] = {
        "messaging.system": "kafka",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": tp.topic,
        "messaging.destination.partition.id": str(tp.partition),
        "messaging.consumer.group.name": s.group_id,
        "messaging.kafka.offset": (msgs or [d.msg for d in dead])[0].offset,
        "messaging.batch.message_count": count,
        "dedup.namespace": s.namespace,
        "dedup.token": token,
    }
    if count == 1 and msgs and msgs[0].key is not None:
        key = telemetry.key_attribute(msgs[0].key)
        if key is not None:
            attributes["messaging.kafka.message.key"] = key
    return attributes


def _count(
    stats: MutableMapping[str, int],
    namespace: str,
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
    attrs = {"messaging.destination.name": tp.topic, "dedup.namespace": namespace}
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
