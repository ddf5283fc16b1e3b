"""Every snippet of docs/howto/faststream.md runs: its app on the real broker, its test in memory.

The page's ``app.py`` and ``test_app.py`` are written out as the files they
say they are.  ``pytest test_app.py`` (pytest from the page's ``testing``
extra) runs first, with FastStream's ``TestKafkaBroker``: the order sent twice
is applied once.  Then ``python app.py`` consumes a real topic in which an
order comes twice, one the in-memory test applied comes again and one comes
with another amount: each order is applied exactly once, FastStream's log
shows the page's lines for the suppressed copy and a warning for the
conflict, and SIGTERM stops the app cleanly.  Both run on the docs' database,
after the pages before this one (tests/conftest.py).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import orjson
import pytest

from dedup_dev import children, helpers
from dedup_dev import docs as docs_support
from dedup_dev import kafka as kafka_support
from dedup_dev.kafka import Topics
from dedup_dev.services import ROOT

PAGE = ROOT / "docs" / "howto" / "faststream.md"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
"""The colours of FastStream's log lines."""

# This page runs on the run's one docs database, after the pages before it (tests/conftest.py).
pytestmark = pytest.mark.docs_page


async def test_the_faststream_howto_app_runs_on_the_real_broker_and_in_memory(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics, tmp_path: Path
) -> None:
    blocks = docs_support.checked_snippets(PAGE.name, PAGE.read_text(encoding="utf-8"))
    assert [lang for lang, _ in blocks] == ["sh", "python", "sh", "text", "python", "sh"]
    (_, install), (_, app_code), (_, run_app), (_, app_log), (_, test_code), (_, run_test) = blocks
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

    # The test's extra brings pytest and pytest-asyncio (this venv has them: dev takes it).
    install_testing, pytest_line = run_test.strip().splitlines()
    assert install_testing.startswith("pip install 'dedup-kafka[testing]'")
    testing = extras["optional-dependencies"]["testing"]
    assert sorted(d.split(">")[0] for d in testing) == ["pytest", "pytest-asyncio"]
    assert pytest_line == "pytest test_app.py"
    out = docs_support.run(f"{pytest_line} -q -p no:cacheprovider", env, cwd=tmp_path)
    assert "1 passed" in out, out
    assert await pool.fetchval("SELECT count(*) FROM orders") == 1

    assert run_app.strip() == "python app.py"
    app = await children.Child.spawn(
        [sys.executable, "app.py"], name="faststream app", env=env, cwd=tmp_path
    )
    try:
        # o-2 twice; o-1 applied in memory; o-3 again with another amount (a conflict).
        orders = [("o-1", 5), ("o-2", 5), ("o-3", 5), ("o-2", 5), ("o-4", 5), ("o-3", 7)]
        await kafka_support.produce(
            bootstrap_servers,
            topic,
            ((o.encode(), orjson.dumps({"order_id": o, "amount": a})) for o, a in orders),
        )

        async def all_applied() -> bool:
            return bool(await pool.fetchval("SELECT count(DISTINCT order_id) = 4 FROM orders"))

        await helpers.wait_for(all_applied, within=30, what="the app applying the orders")
        assert await app.stop() == 0, await app.stderr()
        # FastStream's log: the page's lines for o-2's second copy, and the conflict's warning.
        logged = ANSI.sub("", app.stdout)  # the subscribers' log (the app's own: stderr)
        shown = app_log.replace("- orders |", f"- {topic} |")
        assert docs_support.expected_pattern(shown).search(logged), logged
        assert "conflict on key 'o-3': applied before with another payload; dead-lettered" in logged
        assert logged.count("suppressed: applied before, subscriber not run") == 2  # o-2, o-1
    finally:
        await app.close()
    rows = await pool.fetch("SELECT order_id, count(*) FROM orders GROUP BY 1 ORDER BY 1")
    assert [tuple(r) for r in rows] == [("o-1", 1), ("o-2", 1), ("o-3", 1), ("o-4", 1)]
