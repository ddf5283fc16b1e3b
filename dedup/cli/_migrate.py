"""``dedup migrate``: create or update dedup's tables, print their SQL, or list them."""

from __future__ import annotations

import argparse
from typing import Any

from dedup import _errors as errors
from dedup import _report as report
from dedup.cli import _common as common
from dedup.data import _db as db
from dedup.data import _migrations as migrations
from dedup.data import _sql as sql

_COLUMNS = report.columns("component, version, name, status, applied_at")


async def _migrate(args: argparse.Namespace) -> int:
    """create or update dedup's tables (safe to rerun); print their SQL; list them

    Applies the pending migrations under an advisory lock. Exit codes:
    0 done (--status: up to date), 1 --status: migrations are pending, 2 bad usage,
    or a role that may not migrate.
    """
    sql.quote(args.schema)  # a bad name is bad usage, found before connecting
    roles = migrations.Roles(args.runtime_role, args.audit_role)
    if roles != migrations.Roles() and args.status:
        raise errors.ConfigurationError("--runtime-role and --audit-role go with migrate or --sql")
    if args.all and not args.sql:
        raise errors.ConfigurationError("--all goes with --sql")
    if args.format != "table" and not args.status:
        raise errors.ConfigurationError("--format goes with --status")
    if args.sql and args.all:
        found = migrations.discover(sql.migrations_dir())
        print(migrations.script(found, schema=args.schema, roles=roles), end="")
        return common.EXIT_OK
    async with db.connection(common.dsn(args), connect_timeout=args.connect_timeout) as conn:
        if args.sql:
            found = await migrations.pending(conn, schema=args.schema)
            print(migrations.script(found, schema=args.schema, roles=roles), end="")
            return common.EXIT_OK
        if args.status:
            return _status(await migrations.status(conn, schema=args.schema), args)
        applied = await migrations.migrate(
            conn, schema=args.schema, runtime_role=args.runtime_role, audit_role=args.audit_role
        )
        granted = await migrations.roles(conn, schema=args.schema) if applied else None
    for name in applied:
        print(f"applied {name}")
    if granted is not None:
        print(
            f"schema {args.schema}: its tables are granted to runtime role {granted.runtime} "
            f"and audit role {granted.audit}"
        )
    print(f"schema {args.schema} is up to date ({len(applied)} applied now)")
    return common.EXIT_OK


def _status(found: list[migrations.Status], args: argparse.Namespace) -> int:
    """Print what is applied and pending; exit 1 while something is pending."""
    rows = [
        {
            "component": s.component,
            "version": s.version,
            "name": s.name,
            "status": s.status,
            "applied_at": report.utc(s.applied_at),
        }
        for s in found
    ]
    waiting = sum(s.status == migrations.PENDING for s in found)
    done = report.Report(
        query={"schema": args.schema},
        sections=[report.Section("migrations", "migrations", _COLUMNS, rows)],
    )
    common.show(done, args)
    if args.format == "table":
        if waiting:
            print(f"\n{waiting} pending: run `dedup migrate` (or apply `dedup migrate --sql`)")
        else:
            print(f"\nschema {args.schema} is up to date")
    return common.EXIT_PROBLEM if waiting else common.EXIT_OK


def add_migrate(sub: Any) -> None:
    """The ``migrate`` command."""
    p = common.command(sub, "migrate", _migrate)
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--sql",
        action="store_true",
        help="print the SQL of the pending migrations instead of applying it "
        "(for alembic, flyway, a DBA)",
    )
    what.add_argument("--status", action="store_true", help="list applied and pending migrations")
    p.add_argument(
        "--all",
        action="store_true",
        help="with --sql: every migration, for an empty schema; needs no database",
    )
    p.add_argument(
        "--runtime-role",
        metavar="ROLE",
        help="the group role the schema's tables are granted to for consumers and task "
        "runners (created if missing; default DATABASE_SCHEMA_runtime); fixed once migrated",
    )
    p.add_argument(
        "--audit-role",
        metavar="ROLE",
        help="the read-only group role of the schema (default DATABASE_SCHEMA_audit)",
    )
    p.add_argument(
        "--format",
        choices=("table", "json"),
        default="table",
        help="with --status: aligned table, or one JSON document",
    )
    common.add_common(p)
