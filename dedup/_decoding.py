"""Record batches that aiokafka cannot decode: where they are, and the error that says so.

dedup depends on aiokafka's codec extras, so gzip, snappy, lz4 and zstd batches
are read out of the box.  A batch can still fail to decode: a codec library
missing from the environment, corrupt bytes, a header name that is not UTF-8.
aiokafka then raises from ``getmany`` without saying which partition; the
frame that was unpacking the batch knows, so the error is located from the
traceback when it can be.  The consumer stops with an
:class:`dedup.UndecodableBatchError` that names the partition, its
fetch position, and what to do.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import aiokafka.errors
from aiokafka.structs import TopicPartition

from dedup import _errors as errors

ERRORS = (aiokafka.errors.UnsupportedCodecError, aiokafka.errors.CorruptRecordException)
"""What aiokafka raises for a batch it cannot read, wherever it is raised from."""

POSITION_TIMEOUT = 5.0
INSTALL = "pip install 'aiokafka[snappy,lz4,zstd]'"

_UNPACKING = "_unpack_records"  # aiokafka.consumer.fetcher.PartitionRecords


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


async def error(
    exc: BaseException, failure: Failure | None, kafka: Any, group_id: str
) -> errors.UndecodableBatchError:
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
    position = None
    with contextlib.suppress(aiokafka.errors.KafkaError, TimeoutError):  # said without it
        position = await asyncio.wait_for(kafka.position(tp), POSITION_TIMEOUT)
    where = f"topic {tp.topic!r} partition {tp.partition}"
    if position is not None:
        where += f", fetch position {position}"
    skip_to = "AFTER_THE_BATCH"
    if failure.batch is not None:
        first, after = failure.batch
        where += f" (the batch holds offsets {first} to {after - 1})"
        skip_to = str(after)
    return errors.UndecodableBatchError(
        f"cannot decode a record batch of {where}: {cause}. {remedy} If the batch is corrupt, "
        f"skip it (its records are not applied, the skip is recorded): `dedup offsets skip "
        f"--group {group_id} --topic {tp.topic} --partition {tp.partition} --to-offset {skip_to}`.",
        topic=tp.topic,
        partition=tp.partition,
        offset=position,
        batch=failure.batch,
    )
