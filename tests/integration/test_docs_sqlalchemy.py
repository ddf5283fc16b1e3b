"""Every snippet of docs/howto/sqlalchemy.md runs, in page order, on the real services.

The page's models and loop are written out as the two modules they say they
are and imported; the loop consumes payments (a duplicate and a conflicting
copy among them) until Kafka holds its offsets; then the group's offsets go
back to the start, as after a crash between the Postgres and the Kafka commit,
and every record is delivered again: nothing is applied twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import sys
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy.ext.asyncio import create_async_engine

from tests import helpers
from tests.conftest import ROOT, Topics
from tests.integration import docs_support, kafka_support

PAGE = ROOT / "docs" / "howto" / "sqlalchemy.md"

PAYMENTS = [
    {"payment_id": "p1", "account": "acme", "amount": "10.00"},
    {"payment_id": "p2", "account": "acme", "amount": "5.50"},
    {"payment_id": "p3", "account": "globex", "amount": "7.25"},
    {"payment_id": "p1", "account": "acme", "amount": "10.00"},  # a producer retry
    {"payment_id": "p2", "account": "acme", "amount": "9.99"},  # same key, another payload
]


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
    assert [lang for lang, _ in blocks] == ["python", "python", "sql", "console"]
    (_, models_code), (_, consume_code), (_, seen_sql), (_, audit_console) = blocks
    assert models_code.startswith("# models.py\n") and consume_code.startswith("# consume.py\n")

    topic = await topics.create(partitions=2)
    group = f"ledger-{topic}"
    url = dsn.replace("postgresql://", "postgresql+asyncpg://", 1)
    await helpers.produce(
        bootstrap_servers,
        topic,
        [(p["account"].encode(), orjson.dumps(p)) for p in PAYMENTS],
    )
    ends = await kafka_support.end_offsets(bootstrap_servers, topic, 2)

    with page_modules(tmp_path, {"models": models_code, "consume": consume_code}) as mods:
        engine = create_async_engine(url)
        try:
            async with engine.begin() as conn:
                await conn.run_sync(mods["models"].Base.metadata.create_all)
        finally:
            await engine.dispose()

        async def run_until_committed() -> None:
            loop = asyncio.create_task(
                mods["consume"].consume(url, bootstrap_servers, topic=topic, group_id=group)
            )
            try:
                await helpers.wait_for(
                    lambda: helpers.equal(kafka_support.committed(bootstrap_servers, group), ends),
                    what="the loop's Kafka commit of every record",
                    interval=0.5,
                )
            finally:
                loop.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loop

        await run_until_committed()
        first = [tuple(r) for r in await pool.fetch(seen_sql)]
        env = docs_support.shell_env(dsn, bootstrap_servers)
        for command, expected in docs_support.console(audit_console):
            out = docs_support.run(command, env)
            assert docs_support.expected_pattern(expected + "\n").fullmatch(out), out
        # A crash after the Postgres commit, before Kafka's: every record again.
        await kafka_support.reset(bootstrap_servers, group, topic, {0: 0, 1: 0})
        await run_until_committed()
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
    dead = await pool.fetch("SELECT idempotency_key, reason FROM dedup.dead_letters")
    assert [r["idempotency_key"] for r in dead] == ["p2"], "the conflicting copy, once"
    assert dead[0]["reason"].startswith("conflict: key 'p2' was applied from")
