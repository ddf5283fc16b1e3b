"""What the offsets tests ask of Kafka: committed and end offsets, a reset, transactions."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import TopicPartition


async def committed(bootstrap_servers: str, group: str, topic: str | None = None) -> dict[int, int]:
    """Kafka's committed offset of each partition of ``group`` (as Kafka's lag tools read it).

    With ``topic``, of that topic's partitions only (a group may consume several).
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    return {
        tp.partition: meta.offset
        for tp, meta in offsets.items()
        if meta.offset >= 0 and topic in (None, tp.topic)
    }


async def end_offsets(bootstrap_servers: str, topic: str, partitions: int) -> dict[int, int]:
    """The end offset (log end, transaction markers included) of each partition."""
    reader = AIOKafkaConsumer(bootstrap_servers=bootstrap_servers)
    await reader.start()
    try:
        ends = await reader.end_offsets([TopicPartition(topic, p) for p in range(partitions)])
    finally:
        await reader.stop()
    return {tp.partition: offset for tp, offset in ends.items()}


async def reset(bootstrap_servers: str, group: str, topic: str, offsets: Mapping[int, int]) -> None:
    """Commit ``offsets`` for a stopped group, as ``kafka-consumer-groups --reset-offsets`` does."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers, group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, p) for p in offsets])
        await consumer.commit({TopicPartition(topic, p): o for p, o in offsets.items()})
    finally:
        await consumer.stop()


async def produce_transactions(
    bootstrap_servers: str,
    topic: str,
    transactions: Iterable[tuple[bool, Sequence[tuple[int, bytes]]]],
) -> None:
    """Send each ``(commit, [(partition, value), ...])`` in a transaction, committed or aborted."""
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap_servers, transactional_id=f"tx-{uuid.uuid4().hex[:12]}"
    )
    await producer.start()
    try:
        for commit, records in transactions:
            await producer.begin_transaction()
            for partition, value in records:
                await producer.send_and_wait(topic, value, partition=partition)
            if commit:
                await producer.commit_transaction()
            else:
                await producer.abort_transaction()
    finally:
        await producer.stop()
