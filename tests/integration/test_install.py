"""The two wheels, installed as a user installs them: not editable, in a venv of their own.

The library (dedup-kafka) and the bundled services (dedup-kafka-services, from
``consumers/``) are built from this checkout without a network (hatchling is a
dev dependency), then installed by file into fresh virtual environments, their
dependencies from the package index (pip's cache makes that quick). Every
command here runs outside the checkout, so nothing is imported from it.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import signal
import subprocess
import sys
import tarfile
import tomllib
import uuid
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest
from aiokafka.admin import AIOKafkaAdminClient

import dedup
from dedup_dev import database as dev_database
from dedup_dev import docs as docs_support
from dedup_dev import helpers
from dedup_dev.catalog import catalog
from dedup_dev.database import NewDatabase
from dedup_dev.services import ROOT, Services

INSTALL_PAGE = ROOT / "docs" / "install.md"
QUICKSTART_BLOCKS = docs_support.snippets(ROOT / "docs" / "quickstart.md")
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


@dataclass(frozen=True)
class Wheels:
    library: Path
    services: Path


def _no_venv_shell() -> dict[str, str]:
    """A user's shell: no venv active (not this one either), none of our DEDUP_* or PG*."""
    ours = str(Path(sys.executable).parent)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DEDUP_", "PYTHON", "PG", "VIRTUAL_ENV", "KAFKA_"))
    }
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != ours)
    return env


@dataclass(frozen=True)
class Venv:
    """A virtual environment and a project directory outside the checkout to run in."""

    path: Path
    cwd: Path
    pip_env: dict[str, str]
    """PIP_* variables under which `pip install dedup-kafka` installs the wheels built here."""

    @property
    def bin(self) -> Path:
        return self.path / "bin"

    def env(self) -> dict[str, str]:
        """The environment of a shell with this venv activated (as `. .venv/bin/activate`)."""
        env = _no_venv_shell()
        env["PATH"] = f"{self.bin}{os.pathsep}{env['PATH']}"
        env["VIRTUAL_ENV"] = str(self.path)
        return env | self.pip_env

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``argv``, as typed in that shell."""
        done = subprocess.run(
            argv, cwd=self.cwd, env=self.env(), capture_output=True, text=True, timeout=300
        )
        assert not check or done.returncode == 0, f"{argv}:\n{done.stdout}{done.stderr}"
        return done

    def sh(self, script: str, env: dict[str, str] | None = None, **more: str) -> str:
        """What a docs page's shell lines print (stdout and stderr), run as written."""
        done = subprocess.run(
            ["/bin/sh", "-ec", script],
            cwd=self.cwd,
            env=(env or self.env()) | more,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, f"{script}\n{done.stdout}"
        return done.stdout


def _pip(*args: str, python: Path | str = sys.executable) -> None:
    done = subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", "-q", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"pip {' '.join(args)}:\n{done.stdout}{done.stderr}"


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Wheels:
    out = tmp_path_factory.mktemp("wheels")
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT))
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT / "consumers"))
    (library,) = out.glob(f"dedup_kafka-{VERSION}-*.whl")
    (services,) = out.glob(f"dedup_kafka_services-{VERSION}-*.whl")
    return Wheels(library, services)


def _pip_env(root: Path, wheels: Wheels) -> dict[str, str]:
    """Under these, `pip install dedup-kafka` takes the wheels built here.

    pip finds them through PIP_FIND_LINKS and, the dependencies aside, takes
    nothing else: the constraints pin both names to this version, so no
    release on the index could stand in for them.
    """
    constraints = root / "constraints.txt"
    constraints.write_text(f"dedup-kafka=={VERSION}\ndedup-kafka-services=={VERSION}\n")
    return {
        "PIP_FIND_LINKS": str(wheels.library.parent),
        "PIP_CONSTRAINT": str(constraints),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }


def _fresh_venv(root: Path, wheels: Wheels) -> Venv:
    """An empty venv, and a project folder."""
    venv.create(root / "venv", with_pip=True)
    (root / "project").mkdir()
    return Venv(root / "venv", root / "project", _pip_env(root, wheels))


