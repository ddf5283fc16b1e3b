"""`dedup migrate` / `dedup.migrate` against a real Postgres."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import asyncpg

import dedup


async def test_migrate_is_rerunnable(dsn: str) -> None:
    # The test database is a clone of a migrated template: nothing is left to do.
    assert await dedup.migrate(dsn) == []
    assert await dedup.migrate(dsn) == []


async def test_concurrent_migrations_of_a_new_schema_apply_once(pool: Any) -> None:
    results = await asyncio.gather(*(dedup.migrate(pool, schema_name="fresh") for _ in range(4)))
    applied = [r for r in results if r]
    assert len(applied) == 1
    assert applied[0][0] == "dedup/0001_core.sql"
    rows = await pool.fetch("SELECT component, version FROM fresh.migrations")
    assert len(rows) == len(applied[0])


def test_cli_migrate_exit_codes(dsn: str) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "dedup.cli", "migrate", "--dsn", dsn, "--schema", "cli_s"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert "applied dedup/0001_core.sql" in ok.stdout

    bad = subprocess.run(
        [sys.executable, "-m", "dedup.cli", "migrate", "--dsn", dsn, "--schema", "Bad-Name"],
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
