"""Every command and file of docs/howto/django.md runs, in page order, on the real services.

In an empty folder, ``django-admin startproject`` and ``startapp`` make the
project, the page's settings go at the end of its ``settings.py``, its models
and management command are written where the page says, and Django's and
dedup's migrations run.  Kafka's tools make the topic and send the donations
(a producer retry and a conflicting copy among them) while ``python manage.py
consume_donations`` runs; once Kafka holds the group's commit of every
record, SIGTERM stops it with exit code 0 and the output the page shows.
``manage.py dbshell`` and ``dedup audit`` print what the page shows.  Then
the group's offsets go back to the start with Kafka's tool and the command
runs again: every record is a duplicate, nothing applied twice, and Ctrl-C
stops it cleanly.

The page's Kafka commands are Kafka's own scripts (``kafka-topics.sh``, ...):
here they run Kafka's tools through ``compose/local/kafka-tool``, the same
classes with the local broker's jars.  The page's topic ``donations`` is this
test's own topic (``DONATIONS_TOPIC`` in the settings, ``--topic`` in the
commands).
"""

from __future__ import annotations

import asyncio
import re
import sys
import tomllib
import uuid
from decimal import Decimal
from pathlib import Path
from signal import Signals
from typing import Any

import pytest

from dedup_dev import children
from dedup_dev import docs as docs_support
from dedup_dev import kafka as kafka_support
from dedup_dev.kafka import Topics
from dedup_dev.services import ROOT

PAGE = ROOT / "docs" / "howto" / "django.md"
GROUP = "donations"  # the command's group.id
KAFKA_SCRIPTS = {
    "kafka-topics.sh": "topics",
    "kafka-console-producer.sh": "console-producer",
    "kafka-consumer-groups.sh": "consumer-groups",
}
"""The page's Kafka scripts and the compose/local/kafka-tool tool each one is."""
PARTITIONS = 2  # the page's topic's
DONATIONS = 5  # the page sends

# This page runs on the run's one docs database, after the pages before it (tests/conftest.py).
pytestmark = pytest.mark.docs_page


def kafka_scripts(folder: Path) -> Path:
    """A folder holding the page's Kafka scripts, each running its tool on Kafka's jars."""
    folder.mkdir()
    for script, tool in KAFKA_SCRIPTS.items():
        path = folder / script
        path.write_text(f'#!/bin/sh\nexec "{ROOT}/compose/local/kafka-tool" {tool} "$@"\n')
        path.chmod(0o755)
    return folder


async def consume(
    run_command: str, *, project: Path, env: dict[str, str], send: str | None, stop: Signals,
    bootstrap_servers: str, topic: str,
) -> str:  # fmt: skip
    """Run the page's command; run ``send`` meanwhile, in another shell; once Kafka holds the
    group's commit of every record of ``topic``, ``stop`` it.  It must exit 0: what it printed.
    """
    assert run_command == "python manage.py consume_donations\n"
    command = await children.Child.spawn(
        [sys.executable, "manage.py", "consume_donations"],
        name="consume_donations", env=env, cwd=project,
    )  # fmt: skip
    try:
        if send is not None:
            await asyncio.to_thread(docs_support.run, send, env, project, check=True)
        ends = await kafka_support.end_offsets(bootstrap_servers, topic, PARTITIONS)
        assert sum(ends.values()) == DONATIONS, ends
        await docs_support.committed_to(bootstrap_servers, GROUP, topic, ends)
        assert await command.stop(stop) == 0, await command.stderr()
        return command.stdout + "\n"
    finally:
        await command.close()


