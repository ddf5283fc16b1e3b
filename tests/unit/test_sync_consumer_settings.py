"""``dedup.sync.Consumer`` refuses bad settings at construction, each error naming the setting;
and reads confluent-kafka's configuration as documented (no services: nothing connects
before ``run()``)."""

from __future__ import annotations

from typing import Any

import pytest

import dedup
from dedup.sync import _consumer as sync_consumer

SERVERS = {"bootstrap.servers": "127.0.0.1:9092"}


def handler(msg: dedup.Message, tx: dedup.sync.Tx) -> None:
    """A blocking handler."""


async def async_handler(msg: dedup.Message, tx: dedup.Tx) -> None:
    """An async one: dedup.IdempotentConsumer's."""


def consumer(**options: Any) -> dedup.sync.Consumer:
    the_handler = options.pop("handler", handler)
    settings: dict[str, Any] = {
        "topics": ["t"],
        "group_id": "g",
        "config": SERVERS,
        "dsn": "postgresql://localhost/x",
        **options,
    }
    return dedup.sync.Consumer(the_handler, **settings)


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"handler": async_handler}, r"^handler=.* is async: dedup.sync.Consumer calls a block"),
        ({"handler": "apply"}, r"^handler='apply' is not callable"),
        ({"dsn": None}, r"pass exactly one of dsn= or connection="),
        ({"connection": object()}, r"pass exactly one of dsn= or connection="),
        ({"topics": "t"}, r"^topics must be a non-empty list"),
        ({"group_id": ""}, r"^group_id must be set"),
        ({"key": dedup.keys.json_field}, r"^key=json_field: that makes a strategy"),
        ({"batch_size": 0}, r"^batch_size=0"),
        ({"max_attempts": 0}, r"^max_attempts=0"),
        ({"handler_timeout": 0}, r"^handler_timeout=0"),
        ({"kafka_commit_interval": -1}, r"^kafka_commit_interval=-1"),
        ({"on_conflict": "ignore"}, r"^on_conflict='ignore': expected"),
        ({"config": {}}, r"^config: set 'bootstrap.servers'"),
        ({"config": "127.0.0.1:9092"}, r"^config='127.0.0.1:9092': expected confluent-kafka's"),
        ({"config": {**SERVERS, "group.id": "other"}}, r"^config: 'group.id' is 'other' but"),
        (
            {"config": {**SERVERS, "enable.auto.commit": True}},
            r"^config: 'enable.auto.commit'=True: dedup stores offsets in Postgres",
        ),
        ({"schema": "no-such schema!"}, r"schema"),
        ({"concurrency": 0}, r"^concurrency=0: expected a whole number from 1 to 64"),
        ({"concurrency": 2.5}, r"^concurrency=2.5: expected a whole number"),
        (
            {"connection": "x", "dsn": None, "concurrency": 2},
            r"^concurrency=2: the lanes run on connections of their own; with connection=",
        ),
        (
            {"connection": "x", "dsn": None, "connect_options": {"a": 1}},
            r"^connect_options configure the connection dedup opens for dsn=",
        ),
    ],
)
def test_a_bad_setting_is_refused_naming_it(options: dict[str, Any], error: str) -> None:
    with pytest.raises(dedup.ConfigurationError, match=error):
        consumer(**options)


def test_the_offsets_are_left_to_postgres_and_the_rest_is_the_callers() -> None:
    made = sync_consumer._kafka_config(
        {**SERVERS, "isolation.level": "read_uncommitted", "session.timeout.ms": 3000},
        "g",
        "holder-1",
    )
    assert made == {
        **SERVERS,
        "group.id": "g",
        "client.id": "holder-1",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "isolation.level": "read_uncommitted",  # the caller's, over dedup's default
        "auto.offset.reset": "earliest",
        "session.timeout.ms": 3000,
    }
    assert not sync_consumer._cooperative(made)
    assert sync_consumer._cooperative({"partition.assignment.strategy": "cooperative-sticky"})


def test_a_batch_handler_is_found_from_its_annotation() -> None:
    def batch(msgs: list[dedup.Message], tx: dedup.sync.Tx) -> None:
        """A batch handler."""

    assert consumer(handler=batch).batch_handler
    assert not consumer().batch_handler
    assert consumer(batch=True).batch_handler


def test_the_lanes_are_the_async_consumers_by_default_and_one_on_a_given_connection() -> None:
    def batch(msgs: list[dedup.Message], tx: dedup.sync.Tx) -> None:
        """A batch handler."""

    assert consumer(handler=batch).concurrency == 4
    assert consumer().concurrency == 1, "a per-message handler batches instead"
    assert consumer(batch_size=1).concurrency == 4
    assert consumer(concurrency=3).concurrency == 3
    assert consumer(handler=batch, connection="x", dsn=None).concurrency == 1
