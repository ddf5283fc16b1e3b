"""``dedup.Leases``: tokens, expiry by the database clock, the fence, the watchdog."""

from __future__ import annotations

import datetime as dt
import signal
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import dedup
from dedup import _leases as leases
from dedup_dev import helpers, task_jobs, task_worker
from tests.integration.test_tracing import series

SIX_HOURS = 6 * 3600.0


async def db_now(pool: Any) -> dt.datetime:
    return await pool.fetchval("SELECT clock_timestamp()")  # type: ignore[no-any-return]


async def lease_events(pool: Any, resource: str) -> list[tuple[str, str, int]]:
    rows = await pool.fetch(
        "SELECT kind, holder, token FROM dedup.events WHERE resource = $1 ORDER BY id", resource
    )
    return [(r["kind"], r["holder"], r["token"]) for r in rows]


async def test_tokens_only_grow_and_a_live_lease_excludes_everyone(pool: Any) -> None:
    book = dedup.Leases(pool)
    before = await db_now(pool)
    first = await book.acquire("r", "a", 5)
    assert first is not None and first.token == 1
    # Times are the database's: the lease lasts exactly its ttl from the server's now.
    assert first.expires_at - first.acquired_at == dt.timedelta(seconds=5)
    assert before <= first.acquired_at <= await db_now(pool)

    # Live: nobody else, and not the same holder name either (holders are not re-entrant).
    assert await book.acquire("r", "b", 5) is None
    assert await book.acquire("r", "a", 5) is None
    assert await book.current("r") == dedup.Lease(
        "r", "a", 1, 5.0, first.acquired_at, first.renewed_at, first.expires_at
    )

    renewed = await book.renew(first)
    assert renewed.token == 1 and renewed.expires_at > first.expires_at
    assert await book.release(renewed)
    assert await book.current("r") is None
    second = await book.acquire("r", "b", 5)
    assert second is not None and second.token == 2
    assert not await book.release(renewed), "a released lease can't be released again"

    assert await lease_events(pool, "r") == [
        ("lease_acquired", "a", 1),
        ("lease_renewed", "a", 1),
        ("lease_released", "a", 1),
        ("lease_acquired", "b", 2),
    ]


async def test_after_expiry_the_old_token_is_refused_inside_the_callers_transaction(
    pool: Any,
) -> None:
    await pool.execute("CREATE TABLE ledger (note text NOT NULL)")
    book = dedup.Leases(pool)
    old = await book.acquire("r", "a", 0.3)
    assert old is not None

    new = await helpers.wait_for(
        lambda: book.acquire("r", "b", 5), within=10, what="the expired lease to be taken"
    )
    assert new.token == old.token + 1

    async with pool.acquire() as conn:
        with pytest.raises(dedup.StaleTokenError, match="'b' took over with token 2") as err:
            async with conn.transaction():
                await conn.execute("INSERT INTO ledger VALUES ('written by the old holder')")
                await book.check(conn, old)
        assert (err.value.resource, err.value.token) == ("r", 1)
        async with conn.transaction():
            await conn.execute("INSERT INTO ledger VALUES ('written by the new holder')")
            await book.check(conn, new)
    assert await pool.fetch("SELECT note FROM ledger") == [("written by the new holder",)]

    with pytest.raises(dedup.StaleTokenError):
        await book.renew(old)
    # The fence needs the transaction whose writes it guards.
    async with pool.acquire() as conn:
        with pytest.raises(dedup.ConfigurationError, match="inside the transaction"):
            await book.check(conn, new)


async def test_an_expired_lease_is_stale_even_before_anyone_takes_over(pool: Any) -> None:
    book = dedup.Leases(pool)
    lease = await book.acquire("r", "a", 0.2)
    assert lease is not None

    async def expired() -> bool:
        return bool(await pool.fetchval("SELECT expires_at <= clock_timestamp() FROM dedup.leases"))

    await helpers.wait_for(expired, within=5, what="the lease to expire by the database clock")
    with pytest.raises(dedup.StaleTokenError, match="expired before it was renewed"):
        await book.renew(lease)
    async with pool.acquire() as conn, conn.transaction():
        with pytest.raises(dedup.StaleTokenError):
            await book.check(conn, lease)


async def test_watchdog_keeps_the_lease_and_tells_the_holder_when_it_cannot(
    pool: Any, metric_reader: InMemoryMetricReader
) -> None:
    book = dedup.Leases(pool)
    lease = await book.acquire("r", "a", 1)
    assert lease is not None
    lost: list[tuple[dedup.Lease, dedup.StaleTokenError]] = []

    async def renewals() -> bool:
        kinds = [k for k, _, _ in await lease_events(pool, "r")]
        return kinds.count("lease_renewed") >= 4

    async with book.watch(lease, lambda lease, err: lost.append((lease, err))) as watchdog:
        # The losses' counter exists (at 0 in a fresh process) from the first watch on.
        losses = series(metric_reader, {})["dedup.lease.losses"]
        # Four renewals span well over the ttl: the lease stayed the holder's throughout.
        await helpers.wait_for(renewals, within=10, what="four renewals")
        assert await book.acquire("r", "b", 5) is None
        assert not lost

        # Stall the database for this row (a lock held elsewhere): renewals can't
        # get through, and the holder is told before its lease would run out.
        async with pool.acquire() as blocker, blocker.transaction():
            await blocker.execute("SELECT 1 FROM dedup.leases WHERE resource = 'r' FOR UPDATE")

            async def told() -> bool:
                return bool(lost)

            await helpers.wait_for(told, within=5, what="on_lost to be called")
    assert watchdog.lost is lost[0][1]
    assert lost[0][0].token == 1
    assert "could not be renewed before it expired" in str(lost[0][1])
    assert ("lease_lost", "a", 1) in await lease_events(pool, "r")
    assert series(metric_reader, {})["dedup.lease.losses"] == losses + 1
    taken = await helpers.wait_for(lambda: book.acquire("r", "b", 5), within=5, what="takeover")
    assert taken.token == 2


