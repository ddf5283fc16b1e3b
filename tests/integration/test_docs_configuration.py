"""Every snippet of docs/reference/configuration.md runs as written.

The page's ``console`` blocks run in ``/bin/sh`` from the checkout, with the
test's Kafka and database; the page's topic and group ``payments`` become this
test's own.  Before a ``consumer-groups`` command, the bundled payments service
consumes the topic (the page says it has), and its business row is checked.
Each command's stdout must be what the page shows (``...`` as in
docs_support.expected_pattern); a block of any other kind fails the test.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import uuid
from pathlib import Path
from typing import Any

from dedup_services import payments

from dedup_dev import docs as docs_support
from dedup_dev import effects as consumer_support
from dedup_dev import helpers
from dedup_dev.kafka import Topics
from dedup_dev.services import ROOT

PAGE = ROOT / "docs" / "reference" / "configuration.md"


async def run(command: str, env: dict[str, str]) -> str:
    proc = await asyncio.create_subprocess_exec(
        "/bin/sh",
        "-c",
        command,
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 180)
    assert proc.returncode == 0, f"`{command}` exited {proc.returncode}:\n{err.decode()}"
    return out.decode()


async def consume_the_payment(bootstrap_servers: str, topic: str, group: str, pool: Any) -> None:
    consumer = payments.SERVICE.consumer(
        topic=topic,
        bootstrap_servers=bootstrap_servers,
        pool=pool,
        group_id=group,
        install_signal_handlers=False,
    )

    async def applied() -> bool:
        return bool(await pool.fetchval("SELECT count(*) FROM payments.payments"))

    async with consumer_support.running(consumer):
        await helpers.wait_for(applied, what="the payment")
    row = await pool.fetchrow("SELECT payment_id, status, amount FROM payments.payments")
    assert tuple(row) == ("pay-1", "applied", 100)


async def test_every_snippet_of_the_page_runs_as_written(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    await payments.SERVICE.migrate(pool)
    await pool.execute("INSERT INTO payments.accounts (account, balance) VALUES ('acct-7', 500)")
    topic = f"t-{uuid.uuid4().hex[:12]}"
    topics.created.append(topic)  # the page's first command creates it; deleted afterwards
    group = f"g-{topic}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEDUP_", "PG"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(DEDUP_DSN=dsn, KAFKA_BOOTSTRAP_SERVERS=bootstrap_servers)
    if "DEDUP_CACHE" in os.environ:  # where the Kafka jars are
        env["DEDUP_CACHE"] = os.environ["DEDUP_CACHE"]

    def ours(command: str) -> str:
        command = re.sub(r"--topic payments\b", f"--topic {topic}", command)
        return re.sub(r"--group payments\b", f"--group {group}", command)

    found = docs_support.snippets(PAGE)
    assert [language for language, _ in found] == ["console"]
    for _, text in found:
        for command, expected in docs_support.console(text):
            if "consumer-groups" in command:
                await consume_the_payment(bootstrap_servers, topic, group, pool)
            actual = docs_support.columns(await run(ours(command), env))
            shown = re.sub(
                r"^payments payments ",
                f"{group} {topic} ",
                docs_support.columns(expected),
                flags=re.M,
            ).replace("Created topic payments.", f"Created topic {topic}.")
            assert docs_support.expected_pattern(shown).fullmatch(actual), (
                f"`{command}` printed:\n{actual}\nthe page says:\n{expected}"
            )
