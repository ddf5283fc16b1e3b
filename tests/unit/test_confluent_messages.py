"""A ``confluent_kafka.Message`` becomes the ``dedup.Message`` an aiokafka record of the same
content becomes; one whose ``error()`` is set, or a record of no known kind, is refused."""

from __future__ import annotations

import confluent_kafka
import pytest
from aiokafka.structs import ConsumerRecord

import dedup
from dedup import _message as message_

HEADERS = [("a", b"1"), ("n", None), ("a", b"2")]


def fields(msg: dedup.Message) -> tuple[object, ...]:
    return (
        msg.topic, msg.partition, msg.offset, msg.key, msg.value, msg.headers, msg.timestamp,
        msg.raw_headers, msg.tombstone,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("key", "value", "headers"),
    [(b"k", b'{"id": 1}', HEADERS), (None, None, None), (b"", b"", [])],
)
def test_a_confluent_message_is_what_the_same_aiokafka_record_is(
    key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes | None]] | None
) -> None:
    confluent = confluent_kafka.Message(
        topic="t", partition=2, offset=9, key=key, value=value, headers=headers,
        timestamp=(confluent_kafka.TIMESTAMP_CREATE_TIME, 5),
    )  # fmt: skip
    aiokafka = ConsumerRecord("t", 2, 9, 5, 0, key, value, None, 0, 0, headers or [])
    assert fields(message_.of(confluent)) == fields(message_.of(aiokafka))


def test_a_message_with_an_error_is_refused_naming_the_error_and_where() -> None:
    eof = confluent_kafka.Message(
        topic="payments", partition=3, offset=-1001,
        error=confluent_kafka.KafkaError(confluent_kafka.KafkaError._PARTITION_EOF),
    )  # fmt: skip
    with pytest.raises(dedup.ConfigurationError) as refused:
        message_.of(eof)
    assert str(refused.value) == (
        "a confluent_kafka.Message with an error is no record to claim: "
        f"{eof.error()} (at payments:3); skip such messages (`if msg.error(): ...`) before "
        "handing the rest to dedup"
    )


def test_a_record_of_no_known_kind_is_named() -> None:
    with pytest.raises(dedup.ConfigurationError, match=r"a record is a builtins\.dict; expected"):
        message_.of({"topic": "t"})
    msg = dedup.Message("t", 0, 0, None, b"", {}, 0)
    assert message_.of(msg) is msg
