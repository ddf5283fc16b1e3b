"""Every snippet of docs/quickstart.md runs, in page order, against a fresh database.

Shell blocks run in /bin/sh with the test's DSN and Kafka; the SQL blocks run
on the database; the consumer program runs as a real process, is sent real
duplicates and stopped with SIGTERM; the batch handler and the ``wrap`` loop
are executed as written and driven with real records.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer

import dedup
from tests import helpers
from tests.conftest import ROOT, Topics

PAGE = ROOT / "docs" / "quickstart.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def snippets() -> list[tuple[str, str]]:
    return [(m[1], m[2]) for m in BLOCK.finditer(PAGE.read_text(encoding="utf-8"))]


def run_sh(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/sh", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )


async def test_quickstart_runs_as_written(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any, tmp_path: Path
) -> None:
    blocks = snippets()
    assert [lang for lang, _ in blocks] == ["sh", "sh", "python", "sql", "sql", "python", "python"]
    (_, env_line), (_, migrate), (_, app), (_, table), (_, audit), (_, batch), (_, loop) = blocks
    topic = await topics.create()
    bin_dir = str(Path(sys.executable).parent)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "DEDUP_DSN": dsn,
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers,
        "PAYMENTS_TOPIC": topic,
    }

    # The env line reads .services/env; it must parse and export as written.
    sourced = run_sh(env_line + 'echo "$DEDUP_DSN"', {"PATH": env["PATH"]})
    assert sourced.returncode == 0, sourced.stderr
    assert sourced.stdout.startswith("postgresql://")

    done = run_sh(migrate, env)
    assert done.returncode == 0, done.stderr
    assert "up to date" in done.stdout
    await pool.execute(table)

    (tmp_path / "payments_app.py").write_text(app)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "payments_app.py",
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        payment = orjson.dumps({"payment_id": "pay-1", "account": "acc-7", "amount": 25})
        await helpers.produce(bootstrap_servers, topic, [(None, payment)] * 3)
        await helpers.wait_for(
            lambda: pool.fetchval("SELECT duplicates = 2 FROM dedup.processed"),
            what="the app to apply pay-1 and suppress two copies",
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    assert "'processed': 1, 'duplicates': 2" in out.decode()
    assert await pool.fetchval("SELECT count(*) FROM payments") == 1
    row = await pool.fetchrow(audit)
    assert (row["idempotency_key"], row["duplicates"]) == ("pay-1", 2)

    # The batch handler as written, in a consumer of its own.
    namespace: dict[str, Any] = {"dedup": dedup}
    exec(batch, namespace)  # noqa: S102 - the page's own code is what is tested
    batch_topic = await topics.create()
    more = [
        orjson.dumps({"payment_id": f"b{i}", "account": "acc-8", "amount": i}) for i in range(5)
    ]
    await helpers.produce(bootstrap_servers, batch_topic, [(None, v) for v in more + more])
    consumer = dedup.IdempotentConsumer(
        namespace["apply_payments"],
        topics=[batch_topic],
        group_id="batched",
        bootstrap_servers=bootstrap_servers,
        pool=pool,
        key=dedup.keys.json_field("payment_id"),
        auto_offset_reset="earliest",
        install_signal_handlers=False,
    )
    assert consumer.batch_handler
    task = asyncio.create_task(consumer.run())
    await helpers.wait_for(lambda: _at(consumer, 10), what="10 batch messages")
    await consumer.stop()
    await task
    assert await pool.fetchval("SELECT count(*) FROM payments WHERE account = 'acc-8'") == 5

    # The wrap() loop as written, over a real aiokafka consumer.
    exec(app + "\n" + loop, namespace)  # noqa: S102
    wrap_topic = await topics.create()
    await helpers.produce(bootstrap_servers, wrap_topic, [(None, payment)] * 2)
    kafka = AIOKafkaConsumer(
        wrap_topic,
        bootstrap_servers=bootstrap_servers,
        group_id="wrapped",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await kafka.start()
    run = asyncio.create_task(namespace["consume"](kafka, pool))
    await helpers.wait_for(lambda: _wrapped(pool), what="the wrap loop to see both copies")
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    await kafka.stop()
    assert await pool.fetchval("SELECT count(*) FROM payments WHERE payment_id = 'pay-1'") == 1


async def _at(consumer: dedup.IdempotentConsumer, n: int) -> bool:
    return consumer.stats["messages"] >= n


async def _wrapped(pool: Any) -> bool:
    # pay-1 was already applied by the app (2 duplicates); the wrap loop adds two more.
    return bool(
        await pool.fetchval(
            "SELECT duplicates = 4 FROM dedup.processed WHERE idempotency_key = 'pay-1'"
        )
    )
