"""The commands of docs/operations.md's failover section run against a primary and a real standby.

The page's hosts ``db1`` and ``db2`` become the chaos Postgres and a streaming
standby of it (:mod:`tests.chaos.pg_failover`), ``app`` and ``shop`` this run's
user and database.  The commands run while the primary is up (``db1``
answers), and again after it was killed and the standby promoted (``db1``
refuses, ``db2`` takes writes), with the same DSNs.  While the standby is not
yet promoted, a DSN naming only it is turned down, as the page says.
"""

from __future__ import annotations

import asyncio

import pytest

from dedup_dev import docs as docs_support
from dedup_dev.services import ROOT
from tests.chaos import driver, pg_failover
from tests.chaos.services import STANDBY_PORT

pytestmark = pytest.mark.chaos

PAGE = ROOT / "docs" / "operations.md"
SECTION = "## Against a replicated Postgres"


async def run_console(text: str, env: dict[str, str], ours: dict[str, str]) -> None:
    def mine(line: str) -> str:
        for theirs, local in ours.items():
            line = line.replace(theirs, local)
        return line

    for command, expected in docs_support.console(text):
        done = await asyncio.to_thread(docs_support.run, mine(command), env)
        assert docs_support.expected_pattern(expected).fullmatch(done), (
            f"`{mine(command)}` printed:\n{done}\nthe page says:\n{expected}"
        )


async def test_the_multi_host_dsn_finds_the_primary_before_and_after_a_failover(
    chaos_run: driver.RunContext,
) -> None:
    blocks = docs_support.checked_snippets(
        PAGE.name, docs_support.section(PAGE.read_text(encoding="utf-8"), SECTION)
    )
    assert [language for language, _ in blocks] == ["console"]
    [(_, commands)] = blocks
    primary = int(chaos_run.dsn.rsplit(":", 1)[1].split("/", 1)[0])
    database = chaos_run.dsn.rsplit("/", 1)[1]
    ours = {
        "app@db1:5432,db2:5432/shop": f"postgres@127.0.0.1:{primary},127.0.0.1:{STANDBY_PORT}/"
        f"{database}",
        "host=db1,db2 port=5432,5432 user=app dbname=shop": "host=127.0.0.1,127.0.0.1 "
        f"port={primary},{STANDBY_PORT} user=postgres dbname={database}",
    }
    env = docs_support.shell_env(chaos_run.dsn, chaos_run.services.bootstrap_servers)
    standby = await pg_failover.Standby.create(chaos_run.services, synchronous=False)
    try:
        await run_console(commands, env, ours)
        only_standby = (
            f"dedup migrate --dsn 'postgresql://postgres@127.0.0.1:{STANDBY_PORT}/{database}"
            "?target_session_attrs=read-write'"
        )
        refused = await asyncio.to_thread(docs_support.run, only_standby, env)
        assert "None of the hosts match the target attribute requirement" in refused, refused

        await standby.kill_primary()
        await standby.promote()
        await run_console(commands, env, ours)
    finally:
        await standby.discard()
