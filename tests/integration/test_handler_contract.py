"""What a handler hands back and leaves behind: a forgotten ``await`` is a handler failure,
never a claimed key, and what a handler sets on its session ends with its transaction.

Each test reproduces a way a record used to be lost or another record blamed, and
checks what a user sees: effects rows, dead letters, claimed keys, stats.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import dedup
from dedup_dev import consumer_process as processes
from dedup_dev import effects as support
from dedup_dev import helpers
from dedup_dev.kafka import Topics
from tests.integration.test_handlers import (
    claimed_without_effect,
    dead_letter_reasons,
    item,
    run_until_settled,
    settled,
)

INSERT = (
    'INSERT INTO effects (key, payload, token, "partition", "offset") VALUES ($1, $2, $3, $4, $5)'
)


def _effect_args(msg: dedup.Message, tx: dedup.Tx) -> tuple[Any, ...]:
    return (INSERT, msg.idempotency_key, msg.json(), tx.token, msg.partition, msg.offset)


async def _returns_the_statement(msg: dedup.Message, tx: dedup.Tx) -> object:
    if msg.idempotency_key == "m3":
        return tx.conn.execute(*_effect_args(msg, tx))  # the missing `await`
    await tx.conn.execute(*_effect_args(msg, tx))
    return None


async def _forgets_the_statement(msg: dedup.Message, tx: dedup.Tx) -> None:
    if msg.idempotency_key == "m3":
        tx.conn.execute(*_effect_args(msg, tx))  # the bug under test
        return
    await tx.conn.execute(*_effect_args(msg, tx))


async def _returns_a_task(msg: dedup.Message, tx: dedup.Tx) -> object:
    if msg.idempotency_key == "m3":
        return asyncio.ensure_future(asyncio.sleep(0))
    await tx.conn.execute(*_effect_args(msg, tx))
    return None


@pytest.mark.parametrize("batch_size", [1, 500])
@pytest.mark.parametrize(
    ("handler", "said"),
    [
        (_returns_the_statement, "returned coroutine"),
        (_forgets_the_statement, "without awaiting it"),
        (_returns_a_task, "returned Task"),
    ],
    ids=["returns-coroutine", "forgets-await", "returns-task"],
)
async def test_a_missing_await_is_a_handler_failure_not_a_claimed_key(
    handler: Any, said: str, batch_size: int, bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    await helpers.produce(bootstrap_servers, topic, [(None, item(i)) for i in range(10)])
    consumer = support.consumer(handler, topic, bootstrap_servers, pool, batch_size=batch_size)
    await run_until_settled(consumer, pool, topic, 10)

    keys = sorted(r["key"] for r in await pool.fetch("SELECT key FROM effects"))
    assert keys == sorted(f"m{i}" for i in range(10) if i != 3), "each other effect once"
    reasons = await dead_letter_reasons(pool)
    assert list(reasons) == ["m3"], reasons
    assert said in reasons["m3"] and "await" in reasons["m3"]
    assert await claimed_without_effect(pool) == [], "no key claimed without its write"
    claimed = await pool.fetchval(
        "SELECT count(*) FROM dedup.processed WHERE idempotency_key = 'm3'"
    )
    assert claimed == 0, "the forgotten message's key is not claimed: a redelivery applies it"
    assert consumer.stats["dead_lettered"] == 1 and consumer.stats["processed"] == 9


@pytest.mark.parametrize(
    "statement",
    [
        "SET search_path = nowhere",
        "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY",
        "SET ROLE {role}",
    ],
    ids=["search-path", "read-only", "role"],
)
async def test_a_handlers_session_settings_end_with_its_transaction(
    statement: str, bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    role = f"nobody_{topic.replace('-', '_')}"[:60]
    await pool.execute(f'CREATE ROLE "{role}" NOLOGIN')  # may touch none of our tables
    try:
        await helpers.produce(bootstrap_servers, topic, [(None, item(i)) for i in range(10)])

        async def sets_its_session(msg: dedup.Message, tx: dedup.Tx) -> None:
            await support.record_effect(msg, tx)
            if msg.idempotency_key == "m2":
                await tx.conn.execute(statement.format(role=f'"{role}"'))

        # One message per transaction, all on one lane: m2's setting would meet m3..m9.
        consumer = support.consumer(
            sets_its_session, topic, bootstrap_servers, pool, batch_size=1, concurrency=1
        )
        await run_until_settled(consumer, pool, topic, 10)
    finally:
        await pool.execute(f'DROP ROLE "{role}"')

    keys = sorted(r["key"] for r in await pool.fetch("SELECT key FROM effects"))
    assert keys == sorted(f"m{i}" for i in range(10)), "every message applied once"
    assert await dead_letter_reasons(pool) == {}, "nobody blamed for m2's setting"
    assert consumer.stats["processed"] == 10


@pytest.mark.parametrize("how", ["system-exit", "keyboard-interrupt", "kill"])
async def test_a_message_that_ends_the_process_is_dead_lettered_after_max_attempts_restarts(
    how: str, bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    """m5 ends the process whenever it is handled: in a batch of 20 first, then alone.

    max_attempts is 3: three runs end, the fourth (the third restart) dead-letters m5
    unhandled and applies the rest; the messages after it lost no attempt of theirs.
    """
    topic = await topics.create()
    await helpers.produce(bootstrap_servers, topic, [(None, item(i)) for i in range(20)])
    args = [
        *("--dsn", dsn, "--bootstrap-servers", bootstrap_servers, "--topic", topic),
        *("--group", f"g-{topic}", "--batch-size", "100", "--exit-on", "m5"),
        *("--exit-how", how),
    ]
    codes = []
    for _ in range(3):
        async with processes.started(*args) as child:
            await child.expect("EXITING", within=60)
            codes.append(await child.wait(within=30))
    assert all(code != 0 for code in codes), codes
    assert await pool.fetchval("SELECT count(*) FROM effects WHERE key = 'm5'") == 0

    async with processes.started(*args) as child:
        await helpers.wait_for(
            lambda: settled(pool, topic, 20), within=60, what="the fourth run passes m5"
        )
        assert await child.stop() == 0
        assert "EXITING" not in child.stdout

    keys = sorted(r["key"] for r in await pool.fetch("SELECT key FROM effects"))
    assert keys == sorted(f"m{i}" for i in range(20) if i != 5), "the others once each"
    letter = await pool.fetchrow(
        "SELECT reason, error, attempts FROM dedup.dead_letters WHERE idempotency_key = 'm5'"
    )
    assert letter is not None and letter["attempts"] == 3
    assert "process ended 3 times" in letter["reason"], letter["reason"]
    assert await claimed_without_effect(pool) == []
