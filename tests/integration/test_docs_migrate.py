"""The ``dedup migrate`` section of docs/reference/cli.md runs as written.

Its blocks run in page order on a new, empty database (the page's ``shop``):
``console`` blocks as in docs_support (each command's output must be what the
page shows), the ``sql`` block for real (it makes the page's role, dropped
afterwards).  The role and the database get names of this test's own, put in
place of the page's in the commands and in what they must print; the page's
``READER_DSN`` logs in as that role, with the page's password, which no output
may show.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from dedup_dev import docs as docs_support
from dedup_dev.services import ROOT

PAGE = ROOT / "docs" / "reference" / "cli.md"


async def test_the_migrate_section_runs_as_written(
    new_database: Callable[[], Awaitable[str]], bootstrap_servers: str
) -> None:
    dsn = await new_database()
    parts = urlsplit(dsn)
    names = {"report_reader": f"report_reader_{uuid.uuid4().hex[:6]}", "shop": parts.path[1:]}
    text = docs_support.section(PAGE.read_text(encoding="utf-8"), docs_support.CLI_MIGRATE)
    found = docs_support.checked_snippets(PAGE.name, text)
    assert [language for language, _ in found] == ["console", "console", "sql", "console"]
    env = docs_support.shell_env(dsn, bootstrap_servers)
    password = ""
    try:
        for language, body in found:
            for documented, ours in names.items():
                body = body.replace(documented, ours)
            if language == "sql":
                (password,) = re.findall(r"PASSWORD '([^']+)'", body)
                host = parts.netloc.rpartition("@")[2]
                login = f"{names['report_reader']}:{password}@{host}"
                env["READER_DSN"] = urlunsplit(parts._replace(netloc=login))
                conn = await asyncpg.connect(dsn)
                try:
                    await conn.execute(body)
                finally:
                    await conn.close()
                continue
            for command, expected in docs_support.console(body):
                actual = docs_support.run(command, env)
                assert docs_support.expected_pattern(expected + "\n").fullmatch(actual), (
                    f"`{command}` printed:\n{actual}\nthe page says:\n{expected}"
                )
                assert not password or password not in actual
    finally:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f"DROP ROLE IF EXISTS {names['report_reader']}")
        finally:
            await conn.close()
