"""`dedup migrate` / `dedup.migrate` against a real Postgres."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import orjson
import pytest

import dedup
from dedup.data import _migrations as dedup_migrations
from dedup_dev.catalog import catalog
from dedup_dev.database import LoginAs, NewDatabase


async def test_migrate_is_rerunnable(dsn: str) -> None:
    # The test database is a clone of a migrated template: nothing is left to do.
    assert await dedup.migrate(dsn) == []
    assert await dedup.migrate(dsn) == []


async def test_concurrent_migrations_of_a_new_schema_apply_once(pool: Any) -> None:
    results = await asyncio.gather(*(dedup.migrate(pool, schema="fresh") for _ in range(4)))
    applied = [r for r in results if r]
    assert len(applied) == 1
    assert applied[0][0] == "dedup/0001_core.sql"
    rows = await pool.fetch("SELECT component, version FROM fresh.migrations")
    assert len(rows) == len(applied[0])


def test_cli_migrate_exit_codes(dsn: str) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "dedup", "migrate", "--dsn", dsn, "--schema", "cli_s"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert "applied dedup/0001_core.sql" in ok.stdout

    bad = subprocess.run(
        [sys.executable, "-m", "dedup", "migrate", "--dsn", dsn, "--schema", "Bad-Name"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2
    assert "invalid schema name 'Bad-Name'" in bad.stderr


async def test_migrate_names_an_unreachable_database() -> None:
    try:
        await dedup.migrate("postgresql://nobody@127.0.0.1:1/none")
    except dedup.ServiceUnavailableError as exc:
        assert "127.0.0.1:1" in str(exc)
        assert isinstance(exc.__cause__, OSError | asyncpg.PostgresError)
    else:
        raise AssertionError("migrate against a closed port must fail")


# --- migrations for other tools: --sql, --status, privileges, compatibility ----------


def dedup_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m dedup.cli ARGS``, its output as text, never a traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "dedup", *args],
        capture_output=True,
        text=True,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("DEDUP_")}, **env},
        timeout=60,
        check=False,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done


def psql(dsn: str, sql: str) -> None:
    """Run ``sql`` with psql in one transaction, stopping at the first error."""
    done = subprocess.run(
        ["psql", "-X", "-q", "-1", "-v", "ON_ERROR_STOP=1", "-f", "-", dsn],
        input=sql,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr


async def test_sql_all_applied_with_psql_gives_what_migrate_gives(
    new_database: NewDatabase,
) -> None:
    printed = dedup_cli("migrate", "--sql", "--all", "--schema", "billing")  # no database
    assert printed.returncode == 0, printed.stderr
    assert '"billing".processed' in printed.stdout
    assert "{schema}" not in printed.stdout
    by_psql, by_dedup = await new_database(), await new_database()
    psql(by_psql, printed.stdout)
    applied = dedup_cli("migrate", "--dsn", by_dedup, "--schema", "billing")
    assert applied.returncode == 0, applied.stderr

    expected = await catalog(by_dedup, "billing")
    assert {name for name, kind, *_ in expected["relations"] if kind == "r"} >= {
        "processed", "partitions", "events", "dead_letters", "leases", "tasks", "migrations"
    }  # fmt: skip
    assert expected["grants"] and expected["default_privileges"] and expected["indexes"]
    assert await catalog(by_psql, "billing") == expected
    # Recorded as applied: dedup finds nothing to do, and the text reruns as a no-op.
    again = dedup_cli("migrate", "--dsn", by_psql, "--schema", "billing")
    assert again.stdout == "schema billing is up to date (0 applied now)\n"
    psql(by_psql, printed.stdout)
    assert await catalog(by_psql, "billing") == expected


async def test_status_and_sql_show_what_is_applied_pending_and_newer(dsn: str, pool: Any) -> None:
    await pool.execute("DELETE FROM dedup.migrations WHERE version = 4")
    await pool.execute("INSERT INTO dedup.migrations VALUES ('dedup', 9999, 'from_the_future')")
    await pool.execute("INSERT INTO dedup.migrations VALUES ('payments', 1, 'ledger')")

    status = dedup_cli("migrate", "--dsn", dsn, "--status", "--format", "json")
    assert status.returncode == 1, status.stderr  # something is pending
    rows = orjson.loads(status.stdout)["migrations"]
    assert [(r["component"], r["version"], r["name"], r["status"]) for r in rows] == [
        ("dedup", 1, "core", "applied"),
        ("dedup", 2, "tasks", "applied"),
        ("dedup", 3, "roles", "applied"),
        ("dedup", 4, "schema_roles", "pending"),
        ("dedup", 5, "partition_starts", "applied"),
        ("dedup", 6, "schedules", "applied"),
        ("dedup", 7, "task_steps", "applied"),
        ("dedup", 8, "outbox", "applied"),
        ("dedup", 9, "task_durations", "applied"),
        ("dedup", 10, "outbox_kafka", "applied"),
        ("dedup", 11, "outbox_http", "applied"),
        ("dedup", 9999, "from_the_future", "newer"),
        ("payments", 1, "ledger", "applied"),
    ]
    assert rows[3]["applied_at"] is None and rows[0]["applied_at"].endswith("+00:00")
    table = dedup_cli("migrate", "--dsn", dsn, "--status")
    assert "dedup      4        schema_roles      pending  -" in table.stdout
    assert table.stdout.endswith(
        "\n1 pending: run `dedup migrate` (or apply `dedup migrate --sql`)\n"
    )

    pending = dedup_cli("migrate", "--dsn", dsn, "--sql")
    assert pending.returncode == 0, pending.stderr
    assert "-- dedup/0004_schema_roles.sql" in pending.stdout
    assert "0001_core" not in pending.stdout and "0003_roles" not in pending.stdout
    psql(dsn, pending.stdout)
    done = dedup_cli("migrate", "--dsn", dsn, "--status")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.endswith("\nschema dedup is up to date\n")
    nothing = dedup_cli("migrate", "--dsn", dsn, "--sql")
    assert nothing.stdout == '-- dedup migrations for schema "dedup": none pending\n'


def test_migrate_options_that_do_not_go_together_are_bad_usage() -> None:
    for args, says in (
        (["--all"], "--all goes with --sql"),
        (["--format", "json"], "--format goes with --status"),
        (["--sql", "--all", "--schema", "Bad-Name"], "invalid schema name 'Bad-Name'"),
    ):
        done = dedup_cli("migrate", *args)
        assert done.returncode == 2
        assert done.stderr.startswith(f"dedup migrate: {says}"), done.stderr
    both = dedup_cli("migrate", "--sql", "--status")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


async def test_the_library_refuses_a_schema_older_than_it_needs_and_runs_on_a_newer(
    dsn: str, pool: Any
) -> None:
    await pool.execute("INSERT INTO dedup.migrations VALUES ('dedup', 9999, 'from_the_future')")
    outcome = await dedup.TaskRunner(pool=pool).run("compat", "k", _job)
    assert outcome.status == "succeeded"
    assert dedup_cli("audit", "--dsn", dsn, "--key", "k").returncode == 1  # ran: found nothing

    await pool.execute("DELETE FROM dedup.migrations WHERE version = 2")
    with pytest.raises(dedup.ConfigurationError, match="lacks migration 0002_tasks") as caught:
        await dedup.TaskRunner(dsn=dsn).run("compat", "k2", _job)
    assert "run `dedup migrate`" in str(caught.value)
    old = dedup_cli("audit", "--dsn", dsn, "--key", "k")
    assert old.returncode == 2
    assert "schema 'dedup' lacks migration 0002_tasks, which this version of dedup needs" in (
        old.stderr
    )


async def _job(run: dedup.TaskRun) -> None:
    return None


async def test_a_role_that_may_not_migrate_is_told_what_it_needs(
    dsn: str, pool: Any, login_as: LoginAs
) -> None:
    reader = await login_as((await dedup_migrations.roles(pool)).audit)
    role = urlsplit(reader).username
    database = urlsplit(dsn).path.lstrip("/")
    # Up to date: nothing to change, so a role without DDL may run it.
    ok = dedup_cli("migrate", "--dsn", reader)
    assert (ok.returncode, ok.stdout) == (0, "schema dedup is up to date (0 applied now)\n")
    assert dedup_cli("migrate", "--dsn", reader, "--status").returncode == 0

    new_schema = dedup_cli("migrate", "--dsn", reader, "--schema", "reports")
    assert new_schema.returncode == 2
    assert new_schema.stderr == (
        f'dedup migrate: role "{role}" may not migrate schema "reports" in database '
        f'"{database}": permission denied for database {database}; creating the schema needs '
        f'CREATE on database "{database}" (GRANT CREATE ON DATABASE "{database}" TO "{role}"), '
        f'or a DBA makes it for the role: CREATE SCHEMA "reports" AUTHORIZATION "{role}"; '
        "or give a DBA the SQL: dedup migrate --sql --schema reports\n"
    )

    # What the message offers: a schema a DBA makes for the role, which then migrates it,
    # itself or with the SQL, without CREATE on the database.
    for name in ("reports", "ledger"):
        await pool.execute(f'CREATE SCHEMA {name} AUTHORIZATION "{role}"')
    # The schema's roles too: a role without CREATEROLE is told which to ask for.
    no_roles = dedup_cli("migrate", "--dsn", reader, "--schema", "reports")
    assert no_roles.returncode == 2
    assert no_roles.stderr.startswith(
        f'dedup migrate: schema "reports": role {role} may not create the runtime role '
        f"{database}_reports_runtime of schema reports (permission denied to create role): "
        f"a DBA runs CREATE ROLE {database}_reports_runtime NOLOGIN, then `dedup migrate` again"
    ), no_roles.stderr
    assert await pool.fetchval("SELECT to_regclass('reports.processed')") is None
    for name in ("reports", "ledger"):
        for purpose in ("runtime", "audit"):
            await pool.execute(f"CREATE ROLE {database}_{name}_{purpose} NOLOGIN")
    assert dedup_cli("migrate", "--dsn", reader, "--schema", "reports").returncode == 0
    psql(reader, dedup_cli("migrate", "--dsn", reader, "--schema", "ledger", "--sql").stdout)
    for name in ("reports", "ledger"):
        assert dedup_cli("migrate", "--dsn", reader, "--schema", name, "--status").returncode == 0

    await pool.execute("DELETE FROM dedup.migrations WHERE version = 2")
    not_owner = dedup_cli("migrate", "--dsn", reader)
    assert not_owner.returncode == 2
    assert not_owner.stderr.startswith(
        f'dedup migrate: role "{role}" may not migrate schema "dedup" in database "{database}": '
        "permission denied for schema dedup; migrating needs the owner of schema "
        '"dedup" and its tables: run it as "postgres" or a role granted it'
    )
    with pytest.raises(dedup.ConfigurationError, match=f'role "{role}" may not migrate'):
        await dedup.migrate(reader)

    stranger = await login_as("pg_monitor")  # granted nothing of dedup's
    for args in (["--status"], ["--sql"], []):
        refused = dedup_cli("migrate", "--dsn", stranger, *args)
        assert refused.returncode == 2, refused.stderr
        assert f'role "{urlsplit(stranger).username}" may not ' in refused.stderr
