"""dedup through pgbouncer in transaction pooling mode (Debian's package), on the real services.

pgbouncer hands each transaction whichever server connection is free, refuses
startup parameters it does not know, and keeps no prepared statement past a
transaction.  The consumer (``dsn=`` mode), the task runner and the CLI talk to
the test's database through it (``pgbouncer_dsn``); what they leave behind is
read on the server directly.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import orjson

import dedup
from dedup_dev import effects as support
from dedup_dev import helpers
from dedup_dev.audit import json_out, run_cli_async
from dedup_dev.kafka import Topics

NO_STATEMENT_CACHE = {"statement_cache_size": 0}


def item(key: str) -> bytes:
    return orjson.dumps({"id": key, "amount": 10})


async def test_the_consumer_applies_each_message_once_through_pgbouncer_across_a_redelivery(
    bootstrap_servers: str, topics: Topics, pool: Any, pgbouncer_dsn: str
) -> None:
    topic = await topics.create(partitions=2)
    group = f"g-{topic}"
    await pool.execute(support.EFFECTS)
    # 12 payments; two of them sent twice (a producer's retry).
    records = [(None, item(f"p{i}")) for i in range(12)] + [(None, item("p0")), (None, item("p5"))]
    await helpers.produce(bootstrap_servers, topic, records)
    idle_timeouts: set[str] = set()

    async def handler(msgs: list[dedup.Message], tx: dedup.Tx) -> None:
        idle_timeouts.add(
            await tx.conn.fetchval("SELECT current_setting('idle_in_transaction_session_timeout')")
        )
        await support.record_effects(msgs, tx)

    def consumer() -> dedup.IdempotentConsumer:
        return dedup.IdempotentConsumer(
            handler,
            topics=[topic],
            group_id=group,
            bootstrap_servers=bootstrap_servers,
            dsn=pgbouncer_dsn,
            pool_options=NO_STATEMENT_CACHE,
            key=dedup.keys.json_field("id"),
            batch_size=4,
            handler_timeout=5,
            auto_offset_reset="earliest",
            install_signal_handlers=False,
        )

    first = consumer()
    async with support.running(first):
        await helpers.wait_for(lambda: support.handled(first, 14), what="every record handled")
    assert await support.effect_counts(pool) == (12, 12)
    assert (first.stats["processed"], first.stats["duplicates"]) == (12, 2)

    # Kafka delivers every record again: the group is rewound through pgbouncer.
    rewound = await run_cli_async(
        "offsets",
        "rewind",
        *("--group", group, "--topic", topic, "--to-time", "2000-01-01T00:00:00Z", "--yes"),
        *("--bootstrap-servers", bootstrap_servers),
        dsn=pgbouncer_dsn,
    )
    assert rewound.returncode == 0, rewound.stderr
    second = consumer()
    async with support.running(second):
        await helpers.wait_for(lambda: support.handled(second, 14), what="the redelivery")
    assert (second.stats["processed"], second.stats["duplicates"]) == (0, 14)
    assert await support.effect_counts(pool) == (12, 12), "nothing applied twice"
    # Each batch's transaction ran with handler_timeout + 2 s, set in that transaction.
    assert idle_timeouts == {"7s"}

    # What an operator reads through pgbouncer is what the server holds.
    stored = await pool.fetchval(
        "SELECT duplicates FROM dedup.processed WHERE idempotency_key = 'p0'"
    )
    assert stored == 3, "one copy in the first run, two in the redelivery"
    audit = json_out(
        await run_cli_async("audit", "--key", "p0", "--format", "json", dsn=pgbouncer_dsn)
    )
    assert [(r["idempotency_key"], r["duplicates"]) for r in audit["processed"]] == [("p0", 3)]

    # Retention's batches set their lock_timeout per transaction too.
    purged = await run_cli_async(
        "purge",
        "--before",
        "2999-01-01T00:00:00Z",
        "--force",
        "--format",
        "json",
        dsn=pgbouncer_dsn,
    )
    assert json_out(purged)["purged"]["processed"] == 12, purged.stderr
    assert await pool.fetchval("SELECT count(*) FROM dedup.processed") == 0


async def test_the_task_runner_runs_a_task_once_through_pgbouncer(
    pool: Any, pgbouncer_dsn: str
) -> None:
    await pool.execute(
        "CREATE TABLE statements (day text NOT NULL, token bigint NOT NULL, idle text NOT NULL)"
    )

    async def job(run: dedup.TaskRun) -> str:
        async with run.transaction() as conn:
            await conn.execute(
                "INSERT INTO statements"
                " VALUES ($1, $2, current_setting('idle_in_transaction_session_timeout'))",
                run.business_key,
                run.token,
            )
        return "sent"

    # Three schedulers fire the same job at once, each with its own pool.
    runners = [
        dedup.TaskRunner(dsn=pgbouncer_dsn, pool_options=NO_STATEMENT_CACHE, holder=f"cron-{i}")
        for i in range(3)
    ]
    outcomes = await asyncio.gather(*(r.run("statements", "2026-11-30", job) for r in runners))
    statuses = sorted(o.status for o in outcomes)
    assert statuses.count("succeeded") == 1, statuses
    assert set(statuses) <= {"succeeded", "skipped_running", "skipped_done"}

    # A rerun from the command line, through pgbouncer too: skipped, exit 3.
    rerun = await run_cli_async(
        "task",
        "run",
        "dedup_dev.task_jobs:record",
        *("--task", "statements", "--key", "2026-11-30"),
        dsn=pgbouncer_dsn,
    )
    assert rerun.returncode == 3, rerun.stderr
    assert "skipped_done" in rerun.stdout

    rows = await pool.fetch("SELECT day, token, idle FROM statements")
    assert [tuple(r) for r in rows] == [("2026-11-30", 1, "10s")], "once, on dedup's own timeout"
    task = await pool.fetchrow("SELECT state, attempts, result FROM dedup.tasks")
    assert (task["state"], task["attempts"], task["result"]) == ("succeeded", 1, "sent")


async def test_migrate_creates_the_tables_through_pgbouncer(
    pool: Any, dsn: str, pgbouncer_dsn: str
) -> None:
    name = f"dedup_pgb_{uuid.uuid4().hex[:12]}"
    await pool.execute(f'CREATE DATABASE "{name}"')
    through = pgbouncer_dsn.rpartition("/")[0] + f"/{name}"
    direct = dsn.rpartition("/")[0] + f"/{name}"
    try:
        migrated = await run_cli_async("migrate", dsn=through)
        assert migrated.returncode == 0, migrated.stderr
        assert "applied dedup/0001_" in migrated.stdout
        again = await run_cli_async("migrate", dsn=through)
        assert again.returncode == 0, again.stderr
        assert again.stdout.endswith("(0 applied now)\n")

        conn = await asyncpg.connect(direct)
        try:
            tables = await conn.fetch(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'dedup' ORDER BY 1"
            )
        finally:
            await conn.close()
        expected = await pool.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'dedup' ORDER BY 1"
        )
        assert [r[0] for r in tables] == [r[0] for r in expected]
    finally:
        await pool.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
