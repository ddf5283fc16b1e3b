"""Every limit of dedup's inputs, refused at construction with the setting and the limit named.

What touches Postgres (a task run, a lease, the longest values in every index)
is in tests/integration/test_limits.py.
"""

from __future__ import annotations

from typing import Any

import pytest

import dedup
from dedup import _limits as limits
from dedup import keys
from dedup.tasks import _run as task_run
from dedup_dev import effects as support
from tests.integration.test_wrap_and_config import consumer_with

# Bytes Postgres adds to an index entry: an 8-byte tuple header, then per column a
# varlena header of up to 4 bytes and alignment padding of up to 7.
ENTRY_HEADER = 8
PER_COLUMN = 4 + 7
PARTITION_DIGITS = len(str(2**31 - 1))
OFFSET_DIGITS = len(str(2**63 - 1))
OFFSET_KEY = limits.MAX_TOPIC_BYTES + 2 + PARTITION_DIGITS + OFFSET_DIGITS
"""``topic:partition:offset``: the key under ``on_missing_key="offset"``."""
LONGEST_STORED_KEY = max(keys.MAX_KEY_BYTES, OFFSET_KEY)

# Every B-tree index of sql/migrations that holds a name or a key, with the
# longest value each column can get.
INDEXES = {
    "processed (namespace, idempotency_key)": [limits.MAX_NAME_BYTES, LONGEST_STORED_KEY],
    "dead_letters (namespace, topic, partition, offset)": [
        limits.MAX_NAME_BYTES,
        limits.MAX_TOPIC_BYTES,
        4,
        8,
    ],
    "partitions (group_id, topic, partition)": [
        limits.MAX_NAME_BYTES,
        limits.MAX_TOPIC_BYTES,
        4,
    ],
    "tasks (task, business_key)": [limits.MAX_NAME_BYTES, limits.MAX_BUSINESS_KEY_BYTES],
    "tasks_unfinished (task, state)": [limits.MAX_NAME_BYTES, len("succeeded")],
    "leases (resource)": [limits.MAX_RESOURCE_BYTES],
    "events_namespace_key, a message's (namespace, key)": [
        limits.MAX_NAME_BYTES,
        LONGEST_STORED_KEY,
    ],
    "events_namespace_key, a task's (task, business key)": [
        limits.MAX_NAME_BYTES,
        limits.MAX_BUSINESS_KEY_BYTES,
    ],
    "events_resource, a partition's group:topic:partition": [
        limits.MAX_NAME_BYTES + 1 + limits.MAX_TOPIC_BYTES + 1 + PARTITION_DIGITS
    ],
    "events_resource, a lease's": [limits.MAX_RESOURCE_BYTES],
}


@pytest.mark.parametrize("index", list(INDEXES))
def test_the_longest_values_fit_every_index_whatever_they_compress_to(index: str) -> None:
    columns = INDEXES[index]
    assert ENTRY_HEADER + sum(size + PER_COLUMN for size in columns) <= limits.BTREE_ENTRY_BYTES


def test_a_tasks_lease_resource_fits_the_lease_limit() -> None:
    resource = task_run.resource_for(
        "t" * limits.MAX_NAME_BYTES, "k" * limits.MAX_BUSINESS_KEY_BYTES
    )
    assert len(resource) == 1285 <= limits.MAX_RESOURCE_BYTES


# (value, what the error says) for a setting limited to MAX_NAME_BYTES.
BAD_NAMES = [
    ("n" * 256, "is 256 bytes of UTF-8; at most 255"),
    ("é" * 128, "is 256 bytes of UTF-8; at most 255"),  # 128 characters, 256 bytes
    ("pay\x00ments", "has a NUL character at character 3"),
    ("pay\ud800ments", "has a lone surrogate ('\\ud800') at character 3"),
    ("", "must not be empty"),
    (42, "must be a str, not int"),
]


@pytest.mark.parametrize("setting", ["namespace", "group_id", "holder"])
@pytest.mark.parametrize(("value", "says"), [bad for bad in BAD_NAMES if bad[0] != ""])
def test_the_consumer_refuses_a_name_past_its_limit(setting: str, value: Any, says: str) -> None:
    with pytest.raises(dedup.ConfigurationError) as info:
        consumer_with(**{setting: value})
    assert str(info.value).startswith(setting)
    assert says in str(info.value)


