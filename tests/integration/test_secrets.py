"""No password reaches an error, a log line, a span attribute or what the CLI prints.

Each test logs in as a new LOGIN role with a password, granted the schema's runtime role.
The password is given in each way libpq users give one: in the URL's user info,
as ``?password=`` or ``&password=``, in keyword/value pairs, in ``PGPASSWORD``,
in a ``.pgpass`` file (``PGPASSFILE``).  (The test server trusts local
connections, so the password is carried, never checked: what matters here is
that it is never shown.)  Each form goes through the success path and the
failures that print the DSN: a closed port, a database that does not exist, a
schema that was never migrated, a role that may not migrate.  Every exception
(with its causes, as a traceback shows them), every log record at DEBUG, every
span, and stdout and stderr of every command are searched for the password.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import traceback
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import dedup
from dedup.cli import _main as cli
from dedup.data import _migrations as migrations
from dedup_dev import effects as support
from dedup_dev import helpers
from dedup_dev.database import LoginAs
from dedup_dev.kafka import Topics

MARK = uuid.uuid4().hex
"""In every password of this run; found in none of the outputs."""
PASSWORD = f"pw@/?&#{MARK}"
"""Characters with a meaning in a URL, so the encoded and decoded forms differ."""
PGPASS_FORMS = ("PGPASSWORD", "pgpass")
FORMS = ("userinfo", "query", "query_amp", "keyword", *PGPASS_FORMS)
CLOSED_PORT = 1


@dataclass(frozen=True)
class Login:
    """A role with a password on this test's database, and its password given one way."""

    role: str
    host: str
    port: int
    database: str
    form: str
    pgpass: Path

    def dsn(self, *, port: int | None = None, database: str | None = None) -> str:
        """The DSN in this form, optionally with another port or database."""
        port = port or self.port
        database = database or self.database
        encoded = urllib.parse.quote(PASSWORD, safe="")
        url = f"postgresql://{self.role}@{self.host}:{port}/{database}"
        if self.form == "userinfo":
            return f"postgresql://{self.role}:{encoded}@{self.host}:{port}/{database}"
        if self.form == "query":
            return f"{url}?password={encoded}"
        if self.form == "query_amp":
            return f"{url}?sslmode=disable&password={encoded}"
        if self.form == "keyword":
            quoted = PASSWORD.replace("\\", "\\\\").replace("'", "\\'")
            return (
                f"host={self.host} port={port} user={self.role} password='{quoted}' "
                f"dbname={database}"
            )
        return url

    def env(self) -> dict[str, str]:
        """Where the password is when it is not in the DSN."""
        if self.form == "PGPASSWORD":
            return {"PGPASSWORD": PASSWORD}
        if self.form == "pgpass":
            return {"PGPASSFILE": str(self.pgpass)}
        return {}

    @property
    def in_dsn(self) -> bool:
        """True when the DSN holds the password (and errors show it masked)."""
        return self.form not in PGPASS_FORMS


