"""aiokafka's rebalance calls, handed to the partitions (:mod:`dedup.consumer._partitions`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import aiokafka
from aiokafka.structs import TopicPartition

from dedup.consumer import _partitions as partitions


class Listener(aiokafka.ConsumerRebalanceListener):  # type: ignore[misc]
    """Hands aiokafka's rebalance calls to the partitions.

    aiokafka only logs what a listener raises; the consumer would then hold
    partitions it never works on.  So an error goes to ``failed`` too, and the
    consumer's fetch loop raises it from ``IdempotentConsumer.run``.
    """

    def __init__(
        self,
        partitions: partitions.Partitions,
        grace: Callable[[], float],
        failed: Callable[[Exception], None],
    ) -> None:
        self.partitions = partitions
        self.grace = grace
        """Seconds the batches in flight of a revoked partition may take, asked at the revoke."""
        self.failed = failed

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._reported(self.partitions.revoke(revoked, self.grace()))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._reported(self.partitions.assign(assigned))

    async def _reported(self, step: Awaitable[None]) -> None:
        try:
            await step
        except Exception as exc:
            self.failed(exc)
            raise
