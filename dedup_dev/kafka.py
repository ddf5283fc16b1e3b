"""Kafka for development: topics made and deleted, records produced, offsets read."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable, Mapping, Sequence

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import ConsumerRecord, TopicPartition

from dedup_dev import services


class Topics:
    """Creates uniquely named topics for one test and deletes them afterwards."""

    def __init__(self, bootstrap_servers: str, **options: object) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.options = options
        """More admin client options (a secured listener's)."""
        self.created: list[str] = []

    async def create(
        self,
        partitions: int = 1,
        prefix: str = "t",
        config: dict[str, str] | None = None,
        name: str | None = None,
        replicas: int = 1,
    ) -> str:
        """A new topic ``<prefix>-<12 hex>`` (or ``name``) with ``partitions``; its name."""
        name = name or f"{prefix}-{uuid.uuid4().hex[:12]}"
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap_servers, **self.options)
        try:
            await admin.start()
        except Exception as exc:  # any failure here means "not reachable"
            raise services.Unreachable(
                f"cannot reach Kafka at {self.bootstrap_servers}: {exc!r}; {services.HOW_TO_START}"
            ) from exc
        try:
            topic = NewTopic(name, partitions, replicas, topic_configs=config or {})
            await admin.create_topics([topic])
        finally:
            await admin.close()
        self.created.append(name)
        return name

    async def delete_all(self) -> None:
        """Delete every topic made here."""
        if not self.created:
            return
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap_servers, **self.options)
        await admin.start()
        try:
            await admin.delete_topics(self.created)
        finally:
            await admin.close()


async def produce(
    bootstrap_servers: str,
    topic: str,
    records: Iterable[tuple[bytes | None, bytes]],
    *,
    partition: int | None = None,
    headers: list[tuple[str, bytes]] | None = None,
    chunk: int = 10_000,
    timestamp_ms: int | None = None,
    in_transaction: bool = False,
    **options: object,
) -> int:
    """Send ``(key, value)`` records and wait until all are acknowledged; return the count.

    ``options`` go to the producer (``linger_ms`` is 5 unless given); acknowledgements are
    awaited every ``chunk`` records, so a large workload holds few futures at once.
    ``timestamp_ms`` is every record's timestamp (default: the producer's clock).  With
    ``in_transaction``, the records are one Kafka transaction: a read_committed consumer
    sees none of them until it commits, then all at once.
    """
    if in_transaction:
        options.setdefault("transactional_id", f"tx-{uuid.uuid4().hex[:12]}")
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers, **{"linger_ms": 5, **options})
    await producer.start()
    sent = 0
    try:
        if in_transaction:
            await producer.begin_transaction()
        futures = []
        for key, value in records:
            futures.append(
                await producer.send(
                    topic,
                    value,
                    key=key,
                    partition=partition,
                    headers=headers,
                    timestamp_ms=timestamp_ms,
                )
            )
            if len(futures) >= chunk:
                sent += len(await asyncio.gather(*futures))
                futures = []
        sent += len(await asyncio.gather(*futures))
        if in_transaction:
            await producer.commit_transaction()
    finally:
        await producer.stop()
    return sent


def produce_confluent(
    bootstrap_servers: str,
    topic: str,
    records: Iterable[tuple[bytes | None, bytes]],
    *,
    partition: int | None = None,
) -> int:
    """:func:`produce` with confluent-kafka's producer (librdkafka), blocking: send ``(key,
    value)`` records, wait until all are acknowledged; return the count."""
    import confluent_kafka

    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap_servers, "linger.ms": 5})
    failed: list[str] = []

    def delivered(err: object, _: object) -> None:
        if err is not None:
            failed.append(str(err))

    sent = 0
    # librdkafka's "any partition" (the partitioner picks one by key).
    where = -1 if partition is None else partition
    for key, value in records:
        while True:
            try:
                producer.produce(topic, value, key=key, partition=where, on_delivery=delivered)
                break
            except BufferError:  # the local queue is full: let it drain
                producer.poll(0.1)
        sent += 1
    if producer.flush(30) or failed:
        raise RuntimeError(f"confluent-kafka could not deliver to {topic}: {failed[:3]}")
    return sent


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


async def group_state(bootstrap_servers: str, group: str) -> str:
    """The group's state as Kafka describes it: ``Stable``, ``Empty``, ... (``Dead``: none)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        [described] = await admin.describe_consumer_groups([group])
    finally:
        await admin.close()
    [(_, _, state, *_)] = described.groups
    return str(state)


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


async def read_topic(
    bootstrap_servers: str, topic: str, *, read_committed: bool = False, within: float = 30.0
) -> list[ConsumerRecord[bytes, bytes]]:
    """Every record of ``topic`` up to its end now, partition by partition, in offset order.

    ``read_committed`` reads as a downstream ``isolation_level="read_committed"``
    consumer does: records of aborted transactions are left out, and the end is
    the last stable offset.
    """
    reader = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers,
        enable_auto_commit=False,
        isolation_level="read_committed" if read_committed else "read_uncommitted",
    )
    await reader.start()
    try:
        parts = [
            TopicPartition(topic, p) for p in range(await partition_count(bootstrap_servers, topic))
        ]
        reader.assign(parts)
        await reader.seek_to_beginning(*parts)
        ends = await reader.end_offsets(parts)
        found: list[ConsumerRecord[bytes, bytes]] = []
        deadline = asyncio.get_running_loop().time() + within
        for tp in parts:
            while await reader.position(tp) < ends[tp]:
                if asyncio.get_running_loop().time() > deadline:
                    raise AssertionError(f"{topic} not read to its end in {within:.0f}s")
                batch = await reader.getmany(tp, timeout_ms=500)
                found += [r for r in batch.get(tp, []) if r.offset < ends[tp]]
        return found
    finally:
        await reader.stop()


async def partition_count(bootstrap_servers: str, topic: str) -> int:
    """How many partitions ``topic`` has."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        [described] = await admin.describe_topics([topic])
    finally:
        await admin.close()
    return len(described["partitions"])