async def test_every_command_of_the_django_howto_works(
    dsn: str, pool: Any, bootstrap_servers: str, topics: Topics, tmp_path: Path
) -> None:
    blocks = docs_support.checked_snippets(PAGE.name, PAGE.read_text(encoding="utf-8"))
    assert [lang for lang, _ in blocks] == [
        *("sh", "sh", "python", "python", "sh", "python"),  # install, project, files, migrate
        *("sh", "sh", "sh", "text"),  # topic, run, send, output
        *("sh", "text", "console"),  # what you see
        *("sh", "text"),  # delivered again
    ]
    (_, install), (_, startproject), (_, settings), (_, models), (_, migrate) = blocks[:5]
    (_, command_code), (_, create_topic), (_, run_command), (_, send), (_, shown) = blocks[5:10]
    (_, dbshell), (_, campaigns), (_, audit), (_, again), (_, shown_again) = blocks[10:]

    # The extras the page installs are the ones pyproject.toml declares; Django is dev's.
    assert install == "pip install 'dedup-kafka[psycopg,confluent]' django\n"
    project_toml = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project_toml["optional-dependencies"]
    assert {"psycopg", "confluent"} <= extras.keys()
    assert any(d.startswith("django>=") for d in extras["dev"])

    topic = f"donations-{uuid.uuid4().hex[:12]}"
    topics.created.append(topic)
    env = docs_support.shell_env(dsn, bootstrap_servers) | {"DONATIONS_TOPIC": topic}
    env["PATH"] = f"{kafka_scripts(tmp_path / 'kafka')}:{env['PATH']}"
    project = tmp_path / "project"
    project.mkdir()

    def ours(command: str) -> str:
        """The page's command on this test's topic."""
        assert command.count("--topic donations ") == 1, command
        return command.replace("--topic donations ", f"--topic {topic} ")

    def on_our_topic(output: str) -> str:
        """The page's output of the command, on this test's topic."""
        assert output.startswith("consuming donations; "), output
        return output.replace("consuming donations; ", f"consuming {topic}; ", 1)

    # 1-3: the project, its settings, the models, the migrations, the command.
    for line in startproject.splitlines():
        docs_support.run(line, env, project, check=True)
    assert settings.startswith("# charity/settings.py, at the end\n")
    with (project / "charity" / "settings.py").open("a", encoding="utf-8") as f:
        f.write("\n" + settings)
    for code in (models, command_code):
        path = project / code.partition("\n")[0].removeprefix("# ")
        assert path.parent.name in ("donations", "commands"), path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code, encoding="utf-8")
    for line in migrate.splitlines():  # dedup migrate: on the docs' database, a no-op
        docs_support.run(line, env, project, check=True)

    # 4: the topic; the command, running while the donations are sent; its output.
    docs_support.run(ours(create_topic), env, project, check=True)
    printed = await consume(
        run_command, project=project, env=env, send=ours(send), stop=Signals.SIGTERM,
        bootstrap_servers=bootstrap_servers, topic=topic,
    )  # fmt: skip
    assert printed == on_our_topic(shown)

    # 5: the campaigns' totals, and dedup's rows of the copies.
    out = docs_support.run(dbshell, env, project, check=True)
    assert docs_support.columns(out) == docs_support.columns(campaigns), out
    for command, expected in docs_support.console(audit):
        out = docs_support.run(command, env, project, check=True)
        assert docs_support.expected_pattern(expected + "\n").fullmatch(out), out
    first = await rows(pool)

    # 6: the group back at the start, every record delivered again: nothing applied.
    reset, run_again = again.splitlines()
    assert reset.startswith("kafka-consumer-groups.sh ") and reset.endswith(" --execute")
    out = docs_support.run(ours(reset), env, project, check=True)
    for partition in range(PARTITIONS):
        assert re.search(rf"^{GROUP} +{topic} +{partition} +0 *$", out, re.MULTILINE), out
    printed = await consume(
        run_again + "\n", project=project, env=env, send=None, stop=Signals.SIGINT,  # Ctrl-C
        bootstrap_servers=bootstrap_servers, topic=topic,
    )  # fmt: skip
    assert printed == on_our_topic(shown_again)
    assert first == [
        ("clinic", Decimal("35.00"), ["d1", "d2"]),
        ("library", Decimal("40.00"), ["d3"]),
    ]
    assert await rows(pool) == first, "applied once: the same donations and totals"
    counted = await pool.fetch(
        "SELECT idempotency_key, duplicates, conflicts FROM dedup.processed"
        " WHERE namespace = 'donations' ORDER BY 1"
    )
    assert [tuple(r) for r in counted] == [("d1", 3, 0), ("d2", 1, 2), ("d3", 1, 0)]
    dead = await pool.fetch(
        "SELECT idempotency_key FROM dedup.dead_letters WHERE namespace = 'donations'"
    )
    assert [r["idempotency_key"] for r in dead] == ["d2"], "the conflicting copy, once"


async def rows(pool: Any) -> list[tuple[str, Decimal, list[str]]]:
    """Each campaign, what it raised, and its donations."""
    found = await pool.fetch(
        "SELECT c.name, c.raised, array_agg(d.donation_id ORDER BY d.donation_id) AS donations"
        " FROM donations_campaign c JOIN donations_donation d ON d.campaign_id = c.id"
        " GROUP BY c.id ORDER BY c.name"
    )
    return [(r["name"], r["raised"], r["donations"]) for r in found]
