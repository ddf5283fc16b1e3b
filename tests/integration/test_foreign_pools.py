"""Any asyncpg pool works: dedup's SQL sends and reads JSON as text, whatever codecs a pool has.

The same work runs on dedup's own pool (orjson codecs), a plain
``asyncpg.create_pool`` (no json codec: jsonb comes back as str) and a pool
with the codecs SQLAlchemy's asyncpg dialect installs (binary format, str in,
``json.loads`` out), and must leave the same rows behind on each.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import orjson
import pytest
from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg

import dedup
from dedup.data import _db as db
from dedup.operations import _audit as audit
from dedup_dev import effects as support
from dedup_dev import helpers, rows
from dedup_dev.kafka import Topics

EFFECTS = "CREATE TABLE effects (key text NOT NULL, payload jsonb NOT NULL)"


async def sqlalchemy_codecs(conn: asyncpg.Connection) -> None:
    """The json and jsonb codecs SQLAlchemy's asyncpg dialect installs on each connection."""
    dialect = PGDialect_asyncpg()
    adapted = types.SimpleNamespace(_connection=conn)  # what the dialect's hooks read
    await dialect.setup_asyncpg_json_codec(adapted)
    await dialect.setup_asyncpg_jsonb_codec(adapted)


@contextlib.asynccontextmanager
async def pool_of(kind: str, dsn: str) -> AsyncIterator[Any]:
    if kind == "dedup":
        pool = await db.create_pool(dsn, max_size=6)
    elif kind == "plain":
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=6)
    else:
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=6, init=sqlalchemy_codecs)
    try:
        yield pool
    finally:
        await pool.close()


async def apply(msg: dedup.Message, tx: dedup.Tx) -> None:
    # The business write sends JSON as text too, so it runs on any pool.
    await tx.conn.execute(
        "INSERT INTO effects (key, payload) VALUES ($1, $2::text::jsonb)",
        msg.idempotency_key,
        msg.value.decode(),
    )


@pytest.mark.parametrize("kind", ["dedup", "plain", "sqlalchemy"])
async def test_consumer_wrap_tasks_and_reconcile_write_the_same_rows_on_any_pool(
    kind: str, dsn: str, bootstrap_servers: str, topics: Topics
) -> None:
    topic = await topics.create()
    await helpers.produce(bootstrap_servers, topic, [(None, orjson.dumps(v)) for v in rows.VALUES])
    async with pool_of(kind, dsn) as pool:
        await pool.execute(EFFECTS)
        consumer = support.consumer(apply, topic, bootstrap_servers, pool, namespace="pay")
        async with support.running(consumer):
            await helpers.wait_for(
                lambda: support.handled(consumer, len(rows.VALUES)), what="5 done"
            )
        assert {k: consumer.stats[k] for k in ("processed", "duplicates", "conflicts")} == {
            "processed": 2,
            "duplicates": 1,
            "conflicts": 1,
        }

        handle = dedup.wrap(apply, pool=pool, namespace="wrapped", key=dedup.keys.json_field("id"))
        outcomes = [await handle(rows.record("w", i, v)) for i, v in enumerate(rows.VALUES[:3])]
        assert outcomes == [
            dedup.Outcome.PROCESSED,
            dedup.Outcome.DUPLICATE,
            dedup.Outcome.CONFLICT,
        ]

        runner = dedup.TaskRunner(pool=pool, holder="runner")

        async def job(run: dedup.TaskRun) -> object:
            return {"rows": 3, "total": "12.50", "names": ["x", "y"]}

        done = await runner.run("report", "2024-01-31", job, lease_ttl=30)
        again = await runner.run("report", "2024-01-31", job, lease_ttl=30)
        assert (done.status, again.status) == ("succeeded", "skipped_done")
        assert done.result == again.result == {"rows": 3, "total": "12.50", "names": ["x", "y"]}

        check = dedup.ReconcileCheck(
            task="report",
            source="SELECT 2, 10 FROM (SELECT $1::date) AS day",
            result="SELECT 2, 7 FROM (SELECT $1::date) AS day",
        )
        report = await dedup.reconcile(pool, check, "2024-01-31", holder="checker")
        assert not report.ok

        async with pool.acquire() as conn:
            seen = await audit.events(conn, "dedup", audit.EventsQuery(key="a", namespace="pay"))
        conflict = next(r for r in seen.sections[0].rows if r["kind"] == "conflict")
        assert conflict["detail"] == {"offset": 2}, "audit reads JSON whatever the codecs"

    assert await rows.snapshot(dsn) == rows.EXPECTED
