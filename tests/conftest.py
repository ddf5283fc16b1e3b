"""Services for the tests: a real Kafka broker and a real Postgres server.

They are found in this order:

1. ``KAFKA_BOOTSTRAP_SERVERS`` / ``DEDUP_DSN`` in the environment (your own);
2. the local services of ``compose/local/up`` (started here if they are not
   running; ``make test`` starts them first anyway);
3. testcontainers, when a Docker engine answers.

Nothing is skipped: a test that can't reach a service fails and says how to
start it.  Each integration test gets its own database, cloned from a template
migrated once per run, and its own topics; but the tests of the docs' pages
(marked ``docs_page``) share one database, in the order pytest runs them, as a
reader who follows one page after another has one database.  Nothing here
writes ``PG*`` or ``DEDUP_*`` into ``os.environ``; tests that want a DSN take a
fixture.

Tests that take ``pgbouncer_dsn`` reach their database through pgbouncer in
transaction mode: ``DEDUP_PGBOUNCER_DSN`` (yours, in front of the Postgres of
``DEDUP_DSN``), else the one ``compose/local/up pgbouncer`` starts (installing
Debian's package first when it can).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import dedup
from dedup.data import _db as db
from dedup_dev import database
from dedup_dev import services as dedup_dev_services
from dedup_dev.database import LoginAs, NewDatabase
from dedup_dev.kafka import Topics
from dedup_dev.services import HOW_TO_START, ROOT, Services, Unreachable, with_database, with_user


def _docker_answers() -> bool:
    docker = shutil.which("docker")
    if not docker:
        return False
    probe = subprocess.run([docker, "info"], capture_output=True, timeout=20, check=False)
    return probe.returncode == 0


@contextlib.contextmanager
def _testcontainers() -> Iterator[Services]:
    from testcontainers.kafka import KafkaContainer
    from testcontainers.postgres import PostgresContainer

    with (
        PostgresContainer("postgres:16", driver=None) as pg,
        KafkaContainer("confluentinc/cp-kafka:7.6.1").with_kraft() as kafka,
    ):
        yield Services(kafka.get_bootstrap_server(), pg.get_connection_url())


def _local_services_running() -> bool:
    status = subprocess.run(
        [ROOT / "compose/local/status", "kafka", "postgres"], capture_output=True, check=False
    )
    return status.returncode == 0


@pytest.fixture(scope="session")
def services() -> Iterator[Services]:
    """Kafka and Postgres for this run, found or started as the module docstring says."""
    kafka = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    dsn = os.environ.get("DEDUP_DSN")
    if kafka and dsn:
        yield Services(kafka, dsn)
        return
    if not _local_services_running() and _docker_answers():
        with _testcontainers() as found:
            yield Services(kafka or found.bootstrap_servers, dsn or found.dsn)
        return
    if not _local_services_running():
        # compose/local/up itself honours a variable that is already set.
        started = subprocess.run(
            [ROOT / "compose/local/up"], capture_output=True, text=True, check=False
        )
        if started.returncode != 0:
            pytest.fail(
                f"Kafka and Postgres are not running and compose/local/up failed:\n"
                f"{started.stderr}\n{HOW_TO_START}",
                pytrace=False,
            )
    found = dedup_dev_services.configured()
    assert found is not None, f"compose/local/up wrote no addresses; {HOW_TO_START}"
    yield Services(kafka or found.bootstrap_servers, dsn or found.dsn)


@contextlib.contextmanager
def _reachable() -> Iterator[None]:
    """A service that does not answer fails the test with how to start it, no traceback."""
    try:
        yield
    except Unreachable as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def template_database(services: Services) -> Iterator[str]:
    """A database migrated once per run; each test's database is cloned from it."""
    name = database.unique_name("dedup_tpl_")

    async def create() -> None:
        with _reachable():
            await dedup.migrate(await database.create(services.dsn, name))

    asyncio.run(create())
    yield name
    asyncio.run(database.drop(services.dsn, name))


@pytest.fixture(scope="session")
def docs_database(services: Services, template_database: str) -> Iterator[str]:
    """The one migrated database every ``docs_page`` test of the run works in, page after page.

    Each page's tables, topics, groups, namespaces and task codes are its own
    (tests/unit/test_docs_names.py), so the pages give their documented
    numbers whatever ran before them on this database.
    """
    name = database.unique_name("dedup_docs_")
    with _reachable():
        made = asyncio.run(database.create(services.dsn, name, template=template_database))
    yield made
    asyncio.run(database.drop(services.dsn, name))


@pytest.fixture
async def fresh_database(services: Services, template_database: str) -> AsyncIterator[str]:
    """A fresh, migrated database for this test alone."""
    name = database.unique_name("dedup_t_")
    with _reachable():
        made = await database.create(services.dsn, name, template=template_database)
    yield made
    await database.drop(services.dsn, name)


@pytest.fixture
def dsn(request: pytest.FixtureRequest) -> str:
    """This test's database: a fresh one, or the docs' database for a ``docs_page`` test."""
    docs_page = request.node.get_closest_marker("docs_page") is not None
    return str(request.getfixturevalue("docs_database" if docs_page else "fresh_database"))


