"""Settings checked and defaulted at construction: ``pool_options`` (asyncpg's options for
the pool dedup opens) and the default ``concurrency``."""

from __future__ import annotations

from typing import Any

import pytest

import dedup


async def handler(msg: dedup.Message, tx: dedup.Tx) -> None:
    """Never called: these consumers are only constructed."""


def consumer(**kw: Any) -> dedup.IdempotentConsumer:
    return dedup.IdempotentConsumer(
        handler, topics=["t"], group_id="g", bootstrap_servers="127.0.0.1:1", **kw
    )


def test_asyncpg_options_are_taken_for_dedups_own_pool() -> None:
    consumer(dsn="postgresql://db/x", pool_options={"statement_cache_size": 0})
    dedup.TaskRunner(dsn="postgresql://db/x", pool_options={"statement_cache_size": 0})


@pytest.mark.parametrize("make", [consumer, dedup.TaskRunner])
def test_pool_options_with_a_pool_of_yours_are_refused(make: Any) -> None:
    with pytest.raises(dedup.ConfigurationError, match="with pool=, pass them to asyncpg"):
        make(pool=object(), pool_options={"statement_cache_size": 0})


@pytest.mark.parametrize("make", [consumer, dedup.TaskRunner])
@pytest.mark.parametrize("name", ["statement_cache", "max_size", "init"])
def test_unknown_options_and_the_pools_size_are_refused_by_name(make: Any, name: str) -> None:
    with pytest.raises(dedup.ConfigurationError, match=f"pool_options: {name} not accepted"):
        make(dsn="postgresql://db/x", pool_options={name: 0})


async def batch_handler(msgs: list[dedup.Message], tx: dedup.Tx) -> None:
    """Never called: these consumers are only constructed."""


@pytest.mark.parametrize(
    ("handler_", "options", "lanes"),
    [
        (batch_handler, {}, 4),
        (batch_handler, {"batch_size": 1}, 4),
        (handler, {}, 1),  # its turns' messages lock rows in offset order: one lane
        (handler, {"batch_size": 1}, 4),  # a message a transaction: the handler's own order
        (handler, {"concurrency": 3}, 3),
    ],
)
def test_the_default_concurrency_follows_the_handler_and_the_batch_size(
    handler_: Any, options: dict[str, Any], lanes: int
) -> None:
    made = dedup.IdempotentConsumer(
        handler_,
        topics=["t"],
        group_id="g",
        bootstrap_servers="127.0.0.1:1",
        dsn="postgresql://db/x",
        **options,
    )
    assert made.config.concurrency == lanes