@pytest.fixture(scope="module")
def library_venv(wheels: Wheels, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """The venv a newcomer makes with the quickstart's first block: `pip install dedup-kafka`."""
    root = tmp_path_factory.mktemp("newcomer")
    project = root / "project"
    project.mkdir()
    lang, install = QUICKSTART_BLOCKS[0]
    assert lang == "sh" and "pip install dedup-kafka\n" in install
    made = Venv(project / ".venv", project, _pip_env(root, wheels))
    made.sh(install, _no_venv_shell() | made.pip_env)
    assert (made.bin / "dedup").exists()
    return made


def _install_page_blocks() -> list[tuple[str, str]]:
    return docs_support.snippets(INSTALL_PAGE)


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as whl:
        return whl.namelist()


def test_library_wheel_holds_the_typed_dedup_package_only(wheels: Wheels) -> None:
    names = _names(wheels.library)
    dist_info = f"dedup_kafka-{VERSION}.dist-info/"
    assert {n.split("/")[0] + "/" for n in names} == {"dedup/", dist_info}
    assert "dedup/py.typed" in names
    statements = ROOT / "sql"
    shipped = {f"dedup/sql/{f.relative_to(statements)}" for f in statements.rglob("*.sql")}
    assert {n for n in names if n.startswith("dedup/sql/")} == shipped, "sql/, as dedup/sql"
    assert "dedup/sql/migrations/0001_core.sql" in shipped
    assert "dedup/sql/queries/consumer.sql" in shipped
    assert f"{dist_info}licenses/LICENSE" in names
    with zipfile.ZipFile(wheels.library) as whl:
        entry_points = whl.read(f"{dist_info}entry_points.txt").decode()
        metadata = whl.read(f"{dist_info}METADATA").decode()
    assert entry_points.split() == [
        *("[console_scripts]", "dedup", "=", "dedup.cli._main:main"),
        *("[pytest11]", "dedup", "=", "dedup.testing._plugin"),
    ]
    assert "Name: dedup-kafka\n" in metadata
    assert "Classifier: Typing :: Typed" in metadata
    assert "License-Expression: Apache-2.0" in metadata


def test_sdist_holds_sql_at_its_root_and_builds_the_same_wheel(
    wheels: Wheels, tmp_path: Path
) -> None:
    """pip builds the wheel from the sdist: the statements go with it, as sql/."""
    done = subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "-t", "sdist", "-d", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (sdist,) = tmp_path.glob(f"dedup_kafka-{VERSION}.tar.gz")
    with tarfile.open(sdist) as tar:
        tops = {name.split("/")[1] for name in tar.getnames() if name.count("/") > 1}
    assert tops == {"dedup", "sql"}, tops
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "w"), str(sdist))
    (rebuilt,) = (tmp_path / "w").glob(f"dedup_kafka-{VERSION}-*.whl")
    assert sorted(_names(rebuilt)) == sorted(_names(wheels.library))


def test_services_wheel_holds_the_dedup_services_package_and_the_reconcile_checks(
    wheels: Wheels,
) -> None:
    names = _names(wheels.services)
    dist_info = f"dedup_kafka_services-{VERSION}.dist-info/"
    assert {n.split("/")[0] + "/" for n in names} == {"dedup_services/", dist_info}
    assert "dedup_services/payments.py" in names
    assert "dedup_services/sql/payments/0001_payments.sql" in names
    assert not any(n.endswith(("pyproject.toml", "README.md")) for n in names)
    with zipfile.ZipFile(wheels.services) as whl:
        entry_points = whl.read(f"{dist_info}entry_points.txt").decode()
        metadata = whl.read(f"{dist_info}METADATA").decode()
    assert "[dedup.reconcile]" in entry_points
    assert f"Requires-Dist: dedup-kafka[otel]=={VERSION}" in metadata


def test_installed_library_has_its_version_and_nothing_of_the_services(
    library_venv: Venv,
) -> None:
    assert library_venv.run("dedup", "--version").stdout == f"dedup (dedup-kafka) {VERSION}\n"
    imported = library_venv.run(
        "python", "-c", "import dedup; print(dedup.__version__, dedup.__file__)"
    )
    version, location = imported.stdout.split()
    assert version == VERSION
    assert Path(location).is_relative_to(library_venv.path), "imported from the venv"
    assert library_venv.run("dedup", "reconcile", "--list").stdout == ""
    no_services = library_venv.run("python", "-c", "import dedup_services", check=False)
    assert "No module named 'dedup_services'" in no_services.stderr


async def test_migrate_from_the_wheel_makes_what_migrate_from_the_checkout_makes(
    library_venv: Venv, new_database: NewDatabase
) -> None:
    """The installed wheel reads its statements from dedup/sql, the checkout from sql/."""
    from_wheel, from_checkout = await new_database(), await new_database()
    library_venv.run("dedup", "migrate", "--dsn", from_wheel)
    await dedup.migrate(from_checkout)
    made = await catalog(from_wheel, "dedup")
    assert made["migrations"], "the wheel's migrations applied"
    assert made == await catalog(from_checkout, "dedup")


