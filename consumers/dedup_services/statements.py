"""statements: the month-end statement, once per business date, however many machines fire it.

For business date D, one ``statements.statements`` row per account that has
payments in the payments service's ledger (``payments.payments``) from the
first of D's month to D: applied and rejected counts and the applied total.

It is a run-once task (task code ``statements``, business key D).  Put the same
line in cron on every machine::

    dedup task run dedup_services.statements:job --task statements --key 2026-11-30

or ``dedup run dedup_services.statements --date 2026-11-30``, which runs the same
job and also applies the migrations and installs the OpenTelemetry SDK.  The
first runner takes the lease and writes; the others exit 4 (running
elsewhere) or 3 (already done).  Exit codes are those of ``dedup task run``.
Without cron, a schedule fires it at each month end (``make demo`` does)::

    dedup schedule add statements dedup_services.statements:job --task statements \
        --cron "0 22 L * *"

and ``dedup schedule run`` on any number of machines.

The rows are written with ``dedup.fenced_upsert``, stamped with the run's
fencing token and only over rows whose token is not newer: a run that was
paused and superseded is refused, and the task is marked succeeded in the same
transaction as its rows.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import sys

import asyncpg

import dedup
from dedup_services import service

TASK = "statements"

ACTIVITY = """
SELECT account,
       count(*) FILTER (WHERE status = 'applied') AS payments,
       count(*) FILTER (WHERE status = 'rejected') AS rejected,
       coalesce(sum(amount) FILTER (WHERE status = 'applied'), 0)::bigint AS total
  FROM payments.payments
 WHERE business_date BETWEEN date_trunc('month', $1::date)::date AND $1
 GROUP BY account
 ORDER BY account
"""
"""Each account's payments from the first of the month to the business date."""

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
    total = 0
    activity = await conn.fetch(ACTIVITY, day)
    for row in activity:
        await dedup.fenced_upsert(
            conn,
            "statements.statements",
            {"business_date": day, "account": row["account"]},
            {
                "period_start": day.replace(day=1),
                "payments": row["payments"],
                "rejected": row["rejected"],
                "total": row["total"],
                "written_at": dt.datetime.now(dt.UTC),
            },
            token=token,
            resource=resource,
        )
        total += row["total"]
    return {"statements": len(activity), "total": total}


async def job(run: dedup.TaskRun) -> dict[str, int]:
    """The task: ``dedup task run dedup_services.statements:job --task statements --key DATE``."""
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
            f"{exc}: apply the migrations first: dedup run dedup_services.statements --migrate-only"
        ) from exc
    return result


def _day(text: str) -> str:
    try:
        return dt.date.fromisoformat(text).isoformat()
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid date {text!r}: expected YYYY-MM-DD") from None


def parser() -> argparse.ArgumentParser:
    """The flags of ``dedup run dedup_services.statements``."""
    p = service.parser(TASK, __doc__ or "")
    group = p.add_argument_group("task")
    group.add_argument("--date", type=_day, help="the business date (the task's key), YYYY-MM-DD")
    group.add_argument("--force", action="store_true", help="run even if it already succeeded")
    group.add_argument("--ttl", type=float, default=30.0, help="lease seconds (default: 30)")
    group.add_argument("--holder", help="this runner's name (default: hostname:pid:xxxxxx)")
    group.add_argument(
        "--max-attempts", type=int, default=3, help="runs of a failing task (default: 3)"
    )
    return p


async def main(argv: list[str]) -> int:
    """``dedup run dedup_services.statements --date YYYY-MM-DD [options]``."""
    args = parser().parse_args(argv)
    if args.date is None and not args.migrate_only:
        raise dedup.ConfigurationError("--date YYYY-MM-DD is required")
    async with service.started(args, TASK, ("payments", TASK)) as go_on:
        if not go_on:
            return 0
        # Exactly what `dedup task run dedup_services.statements:job` does from here on.
        options = {
            o: getattr(args, o) for o in ("dsn", "schema", "holder", "max_attempts", "force")
        }
        return await dedup.run_task(
            job, task=TASK, key=args.date, lease_ttl=args.ttl, prog="statements", **options
        )


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