async def test_fenced_rows_refuse_an_older_token(pool: Any) -> None:
    await pool.execute(
        "CREATE TABLE statements (account text PRIMARY KEY, total numeric NOT NULL,"
        " fence_token bigint NOT NULL)"
    )
    async with pool.acquire() as conn:
        await leases.fenced_upsert(
            conn, "statements", {"account": "A1"}, {"total": 10}, token=2, resource="r"
        )
        with pytest.raises(dedup.StaleTokenError, match="newer fencing token than 1"):
            await leases.fenced_upsert(
                conn, "statements", {"account": "A1"}, {"total": 99}, token=1, resource="r"
            )
        await leases.fenced_upsert(
            conn, "public.statements", {"account": "A1"}, {"total": 12}, token=2, resource="r"
        )
        await leases.fenced_upsert(
            conn, "statements", {"account": "A1"}, {"total": 13}, token=3, resource="r"
        )
        with pytest.raises(dedup.ConfigurationError, match="invalid table name"):
            await leases.fenced_upsert(
                conn, "statements; drop", {"account": "A1"}, {}, token=3, resource="r"
            )
    assert await pool.fetch("SELECT account, total, fence_token FROM statements") == [("A1", 13, 3)]


async def test_a_worker_whose_clock_is_hours_off_gets_the_same_lease(
    dsn: str, pool: Any, tmp_path: Path
) -> None:
    """Workers six hours fast and six hours slow hold and take over leases like any other.

    How the clock is shifted: each worker is a separate process
    (``dedup_dev.task_worker --clock-offset``) that replaces
    ``time.time``/``time.time_ns``/``datetime.now`` before dedup, asyncpg and the
    job are imported; the job writes what its clock says, which proves the shift.
    Had dedup used the worker's clock, the fast holder's 2 s lease would last six
    hours and the slow one would find it long expired at once.
    """
    await pool.execute(task_jobs.JOB_RUNS)
    opts = ["--dsn", dsn, "--task", "clock", "--key", "k", "--ttl", "2"]
    fast = await task_worker.start(
        "task",
        "run",
        "dedup_dev.task_jobs:hang",
        *opts,
        "--holder",
        "fast",
        clock_offset=SIX_HOURS,
    )

    async def started() -> Any:
        await fast.running()
        return await pool.fetchrow(
            "SELECT token, worker_time - at AS skew, worker_now - at AS skew_now FROM job_runs"
        )

    row = await helpers.wait_for(started, within=20, what="the fast worker's job to start")
    for skew in (row["skew"], row["skew_now"]):
        assert abs(skew - dt.timedelta(hours=6)) < dt.timedelta(minutes=1)

    async def renewed() -> Any:
        return await pool.fetchrow(
            "SELECT acquired_at, renewed_at, expires_at, clock_timestamp() AS now"
            " FROM dedup.leases WHERE renewed_at > acquired_at"
        )

    lease = await helpers.wait_for(renewed, within=10, what="the fast worker to renew")
    assert lease["expires_at"] - lease["renewed_at"] == dt.timedelta(seconds=2)
    assert abs(lease["now"] - lease["acquired_at"]) < dt.timedelta(seconds=10)

    # The slow worker finds the fast one's lease live (exit 4: skipped, running elsewhere).
    slow = ["task", "run", "dedup_dev.task_jobs:record", *opts, "--holder", "slow"]
    code, out, err = await (await task_worker.start(*slow, clock_offset=-SIX_HOURS)).finish()
    assert code == 4, out + err
    assert "skipped_running (token 1, attempt 1, holder fast)" in out

    fast.proc.send_signal(signal.SIGKILL)
    await fast.finish()
    died_at = await db_now(pool)
    expires_at = await pool.fetchval("SELECT expires_at FROM dedup.leases")
    # The dead holder's lease runs out one ttl after its last renewal, by the server's clock.
    assert expires_at - died_at <= dt.timedelta(seconds=2)

    async def expired() -> bool:
        return bool(await pool.fetchval("SELECT expires_at <= clock_timestamp() FROM dedup.leases"))

    await helpers.wait_for(expired, within=5, what="the dead holder's lease to run out")
    code, out, err = await (await task_worker.start(*slow, clock_offset=-SIX_HOURS)).finish()
    assert code == 0, out + err
    took = await pool.fetchrow(
        "SELECT token, worker_time - at AS skew FROM job_runs WHERE token = 2"
    )
    assert abs(took["skew"] + dt.timedelta(hours=6)) < dt.timedelta(minutes=1)
    assert await pool.fetchval("SELECT attempts FROM dedup.tasks") == 2
