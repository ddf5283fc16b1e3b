"""dedup_services.statements: one statement per account and business date, however often fired.

Runners race in process, then as the same cron line on four "machines"
(``dedup task run dedup_services.statements:job`` three times and ``dedup run
dedup_services.statements`` once, at the same moment).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest
from dedup_services import service, statements

import dedup
from dedup_dev import service_process as service_support

DAY = "2026-11-30"

LEDGER = [
    # (payment, account, amount, date, status)
    ("p1", "acc-1", 300, "2026-11-02", "applied"),
    ("p2", "acc-1", 200, "2026-11-30", "applied"),
    ("p3", "acc-1", 999, "2026-11-15", "rejected"),
    ("p4", "acc-2", 60, "2026-11-20", "applied"),
    ("p5", "acc-2", 70, "2026-10-31", "applied"),  # last month
    ("p6", "acc-3", 80, "2026-12-01", "applied"),  # next month
]


async def ledger(pool: Any) -> None:
    """The payments service's tables and its ledger, as it left them."""
    await service.migrate(pool, ("payments", "statements"))
    await pool.executemany(
        "INSERT INTO payments.payments (payment_id, account, amount, business_date, status, token)"
        " VALUES ($1, $2, $3, $4, $5, 1)",
        [(p, a, n, dt.date.fromisoformat(d), s) for p, a, n, d, s in LEDGER],
    )


async def written(pool: Any) -> list[tuple[str, int, int, int, int]]:
    rows = await pool.fetch(
        "SELECT account, payments, rejected, total, fence_token FROM statements.statements"
        " WHERE business_date = $1 ORDER BY account",
        dt.date.fromisoformat(DAY),
    )
    return [tuple(r) for r in rows]


async def test_racing_runners_write_one_statement_per_account(pool: Any) -> None:
    await ledger(pool)
    runners = [dedup.TaskRunner(pool=pool, holder=f"machine-{i}") for i in range(3)]
    outcomes = await asyncio.gather(
        *(r.run(statements.TASK, DAY, statements.job, lease_ttl=10) for r in runners)
    )
    statuses = sorted(o.status for o in outcomes)
    assert statuses[-1] == "succeeded" and set(statuses[:-1]) <= {"skipped_done", "skipped_running"}
    assert await written(pool) == [("acc-1", 2, 1, 500, 1), ("acc-2", 1, 0, 60, 1)]
    ran = next(o for o in outcomes if o.status == "succeeded")
    assert ran.result == {"statements": 2, "total": 560}

    # Fired again: nothing runs.  Forced by an operator: the same rows, the next token.
    again = await runners[0].run(statements.TASK, DAY, statements.job)
    assert again.status == "skipped_done"
    forced = await runners[1].run(statements.TASK, DAY, statements.job, force=True)
    assert (forced.status, forced.token) == ("succeeded", 2)
    assert await written(pool) == [("acc-1", 2, 1, 500, 2), ("acc-2", 1, 0, 60, 2)]
    assert (await dedup.reconcile(pool, statements.RECONCILE, DAY)).ok


async def test_a_superseded_run_cannot_overwrite_the_statements(pool: Any) -> None:
    await ledger(pool)
    runner = dedup.TaskRunner(pool=pool)
    await runner.run(statements.TASK, DAY, statements.job)
    await runner.run(statements.TASK, DAY, statements.job, force=True)
    # A late write under token 1, after the run under token 2 wrote.
    with pytest.raises(dedup.StaleTokenError, match="newer fencing token than 1"):
        async with pool.acquire() as conn, conn.transaction():
            await statements.write_statements(
                conn, dt.date.fromisoformat(DAY), 1, "task:statements:" + DAY
            )
    assert {row[-1] for row in await written(pool)} == {2}


async def test_the_same_cron_line_on_four_machines_runs_once(dsn: str, pool: Any) -> None:
    await ledger(pool)
    env = service_support.environment(dsn)
    task_run = (
        "task",
        "run",
        "dedup_services.statements:job",
        "--task",
        "statements",
        "--key",
        DAY,
    )
    fired = await asyncio.gather(
        *(service_support.run(*task_run, env=env) for _ in range(3)),
        service_support.run("run", "dedup_services.statements", "--date", DAY, env=env),
    )
    codes = sorted(code for code, _, _ in fired)
    assert codes[0] == 0 and set(codes[1:]) <= {3, 4}, fired
    assert sum("statements key 2026-11-30: succeeded (token 1" in out for _, out, _ in fired) == 1
    assert await written(pool) == [("acc-1", 2, 1, 500, 1), ("acc-2", 1, 0, 60, 1)]
    started = await pool.fetchval(
        "SELECT count(*) FROM dedup.events WHERE namespace = 'statements' AND kind = 'task_started'"
    )
    assert started == 1
