"""Fixtures of the chaos suite: its own Kafka and Postgres, a database per run, the figures.

The suite restarts and kills its services, so it never uses the shared pair
(``.services``) the other tests run against: ``chaos_services`` starts a second
pair under ``CHAOS_SERVICES_DIR`` (default ``.services/chaos``) once per
session and stops it at the end.  A test fails, never skips, when they can't
be started.

At the end of the session the figures of every run are printed as a table,
written to ``CHAOS_REPORT`` (default ``.services/chaos/results.md``) and, with
``CHAOS_UPDATE_DOCS=1`` (``make chaos``), put into docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

import dedup
from tests.chaos import consumer_child, driver, report, scenarios, task_child
from tests.chaos.services import DEFAULT_DIR, ChaosServices, ServicesError


def _with_database(dsn: str, database: str) -> str:
    base, _, _ = dsn.rpartition("/")
    return f"{base}/{database}"


@pytest.fixture(scope="session")
def chaos_services() -> Iterator[ChaosServices]:
    """The chaos suite's own Kafka and Postgres, started for this session."""
    directory = Path(os.environ.get("CHAOS_SERVICES_DIR") or DEFAULT_DIR)
    try:
        services = ChaosServices.start(directory)
    except ServicesError as exc:
        pytest.fail(
            f"the chaos suite could not start its own Kafka and Postgres under {directory}: "
            f"{exc}\nIt needs what compose/local/up needs (Java 17+, PostgreSQL), and never "
            "uses the shared services, which it would restart.",
            pytrace=False,
        )
    try:
        yield services
    finally:
        services.stop()


@pytest.fixture(scope="session")
def chaos_template(chaos_services: ChaosServices) -> Iterator[str]:
    """A database migrated once, with the business tables; each run's is cloned from it."""
    name = f"chaos_tpl_{uuid.uuid4().hex[:8]}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(chaos_services.dsn, timeout=30)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    async def create() -> None:
        await admin(f'CREATE DATABASE "{name}"')
        dsn = _with_database(chaos_services.dsn, name)
        await dedup.migrate(dsn)
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(consumer_child.EFFECTS + task_child.EFFECTS)
        finally:
            await conn.close()

    asyncio.run(create())
    yield name
    asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
async def chaos_run(
    chaos_services: ChaosServices, chaos_template: str, tmp_path: Path
) -> AsyncIterator[driver.RunContext]:
    """A fresh database for one run, and a folder for its children's logs."""
    await chaos_services.heal()
    name = f"chaos_run_{uuid.uuid4().hex[:10]}"
    conn: Any = await asyncpg.connect(chaos_services.dsn, timeout=30)
    try:
        await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{chaos_template}"')
    finally:
        await conn.close()
    yield driver.RunContext(chaos_services, _with_database(chaos_services.dsn, name), tmp_path)
    await chaos_services.heal()
    conn = await asyncpg.connect(chaos_services.dsn, timeout=30)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The figures of this session's runs: a table on the terminal, in a file, in the docs."""
    results = report.RESULTS
    if not results:
        return
    matrix = scenarios.matrix()
    seconds = sum(r.seconds for r in results)
    terminalreporter.section("chaos figures")
    for r in results:
        terminalreporter.write_line(r.line())
    terminalreporter.write_line("")
    terminalreporter.write_line(report.table(results))
    path = report.write(results, matrix, seconds)
    terminalreporter.write_line(f"written to {path}")
    if os.environ.get("CHAOS_UPDATE_DOCS") == "1":
        report.update_docs(results, matrix, seconds)
        terminalreporter.write_line(f"and to {report.DOCS}")
