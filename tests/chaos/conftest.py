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
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import dedup
from dedup_dev import database
from tests.chaos import (
    consumer_child,
    driver,
    kafka_cluster,
    netsplit,
    report,
    scenarios,
    task_child,
)
from tests.chaos.services import DEFAULT_DIR, ChaosServices, ServicesError

collect_ignore = [] if kafka_cluster.names() else ["test_cluster.py"]
"""The tiny matrix (the docs test's smoke run) has no cluster scenario: nothing to collect."""
if scenarios.matrix() != "full":
    collect_ignore += ["test_relay_cluster.py", "test_partition_teeth.py"]  # make chaos only


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


@pytest.fixture(scope="module")
def chaos_kafka_cluster() -> Iterator[kafka_cluster.KafkaCluster]:
    """The three-broker KRaft cluster of the cluster scenarios (test_cluster.py), started for
    them and stopped after them: its three JVMs don't idle through the rest of the suite."""
    directory = Path(os.environ.get("CHAOS_CLUSTER_DIR") or kafka_cluster.CLUSTER_DIR)
    try:
        cluster = kafka_cluster.KafkaCluster.start(directory)
    except ServicesError as exc:
        pytest.fail(
            f"the chaos suite could not start its three-broker Kafka under {directory}: {exc}",
            pytrace=False,
        )
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def chaos_template(chaos_services: ChaosServices) -> Iterator[str]:
    """A database migrated once, with the business tables; each run's is cloned from it."""
    name = database.unique_name("chaos_tpl_")

    async def create() -> None:
        dsn = await database.create(chaos_services.dsn, name)
        await dedup.migrate(dsn)
        await database.execute(dsn, consumer_child.EFFECTS + task_child.EFFECTS)

    asyncio.run(create())
    yield name
    asyncio.run(database.drop(chaos_services.dsn, name))


@pytest.fixture
async def chaos_run(
    chaos_services: ChaosServices, chaos_template: str, tmp_path: Path
) -> AsyncIterator[driver.RunContext]:
    """A fresh database for one run, and a folder for its children's logs."""
    await chaos_services.heal()
    name = database.unique_name("chaos_run_")
    dsn = await database.create(chaos_services.dsn, name, template=chaos_template)
    yield driver.RunContext(chaos_services, dsn, tmp_path)
    await chaos_services.heal()
    await database.drop(chaos_services.dsn, name)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The figures of this session's runs: a table on the terminal, in a file, in the docs."""
    kafka_cluster.summary(terminalreporter)
    netsplit.summary(terminalreporter)
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
