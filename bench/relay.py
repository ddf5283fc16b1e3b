"""The relay's throughput: outbox rows published per second in each mode, against a bare producer.

``python -m bench relay`` writes ``--records`` outbox rows (a 200-byte JSON
value, a key, one header: what ``tx.publish`` writes) into a fresh database,
then in each round, arms alternating:

``producer``
    A bare aiokafka producer (``acks=all``, ``enable_idempotence``, the relay's
    delivery settings) sending the same records to a fresh topic, every send
    awaited at the end: what a user would write to publish them without dedup.
``relay_at_least_once`` / ``relay_exactly_once``
    The rows set pending again, then a :class:`dedup.Relay` of that mode run
    until none is pending, to a fresh topic.  Its figure includes taking the
    lease, reading the rows, marking them sent and the batch events.

Each figure is records per second over the arm's wall time; the ratios are
each relay's median over the producer's median, in the same run.  The relay
has no throughput target; the page says what each mode costs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import orjson
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

import dedup
from bench import run
from dedup_dev import database as dev_database

ARMS = ("producer", "relay_at_least_once", "relay_exactly_once")
DEFAULT_OUT = run.ROOT / "bench" / "results-relay.json"
PARTITIONS = 8
FILL = """
INSERT INTO dedup.outbox (key, sink, destination, message_key, value, header_names,
                          header_values, source, token)
SELECT 'bench:' || n || ':0', 'kafka', $1, convert_to('account-' || (n % 500), 'UTF8'),
       convert_to(json_build_object('payment_id', 'p' || n, 'account', 'account-' || (n % 500),
                                    'amount', n % 1000, 'note', repeat('x', 120))::text, 'UTF8'),
       '{origin}', ARRAY[convert_to('payments', 'UTF8')], 'bench:' || n, 1
  FROM generate_series(1, $2) n
"""
"""The rows ``tx.publish`` would have written, ``$2`` of them, to topic ``$1``."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The options of ``python -m bench relay``."""
    parser = argparse.ArgumentParser(prog="python -m bench relay", description=__doc__)
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=500, help="the relay's batch size")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench relay``: run, print the table, write results-relay.json."""
    args = parse(argv)
    summary = measure(args, argv if argv is not None else sys.argv[2:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    print()
    print(markdown(summary))
    print(f"\nwritten: {args.out}")
    return 0


def measure(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Every arm, round after round; records per second of each, and the ratios."""
    return asyncio.run(_measure(args, argv))


async def _measure(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    kafka, admin_dsn = run.services()
    name = dev_database.unique_name("bench_relay_")
    dsn = await dev_database.create(admin_dsn, name)
    rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
    try:
        await dedup.migrate(dsn)
        pool = await dedup.create_pool(dsn, max_size=4)
        try:
            await pool.execute(FILL, "unused", args.records)
            for rnd in range(1, args.rounds + 1):
                for arm in ARMS:
                    topic = await _topic(kafka)
                    seconds = await _run_arm(arm, pool, kafka, topic, args)
                    rates[arm].append(args.records / seconds)
                    print(f"relay round {rnd}: {arm} {args.records / seconds:,.0f} records/s")
        finally:
            await pool.close()
    finally:
        await dev_database.drop(admin_dsn, name)
    medians = {arm: statistics.median(r) for arm, r in rates.items()}
    return {
        "config": {
            "records": args.records,
            "rounds": args.rounds,
            "batch_size": args.batch_size,
            "partitions": PARTITIONS,
            "command": " ".join(["python -m bench relay", *argv]),
        },
        "machine": run.machine(),
        "rates": rates,
        "medians": medians,
        "ratios": {arm: medians[arm] / medians["producer"] for arm in ARMS if arm != "producer"},
    }


async def _topic(kafka: str) -> str:
    name = f"bench-relay-{uuid.uuid4().hex[:10]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, PARTITIONS, 1)])
    finally:
        await admin.close()
    return name


async def _run_arm(
    arm: str, pool: asyncpg.Pool, kafka: str, topic: str, args: argparse.Namespace
) -> float:
    """The arm's wall seconds to publish every row to ``topic``."""
    await pool.execute(
        "UPDATE dedup.outbox SET status = 'pending', sent_at = NULL, destination = $1", topic
    )
    await pool.execute("VACUUM dedup.outbox")
    if arm == "producer":
        rows = await pool.fetch(
            "SELECT key, message_key, value, header_names, header_values, token"
            " FROM dedup.outbox ORDER BY id"
        )
        return await _bare_producer(kafka, topic, rows)
    relay = dedup.Relay(
        pool=pool,
        bootstrap_servers=kafka,
        name=f"bench-{topic}",
        mode=arm.removeprefix("relay_"),  # type: ignore[arg-type]
        batch_size=args.batch_size,
    )
    started = time.perf_counter()
    task = asyncio.create_task(relay.run())
    while await pool.fetchval("SELECT count(*) FROM dedup.outbox WHERE status = 'pending'"):
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    seconds = time.perf_counter() - started
    await relay.stop()
    await task
    return seconds


async def _bare_producer(kafka: str, topic: str, rows: list[asyncpg.Record]) -> float:
    producer = AIOKafkaProducer(bootstrap_servers=kafka, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        started = time.perf_counter()
        sent = []
        for row in rows:
            headers = [
                *zip(row["header_names"], row["header_values"], strict=True),
                ("dedup-key", row["key"].encode()),
                ("dedup-token", str(row["token"]).encode()),
            ]
            sent.append(
                await producer.send(topic, row["value"], key=row["message_key"], headers=headers)
            )
        await asyncio.gather(*sent)
        return time.perf_counter() - started
    finally:
        await producer.stop()


def markdown(summary: dict[str, Any]) -> str:
    """The section's table: records per second per arm (median, every round) and the ratio."""
    lines = [
        "| arm | records/s (median) | every round | / producer |",
        "| --- | ---: | --- | ---: |",
    ]
    for arm in ARMS:
        ratio = "1.00" if arm == "producer" else f"{summary['ratios'][arm]:.2f}"
        rounds = ", ".join(f"{r:,.0f}" for r in summary["rates"][arm])
        lines.append(f"| {arm} | {summary['medians'][arm]:,.0f} | {rounds} | {ratio} |")
    c = summary["config"]
    lines.append("")
    lines.append(
        f"{c['records']:,} records, {c['partitions']} partitions, relay batches of "
        f"{c['batch_size']}, {c['rounds']} rounds: `{c['command']}`."
    )
    return "\n".join(lines)
