"""One turn of the consumer's fetch loop: records for the partitions with room, and what
a fetch error means.

- a position outside the partition's log: :mod:`dedup._out_of_range` resolves it;
- a partition with no offset anywhere: it starts where ``auto_offset_reset`` says;
- a batch that cannot be decoded: the readable records aiokafka fetched with it
  are applied, then the consumer stops (:mod:`dedup._decoding`);
- a retriable Kafka error: logged, and the next turn fetches again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiokafka.errors
from aiokafka.structs import TopicPartition

from dedup import _decoding as decoding
from dedup import _out_of_range as out_of_range
from dedup import _partitions as partitions

log = logging.getLogger("dedup.consumer")

FETCH_WAIT_MS = 250
"""Most milliseconds one fetch waits for records; a stop is seen within it."""
RETRY_WAIT = 1.0
"""Seconds before fetching again after a retriable Kafka error (unless stopping)."""


@dataclass(frozen=True)
class Fetcher:
    """Fetches for one running consumer."""

    kafka: Any
    held: partitions.Partitions
    batch_size: int
    group_id: str
    offset_reset: str
    """The user's ``auto_offset_reset`` (aiokafka's own is ``none``)."""
    stopping: asyncio.Event
    grace: Callable[[], float]
    """Seconds the workers may take to apply what was fetched with an undecodable batch."""

    async def __call__(self) -> dict[TopicPartition, list[Any]]:
        """The records fetched, by partition (maybe none)."""
        ready = self.held.ready()
        fetched: dict[TopicPartition, list[Any]] = {}
        try:
            # Without partitions getmany also runs a rebalance that gives us the first ones.
            fetched.update(
                await self.kafka.getmany(
                    *ready, timeout_ms=FETCH_WAIT_MS, max_records=self.batch_size
                )
            )
            # getmany fills max_records from one partition after another; ask each
            # other ready partition for what the fetcher already holds.
            if fetched and len(ready) > 1:
                for tp in ready:
                    if tp not in fetched and tp in self.held.workers:
                        fetched.update(
                            await self.kafka.getmany(tp, timeout_ms=0, max_records=self.batch_size)
                        )
        except aiokafka.errors.OffsetOutOfRangeError as exc:
            await self._resolving(self.held.out_of_range(exc.args[0]))
        except aiokafka.errors.NoOffsetForPartitionError as exc:
            reset = out_of_range.reset(self.kafka, exc.args[0], self.offset_reset, self.group_id)
            await self._resolving(reset)
        except Exception as exc:
            failure = decoding.locate(exc)
            if failure is not None or isinstance(exc, decoding.ERRORS):
                # aiokafka has already moved partitions past records it dropped with
                # this error: apply them, then stop (going on would skip the batch).
                readable = {**fetched, **decoding.salvage(exc)}
                tp = failure.tp if failure is not None else None
                stands_at = await self.held.apply_first(readable, tp, self.grace())
                raise decoding.error(exc, failure, self.group_id, stands_at) from exc
            await self._retry_later(exc)
        return fetched

    async def _resolving(self, step: Awaitable[None]) -> None:
        """Run ``step``, which asks Kafka where a partition's log lies."""
        try:
            await step
        except aiokafka.errors.KafkaError as exc:
            await self._retry_later(exc)

    async def _retry_later(self, exc: Exception) -> None:
        """Raise ``exc`` unless it is a retriable Kafka error; then wait RETRY_WAIT."""
        if not isinstance(exc, aiokafka.errors.KafkaError) or not exc.retriable:
            raise exc
        log.warning("kafka fetch failed, retrying: %r", exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), RETRY_WAIT)
