"""Services for the tests: a real Kafka broker and a real Postgres server.

They are found in this order:

1. ``KAFKA_BOOTSTRAP_SERVERS`` / ``DEDUP_DSN`` in the environment (your own);
2. the local services of ``compose/local/up`` (started here if they are not
   running; ``make test`` starts them first anyway);
3. testcontainers, when a Docker engine answers.

Nothing is skipped: a test that can't reach a service fails and says how to
start it.  Each integration test gets its own database, cloned from a template
migrated once per run, and its own topics.  Nothing here writes ``PG*`` or
``DEDUP_*`` into ``os.environ``; tests that want a DSN take a fixture.

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
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import dedup
from dedup import _conninfo as conninfo
from dedup import _db as db

ROOT = Path(__file__).resolve().parent.parent
HOW_TO_START = (
    "start them with `compose/local/up` (or `make test`, which does), "
    "or point KAFKA_BOOTSTRAP_SERVERS and DEDUP_DSN at your own"
)


@dataclass(frozen=True)
class Services:
    """Where the test services answer."""

    bootstrap_servers: str
    """Kafka, as host:port."""
    dsn: str
    """Postgres, a DSN for a role that may create databases."""


def _read_env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs}


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
    local = _read_env_file(ROOT / ".services" / "env")
    yield Services(kafka or local["KAFKA_BOOTSTRAP_SERVERS"], dsn or local["DEDUP_DSN"])


def _with_database(dsn: str, database: str) -> str:
    base, _, _ = dsn.rpartition("/")
    return f"{base}/{database}"


async def _admin_connection(services: Services) -> asyncpg.Connection:
    try:
        return await asyncpg.connect(services.dsn, timeout=10)
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        pytest.fail(
            f"cannot reach Postgres at {conninfo.redact(services.dsn)}: {exc}; {HOW_TO_START}",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def template_database(services: Services) -> Iterator[str]:
    """A database migrated once per run; each test's database is cloned from it."""
    name = f"dedup_tpl_{uuid.uuid4().hex[:10]}"

    async def create() -> None:
        conn = await _admin_connection(services)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()
        await dedup.migrate(_with_database(services.dsn, name))

    async def drop() -> None:
        conn = await _admin_connection(services)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    asyncio.run(create())
    yield name
    asyncio.run(drop())


@pytest.fixture
async def dsn(services: Services, template_database: str) -> AsyncIterator[str]:
    """A fresh, migrated database for this test alone."""
    name = f"dedup_t_{uuid.uuid4().hex[:12]}"
    conn = await _admin_connection(services)
    try:
        await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_database}"')
    finally:
        await conn.close()
    yield _with_database(services.dsn, name)
    conn = await _admin_connection(services)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


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
    services_dir = Path(os.environ.get("DEDUP_SERVICES_DIR") or ROOT / ".services")
    dsn = _read_env_file(services_dir / "env").get("DEDUP_PGBOUNCER_DSN")
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


@pytest.fixture
def pgbouncer_dsn(pgbouncer: str, dsn: str) -> str:
    """This test's database (the ``dsn`` fixture's, made on the server) through pgbouncer."""
    return _with_database(pgbouncer, dsn.rpartition("/")[2])


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


async def _execute(services: Services, *statements: str) -> None:
    """Run ``statements`` as the test services' admin role."""
    conn = await _admin_connection(services)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


NewDatabase = Callable[[], Awaitable[str]]


@pytest.fixture
async def new_database(services: Services) -> AsyncIterator[NewDatabase]:
    """``await new_database()`` -> the DSN of a new, empty database, dropped after the test."""
    made: list[str] = []

    async def make() -> str:
        made.append(f"dedup_e_{uuid.uuid4().hex[:12]}")
        await _execute(services, f'CREATE DATABASE "{made[-1]}"')
        return _with_database(services.dsn, made[-1])

    yield make
    await _execute(services, *(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)' for name in made))


def with_user(dsn: str, user: str) -> str:
    """``dsn`` logging in as ``user`` (the test server trusts local connections)."""
    parts = urlsplit(dsn)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))


LoginAs = Callable[..., Awaitable[str]]


@pytest.fixture
async def login_as(services: Services, dsn: str) -> AsyncIterator[LoginAs]:
    """``await login_as("dedup_audit")`` -> a DSN of this test's database for a new LOGIN
    role granted that group role (``password=`` gives it one); dropped after the test."""
    made: list[str] = []

    async def make(group: str, *, password: str | None = None) -> str:
        made.append(f"t_{group}_{uuid.uuid4().hex[:8]}")
        given = "" if password is None else f" PASSWORD '{password}'"
        await _execute(services, f'CREATE ROLE "{made[-1]}" LOGIN{given} IN ROLE {group}')
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


class Topics:
    """Creates uniquely named topics for one test and deletes them afterwards."""

    def __init__(self, bootstrap_servers: str) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.created: list[str] = []

    async def create(
        self, partitions: int = 1, prefix: str = "t", config: dict[str, str] | None = None
    ) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap_servers)
        try:
            await admin.start()
        except Exception as exc:  # any failure here means "not reachable"
            pytest.fail(
                f"cannot reach Kafka at {self.bootstrap_servers}: {exc!r}; {HOW_TO_START}",
                pytrace=False,
            )
        try:
            await admin.create_topics([NewTopic(name, partitions, 1, topic_configs=config or {})])
        finally:
            await admin.close()
        self.created.append(name)
        return name

    async def delete_all(self) -> None:
        if not self.created:
            return
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap_servers)
        await admin.start()
        try:
            await admin.delete_topics(self.created)
        finally:
            await admin.close()


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
