"""Every snippet of docs/howto/faststream.md runs: its app on the real broker, its test in memory.

The page's ``app.py`` and ``test_app.py`` are written out as the files they
say they are.  ``pytest test_app.py`` runs first, on a fresh database with
FastStream's ``TestKafkaBroker``: the order sent twice is applied once.  Then
``python app.py`` consumes a real topic in which an order comes twice, and one
the in-memory test applied comes again: each order is applied exactly once,
and SIGTERM stops the app cleanly.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any

import orjson

from dedup_dev import children, helpers
from dedup_dev import docs as docs_support
from dedup_dev import kafka as kafka_support
from dedup_dev.kafka import Topics
from dedup_dev.services import ROOT

PAGE = ROOT / "docs" / "howto" / "faststream.md"


async def test_the_faststream_howto_app_runs_on_the_real_broker_and_in_memory(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics, tmp_path: Path
) -> None:
    blocks = docs_support.checked_snippets(PAGE.name, PAGE.read_text(encoding="utf-8"))
    assert [lang for lang, _ in blocks] == ["sh", "python", "sh", "python", "sh"]
    (_, install), (_, app_code), (_, run_app), (_, test_code), (_, run_test) = blocks
    # The extra the page installs is the one pyproject.toml declares.
    assert install.startswith("pip install 'dedup-kafka[faststream]'")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(
        d.startswith("faststream[kafka]") for d in extras["optional-dependencies"]["faststream"]
    )
    assert app_code.startswith("# app.py\n") and test_code.startswith("# test_app.py\n")
    (tmp_path / "app.py").write_text(app_code, encoding="utf-8")
    (tmp_path / "test_app.py").write_text(test_code, encoding="utf-8")
    await pool.execute("CREATE TABLE orders (order_id text, amount int)")
    topic = await topics.create(partitions=2, prefix="orders")
    env = docs_support.shell_env(dsn, bootstrap_servers) | {"ORDERS_TOPIC": topic}

    assert run_test.strip() == "pytest test_app.py"
    out = docs_support.run(f"{run_test.strip()} -q -p no:cacheprovider", env, cwd=tmp_path)
    assert "1 passed" in out, out
    assert await pool.fetchval("SELECT count(*) FROM orders") == 1

    assert run_app.strip() == "python app.py"
    app = await children.Child.spawn(
        [sys.executable, "app.py"], name="faststream app", env=env, cwd=tmp_path
    )
    try:
        orders = ["o-1", "o-2", "o-3", "o-2", "o-4"]  # o-2 twice; o-1 applied in memory
        await kafka_support.produce(
            bootstrap_servers,
            topic,
            ((o.encode(), orjson.dumps({"order_id": o, "amount": 5})) for o in orders),
        )

        async def all_applied() -> bool:
            return bool(await pool.fetchval("SELECT count(DISTINCT order_id) = 4 FROM orders"))

        await helpers.wait_for(all_applied, within=30, what="the app applying the orders")
        assert await app.stop() == 0, await app.stderr()
    finally:
        await app.close()
    rows = await pool.fetch("SELECT order_id, count(*) FROM orders GROUP BY 1 ORDER BY 1")
    assert [tuple(r) for r in rows] == [("o-1", 1), ("o-2", 1), ("o-3", 1), ("o-4", 1)]
