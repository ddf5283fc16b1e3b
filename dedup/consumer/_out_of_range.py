"""Offsets outside a partition's log: what each means, and what the consumer does about it.

dedup keeps offsets in Postgres and seeks to them at assignment.  aiokafka
runs with ``auto_offset_reset="none"``, so a position outside the log reaches
the consumer as an error instead of a silent jump:

- **below the log start** (retention deleted records the group had not
  applied): nothing can bring them back; the partition resumes at the log
  start, and the loss is recorded (an ``offsets_lost_to_retention`` event with
  the range, the ``dedup.offsets.lost_to_retention`` metric, an ERROR line);
- **beyond the log end** (the topic was deleted and recreated, say): the
  partition is held, not fetched, with an ``offsets_beyond_log_end`` event and
  an ERROR line naming the ``dedup offsets rewind`` that resolves it; the other
  partitions go on.  Waiting would drop the new log's first records.

A partition with no stored offset anywhere starts where the user's
``auto_offset_reset`` says (:func:`reset`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiokafka.structs import TopicPartition

from dedup import _errors as errors
from dedup import _telemetry as telemetry
from dedup.data import _events as events

log = logging.getLogger("dedup.consumer")

RESETS = ("earliest", "latest", "none")
"""Where a partition with no stored offset starts: its log start (the default), its end, or
nowhere (``run()`` stops, naming the partition)."""


def check_reset(value: object) -> None:
    """Refuse an ``auto_offset_reset`` dedup cannot follow, at construction."""
    if value not in RESETS:
        raise errors.ConfigurationError(
            f"auto_offset_reset={value!r}: expected one of {', '.join(RESETS)}"
        )


async def reset(kafka: Any, tp: TopicPartition, policy: str, group_id: str) -> None:
    """``tp`` has no offset in Postgres nor in Kafka: start where ``policy`` says."""
    if policy == "earliest":
        await kafka.seek_to_beginning(tp)
    elif policy == "latest":
        await kafka.seek_to_end(tp)
    else:
        raise errors.DedupError(
            f"topic {tp.topic!r} partition {tp.partition} has no stored offset and "
            f"auto_offset_reset={policy!r}: set one with `dedup offsets skip --group {group_id} "
            f"--topic {tp.topic} --partition {tp.partition} --to-offset N`, or pass "
            "auto_offset_reset='earliest'"
        )


@dataclass
class Found:
    """What :func:`resolve` decided: the events to record, the partitions to hold."""

    events: list[events.Event] = field(default_factory=list)
    beyond_end: dict[TopicPartition, int] = field(default_factory=dict)
    """Partitions beyond their log end, with the offset they stand at."""


@dataclass(frozen=True)
class Owner:
    """Who holds the partitions, for the events and logs."""

    group_id: str
    namespace: str
    holder: str
    tokens: Mapping[TopicPartition, int]
    beyond_end: Mapping[TopicPartition, int]
    """Partitions held already, beyond their log end at that offset."""


async def resolve(kafka: Any, positions: Mapping[TopicPartition, int], owner: Owner) -> Found:
    """Seek what retention passed to the log start; tell what lies beyond the log end."""
    found = Found()
    # A fetch in flight when a partition was held reports it again: known.
    tps = [
        tp for tp in positions if tp in owner.tokens and owner.beyond_end.get(tp) != positions[tp]
    ]
    if not tps:
        return found
    starts = await kafka.beginning_offsets(tps)
    ends = await kafka.end_offsets(tps)
    for tp in tps:
        offset, log_range = positions[tp], range(starts[tp], ends[tp])
        resource = f"{owner.group_id}:{tp.topic}:{tp.partition}"
        if offset < log_range.start:
            lost = range(offset, log_range.start)
            _log_lost(tp, lost, owner.group_id)
            telemetry.lost_to_retention.add(
                len(lost), telemetry.partition_attributes(owner.group_id, tp)
            )
            found.events.append(
                events.lost_to_retention(
                    resource, owner.holder, owner.tokens[tp], lost, owner.namespace
                )
            )
            kafka.seek(tp, log_range.start)
        elif offset > log_range.stop:
            command = (
                f"dedup offsets rewind --group {owner.group_id} --topic {tp.topic} "
                f"--partition {tp.partition} --to-offset {log_range.start} --yes"
            )
            _log_beyond(tp, offset, log_range, owner.group_id, command)
            found.events.append(
                events.beyond_log_end(
                    resource,
                    owner.holder,
                    owner.tokens[tp],
                    (offset, log_range),
                    command,
                    owner.namespace,
                )
            )
            found.beyond_end[tp] = offset
        else:
            kafka.seek(tp, offset)  # the log moved meanwhile: fetch from there again
    return found


def _log_lost(tp: TopicPartition, lost: range, group_id: str) -> None:
    log.error(
        "records lost to retention: topic %s partition %d, offsets %d to %d (%d records) were "
        "deleted before group %s applied them; resuming at the log start, offset %d",
        tp.topic,
        tp.partition,
        lost.start,
        lost.stop - 1,
        len(lost),
        group_id,
        lost.stop,
    )


def _log_beyond(
    tp: TopicPartition, offset: int, log_range: range, group_id: str, command: str
) -> None:
    log.error(
        "topic %s partition %d is held: group %s stands at offset %d, beyond the log end %d "
        "(log start %d); was the topic deleted and recreated? Nothing of the partition is "
        "consumed until `%s` (or another offset in the log) moves it; the other partitions "
        "go on",
        tp.topic,
        tp.partition,
        group_id,
        offset,
        log_range.stop,
        log_range.start,
        command,
    )
