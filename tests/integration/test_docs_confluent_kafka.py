"""Every snippet of docs/howto/confluent-kafka.md runs, in page order, on the real services.

The page's modules are written out as the files they say they are; ``python
send.py`` makes the tables and the topic (under this test's name) and sends
the scans, and ``python worker.py`` runs ``dedup.sync.Consumer`` until Kafka
holds the group's commit of every record, then stops on Ctrl-C with exit 0.
The page's queries print their rows in psql, and ``dedup offsets show`` the
offsets.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from dedup_dev import docs as docs_support
from dedup_dev.kafka import Topics
from dedup_dev.services import ROOT

PAGE = ROOT / "docs" / "howto" / "confluent-kafka.md"
GROUP = "parcel-tracker"
MODULES = ("tracker", "worker", "send")

# This page runs on the run's one docs database, after the pages before it (tests/conftest.py).
pytestmark = pytest.mark.docs_page


async def test_every_snippet_of_the_confluent_kafka_howto_works(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics, tmp_path: Path
) -> None:
    blocks = docs_support.checked_snippets(PAGE.name, PAGE.read_text(encoding="utf-8"))
    assert [lang for lang, _ in blocks] == [
        *("python", "python", "python", "sh"),  # tracker.py, worker.py, send.py; run them
        *("sql", "text", "sql", "text", "console"),  # what you see
    ]
    for name, (_, text) in zip(MODULES, blocks[:3], strict=True):
        assert text.startswith(f"# {name}.py\n")
        (tmp_path / f"{name}.py").write_text(text, encoding="utf-8")
    send, work = blocks[3][1].splitlines()
    (_, parcels_sql), (_, parcels), (_, letters_sql), (_, letters), (_, offsets) = blocks[4:9]

    topic = f"parcel-scans-{uuid.uuid4().hex[:12]}"
    topics.created.append(topic)
    env = docs_support.shell_env(dsn, bootstrap_servers) | {"PARCEL_TOPIC": topic}
    assert send == "python send.py"
    assert docs_support.run(send, env, cwd=tmp_path) == f"sent 5 scans to {topic}\n"
    assert work == "python worker.py"
    await docs_support.until_committed(
        work, cwd=tmp_path, env=env, started="tracking parcel scans; Ctrl-C stops\n",
        bootstrap_servers=bootstrap_servers, group=GROUP, topic=topic, partitions=2,
    )  # fmt: skip

    for query, rows in ((parcels_sql, parcels), (letters_sql, letters)):
        shown = docs_support.run(f'psql "$DEDUP_DSN" -c "{query.strip()}"', env)
        assert docs_support.columns(shown) == docs_support.columns(rows), shown
    # The table's widths follow the names: compared with runs of blanks made one, the test's
    # topic named as the page names it.
    for command, expected in docs_support.console(offsets):
        out = docs_support.columns(docs_support.run(command, env).replace(topic, "parcel-scans"))
        pattern = docs_support.expected_pattern(docs_support.columns(expected))
        assert pattern.fullmatch(out), out
    # Each scan's key claimed once; the retry of s1 counted on it, not applied.
    counted = await pool.fetch(
        "SELECT idempotency_key, duplicates FROM dedup.processed WHERE namespace = $1 ORDER BY 1",
        GROUP,
    )
    assert [tuple(r) for r in counted] == [("s1", 1), ("s2", 0), ("s3", 0)]
    assert await pool.fetchval("SELECT count(*) FROM parcel_scans") == 3
