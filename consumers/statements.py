"""statements: the month-end statement, once per business date, however many machines fire it.

For business date D, one ``statements.statements`` row per account that has
payments in the payments service's ledger (``payments.payments``) from the
first of D's month to D: applied and rejected counts and the applied total.

It is a run-once task (task code ``statements``, business key D).  Put the same
line in cron on every machine::

    dedup task run consumers.statements:job --task statements --key 2026-11-30

or ``dedup run consumers.statements --date 2026-11-30``, which runs the same
job and also applies the migrations and installs the OpenTelemetry SDK.  The
first runner takes the lease and writes; the others exit 4 (running
elsewhere) or 3 (already done).  Exit codes are those of ``dedup task run``.

The rows are written in one statement stamped with the run's fencing token,
and only over rows whose token is not newer: a run that was paused and
superseded is refused, and the task is marked succeeded in the same
transaction as its rows.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import signal
import sys
from typing import Any

import asyncpg

import dedup
from consumers import service

TASK = "statements"

EXIT_CODES = {"succeeded": 0, "failed": 1, "skipped_done": 3, "skipped_running": 4}
"""Those of ``dedup task run``."""

WRITE = """
WITH activity AS (
    SELECT account,
           count(*) FILTER (WHERE status = 'applied') AS payments,
           count(*) FILTER (WHERE status = 'rejected') AS rejected,
           coalesce(sum(amount) FILTER (WHERE status = 'applied'), 0) AS total
      FROM payments.payments
     WHERE business_date BETWEEN date_trunc('month', $1::date)::date AND $1
     GROUP BY account
), written AS (
    INSERT INTO statements.statements AS s
           (business_date, account, period_start, payments, rejected, total, fence_token)
    SELECT $1, account, date_trunc('month', $1::date)::date, payments, rejected, total, $2
      FROM activity
    ON CONFLICT (business_date, account) DO UPDATE
       SET period_start = EXCLUDED.period_start, payments = EXCLUDED.payments,
           rejected = EXCLUDED.rejected, total = EXCLUDED.total,
           fence_token = EXCLUDED.fence_token, written_at = now()
     WHERE s.fence_token <= EXCLUDED.fence_token
    RETURNING total
)
SELECT (SELECT count(*) FROM activity) AS accounts, count(*) AS written,
       coalesce(sum(total), 0)::bigint AS total
  FROM written
"""

RECONCILE = dedup.ReconcileCheck(
    task=TASK,
    source="""
        SELECT count(DISTINCT account),
               coalesce(sum(amount) FILTER (WHERE status = 'applied'), 0)
          FROM payments.payments
         WHERE business_date BETWEEN date_trunc('month', $1::date)::date AND $1""",
    result="SELECT count(*), coalesce(sum(total), 0) FROM statements.statements"
    " WHERE business_date = $1",
    source_label="accounts with payments, month to date",
    result_label="statements written",
    description="accounts with payments in the month to date vs statements written for the date",
)


async def write_statements(
    conn: asyncpg.Connection, day: dt.date, token: int, resource: str
) -> dict[str, int]:
    """Write the statements of ``day`` under ``token``; StaleTokenError if a newer run wrote."""
    row = await conn.fetchrow(WRITE, day, token)
    if row["written"] < row["accounts"]:
        raise dedup.StaleTokenError(
            resource,
            token,
            f"statements of {day} were written by a run newer than fencing token {token}; "
            "this run is stale and stops",
        )
    return {"statements": row["written"], "total": row["total"]}


async def job(run: dedup.TaskRun) -> dict[str, int]:
    """The task: ``dedup task run consumers.statements:job --task statements --key DATE``."""
    try:
        day = dt.date.fromisoformat(run.business_key)
    except ValueError as exc:
        raise ValueError(f"business key {run.business_key!r}: expected YYYY-MM-DD") from exc
    try:
        async with run.transaction() as conn:
            result = await write_statements(conn, day, run.token, run.resource)
            await run.complete(conn, result)
    except asyncpg.UndefinedTableError as exc:
        raise RuntimeError(
            f"{exc}: apply the migrations first: dedup run consumers.statements --migrate-only"
        ) from exc
    return result


def _day(text: str) -> str:
    try:
        return dt.date.fromisoformat(text).isoformat()
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid date {text!r}: expected YYYY-MM-DD") from None


def parser() -> argparse.ArgumentParser:
    """The flags of ``dedup run consumers.statements``."""
    p = service.parser(TASK, __doc__ or "")
    group = p.add_argument_group("task")
    group.add_argument("--date", type=_day, help="the business date (the task's key), YYYY-MM-DD")
    group.add_argument("--force", action="store_true", help="run even if it already succeeded")
    group.add_argument("--ttl", type=float, default=30.0, help="lease seconds (default: 30)")
    group.add_argument("--holder", help="this runner's name (default: hostname:pid)")
    group.add_argument(
        "--max-attempts", type=int, default=3, help="runs of a failing task (default: 3)"
    )
    return p


async def main(argv: list[str]) -> int:
    """``dedup run consumers.statements --date YYYY-MM-DD [options]``."""
    args = parser().parse_args(argv)
    if args.date is None and not args.migrate_only:
        raise dedup.ConfigurationError("--date YYYY-MM-DD is required")
    async with service.started(args, TASK, ("payments", TASK)) as go_on:
        if not go_on:
            return 0
        outcome = await _run(args)
    if outcome is None:
        print(f"statements {args.date}: interrupted; the task is marked failed", file=sys.stderr)
        return EXIT_CODES["failed"]
    forced = ", forced" if outcome.forced else ""
    print(
        f"task {TASK} key {outcome.business_key}: {outcome.status} (token {outcome.token}, "
        f"attempt {outcome.attempts}, holder {outcome.holder}{forced})"
    )
    if outcome.error:
        print(f"statements: {outcome.error}", file=sys.stderr)
    return EXIT_CODES[outcome.status]


async def _run(args: argparse.Namespace) -> Any:
    """The run's outcome, or None when SIGTERM or SIGINT cancelled it (the task is then failed)."""
    loop = asyncio.get_running_loop()
    current = asyncio.current_task()
    assert current is not None  # noqa: S101 (asyncio.run gives us a task)
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, current.cancel)
    try:
        async with dedup.TaskRunner(
            dsn=args.dsn,
            holder=args.holder,
            schema_name=args.schema,
            max_attempts=args.max_attempts,
        ) as runner:
            return await runner.run(TASK, args.date, job, lease_ttl=args.ttl, force=args.force)
    except asyncio.CancelledError:
        current.uncancel()
        return None
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
