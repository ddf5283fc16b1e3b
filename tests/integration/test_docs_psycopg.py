"""Every snippet of docs/howto/psycopg.md runs, in page order, on the real services.

The page's modules and run script are written out as the files they say they
are, and ``python run.py`` runs as the page says: it makes the table and the
topic, sends the top-ups (a producer retry and a conflicting copy among them)
and consumes them with confluent-kafka and ``dedup.sync.claim`` until Kafka
holds its offsets; it stops on Ctrl-C.  The page's queries print their rows
in psql, and ``dedup audit`` the conflicting copy.  Then every record is read
again with aiokafka and applied with the page's asyncio version on a
``psycopg.AsyncConnection``: every key is claimed already, nothing credited
twice.
"""

from __future__ import annotations

import sys
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dedup_dev import docs as docs_support
from dedup_dev import kafka as kafka_support
from dedup_dev.kafka import Topics
from dedup_dev.services import ROOT

PAGE = ROOT / "docs" / "howto" / "psycopg.md"
GROUP = "wallet"  # consume()'s default, which run.py keeps
MODULES = ("wallet", "consume", "run", "wallet_async")

# This page runs on the run's one docs database, after the pages before it (tests/conftest.py).
pytestmark = pytest.mark.docs_page


async def test_every_snippet_of_the_psycopg_howto_works(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics, tmp_path: Path
) -> None:
    blocks = docs_support.checked_snippets(PAGE.name, PAGE.read_text(encoding="utf-8"))
    assert [lang for lang, _ in blocks] == [
        *("python", "python", "python", "sh"),  # wallet.py, consume.py, run.py; run it
        *("sql", "text", "sql", "text", "console", "python"),  # ...; wallet_async.py
    ]
    code = dict(zip(MODULES, [c for _, c in (*blocks[:3], blocks[-1])], strict=True))
    for name, text in code.items():
        assert text.startswith(f"# {name}.py\n")
        (tmp_path / f"{name}.py").write_text(text, encoding="utf-8")
    run_command = blocks[3][1]
    (_, balances_sql), (_, balances), (_, keys_sql), (_, keys), (_, audit) = blocks[4:9]

    # The page's run.py makes the topic (under this test's name) and the table.
    topic = f"wallet-{uuid.uuid4().hex[:12]}"
    topics.created.append(topic)
    env = docs_support.shell_env(dsn, bootstrap_servers) | {"WALLET_TOPIC": topic}
    assert run_command == "python run.py\n"
    await docs_support.until_committed(
        run_command, cwd=tmp_path, env=env,
        started=f"sent 5 top-ups to {topic}; consuming until Ctrl-C\n",
        bootstrap_servers=bootstrap_servers, group=GROUP, topic=topic, partitions=2,
    )  # fmt: skip

    for query, rows in ((balances_sql, balances), (keys_sql, keys)):
        shown = docs_support.run(f'psql "$DEDUP_DSN" -c "{query.strip()}"', env)
        assert docs_support.columns(shown) == docs_support.columns(rows), shown
    for command, expected in docs_support.console(audit):
        out = docs_support.run(command, env)
        assert docs_support.expected_pattern(expected + "\n").fullmatch(out), out

    # The same records again, through the asyncio version: all claimed already.
    records = await kafka_support.read_topic(bootstrap_servers, topic)
    sys.path.insert(0, str(tmp_path))
    try:
        from wallet_async import apply_async  # type: ignore[import-not-found]

        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            again = await apply_async(conn, records)
    finally:
        sys.path.remove(str(tmp_path))
        for name in MODULES:
            sys.modules.pop(name, None)
    assert (again.fresh, len(again.duplicates), len(again.conflicts)) == ([], 4, 1)
    found = await pool.fetch("SELECT wallet, balance FROM wallet_balances ORDER BY 1")
    assert [tuple(r) for r in found] == [("w1", Decimal("15.50")), ("w2", Decimal("7.25"))]
    counted = await pool.fetch(
        "SELECT idempotency_key, duplicates, conflicts FROM dedup.processed"
        " WHERE namespace = 'wallet' ORDER BY 1"
    )
    assert [tuple(r) for r in counted] == [("t1", 3, 0), ("t2", 1, 2), ("t3", 1, 0)]
