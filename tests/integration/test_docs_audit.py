"""Every snippet of docs/reference/cli.md and docs/howto/audit-and-purge.md runs as written.

Each page runs, block by block in page order, against a fresh database loaded
with the story the pages tell (statement requests for 2026-11-30 consumed in
namespace ``statements``, and the ``month-end`` task) by the audit page's own
setup commands and the SQL of its appendix.  A ``console`` block is
a list of ``$ command`` lines, each followed by its expected output; the
command runs in ``/bin/sh`` with ``DEDUP_DSN`` and ``KAFKA_BOOTSTRAP_SERVERS``
pointing at the test's services and must print exactly that (``...`` stands
for anything on a line, or for any lines when alone).  A ``sql`` block runs in
a transaction that is rolled back (it creates cluster-wide roles); a ``cron``
block's commands run the way cron runs them.  A block of any other kind fails
the test, so nothing is added to the pages without a run here.  The sections on
``dedup offsets`` (a story with a running consumer) and ``dedup migrate`` (an
empty database) are run by test_docs_offsets.py and test_docs_migrate.py, the audit
page's on least privilege (cluster-wide roles, made for real) by test_roles.py.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from dedup_dev import docs as docs_support
from dedup_dev.services import ROOT

CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"

AUDIT_PAGE = ROOT / "docs" / "howto" / "audit-and-purge.md"
STORY = "-- story.sql"
"""The first line of the audit page's appendix: the story's rows, which its setup loads."""


def story_setup() -> tuple[str, str]:
    """The audit page's setup commands, and the story's SQL they load as story.sql."""
    found = blocks(AUDIT_PAGE)
    (setup,) = [text for language, text in found if language == "sh"]
    (story,) = [text for language, text in found if text.startswith(STORY)]
    assert "story.sql" in setup
    return setup, story


def load_story(env: dict[str, str], folder: Path) -> None:
    """Run the page's setup as written, from a folder that has story.sql and the checkout's
    compose/ (as the checkout's root has)."""
    setup, story = story_setup()
    (folder / "story.sql").write_text(story)
    (folder / "compose").symlink_to(ROOT / "compose")
    out = docs_support.run(f"set -e\n{setup}echo set up", env, cwd=folder)
    assert out.endswith("set up\n"), out


def blocks(page: Path) -> list[tuple[str, str]]:
    """(language, text) of each fenced code block of ``page``, in order."""
    text = page.read_text(encoding="utf-8")
    if page == CLI_PAGE:
        for own_story in (docs_support.CLI_OFFSETS, docs_support.CLI_MIGRATE):
            text = docs_support.outside(text, own_story)
    if page == AUDIT_PAGE:
        text = docs_support.outside(text, docs_support.AUDIT_ROLES)
    return docs_support.checked_snippets(page.name, text)


def crontab(text: str) -> list[str]:
    """The commands of a crontab (its variables are the test's own)."""
    commands = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#") or re.match(r"^\w+=", line):
            continue
        fields = line.split(maxsplit=5)
        assert len(fields) == 6, f"not a crontab entry: {line!r}"
        assert "%" not in fields[5], "an unescaped % is a newline to cron"
        commands.append(fields[5])
    return commands


@pytest.mark.parametrize("page", [CLI_PAGE, AUDIT_PAGE], ids=lambda p: p.name)
async def test_every_snippet_of_the_page_runs_as_written(
    page: Path, dsn: str, bootstrap_servers: str, pool: Any, tmp_path: Path
) -> None:
    env = docs_support.shell_env(dsn, bootstrap_servers)
    await asyncio.to_thread(load_story, env, tmp_path)
    assert await pool.fetchval("SELECT count(*) FROM dedup.dead_letters") == 2
    found = blocks(page)
    assert found, f"{page.name} has no snippets"
    for language, text in found:
        if text in story_setup():
            continue  # loaded above
        if language == "console":
            for command, expected in docs_support.console(text):
                actual = docs_support.run(command, env)
                assert docs_support.expected_pattern(expected + "\n").fullmatch(actual), (
                    f"{page.name}: `{command}` printed:\n{actual}\nthe page says:\n{expected}"
                )
        elif language == "sql":
            async with pool.acquire() as conn:
                tx = conn.transaction()
                await tx.start()
                try:
                    await conn.execute(text)
                    await check_roles(conn, text)
                finally:
                    await tx.rollback()
        elif language == "cron":
            for command in crontab(text):
                assert docs_support.run(command + "; echo exit $?", env).endswith("exit 0\n"), (
                    command
                )
        else:
            raise AssertionError(f"{page.name}: no way to run a {language!r} block")


async def check_roles(conn: Any, text: str) -> None:
    """Each LOGIN role the snippet creates is a member of the dedup role it names."""
    for user, group in re.findall(r"CREATE ROLE (\w+) LOGIN .*?IN ROLE (\w+)", text):
        assert await conn.fetchval("SELECT pg_has_role($1, $2, 'MEMBER')", user, group)
