"""``dedup.wrap`` in a hand-written aiokafka loop, and configuration that fails fast."""

from __future__ import annotations

import contextlib
from typing import Any

import asyncpg
import orjson
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord

import dedup
from dedup_dev import effects as support
from dedup_dev import helpers
from dedup_dev.kafka import Topics


async def test_wrap_gives_the_same_guarantees_in_your_own_loop(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    values = [
        orjson.dumps({"id": "w1"}),
        orjson.dumps({"id": "w2"}),
        orjson.dumps({"id": "w1"}),  # duplicate
        orjson.dumps({"id": "w2", "changed": True}),  # conflict
        b"not json",  # poison
        orjson.dumps({"id": "w3", "explode": True}),  # handler bug
    ]
    await helpers.produce(bootstrap_servers, topic, [(None, v) for v in values])
    handle = dedup.wrap(
        support.record_effect, pool=pool, namespace="wrapped", key=dedup.keys.json_field("id")
    )

    async def consume_all() -> list[Any]:
        outcomes: list[Any] = []
        consumer = AIOKafkaConsumer(
            topic,
            bootstrap_servers=bootstrap_servers,
            group_id=f"g-{topic}",
            auto_offset_reset="earliest",
            enable_auto_commit=False,
        )
        await consumer.start()
        try:
            while len(outcomes) < len(values):
                for records in (await consumer.getmany(timeout_ms=500)).values():
                    for record in records:
                        try:
                            outcomes.append(await handle(record))
                        except RuntimeError as exc:
                            outcomes.append(exc)
        finally:
            await consumer.stop()  # offsets never committed: the next run replays all
        return outcomes

    first = await consume_all()
    assert first[:5] == [
        dedup.Outcome.PROCESSED,
        dedup.Outcome.PROCESSED,
        dedup.Outcome.DUPLICATE,
        dedup.Outcome.CONFLICT,
        dedup.Outcome.DEAD_LETTERED,
    ]
    assert isinstance(first[5], RuntimeError), "a handler error propagates to your loop"
    # The whole topic again, as after a crash before any offset commit.
    replay = await consume_all()
    assert replay[:4] == [dedup.Outcome.DUPLICATE] * 3 + [dedup.Outcome.CONFLICT]
    assert replay[4] == dedup.Outcome.DEAD_LETTERED
    assert await support.effect_counts(pool) == (2, 2)
    assert (
        await pool.fetchval("SELECT count(*) FROM dedup.processed WHERE idempotency_key = 'w3'")
        == 0
    ), "the failed handler's claim rolled back with it"
    assert await pool.fetchval("SELECT count(*) FROM dedup.dead_letters") == 2


async def test_a_handler_that_swallows_a_failed_statement_is_no_success(pool: Any) -> None:
    """The failed statement aborted the transaction: its COMMIT rolls back, and wrap says so."""
    await pool.execute("CREATE TABLE swallowed (id text)")

    async def swallow(msg: dedup.Message, tx: dedup.Tx) -> None:
        await tx.conn.execute("INSERT INTO swallowed VALUES ($1)", msg.json()["id"])
        with contextlib.suppress(asyncpg.DataError):
            await tx.conn.execute("SELECT 1 / 0")

    handle = dedup.wrap(swallow, pool=pool, namespace="swallow", key=dedup.keys.json_field("id"))
    record = ConsumerRecord("t", 0, 0, 0, 0, None, orjson.dumps({"id": "s1"}), None, 0, 0, ())
    with pytest.raises(dedup.HandlerError, match="the transaction was aborted by a statement"):
        await handle(record)
    assert await pool.fetchval("SELECT count(*) FROM swallowed") == 0
    assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == 0, "nor its claim"
    # The same record with a handler that doesn't fail: applied, as if for the first time.
    handle = dedup.wrap(
        support.record_effect, pool=pool, namespace="swallow", key=dedup.keys.json_field("id")
    )
    await pool.execute(support.EFFECTS)
    assert await handle(record) == dedup.Outcome.PROCESSED


def consumer_with(**overrides: Any) -> dedup.IdempotentConsumer:
    options: dict[str, Any] = {
        "topics": ["t"],
        "group_id": "g",
        "bootstrap_servers": "127.0.0.1:1",
        "dsn": "postgresql://nobody@127.0.0.1:1/none",
        "install_signal_handlers": False,
        **overrides,
    }
    return dedup.IdempotentConsumer(support.record_effect, **options)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"schema": "Robert'); DROP TABLE x;--"}, "invalid schema name"),
        ({"batch_size": 0}, "batch_size=0"),
        ({"concurrency": 0}, "concurrency=0"),
        ({"on_conflict": "ignore"}, "on_conflict='ignore'"),
        ({"on_missing_key": "skip"}, "on_missing_key='skip'"),
        ({"enable_auto_commit": True}, "enable_auto_commit=True"),
        ({"isolation_level": "read_comitted"}, "isolation_level='read_comitted'"),
        ({"auto_ofset_reset": "earliest"}, "auto_ofset_reset"),
        ({"topics": "payments"}, "topics must be a non-empty list"),
        ({"pool": object()}, "exactly one of dsn= or pool="),
    ],
)
def test_bad_settings_fail_at_construction_naming_the_setting(
    overrides: dict[str, Any], named: str
) -> None:
    with pytest.raises(dedup.ConfigurationError) as info:
        consumer_with(**overrides)
    assert named in str(info.value)


async def test_unreachable_postgres_fails_fast_naming_the_dsn() -> None:
    with pytest.raises(dedup.ServiceUnavailableError, match=r"127\.0\.0\.1:1/none"):
        await consumer_with().run()


async def test_unmigrated_database_says_to_run_migrate(bootstrap_servers: str, dsn: str) -> None:
    consumer = consumer_with(dsn=dsn, bootstrap_servers=bootstrap_servers, schema="elsewhere")
    with pytest.raises(dedup.ConfigurationError, match="run `dedup migrate"):
        await consumer.run()


async def test_unreachable_kafka_fails_fast_naming_the_servers(dsn: str) -> None:
    consumer = consumer_with(dsn=dsn, request_timeout_ms=2000)
    with pytest.raises(dedup.ServiceUnavailableError, match=r"127\.0\.0\.1:1"):
        await consumer.run()


async def test_unknown_topic_fails_fast_naming_it(bootstrap_servers: str, dsn: str) -> None:
    consumer = consumer_with(dsn=dsn, bootstrap_servers=bootstrap_servers, topics=["no-such"])
    with pytest.raises(dedup.ConfigurationError, match="'no-such' not found"):
        await consumer.run()
