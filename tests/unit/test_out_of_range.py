"""Where a partition with no stored offset starts, and refusing a policy dedup can't follow."""

from __future__ import annotations

import pytest
from aiokafka.structs import TopicPartition

import dedup
from dedup.consumer import _out_of_range as out_of_range


async def handler(msg: dedup.Message, tx: dedup.Tx) -> None:
    """Never called: these consumers are only built."""


def build(**options: object) -> dedup.IdempotentConsumer:
    return dedup.IdempotentConsumer(
        handler,
        topics=["orders"],
        group_id="billing",
        bootstrap_servers="127.0.0.1:9092",
        dsn="postgresql://localhost/app",
        **options,  # type: ignore[arg-type]
    )


def test_the_default_starts_a_partition_with_no_offset_at_its_log_start() -> None:
    assert build().config.kafka_options["auto_offset_reset"] == "earliest"
    assert build(auto_offset_reset="latest").config.kafka_options["auto_offset_reset"] == "latest"


def test_an_unknown_auto_offset_reset_is_refused_at_construction() -> None:
    with pytest.raises(dedup.ConfigurationError) as refused:
        build(auto_offset_reset="smallest")
    assert str(refused.value) == (
        "auto_offset_reset='smallest': expected one of earliest, latest, none"
    )


async def test_none_stops_naming_the_partition_and_the_command_that_sets_an_offset() -> None:
    with pytest.raises(dedup.DedupError) as stopped:
        await out_of_range.reset(None, TopicPartition("orders", 3), "none", "billing")
    assert "topic 'orders' partition 3 has no stored offset" in str(stopped.value)
    assert "`dedup offsets skip --group billing --topic orders --partition 3 --to-offset N`" in str(
        stopped.value
    )