@pytest.fixture(params=FORMS)
async def login(
    request: pytest.FixtureRequest,
    login_as: LoginAs,
    pool: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Login:
    """A new LOGIN role with PASSWORD, granted the schema's runtime role; its password in one
    form."""
    runtime = (await migrations.roles(pool)).runtime
    parts = urllib.parse.urlsplit(await login_as(runtime, password=PASSWORD))
    await pool.execute(support.EFFECTS)
    await pool.execute(f'GRANT ALL ON effects, effects_id_seq TO "{runtime}"')
    role = parts.username or ""
    pgpass = tmp_path / "pgpass"
    pgpass.write_text(f"*:*:*:{role}:{PASSWORD}\n")
    pgpass.chmod(0o600)
    found = Login(
        role, parts.hostname or "", parts.port or 5432, parts.path[1:], request.param, pgpass
    )
    monkeypatch.delenv("PGPASSWORD", raising=False)
    monkeypatch.delenv("PGPASSFILE", raising=False)
    for name, value in found.env().items():
        monkeypatch.setenv(name, value)
    return found


class Shown:
    """What the test saw: texts it adds, and every log record (at DEBUG)."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self.caplog = caplog
        self.texts: list[str] = []

    def add(self, *texts: str) -> None:
        self.texts += texts

    def check(self) -> None:
        """Nothing seen holds the password (MARK is in it, written or encoded)."""
        self.add(self.caplog.text, *(repr(r.args) for r in self.caplog.records))
        for text in self.texts:
            assert MARK not in text, text


@pytest.fixture
def shown(caplog: pytest.LogCaptureFixture) -> Shown:
    """Collects what the test saw; ``check()`` it at the end."""
    caplog.set_level(logging.DEBUG)
    return Shown(caplog)


def spans_text(exporter: InMemorySpanExporter) -> str:
    """Every span's name, attributes, events, links and status, as one text."""
    return "\n".join(
        orjson.dumps(orjson.loads(span.to_json()), option=orjson.OPT_SORT_KEYS).decode()
        for span in exporter.get_finished_spans()
    )


async def raises(call: Callable[[], Awaitable[Any]], shown: Shown) -> str:
    """What ``call`` raised (a dedup error) as a traceback prints it, causes included."""
    with pytest.raises(dedup.DedupError) as caught:
        await call()
    text = "".join(traceback.format_exception(caught.value))
    shown.add(text)
    return text


async def job(run: dedup.TaskRun) -> str:
    """A task job for the CLI (``tests.integration.test_secrets:job``) and the library."""
    return run.holder


def consumer(dsn: str, topic: str, bootstrap_servers: str, **options: Any) -> Any:
    """A consumer of ``topic`` opening its own pool with ``dsn``."""
    return support.consumer(
        support.record_effect, topic, bootstrap_servers, None, dsn=dsn, **options
    )


async def test_the_library_never_shows_the_password(
    login: Login,
    bootstrap_servers: str,
    topics: Topics,
    pool: Any,
    spans: InMemorySpanExporter,
    shown: Shown,
) -> None:
    dsn = login.dsn()
    topic = await topics.create()
    # Success: migrate (nothing to do, so no DDL for this runtime role), a task, a consumer.
    assert await dedup.migrate(dsn) == []
    outcome = await dedup.TaskRunner(dsn=dsn, holder="h").run("secrets", "k", job)
    assert outcome.status == "succeeded"
    await helpers.produce(bootstrap_servers, topic, [(b"k", b'{"id": "m-1"}')])
    running = consumer(dsn, topic, bootstrap_servers)
    async with support.running(running):
        await helpers.wait_for(lambda: support.handled(running, 1), what="the message")
    assert await support.effect_counts(pool) == (1, 1)

    # Failures that print the DSN: a closed port, a database that does not exist.
    for broken in (login.dsn(port=CLOSED_PORT), login.dsn(database=f"{login.database}_gone")):
        text = await raises(lambda d=broken: dedup.migrate(d), shown)
        assert ("***" in text) == login.in_dsn, text
        await raises(lambda d=broken: dedup.TaskRunner(dsn=d).run("secrets", "k", job), shown)
        await raises(consumer(broken, topic, bootstrap_servers).run, shown)
    # A schema never migrated; a role that may not migrate.
    await raises(
        lambda: dedup.TaskRunner(dsn=dsn, schema="nothere").run("secrets", "k", job),
        shown,
    )
    await raises(consumer(dsn, topic, bootstrap_servers, schema="nothere").run, shown)
    refused = await raises(lambda: dedup.migrate(dsn, schema="fresh"), shown)
    assert f'role "{login.role}" may not migrate schema "fresh"' in refused

    shown.add(spans_text(spans))
    shown.check()


COMMANDS = [
    ["migrate"],
    ["migrate", "--status", "--format", "json"],
    ["migrate", "--sql"],
    ["audit", "--key", "k"],
    ["events", "--key", "k"],
    ["dead-letters", "list"],
    ["purge", "--older-than", "30d", "--dry-run"],
    ["offsets", "show", "--bootstrap-servers", ""],
    ["reconcile", "--task", "payments", "--date", "2026-11-30"],
    ["task", "run", "tests.integration.test_secrets:job", "--task", "secrets", "--key", "k"],
    ["run", "dedup_services.payments", "--migrate-only"],
]


def argv(command: list[str], dsn: str, schema: str | None = None) -> list[str]:
    """``command`` with ``--dsn`` (and ``--schema``) where its parser takes them."""
    options = ["--dsn", dsn, *(["--schema", schema] if schema else [])]
    if command[0] == "run":  # options after the module are the service's
        return [command[0], *options, *command[1:]]
    return [*command, *options]


def test_the_cli_never_shows_the_password(
    login: Login, capsys: pytest.CaptureFixture[str], shown: Shown
) -> None:
    cases = [
        (login.dsn(), None),
        (login.dsn(port=CLOSED_PORT), None),
        (login.dsn(database=f"{login.database}_gone"), None),
        (login.dsn(), "nothere"),
    ]
    codes = {}
    for dsn, schema in cases:
        for command in COMMANDS:
            args = argv(command, dsn, schema)
            code = cli.main(args)
            out, err = capsys.readouterr()
            shown.add(out, err)
            codes[" ".join(command), dsn, schema] = code
            assert code in (0, 1, 2), (args, out, err)
            if dsn != login.dsn() and login.in_dsn:
                assert "***" in err, (args, err)  # the DSN was shown, masked
    # The success path did succeed where this runtime role may act.
    assert codes["migrate", login.dsn(), None] == 0
    assert codes["migrate --status --format json", login.dsn(), None] == 0
    assert codes[" ".join(COMMANDS[-2]), login.dsn(), None] == 0
    shown.check()


def test_the_dedup_command_never_shows_the_password(login: Login) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEDUP_", "PG"))}
    env.update(login.env())
    for args, code in (
        (["migrate", "--dsn", login.dsn(port=CLOSED_PORT)], 1),
        (["audit", "--key", "k", "--dsn", login.dsn(database=f"{login.database}_gone")], 2),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "dedup", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == code, done.stdout + done.stderr
        assert "Traceback" not in done.stderr
        assert MARK not in done.stdout + done.stderr, done.stdout + done.stderr
