"""A renewal that fails inside asyncpg's client, not the server or the socket, is a failed one.

After a long pause (SIGSTOP) the server may already have cut the watchdog's
session (idle-in-transaction timeout) when the watchdog sends its next
statement; asyncpg then raises ``InternalClientError`` ("cannot switch to state
15; another operation (2) is in progress") rather than ``InterfaceError``.
Found by the chaos suite (tasks scenario, seed 11 of the full matrix): the
watchdog task died with the error, the job ran on unguarded and the runner
process crashed with a traceback instead of reporting its lost lease.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

import dedup
from dedup import _leases as leases


async def test_a_client_error_during_renewal_loses_the_lease_cleanly(
    pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken_renew(self: leases.Leases, lease: leases.Lease, **kwargs: Any) -> Any:
        raise asyncpg.InternalClientError(
            "cannot switch to state 15; another operation (2) is in progress"
        )

    monkeypatch.setattr(leases.Leases, "renew", broken_renew)
    cancelled = asyncio.Event()

    async def job(run: dedup.TaskRun) -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    runner = dedup.TaskRunner(pool=pool, holder="w")
    outcome = await asyncio.wait_for(runner.run("report", "k", job, lease_ttl=1), 10)

    assert cancelled.is_set(), "the job was stopped when the lease could not be renewed"
    assert outcome.status == "failed"
    assert "could not be renewed" in (outcome.error or "")
    kinds = await pool.fetch("SELECT kind FROM dedup.events WHERE kind = 'lease_lost'")
    assert len(kinds) == 1