USER_CODE = """\
from __future__ import annotations

import dedup


async def apply(msg: dedup.Message, tx: dedup.Tx) -> None:
    payment = msg.json()
    await tx.conn.execute("SELECT $1::text", payment["payment_id"])


def consumer(dsn: str) -> dedup.IdempotentConsumer:
    return dedup.IdempotentConsumer(
        apply,
        topics=["payments"],
        group_id="payments",
        bootstrap_servers="127.0.0.1:9092",
        dsn=dsn,
        key=dedup.keys.json_field("payment_id"),
    )


def where(msg: dedup.Message) -> tuple[str, int, int]:
    return msg.topic, msg.partition, msg.offset


version: str = dedup.__version__
"""

USER_MISTAKE = """\
import dedup


def offset_of(msg: dedup.Message) -> str:
    return msg.offset
"""


def test_mypy_sees_the_installed_packages_types(library_venv: Venv) -> None:
    """py.typed: a user's strict mypy checks their code against dedup's annotations."""
    (library_venv.cwd / "app.py").write_text(USER_CODE)
    (library_venv.cwd / "mistake.py").write_text(USER_MISTAKE)
    mypy = [
        sys.executable,
        "-m",
        "mypy",
        "--strict",
        "--python-executable",
        str(library_venv.bin / "python"),
        "--cache-dir",
        str(library_venv.cwd / ".mypy_cache"),
    ]
    clean = library_venv.run(*mypy, "app.py", check=False)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "Success: no issues found in 1 source file" in clean.stdout
    wrong = library_venv.run(*mypy, "mistake.py", check=False)
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert 'Incompatible return value type (got "int", expected "str")' in wrong.stdout


def test_install_page_commands_run_as_written(library_venv: Venv) -> None:
    blocks = _install_page_blocks()
    assert [lang for lang, _ in blocks] == ["sh", "console", "sh", "sh"]
    (_, versions), (_, extras) = blocks[1], blocks[2]
    for command, expected in docs_support.console(versions):
        out = library_venv.sh(command)
        assert docs_support.expected_pattern(expected + "\n").fullmatch(out), (command, out)
    library_venv.sh(extras)
    imports = "sqlalchemy, opentelemetry.sdk, opentelemetry.exporter.prometheus, prometheus_client"
    library_venv.run("python", "-c", f"import {imports}")


