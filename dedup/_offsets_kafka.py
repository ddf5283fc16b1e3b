"""What ``dedup offsets`` asks Kafka: partitions, log ranges, group members, committed offsets;
and deleting a group."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import aiokafka
import aiokafka.admin
import aiokafka.errors
from aiokafka.protocol.admin import DeleteGroupsRequest
from aiokafka.structs import TopicPartition

from dedup import _errors as errors
from dedup import _kafka_client as kafka_client

KAFKA_TIMEOUT_MS = 10_000


class Kafka:
    """What ``dedup offsets`` asks Kafka: partitions, log ranges, group members and offsets;
    and deleting a group."""

    def __init__(
        self, bootstrap_servers: str, kafka_options: Mapping[str, Any] | None = None
    ) -> None:
        """``kafka_options``: the security settings (aiokafka's names, and ``ssl_cafile``...:
        dedup._kafka_client)."""
        self.bootstrap_servers = bootstrap_servers
        self._options = kafka_client.client_options(kafka_options or {})
        self._admin = aiokafka.admin.AIOKafkaAdminClient(
            bootstrap_servers=bootstrap_servers,
            request_timeout_ms=KAFKA_TIMEOUT_MS,
            **self._options,
        )
        # No group: it only reads offsets.  read_uncommitted (the default), so
        # end offsets are the log end that Kafka's own lag tools count from.
        self._reader = aiokafka.AIOKafkaConsumer(
            bootstrap_servers=bootstrap_servers,
            enable_auto_commit=False,
            request_timeout_ms=KAFKA_TIMEOUT_MS,
            **self._options,
        )

    async def __aenter__(self) -> Kafka:
        try:
            await self._admin.start()
            await self._reader.start()
        except aiokafka.errors.KafkaError as exc:
            await self.__aexit__(None, None, None)
            # A refused login or certificate names the setting to fix (exit code 2).
            raise await kafka_client.unreachable(
                self.bootstrap_servers, self._options, exc, what="dedup offsets"
            ) from exc
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._reader.stop()
        await self._admin.close()

    def unavailable(self, exc: BaseException) -> errors.ServiceUnavailableError:
        """The error for a Kafka request that failed."""
        return errors.ServiceUnavailableError(
            f"Kafka at {self.bootstrap_servers} did not answer: {exc!r}; "
            "check --bootstrap-servers and run the command again"
        )

    async def partitions(self, topic: str) -> list[int]:
        """The topic's partition numbers; a ConfigurationError if Kafka has no such topic."""
        # Listing first: asking for one topic's metadata may create it on a broker
        # that auto-creates topics.
        if topic not in await self.topics():
            raise errors.ConfigurationError(
                f"--topic {topic}: no such topic on Kafka at {self.bootstrap_servers}"
            )
        [described] = await self._admin.describe_topics([topic])
        return sorted(p["partition"] for p in described["partitions"])

    async def topics(self) -> set[str]:
        """Every topic Kafka knows."""
        return set(await self._admin.list_topics())

    async def members(self, group: str) -> int:
        """How many consumers are in ``group`` now (0: empty, or no such group)."""
        described = await self._admin.describe_consumer_groups([group])
        groups = [g for response in described for g in response.groups]
        for error_code, *_ in groups:
            if error_code:  # a coordinator still loading must not pass for an empty group
                raise aiokafka.errors.for_code(error_code)(f"describing group {group}")
        return sum(len(members) for _, _, _, _, _, members, *_ in groups)

    async def delete_group(self, group: str) -> None:
        """Delete ``group`` in Kafka, its committed offsets with it.

        Raises Kafka's answer when it refuses: ``GroupIdNotFound`` (no such
        group), ``NonEmptyGroup`` (it has members), or another KafkaError.
        """
        # aiokafka's admin client has no call for DeleteGroups; its public client sends it.
        coordinator = await self._admin.find_coordinator(group)
        client = aiokafka.AIOKafkaClient(
            bootstrap_servers=self.bootstrap_servers,
            request_timeout_ms=KAFKA_TIMEOUT_MS,
            **self._options,
        )
        try:
            await client.bootstrap()
            response = await client.send(coordinator, DeleteGroupsRequest([group]))
        finally:
            await client.close()
        for _, error_code in response.results:
            if error_code:
                raise aiokafka.errors.for_code(error_code)(f"deleting group {group}")

    async def committed(self, group: str) -> dict[TopicPartition, int]:
        """Kafka's committed offsets of ``group`` (partitions without one are left out)."""
        found = await self._admin.list_consumer_group_offsets(group)
        return {tp: meta.offset for tp, meta in found.items() if meta.offset >= 0}

    async def log_range(self, tps: Sequence[TopicPartition]) -> dict[TopicPartition, range]:
        """Each partition's offsets from its log start to its end (the end included)."""
        starts = await self._reader.beginning_offsets(list(tps))
        ends = await self._reader.end_offsets(list(tps))
        return {tp: range(starts[tp], ends[tp] + 1) for tp in tps}

    async def ends(self, tps: Sequence[TopicPartition]) -> dict[TopicPartition, int]:
        """Each partition's end offset (where the next record will be written)."""
        found: dict[TopicPartition, int] = await self._reader.end_offsets(list(tps))
        return found

    async def at_time(
        self, tps: Sequence[TopicPartition], when: datetime.datetime
    ) -> dict[TopicPartition, int]:
        """The offset of each partition's first record at or after ``when``, else its end."""
        ms = int(when.timestamp() * 1000)
        found = await self._reader.offsets_for_times(dict.fromkeys(tps, ms))
        ends = await self.ends(tps)
        return {tp: ends[tp] if found.get(tp) is None else found[tp].offset for tp in tps}

    async def commit(self, group: str, offsets: Mapping[TopicPartition, int]) -> None:
        """Set ``group``'s committed offsets; Kafka accepts it only while the group is empty."""
        committer = aiokafka.AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap_servers,
            group_id=group,
            enable_auto_commit=False,
            request_timeout_ms=KAFKA_TIMEOUT_MS,
            **self._options,
        )
        await committer.start()
        try:
            committer.assign(list(offsets))
            await committer.commit(dict(offsets))
        finally:
            await committer.stop()


def quiet_aiokafka() -> None:
    """aiokafka logs each retried request (a group coordinator still loading, ...) as an
    error; a command reports what finally failed, so keep its output to that."""
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