@pytest.fixture(scope="session")
def pgbouncer(services: Services) -> str:
    """A DSN of pgbouncer (transaction pooling) in front of the test Postgres, found or started."""
    found = os.environ.get("DEDUP_PGBOUNCER_DSN")
    if found:
        return found
    # compose/local/up puts it in front of the Postgres of DEDUP_DSN: this run's.
    env = {**os.environ, "DEDUP_DSN": services.dsn}
    started = subprocess.run(
        [ROOT / "compose/local/up", "pgbouncer"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    dsn = dedup_dev_services.read_env(dedup_dev_services.services_dir() / "env").get(
        "DEDUP_PGBOUNCER_DSN"
    )
    if started.returncode != 0 or not dsn:
        pytest.fail(
            f"pgbouncer is not running and `compose/local/up pgbouncer` failed:\n"
            f"{started.stderr}\nstart it with `compose/local/up pgbouncer` (it installs "
            "Debian's pgbouncer when run as root; else `sudo apt-get install pgbouncer` "
            "first), or set DEDUP_PGBOUNCER_DSN to a pgbouncer in transaction mode in "
            "front of DEDUP_DSN's server",
            pytrace=False,
        )
    return dsn


@pytest.fixture(scope="session")
def secured_kafka(services: Services) -> Iterator[dedup_dev_services.SecuredKafka]:
    """A SASL/SCRAM-SHA-512 over TLS listener: the local broker's when it has one, else a
    broker of its own (``DEDUP_KAFKA_SASL_SSL=1 compose/local/up kafka`` in
    ``.services/sasl-ssl``), stopped after the run if started here."""
    found = dedup_dev_services.secured_kafka(dedup_dev_services.services_dir() / "env")
    if found is not None:
        yield found
        return
    own = dedup_dev_services.services_dir() / "sasl-ssl"
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    env.update(DEDUP_SERVICES_DIR=str(own), DEDUP_KAFKA_SASL_SSL="1")
    was_running = subprocess.run(
        [ROOT / "compose/local/status", "kafka"], env=env, capture_output=True, check=False
    )
    started = subprocess.run(
        [ROOT / "compose/local/up", "kafka"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    secured = dedup_dev_services.secured_kafka(own / "env")
    if started.returncode != 0 or secured is None:
        pytest.fail(
            f"`DEDUP_KAFKA_SASL_SSL=1 compose/local/up kafka` failed:\n{started.stderr}",
            pytrace=False,
        )
    yield secured
    if was_running.returncode != 0:
        subprocess.run([ROOT / "compose/local/down", "kafka"], env=env, check=False)


@pytest.fixture
def pgbouncer_dsn(pgbouncer: str, dsn: str) -> str:
    """This test's database (the ``dsn`` fixture's, made on the server) through pgbouncer."""
    return with_database(pgbouncer, dsn.rpartition("/")[2])


@pytest.fixture
async def pool(dsn: str) -> AsyncIterator[Any]:
    """An asyncpg pool (orjson codecs) on this test's database."""
    p = await db.create_pool(dsn, max_size=8)
    yield p
    await p.close()


@pytest.fixture
def bootstrap_servers(services: Services) -> str:
    """Kafka's address."""
    return services.bootstrap_servers


@pytest.fixture
async def new_database(services: Services) -> AsyncIterator[NewDatabase]:
    """``await new_database()`` -> the DSN of a new, empty database, dropped after the test."""
    made: list[str] = []

    async def make() -> str:
        made.append(database.unique_name("dedup_e_"))
        return await database.create(services.dsn, made[-1])

    yield make
    if made:
        await database.drop(services.dsn, *made)


@pytest.fixture
async def login_as(services: Services, dsn: str) -> AsyncIterator[LoginAs]:
    """``await login_as("dedup_audit")`` -> a DSN of this test's database for a new LOGIN
    role granted that group role (``password=`` gives it one); dropped after the test."""
    made: list[str] = []

    async def make(group: str, *, password: str | None = None) -> str:
        made.append(database.unique_name(f"t_{group}_"))
        given = "" if password is None else f" PASSWORD '{password}'"
        await database.execute(
            services.dsn, f'CREATE ROLE "{made[-1]}" LOGIN{given} IN ROLE {group}'
        )
        return with_user(dsn, made[-1])

    yield make
    if not made:
        return
    users = ", ".join(f'"{user}"' for user in made)
    conn = await asyncpg.connect(dsn)  # what a role made in this database goes first
    try:
        await conn.execute(f"DROP OWNED BY {users}; DROP ROLE {users}")
    finally:
        await conn.close()


@pytest.fixture
async def topics(bootstrap_servers: str) -> AsyncIterator[Topics]:
    """Make topics with ``await topics.create(partitions)``; they are deleted after the test."""
    made = Topics(bootstrap_servers)
    yield made
    await made.delete_all()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Spans ended during the test (on the process's SDK provider, installed if none is).

    A process has one global tracer provider; this adds an exporter to it for
    the test's duration, so tests that look at spans don't fight over it.
    """
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()


_METRIC_READER: list[InMemoryMetricReader] = []


@pytest.fixture
def metric_reader() -> InMemoryMetricReader:
    """The in-memory reader of the process's SDK meter provider (installed on first use).

    Readers can only be given when a meter provider is made, so there is one
    for the whole run: compare readings before and after, not absolute values.
    """
    if not _METRIC_READER:
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        _METRIC_READER.append(reader)
    return _METRIC_READER[0]
