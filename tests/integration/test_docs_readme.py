"""The README's example runs as written: a payment delivered three times deducts once.

The README's `make demo` and `make test` lines are the demo's test
(tests/integration/test_demo.py) and this suite itself.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import orjson
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from dedup_dev import helpers
from dedup_dev.services import ROOT

BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def readme_blocks() -> list[tuple[str, str]]:
    return [(m[1], m[2]) for m in BLOCK.finditer((ROOT / "README.md").read_text())]


async def test_readme_example_deducts_once(
    bootstrap_servers: str, dsn: str, pool: Any, tmp_path: Path
) -> None:
    blocks = readme_blocks()
    assert [lang for lang, _ in blocks][:2] == ["sh", "python"]
    assert {"make demo", "make test"} <= {
        line.split("#")[0].strip() for line in blocks[0][1].splitlines()
    }
    # The example's own topic name (the quickstart's); it may exist from an earlier run.
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        await admin.create_topics([NewTopic("quickstart-payments", 1, 1)])
    except TopicAlreadyExistsError:
        pass
    finally:
        await admin.close()
    await pool.execute("CREATE TABLE accounts (id text PRIMARY KEY, balance integer NOT NULL)")
    await pool.execute("INSERT INTO accounts VALUES ('acc-1', 100)")

    (tmp_path / "app.py").write_text(blocks[1][1])
    env = {
        "PATH": os.environ["PATH"],
        "DEDUP_DSN": dsn,
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers,
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "app.py", cwd=tmp_path, env=env, stderr=asyncio.subprocess.PIPE
    )
    try:
        # Produce once the example holds the partition (it reads from the latest offset).
        await helpers.wait_for(
            lambda: pool.fetchval(
                "SELECT count(*) FROM dedup.partitions WHERE topic = 'quickstart-payments'"
            ),
            what="the example to take the payments partition",
        )
        pay_id = f"pay-{os.getpid()}-{id(proc)}"
        payment = orjson.dumps({"payment_id": pay_id, "account": "acc-1", "amount": 30})
        await helpers.produce(bootstrap_servers, "quickstart-payments", [(None, payment)] * 3)
        await helpers.wait_for(
            lambda: pool.fetchval(
                "SELECT duplicates = 2 FROM dedup.processed WHERE idempotency_key = $1", pay_id
            ),
            what="one deduction and two suppressed copies",
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    assert await pool.fetchval("SELECT balance FROM accounts WHERE id = 'acc-1'") == 70