def test_install_page_names_the_versions_this_run_tested(services: Services) -> None:
    page = INSTALL_PAGE.read_text(encoding="utf-8")
    tested = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in docs_support.section(page, "## Supported versions").splitlines()
        if line.startswith("| ") and not line.startswith(("| what", "| ---"))
    }
    assert tested["Python"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    pom = (ROOT / "compose" / "local" / "kafka-pom.xml").read_text()
    assert f"<kafka.version>{tested['Apache Kafka']}</kafka.version>" in pom
    server = asyncio.run(_server_version(services.dsn))
    assert server.split(".")[0] == tested["PostgreSQL"], (
        f"the tests ran on PostgreSQL {server}: add it to docs/install.md if it passes"
    )
    for dist in ("aiokafka", "asyncpg"):
        assert importlib.metadata.version(dist) == tested[dist]


async def _server_version(dsn: str) -> str:
    conn = await asyncpg.connect(dsn)
    try:
        return str(await conn.fetchval("SHOW server_version"))
    finally:
        await conn.close()


def test_services_install_from_a_checkout_with_their_reconcile_checks(
    wheels: Wheels, tmp_path: Path
) -> None:
    both = _fresh_venv(tmp_path, wheels)
    _, from_checkout = _install_page_blocks()[3]
    assert "$DEDUP_CHECKOUT" in from_checkout
    both.sh(from_checkout, DEDUP_CHECKOUT=str(ROOT))
    listed = both.run("dedup", "reconcile", "--list").stdout
    assert [line.split("\t")[0] for line in listed.splitlines()] == [
        "coupons",
        "notifications",
        "payments",
        "statements",
    ]
    shown = both.run("dedup", "run", "dedup_services.payments", "--help")
    assert "--migrate-only" in shown.stdout
    located = both.run("python", "-c", "import dedup_services; print(dedup_services.__file__)")
    assert Path(located.stdout.strip()).is_relative_to(both.path), "installed, not the checkout"


async def test_newcomer_follows_the_quickstart_to_a_balance_moved_once(
    library_venv: Venv, services: Services
) -> None:
    """The quickstart's files and commands, verbatim and in order, from an empty database."""
    langs = [lang for lang, _ in QUICKSTART_BLOCKS]
    assert langs == [
        *("sh", "sh", "console", "console", "python", "console", "python", "sh", "text"),
        *("python", "console", "text", "console", "console", "text", "python", "python"),
        *("ini", "python", "sh", "text"),
    ]
    (
        _,
        variables,
        migrate,
        business_table,
        create_topic,
        topic_created,
        app,
        run_app,
        app_started,
        send,
        sent,
        app_counted,
        balance,
        audit,
        app_stopped,
        _batch_handler,  # tests/integration/test_docs_quickstart.py runs these two fragments
        _wrap_loop,
        pytest_ini,
        test_file,
        run_tests,
        tests_passed,
    ) = (body for _, body in QUICKSTART_BLOCKS)
    database = f"newcomer_{uuid.uuid4().hex[:8]}"
    topic = f"quickstart-payments-{uuid.uuid4().hex[:8]}"
    newcomer_dsn = await dev_database.create(services.dsn, database)
    shell = library_venv.env() | {
        "KAFKA_BOOTSTRAP_SERVERS": services.bootstrap_servers,
        "DEDUP_DSN": newcomer_dsn,
        "PAYMENTS_TOPIC": topic,
    }
    app_process = None
    try:
        # The variables block keeps values that are set (here: the test's own).
        echoed = library_venv.sh(
            variables + 'echo "$KAFKA_BOOTSTRAP_SERVERS $DEDUP_DSN $PAYMENTS_TOPIC"', shell
        )
        assert echoed.split() == [shell[k] for k in ("KAFKA_BOOTSTRAP_SERVERS", "DEDUP_DSN")] + [
            topic
        ]

        def console(block: str) -> None:
            for command, expected in docs_support.console(block):
                out = library_venv.sh(command, shell)
                # The page shows the default topic name; this run has a topic of its own,
                # so a table's columns are as wide as its name makes them.
                pattern = docs_support.expected_pattern(
                    docs_support.columns(expected.replace("quickstart-payments", topic))
                )
                assert pattern.fullmatch(docs_support.columns(out)), (
                    f"$ {command}\n{out}\nwanted:\n{expected}"
                )

        console(migrate)
        console(business_table)
        _write_file(library_venv.cwd, create_topic)
        console(topic_created)
        _write_file(library_venv.cwd, app)
        assert run_app == "python payments_app.py\n"
        app_process = await asyncio.create_subprocess_exec(
            "/bin/sh",
            "-c",
            f"exec {run_app}",
            cwd=library_venv.cwd,
            env=shell,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output = AppOutput(app_process)
        await output.shows(app_started, topic)
        _write_file(library_venv.cwd, send)
        console(sent)
        await output.shows(app_counted, topic)
        console(balance)
        console(audit)
        app_process.send_signal(signal.SIGINT)  # Ctrl-C
        assert await asyncio.wait_for(app_process.wait(), 30) == 0, output.text
        await output.shows(app_stopped, topic)

        # Section 10: the testing extra, dedup's pytest plugin from its entry point, on the
        # page's database (DEDUP_DSN), each test on a schema of its own that is dropped after.
        _write_file(library_venv.cwd, pytest_ini, ".ini")
        _write_file(library_venv.cwd, test_file)
        assert run_tests == "pip install 'dedup-kafka[testing]'\npytest test_payments_app.py\n"
        tested = library_venv.sh(run_tests, shell)
        assert docs_support.expected_pattern(tests_passed).fullmatch(tested), tested
        assert await _dedup_test_schemas(newcomer_dsn) == []
    finally:
        if app_process is not None and app_process.returncode is None:
            app_process.kill()
            await app_process.wait()
        await dev_database.drop(services.dsn, database)
        await _delete_topic(services, topic)


class AppOutput:
    """What the running app has printed so far (its log lines go to stderr)."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.text = ""
        self._reader = asyncio.create_task(self._read(process))

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        async for line in process.stdout:
            self.text += line.decode()

    async def shows(self, expected: str, topic: str) -> None:
        """Wait until the page's output block appears in what the app printed."""
        pattern = docs_support.expected_pattern(expected.replace("quickstart-payments", topic))

        async def found() -> bool:
            return pattern.search(self.text) is not None

        await helpers.wait_for(found, within=30, what=f"the app to print:\n{expected}")


def _write_file(folder: Path, text: str, suffix: str = ".py") -> None:
    """A file of the page, under the name its first line gives (``# name.py: ...``)."""
    first = text.splitlines()[0]
    assert first.startswith("# ") and suffix in first, first
    name = first[2:].split(":")[0].strip()
    (folder / name).write_text(text)


async def _dedup_test_schemas(dsn: str) -> list[str]:
    """The schemas dedup.testing made that are still there."""
    conn = await asyncpg.connect(dsn)
    try:
        found = await conn.fetch(
            "SELECT nspname FROM pg_namespace WHERE starts_with(nspname, 'dedup_test_')"
        )
    finally:
        await conn.close()
    return [r["nspname"] for r in found]


async def _delete_topic(services: Services, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=services.bootstrap_servers)
    await admin.start()
    try:
        if topic in await admin.list_topics():
            await admin.delete_topics([topic])
    finally:
        await admin.close()
