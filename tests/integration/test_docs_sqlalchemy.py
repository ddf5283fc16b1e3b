"""Every snippet of docs/howto/sqlalchemy.md runs, in page order, on the real services.

The page's models, loop and run script are written out as the files they say
they are, and ``python run.py`` runs as the page says: it makes the tables
and the topic, sends the payments (a duplicate and a conflicting copy among
them) and consumes them until Kafka holds its offsets; it stops on Ctrl-C.
The page's query prints its rows in psql.  Then the group's offsets go back
to the start, as after a crash between the Postgres and the Kafka commit, and
every record is delivered again: nothing is applied twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import sys
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from dedup_dev import docs as docs_support
from dedup_dev import kafka as kafka_support
from dedup_dev.kafka import Topics
from dedup_dev.services import ROOT

PAGE = ROOT / "docs" / "howto" / "sqlalchemy.md"

# This page runs on the run's one docs database, after the pages before it (tests/conftest.py).
pytestmark = pytest.mark.docs_page


@contextlib.contextmanager
def page_modules(tmp_path: Path, blocks: dict[str, str]) -> Iterator[dict[str, Any]]:
    """Write each ``# name.py`` block as that module and import them; forget them afterwards."""
    for name, code in blocks.items():
        (tmp_path / f"{name}.py").write_text(code, encoding="utf-8")
    sys.path.insert(0, str(tmp_path))
    try:
        yield {name: importlib.import_module(name) for name in blocks}
    finally:
        sys.path.remove(str(tmp_path))
        for name in blocks:
            sys.modules.pop(name, None)


async def test_every_snippet_of_the_sqlalchemy_howto_works(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics, tmp_path: Path
) -> None:
    blocks = docs_support.checked_snippets(PAGE.name, PAGE.read_text(encoding="utf-8"))
    assert [lang for lang, _ in blocks] == [
        *("python", "python", "python", "sh"),  # models.py, consume.py, run.py; run it
        *("sql", "text", "console"),
    ]
    (_, models_code), (_, consume_code), (_, run_code), (_, run_command) = blocks[:4]
    (_, seen_sql), (_, seen_rows), (_, audit_console) = blocks[4:]
    for name, code in (("models", models_code), ("consume", consume_code), ("run", run_code)):
        assert code.startswith(f"# {name}.py\n")
        (tmp_path / f"{name}.py").write_text(code, encoding="utf-8")

    # The page's run.py makes the topic (under this test's name) and the tables.
    topic = f"ledger-{uuid.uuid4().hex[:12]}"
    topics.created.append(topic)
    group = "ledger-payments"  # consume()'s default, which run.py keeps
    env = docs_support.shell_env(dsn, bootstrap_servers) | {"LEDGER_TOPIC": topic}
    assert run_command == "python run.py\n"
    ends = await docs_support.until_committed(
        run_command, cwd=tmp_path, env=env,
        started=f"sent 5 payments to {topic}; consuming until Ctrl-C\n",
        bootstrap_servers=bootstrap_servers, group=group, topic=topic, partitions=2,
    )  # fmt: skip

    first = [tuple(r) for r in await pool.fetch(seen_sql)]
    shown = docs_support.run(f'psql "$DEDUP_DSN" -c "{seen_sql}"', env)
    assert docs_support.columns(shown) == docs_support.columns(seen_rows), shown
    for command, expected in docs_support.console(audit_console):
        out = docs_support.run(command, env)
        assert docs_support.expected_pattern(expected + "\n").fullmatch(out), out

    # A crash after the Postgres commit, before Kafka's: every record again.
    url = dsn.replace("postgresql://", "postgresql+asyncpg://", 1)
    with page_modules(tmp_path, {"models": models_code, "consume": consume_code}) as mods:
        await kafka_support.reset(bootstrap_servers, group, topic, {0: 0, 1: 0})
        loop = asyncio.create_task(
            mods["consume"].consume(url, bootstrap_servers, topic=topic, group_id=group)
        )
        try:
            await docs_support.committed_to(bootstrap_servers, group, topic, ends)
        finally:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
    again = [tuple(r) for r in await pool.fetch(seen_sql)]

    d = Decimal
    assert first == [
        ("p1", "acme", d("10.00"), d("15.50"), 1, 0),
        ("p2", "acme", d("5.50"), d("15.50"), 0, 1),
        ("p3", "globex", d("7.25"), d("7.25"), 0, 0),
    ]
    # Applied once: the same payments and balances; each redelivered copy counted.
    assert again == [
        ("p1", "acme", d("10.00"), d("15.50"), 3, 0),
        ("p2", "acme", d("5.50"), d("15.50"), 1, 2),
        ("p3", "globex", d("7.25"), d("7.25"), 1, 0),
    ]
    dead = await pool.fetch(
        "SELECT idempotency_key, reason FROM dedup.dead_letters WHERE namespace = 'ledger'"
    )
    assert [r["idempotency_key"] for r in dead] == ["p2"], "the conflicting copy, once"
    assert dead[0]["reason"].startswith("conflict: key 'p2' was applied from")
