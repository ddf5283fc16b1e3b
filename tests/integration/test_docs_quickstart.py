"""The code fragments of docs/quickstart.md (a batch handler, a wrap loop) run as written.

The page's files and commands, from ``pip install`` to the balance moved once
and the handler's tests with ``dedup.testing``, are run in order in a fresh
virtual environment by tests/integration/test_install.py (the newcomer test);
here the two fragments that are not a program of their own are executed and
driven with real records.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer

import dedup
from dedup_dev import docs as docs_support
from dedup_dev import helpers
from dedup_dev.kafka import Topics
from dedup_dev.services import ROOT

PAGE = ROOT / "docs" / "quickstart.md"

# This page runs on the run's one docs database, after the pages before it (tests/conftest.py).
pytestmark = pytest.mark.docs_page


def fragments() -> tuple[str, str, str]:
    """The page's app, and its batch handler and wrap loop (the two blocks after the app's
    stop, in sections 8 and 9)."""
    blocks = docs_support.snippets(PAGE)
    (app,) = [body for lang, body in blocks if body.startswith("# payments_app.py\n")]
    (batch,) = [body for lang, body in blocks if "async def apply_payments(" in body]
    (loop,) = [body for lang, body in blocks if "dedup.wrap(" in body]
    assert [lang for lang, body in blocks if body in (batch, loop)] == ["python", "python"]
    return app, batch, loop


async def test_quickstart_batch_handler_and_wrap_loop_apply_each_payment_once(
    bootstrap_servers: str, topics: Topics, pool: Any
) -> None:
    app, batch, loop = fragments()
    await pool.execute("CREATE TABLE accounts (id text PRIMARY KEY, balance integer NOT NULL)")
    await pool.execute("INSERT INTO accounts VALUES ('acc-1', 100), ('acc-8', 100)")

    # The batch handler as written, in a consumer of its own: five payments, each twice.
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
        group_id="quickstart-batched",
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
    assert await pool.fetchval("SELECT balance FROM accounts WHERE id = 'acc-8'") == 100 - 10

    # The wrap() loop as written, with the app's handler, over a real aiokafka consumer.
    # (exec'd without __name__ == "__main__": the app's definitions, not its run)
    exec(app + "\n" + loop, namespace)  # noqa: S102
    wrap_topic = await topics.create()
    payment = orjson.dumps({"payment_id": "pay-1001", "account": "acc-1", "amount": 25})
    await helpers.produce(bootstrap_servers, wrap_topic, [(None, payment)] * 3)
    kafka = AIOKafkaConsumer(
        wrap_topic,
        bootstrap_servers=bootstrap_servers,
        group_id="quickstart-wrapped",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await kafka.start()
    run = asyncio.create_task(namespace["consume"](kafka, pool))
    await helpers.wait_for(lambda: _wrapped(pool), what="the wrap loop to see all three copies")
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    await kafka.stop()
    assert await pool.fetchval("SELECT balance FROM accounts WHERE id = 'acc-1'") == 75


async def _at(consumer: dedup.IdempotentConsumer, n: int) -> bool:
    return consumer.stats["messages"] >= n


async def _wrapped(pool: Any) -> bool:
    return bool(
        await pool.fetchval(
            "SELECT duplicates = 2 FROM dedup.processed"
            " WHERE namespace = 'quickstart-app' AND idempotency_key = 'pay-1001'"
        )
    )
