"""Record batches that aiokafka cannot decode: where they are, and the error that says so.

dedup depends on aiokafka's codec extras, so gzip, snappy, lz4 and zstd batches
are read out of the box.  A batch can still fail to decode: a codec library
missing from the environment, corrupt bytes, a header name that is not UTF-8.
aiokafka then raises from ``getmany`` without saying which partition; the
frame that was unpacking the batch knows, so the error is located from the
traceback when it can be.  The records aiokafka had decoded in that call (the
readable ones before the bad batch, and other partitions' whose positions it
had already moved) are taken from the same frames (:func:`salvage`); the
consumer applies them, then stops with an :class:`dedup.UndecodableBatchError`
that names the partition, the batch, where the group stands, and what to do.
Its ``dedup offsets skip`` command then skips only the undecodable batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiokafka.errors
from aiokafka.structs import TopicPartition

from dedup import _errors as errors

ERRORS = (aiokafka.errors.UnsupportedCodecError, aiokafka.errors.CorruptRecordException)
"""What aiokafka raises for a batch it cannot read, wherever it is raised from."""

INSTALL = "pip install 'aiokafka[snappy,lz4,zstd]'"

# Frames of aiokafka.consumer.fetcher, and their locals that hold decoded records.
_UNPACKING = "_unpack_records"  # PartitionRecords: the batch being unpacked
_DRAINING = "fetched_records"  # Fetcher: ``drained``, other partitions' records
_GETTING_ALL = "getall"  # FetchResult: ``ret_list``, this partition's records so far


@dataclass(frozen=True, slots=True)
class Failure:
    """Where a batch failed to decode."""

    tp: TopicPartition
    """The partition it came from."""
    batch: tuple[int, int] | None
    """The batch's first offset and the offset after it, when aiokafka had them."""


def locate(exc: BaseException) -> Failure | None:
    """The partition whose records aiokafka was unpacking when ``exc`` was raised, if it was."""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == _UNPACKING and "aiokafka" in frame.f_code.co_filename:
            tp = frame.f_locals.get("tp")
            if not isinstance(tp, TopicPartition):
                return None
            batch = frame.f_locals.get("next_batch")
            first = getattr(batch, "base_offset", None)
            after = getattr(batch, "next_offset", None)
            offsets = (first, after) if isinstance(first, int) and isinstance(after, int) else None
            return Failure(tp, offsets)
        tb = tb.tb_next
    return None


def salvage(exc: BaseException) -> dict[TopicPartition, list[Any]]:
    """The records aiokafka decoded in the ``getmany`` call that raised ``exc``, by partition.

    aiokafka drops them with the error, although it may already have moved the
    partitions' positions past them; they are readable and must be applied.
    """
    found: dict[TopicPartition, list[Any]] = {}
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        where = tb.tb_frame.f_locals
        if "aiokafka" in code.co_filename:
            if code.co_name == _DRAINING and isinstance(where.get("drained"), dict):
                found.update(where["drained"])
            elif code.co_name == _GETTING_ALL and isinstance(where.get("ret_list"), list):
                tp = getattr(where.get("self"), "_topic_partition", None)
                if isinstance(tp, TopicPartition) and where["ret_list"]:
                    found[tp] = list(where["ret_list"])
        tb = tb.tb_next
    return found


def error(
    exc: BaseException, failure: Failure | None, group_id: str, stands_at: int | None
) -> errors.UndecodableBatchError:
    """The error the consumer stops with, naming where and what to do.

    ``stands_at``: the partition's stored offset once the readable records before
    the batch were applied (None when not known).
    """
    """The error the consumer stops with, naming where and what to do."""
    cause = (
        str(exc) if isinstance(exc, aiokafka.errors.KafkaError) else f"{type(exc).__name__}: {exc}"
    )
    remedy = (
        f"If a compression library is missing where the consumer runs, install it ({INSTALL}; "
        "dedup depends on it) and start the consumer again: it resumes where it stopped."
    )
    if failure is None:
        return errors.UndecodableBatchError(
            f"cannot decode a record batch fetched for group {group_id!r}: {cause}. {remedy}"
        )
    tp = failure.tp
    where = f"topic {tp.topic!r} partition {tp.partition}"
    skip_to, first = "AFTER_THE_BATCH", None
    if failure.batch is not None:
        first, after = failure.batch
        where += f" (the batch holds offsets {first} to {after - 1})"
        skip_to = str(after)
    if stands_at is not None and (first is None or stands_at >= first):
        where += f"; the records before it are applied, the group stands at offset {stands_at}"
    elif stands_at is not None:
        # The handlers ran out of shutdown_timeout: a skip now would pass over readable records.
        where += (
            f"; the group stands at offset {stands_at}, short of the batch: start the consumer "
            "again to apply the records before it, then skip"
        )
    return errors.UndecodableBatchError(
        f"cannot decode a record batch of {where}: {cause}. {remedy} If the batch is corrupt, "
        f"skip it (its records are not applied, the skip is recorded): `dedup offsets skip "
        f"--group {group_id} --topic {tp.topic} --partition {tp.partition} --to-offset {skip_to}`.",
        topic=tp.topic,
        partition=tp.partition,
        offset=stands_at,
        batch=failure.batch,
    )