def test_the_consumer_refuses_a_topic_past_kafkas_limit() -> None:
    with pytest.raises(dedup.ConfigurationError, match=r"topics\[1\]=.* is 250 bytes.*at most 249"):
        consumer_with(topics=["fine", "t" * 250])
    with pytest.raises(dedup.ConfigurationError, match=r"topics\[0\]=.* has a NUL"):
        consumer_with(topics=["a\x00b"])


def test_a_name_exactly_at_the_limit_is_taken() -> None:
    consumer = consumer_with(namespace="é" * 127 + "n", group_id="g" * 255, topics=["t" * 249])
    assert len(consumer.config.namespace.encode()) == limits.MAX_NAME_BYTES


def test_the_consumer_refuses_a_schema_with_a_nul() -> None:
    with pytest.raises(dedup.ConfigurationError, match="invalid schema name"):
        consumer_with(schema="dedup\x00")


@pytest.mark.parametrize(
    "setting",
    ["handler_timeout", "shutdown_timeout", "kafka_commit_interval"],
)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 1e12])
def test_the_consumer_refuses_seconds_out_of_range(setting: str, value: float) -> None:
    with pytest.raises(dedup.ConfigurationError, match=rf"^{setting}=.*expected a number of sec"):
        consumer_with(**{setting: value})


@pytest.mark.parametrize("setting", ["batch_size", "concurrency", "max_attempts"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, 0, 2.5, 10**400])
def test_the_consumer_refuses_counts_out_of_range(setting: str, value: float) -> None:
    with pytest.raises(dedup.ConfigurationError, match=rf"^{setting}=.*expected a whole number"):
        consumer_with(**{setting: value})


@pytest.mark.parametrize(("value", "says"), BAD_NAMES)
def test_wrap_and_the_faststream_middleware_refuse_a_bad_namespace(value: Any, says: str) -> None:
    with pytest.raises(dedup.ConfigurationError, match=f"^namespace.*{says[:20]}"):
        dedup.wrap(support.record_effect, pool=object(), namespace=value)
    with pytest.raises(dedup.ConfigurationError, match=f"^namespace.*{says[:20]}"):
        dedup.FastStreamDedup(dsn="postgresql://x", namespace=value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5, 61.0])
def test_the_faststream_middleware_refuses_a_backoff_out_of_range(value: float) -> None:
    with pytest.raises(dedup.ConfigurationError, match=r"^retry_backoff=.* from 0 to 60"):
        dedup.FastStreamDedup(dsn="postgresql://x", namespace="n", retry_backoff=value)


@pytest.mark.parametrize(("value", "says"), BAD_NAMES[:4])
def test_the_task_runner_refuses_a_bad_holder(value: Any, says: str) -> None:
    with pytest.raises(dedup.ConfigurationError, match=f"^holder.*{says[:20]}"):
        dedup.TaskRunner(dsn="postgresql://x", holder=value)


@pytest.mark.parametrize("value", [float("nan"), 0, 10**400])
def test_the_task_runner_refuses_max_attempts_out_of_range(value: float) -> None:
    with pytest.raises(dedup.ConfigurationError, match=r"^max_attempts=.* from 1 to 1000"):
        dedup.TaskRunner(dsn="postgresql://x", max_attempts=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raised", "reason"),
    [
        ("tenant a\x00b unknown", "tenant a\\x00b unknown"),
        ("tenant a\ud800b unknown", "tenant a\\ud800b unknown"),
        ("tenant é unknown", "tenant é unknown"),
    ],
)
def test_a_reason_for_no_key_is_text_postgres_can_store(raised: str, reason: str) -> None:
    def strict(msg: dedup.Message) -> str | None:
        raise dedup.KeyExtractionError(raised)

    with pytest.raises(dedup.KeyExtractionError) as info:
        keys.extract(strict, dedup.Message("t", 0, 0, None, b"{}", {}, 0))
    assert str(info.value) == reason
    str(info.value).encode("utf-8")  # no lone surrogate left
