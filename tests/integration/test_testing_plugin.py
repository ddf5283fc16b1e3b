"""dedup's pytest plugin: the ``dedup_schema`` fixture, in a user's test run of its own.

Each test writes a user's test file and runs pytest on it in a child process
that loads dedup's plugin and pytest-asyncio by name and nothing else
(``PYTEST_DISABLE_PLUGIN_AUTOLOAD``), whether or not the checkout under test is
installed with its ``pytest11`` entry point; the entry point itself is what the
newcomer test of tests/integration/test_install.py runs, from the built wheel.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import asyncpg

from dedup_dev import helpers
from dedup_dev.services import ROOT

USER_TESTS = """\
from pathlib import Path

import asyncpg
import pytest

import dedup
from dedup.testing import record

KEY = dedup.keys.kafka_key()


@pytest.mark.asyncio
@pytest.mark.parametrize("run", [1, 2])
async def test_each_test_has_a_fresh_schema(dedup_schema, run):
    with Path("seen.txt").open("a") as seen:
        seen.write(dedup_schema.name + "\\n")
    assert dedup_schema.dsn == Path("wanted.txt").read_text()

    async def handle(msg, tx):
        pass

    copies = [record("x", key="k-1")] * 2
    delivery = await dedup_schema.deliver(handle, copies, namespace="n", key=KEY)
    assert delivery.outcomes == [dedup.Outcome.PROCESSED, dedup.Outcome.DUPLICATE]
    conn = await asyncpg.connect(dedup_schema.dsn)
    try:
        held = await conn.fetchval(
            "SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'processed'",
            dedup_schema.name,
        )
    finally:
        await conn.close()
    assert held == 1
"""


PLUGINS = ("-p", "dedup.testing._plugin", "-p", "pytest_asyncio.plugin", "-p", "no:cacheprovider")
"""The plugins of the user's run, by name: dedup's, pytest-asyncio; no cache written."""


def run_user_tests(
    folder: Path, env: dict[str, str], *args: str, wanted: str = ""
) -> subprocess.CompletedProcess[str]:
    """pytest on the user's test file, with dedup's plugin (and pytest-asyncio) only, the
    library imported from this checkout; the tests check their DSN is ``wanted``."""
    (folder / "test_user.py").write_text(USER_TESTS, encoding="utf-8")
    (folder / "wanted.txt").write_text(wanted, encoding="utf-8")
    ours = {k: v for k, v in os.environ.items() if not k.startswith(("DEDUP_", "PG", "PYTEST"))}
    return subprocess.run(
        [sys.executable, "-m", "pytest", *PLUGINS, "test_user.py", *args],
        cwd=folder,
        env=ours
        | {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
        | env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def schemas_and_roles(dsn: str, names: list[str]) -> list[str]:
    """Which of the schemas ``names``, and their roles, exist."""
    conn = await asyncpg.connect(dsn)
    try:
        found = await conn.fetch(
            "SELECT nspname FROM pg_namespace WHERE nspname = ANY($1::text[])"
            " UNION ALL SELECT rolname FROM pg_roles WHERE rolname = ANY($2::text[])",
            names,
            [f"{n}_{purpose}" for n in names for purpose in ("runtime", "audit")],
        )
    finally:
        await conn.close()
    return sorted(r[0] for r in found)


async def test_each_test_gets_a_fresh_migrated_schema_dropped_with_its_roles_after_it(
    dsn: str, tmp_path: Path
) -> None:
    done = run_user_tests(tmp_path, {"DEDUP_TEST_DSN": dsn}, wanted=dsn)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
    names = (tmp_path / "seen.txt").read_text().split()
    assert len(set(names)) == 2
    assert all(n.startswith("dedup_test_") and len(n) == len("dedup_test_") + 12 for n in names)
    assert await schemas_and_roles(dsn, names) == []


async def test_the_option_comes_first_then_dedup_test_dsn_then_dedup_dsn(
    dsn: str, tmp_path: Path
) -> None:
    nowhere = f"postgresql://postgres@127.0.0.1:{helpers.free_port()}/nowhere"
    given = {
        "option": (["--dedup-dsn", dsn], {"DEDUP_TEST_DSN": nowhere, "DEDUP_DSN": nowhere}),
        "DEDUP_TEST_DSN": ([], {"DEDUP_TEST_DSN": dsn, "DEDUP_DSN": nowhere}),
        "DEDUP_DSN": ([], {"DEDUP_DSN": dsn}),
    }
    for where, (args, env) in given.items():
        done = run_user_tests(tmp_path, env, *args, wanted=dsn)
        assert done.returncode == 0, (where, done.stdout + done.stderr)
    names = (tmp_path / "seen.txt").read_text().split()
    assert await schemas_and_roles(dsn, names) == []


def test_without_a_test_database_the_test_fails_saying_how_to_give_one(tmp_path: Path) -> None:
    done = run_user_tests(tmp_path, {}, "-k", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 error" in done.stdout and "skipped" not in done.stdout
    assert (
        "dedup_schema has no test database: give the test database with pytest "
        "--dedup-dsn=postgresql://USER@HOST/DB, or set DEDUP_TEST_DSN (else DEDUP_DSN is "
        "used); its login needs CREATEROLE"
    ) in done.stdout


def test_a_database_that_does_not_answer_fails_the_test_naming_where_it_was_given(
    tmp_path: Path,
) -> None:
    port = helpers.free_port()
    nowhere = f"postgresql://postgres:secret@127.0.0.1:{port}/nowhere"
    done = run_user_tests(tmp_path, {"DEDUP_TEST_DSN": nowhere}, "-k", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 error" in done.stdout and "skipped" not in done.stdout
    assert (
        "dedup_schema could not migrate a schema on the test database of DEDUP_TEST_DSN: "
        f"cannot connect to Postgres with the dsn setting (postgresql://postgres:***@127.0.0.1:"
        f"{port}/nowhere)"
    ) in done.stdout
    assert "secret" not in done.stdout
