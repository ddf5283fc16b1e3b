"""The lock wait of a batch on a shared lane, on a real Postgres: it gives up well before
Postgres's deadlock check would run, and it is set for that transaction only."""

from __future__ import annotations

import time
from typing import Any

import asyncpg
import pytest

import dedup
from dedup import _lanes as lanes
from dedup import _store as store


def one_message() -> dedup.Message:
    return dedup.Message(
        topic="t",
        partition=0,
        offset=0,
        key=None,
        value=b"{}",
        headers={},
        timestamp=0,
        idempotency_key="k",
    )


async def bump(msg: dedup.Message, tx: dedup.Tx) -> None:
    await tx.conn.execute("UPDATE hot SET n = n + 1 WHERE id = 1")


async def test_a_batch_on_a_shared_lane_gives_up_a_lock_wait_before_the_deadlock_check(
    pool: Any,
) -> None:
    await pool.execute("CREATE TABLE hot (id int PRIMARY KEY, n int NOT NULL)")
    await pool.execute("INSERT INTO hot VALUES (1, 0)")
    writes = store.Store(schema="dedup", namespace="lanes")
    async with pool.acquire() as holder, pool.acquire() as waiter:
        held = holder.transaction()
        await held.start()
        await holder.execute("UPDATE hot SET n = n + 1 WHERE id = 1")
        started = time.monotonic()
        with pytest.raises(asyncpg.LockNotAvailableError) as caught:
            async with waiter.transaction():
                await writes.apply(
                    waiter,
                    [one_message()],
                    handler=bump,
                    batch_handler=False,
                    fence=None,
                    lock_timeout=lanes.LOCK_WAIT,
                )
        waited = time.monotonic() - started
        await held.rollback()
        # Postgres's deadlock_timeout is 1 s: four tangled lanes would take seconds.
        assert lanes.LOCK_WAIT <= waited < 1.0
        assert lanes.contended(caught.value, shared=True)
        # The setting was the transaction's: the session keeps its own.
        assert await waiter.fetchval("SHOW lock_timeout") == "0"
    assert await pool.fetchval("SELECT n FROM hot") == 0
    assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == 0
