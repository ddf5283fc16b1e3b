"""Lanes on a real Postgres: a shared lane stops waiting for another lane's row lock well
before Postgres's deadlock check would run; a lane that runs alone waits."""

from __future__ import annotations

import time
from typing import Any

import asyncpg
import pytest

from dedup import lanes


async def test_a_shared_lane_gives_up_a_lock_wait_before_the_deadlock_check(pool: Any) -> None:
    await pool.execute("CREATE TABLE hot (id int PRIMARY KEY, n int NOT NULL)")
    await pool.execute("INSERT INTO hot VALUES (1, 0)")
    ls = lanes.Lanes(pool, 2, {})
    try:
        async with ls.lane() as first, ls.lane() as second:
            holder = await first.connection()
            waiter = await second.connection()
            held = holder.transaction()
            await held.start()
            await holder.execute("UPDATE hot SET n = n + 1 WHERE id = 1")
            started = time.monotonic()
            with pytest.raises(asyncpg.LockNotAvailableError) as caught:
                async with waiter.transaction():
                    await waiter.execute("UPDATE hot SET n = n + 1 WHERE id = 1")
            waited = time.monotonic() - started
            await held.rollback()
        # Postgres's deadlock_timeout is 1 s: four tangled lanes would take seconds.
        assert lanes.LOCK_WAIT <= waited < 1.0
        assert lanes.contended(caught.value, second.shared)
        ls.deadlocked()  # what the worker does next: the lanes run one at a time
        async with ls.lane() as alone:
            conn = await alone.connection()
            assert not alone.shared
            assert await conn.fetchval("SHOW lock_timeout") == await pool.fetchval(
                "SHOW lock_timeout"
            )
    finally:
        await ls.close()
    assert await pool.fetchval("SELECT n FROM hot") == 0
