"""Throughput against table size: dedup_batch with millions of keys already stored.

``python -m bench table-size`` makes one database, and for each size (default
0, 10 M and 50 M keys) fills dedup's ``processed`` table up to it directly in
Postgres, then runs the ``dedup_batch`` arm (dedup's defaults) a few rounds,
each over a fresh topic of new keys in the same namespace.  Last, at the
largest size, ``dedup purge`` deletes the oldest ``--purge-keys`` keys while
the consumer keeps running.

The stored keys look like production's: ``order-<uuid>`` (42 characters),
random, so the B-tree on ``(namespace, idempotency_key)`` is as scattered as a
long-lived table's; the consumer's keys are random UUIDs too, so each claim
lands on leaf pages all over the index.  The fill inserts the rows without the
primary key, then builds it by sorting with ``fillfactor = 70`` (the leaf
density a B-tree grown by random inserts settles at, ~69%, as measured with
pgstattuple) and resets the fillfactor, so later inserts split pages as they
would in production; then ``VACUUM (ANALYZE)`` and a ``CHECKPOINT``, as a
long-lived table would have had.  ``first_seen`` grows with the row number,
the oldest first, so ``--purge-keys`` rows are older than the cutoff.

What is measured per size: msgs/s of the arm (median over rounds), the claim's
mean time per call (``fence_and_claim``: one statement per batch of up to
500 keys, summed by the arm's query logger), the index's blocks read from
outside shared buffers per claimed key, and the sizes of table and index.
Postgres is used as it is configured (its ``shared_buffers`` is reported).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import orjson

from bench import arms, run, workload
from dedup.data import _sql as sql
from dedup.operations import _retention as retention
from dedup_dev import database as dev_database
from dedup_dev import services as dev_services

DEFAULT_OUT = run.ROOT / "bench" / "results-table-size.json"
DEFAULT_SIZES = "0,10000000,50000000"
PLOT = "img/throughput-vs-table-size.png"
SCHEMA = "dedup"
RATIO_TARGET = 0.7
"""dedup_batch at the largest size / at the empty table."""
PURGE_TARGET = 0.8
"""dedup_batch while purge runs / without it, at the same size."""
ROW_SPACING = datetime.timedelta(milliseconds=100)
"""``first_seen`` of filled row i is ``base + i * ROW_SPACING`` (50 M rows: 58 days)."""
CLAIM_SQL = " ".join(sql.Queries(SCHEMA).fence_and_claim.sql.split())[:60]
"""The claim (``fence_and_claim``) as the arm's query logger names it (arms.Clock)."""

FILL_INSERT = f"""
INSERT INTO {SCHEMA}.processed
    (namespace, idempotency_key, topic, "partition", "offset", token, payload_hash,
     first_seen, processed_at)
SELECT $1, 'order-' || gen_random_uuid(), 'orders', (i % 8)::int, i, 1,
       uuid_send(gen_random_uuid()),
       $2::timestamptz + i * $3::interval, $2::timestamptz + i * $3::interval
  FROM generate_series($4::bigint, $5::bigint, $6::bigint) AS i
"""
DROP_KEY = f"ALTER TABLE {SCHEMA}.processed DROP CONSTRAINT processed_pkey"
BUILD_KEY = (
    "SET maintenance_work_mem = '1GB'",
    f"CREATE UNIQUE INDEX processed_pkey ON {SCHEMA}.processed (namespace, idempotency_key)"
    " WITH (fillfactor = 70)",
    f"ALTER TABLE {SCHEMA}.processed ADD CONSTRAINT processed_pkey"
    " PRIMARY KEY USING INDEX processed_pkey",
    f"ALTER INDEX {SCHEMA}.processed_pkey RESET (fillfactor)",
)
SIZES_SQL = f"""
SELECT pg_relation_size('{SCHEMA}.processed') AS heap_bytes,
       pg_relation_size('{SCHEMA}.processed_pkey') AS index_bytes,
       (SELECT setting::bigint * 8192 FROM pg_settings WHERE name = 'shared_buffers')
           AS shared_buffers_bytes
"""
# The index's blocks read from outside shared buffers; the WAL written and the
# checkpoints taken, server-wide (other databases' work counts too, if any).
COUNTERS = f"""
SELECT coalesce((SELECT idx_blks_read FROM pg_statio_user_indexes
                  WHERE schemaname = '{SCHEMA}' AND indexrelname = 'processed_pkey'), 0) AS read,
       (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint AS wal_bytes,
       (SELECT checkpoints_req + checkpoints_timed FROM pg_stat_bgwriter) AS checkpoints,
       (SELECT wal_fpi FROM pg_stat_wal) AS wal_fpi
"""
AUTOVACUUMS = """
SELECT count(*) FROM pg_stat_activity
 WHERE datname = current_database() AND backend_type = 'autovacuum worker'
"""


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The options."""
    parser = argparse.ArgumentParser(prog="python -m bench table-size", description=__doc__)
    parser.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help="keys stored before each measurement (0, the empty table, is always measured)",
    )
    parser.add_argument("--messages", type=int, default=100_000, help="records per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds at each size")
    parser.add_argument(
        "--purge-keys",
        type=int,
        default=10_000_000,
        help="expired keys purged at the largest size while the consumer runs (0: no purge)",
    )
    parser.add_argument("--purge-batch-size", type=int, help="dedup purge --batch-size")
    parser.add_argument("--purge-pause", type=float, help="dedup purge --pause")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--duplicates", type=float, default=0.10, help="share of duplicate keys")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON")
    parser.add_argument(
        "--publish", action="store_true", help=f"also write the plot to docs/{PLOT}"
    )
    parser.add_argument(
        "--from-results",
        type=Path,
        metavar="FILE",
        help="measure nothing: print the section (and with --publish, plot) from FILE",
    )
    args = parser.parse_args(argv)
    # 0 is always measured: the empty table every size is compared with.
    args.size_list = sorted({int(s) for s in args.sizes.split(",") if s.strip()} - {0})
    if not args.size_list:
        parser.error(f"--sizes {args.sizes}: give at least one size above 0")
    if args.purge_keys > (args.size_list[-1] if args.size_list else 0):
        parser.error(f"--purge-keys {args.purge_keys:,}: more than the largest size")
    return args


def random_keys(records: list[tuple[bytes, bytes]], seed: int) -> list[tuple[bytes, bytes]]:
    """The same records with each key replaced by ``order-<random uuid>`` (copies alike).

    The benchmark's own keys are sequential, so their inserts all go to the
    B-tree's rightmost leaf; production keys land anywhere.
    """
    rng = random.Random(seed)
    renamed: dict[bytes, bytes] = {}
    out = []
    for key, value in records:
        new = renamed.get(key)
        if new is None:
            new = renamed[key] = f"order-{uuid.UUID(int=rng.getrandbits(128), version=4)}".encode()
        doc = orjson.loads(value)
        doc["id"] = new.decode()
        out.append((new, orjson.dumps(doc)))
    return out


def feed(kafka: str, args: argparse.Namespace, seed: int, made: list[str]) -> run.Feed:
    """A fresh topic of ``--messages`` records with new random keys."""
    records, expected = workload.generate(args.messages, args.duplicates, seed=seed)
    return run.fill(kafka, args.partitions, random_keys(records, seed), expected, made)


@dataclass(frozen=True)
class Place:
    """The database measured in, and its namespace."""

    dsn: str
    """The run's database."""
    kafka: str
    """Kafka's bootstrap servers."""
    group: str
    """Consumer group of every round, hence dedup's namespace of every key."""
    empty: bool = False
    """The reference: processed is emptied before each round."""


async def fill(place: Place, start: int, stop: int, base: datetime.datetime) -> dict[str, float]:
    """Rows ``start <= i < stop`` into processed; seconds per step."""
    took: dict[str, float] = {}
    if stop <= start:
        return took
    conns = [await asyncpg.connect(place.dsn) for _ in range(2)]
    try:
        t0 = time.monotonic()
        await conns[0].execute(DROP_KEY)
        # Two sessions (the machine's two cores), odd and even rows, so both
        # halves interleave on the heap in about first_seen order.
        await asyncio.gather(
            *(
                c.execute(FILL_INSERT, place.group, base, ROW_SPACING, start + k, stop - 1, 2)
                for k, c in enumerate(conns)
            )
        )
        t1 = time.monotonic()
        for statement in BUILD_KEY:
            await conns[0].execute(statement)
        t2 = time.monotonic()
        await conns[0].execute(f"VACUUM (ANALYZE) {SCHEMA}.processed")
        await conns[0].execute("CHECKPOINT")
        t3 = time.monotonic()
    finally:
        for c in conns:
            await c.close()
    took.update(insert_s=t1 - t0, index_s=t2 - t1, vacuum_s=t3 - t2, total_s=t3 - t0)
    return {k: round(v, 1) for k, v in took.items()}


async def _fetchrow(dsn: str, query: str, *params: Any) -> dict[str, Any]:
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(query, *params)
    finally:
        await conn.close()
    return dict(row) if row is not None else {}


def one_round(place: Place, topic: run.Feed) -> dict[str, Any]:
    """dedup_batch over ``topic`` into the run's database; its result, claim time, index I/O."""
    reset = ["DROP TABLE IF EXISTS effects, accounts"]
    if place.empty:
        reset.append(f"TRUNCATE {SCHEMA}.processed")
    asyncio.run(dev_database.execute(place.dsn, *reset))
    before = asyncio.run(_fetchrow(place.dsn, COUNTERS))
    cfg = arms.Config(
        arm="dedup_batch",
        bootstrap_servers=place.kafka,
        topic=topic.topic,
        group_id=place.group,
        dsn=place.dsn,
        workload=topic.expected.as_dict(),
        end_offsets=topic.end_offsets,
        query_times=True,
    )
    result = run.arm_process(cfg)
    after = asyncio.run(_fetchrow(place.dsn, COUNTERS))
    claims = [s for s in result.get("statements", []) if s["sql"] == CLAIM_SQL]
    calls = sum(s["calls"] for s in claims)
    if calls:
        result["claim_calls"] = calls
        result["claim_ms"] = round(1000 * sum(s["total_s"] for s in claims) / calls, 2)
    keys = topic.expected.messages
    result["index_reads_per_key"] = round((after["read"] - before["read"]) / keys, 3)
    result["wal_kib_per_record"] = round(
        (after["wal_bytes"] - before["wal_bytes"]) / keys / 1024, 2
    )
    result["checkpoints"] = after["checkpoints"] - before["checkpoints"]
    # Full-page images: the first change to a page after each checkpoint logs all 8 KiB of it.
    result["wal_fpi_per_record"] = round((after["wal_fpi"] - before["wal_fpi"]) / keys, 3)
    return result


def _ratio(num: dict[str, Any], den: dict[str, Any]) -> float | None:
    if num.get("ok") and den.get("ok") and den["msgs_per_s"]:
        return round(float(num["msgs_per_s"]) / float(den["msgs_per_s"]), 3)
    return None


def _line(label: str, result: dict[str, Any]) -> str:
    if not result.get("ok"):
        return f"  {label:>22}: FAILED {result.get('check') or result.get('error')}"
    return (
        f"  {label:>22}: {result['msgs_per_s']:>9,.0f} msg/s, claim "
        f"{result.get('claim_ms', '-')} ms/call, {result['index_reads_per_key']} index "
        f"reads, {result.get('wal_kib_per_record', '-')} KiB of WAL and "
        f"{result.get('wal_fpi_per_record', '-')} full-page images per record, "
        f"{result.get('checkpoints', '-')} checkpoints"
    )


def measure_size(
    sized: Place, empty: Place, args: argparse.Namespace, size: int, made: list[str]
) -> list[dict[str, Any]]:
    """``--rounds`` pairs of rounds over one topic each: the empty table's and this size's.

    The machine is shared, so its load drifts over minutes: each size is
    judged by the ratio within pairs, run back to back (which goes first
    alternates).
    """
    pairs = []
    for rnd in range(args.rounds):
        topic = feed(sized.kafka, args, seed=1000 + len(made), made=made)
        order = [(sized, size), (empty, 0)]
        got = {label: one_round(place, topic) for place, label in order[:: 1 - 2 * (rnd % 2)]}
        for label, result in got.items():
            print(_line(f"{label:,} keys", result), flush=True)
        pairs.append({"round": rnd + 1, "sized": got[size], "empty": got[0]})
        pairs[-1]["ratio"] = _ratio(got[size], got[0])
    return pairs


def purge_command(place: Place, args: argparse.Namespace, cutoff: datetime.datetime) -> list[str]:
    """``dedup purge`` of every filled key before ``cutoff``, with the options asked for."""
    command = [sys.executable, "-m", "dedup", "purge", "--dsn", place.dsn]
    command += ["--before", cutoff.isoformat(), "--format", "json"]
    if args.purge_batch_size is not None:
        command += ["--batch-size", str(args.purge_batch_size)]
    if args.purge_pause is not None:
        command += ["--pause", str(args.purge_pause)]
    return command


def purge_while_consuming(
    place: Place, args: argparse.Namespace, base: datetime.datetime, made: list[str]
) -> dict[str, Any]:
    """``dedup purge`` of the oldest ``--purge-keys`` keys, in ``--rounds`` slices.

    Each slice is one ``dedup purge`` (the next older part of the keys); a
    dedup_batch round runs while it does, and once it is over, another round
    without purge: pairs back to back again.  A round counts as "during" only
    if the slice was still running when it ended.
    """
    slices = []
    seconds = 0.0
    keys = 0
    for k in range(args.rounds):
        during_topic = feed(place.kafka, args, seed=2000 + k, made=made)
        after_topic = feed(place.kafka, args, seed=3000 + k, made=made)
        cutoff = base + (args.purge_keys * (k + 1) // args.rounds) * ROW_SPACING
        command = purge_command(place, args, cutoff)
        started = time.monotonic()
        proc = subprocess.Popen(command, cwd=run.ROOT, stdout=subprocess.PIPE, text=True)
        during = one_round(place, during_topic)
        during["purge_running_at_end"] = proc.poll() is None
        during["autovacuum_workers_at_end"] = asyncio.run(_fetchrow(place.dsn, AUTOVACUUMS))[
            "count"
        ]
        out, _ = proc.communicate()
        wall = time.monotonic() - started
        done: dict[str, Any] = orjson.loads(out) if out.strip() else {}
        after = one_round(place, after_topic)
        after["autovacuum_workers_at_end"] = asyncio.run(_fetchrow(place.dsn, AUTOVACUUMS))["count"]
        purged = (done.get("purged") or {}).get("processed", 0)
        took = done.get("seconds") or wall
        keys += purged
        seconds += took
        ratio = _ratio(during, after) if during["purge_running_at_end"] else None
        slices.append(
            {
                "slice": k + 1,
                "keys": purged,
                "seconds": round(took, 1),
                "exit_code": proc.returncode,
                "batches": done.get("batches"),
                "batches_skipped": done.get("batches_skipped"),
                "during": during,
                "after": after,
                "ratio": ratio,
            }
        )
        note = "" if during["purge_running_at_end"] else " (the slice ended first: not counted)"
        print(f"  purge slice {k + 1}: {purged:,} keys in {took:.1f}s{note}", flush=True)
        print(_line("during purge", during), flush=True)
        print(_line("after it", after), flush=True)
    return {
        "keys": keys,
        "expected_keys": args.purge_keys,
        "seconds": round(seconds, 1),
        "keys_per_s": round(keys / seconds) if seconds else None,
        "batches": sum(s["batches"] or 0 for s in slices),
        "batches_skipped": sum(s["batches_skipped"] or 0 for s in slices),
        "batch_size": args.purge_batch_size or retention.DEFAULT_BATCH_SIZE,
        "pause": retention.DEFAULT_PAUSE if args.purge_pause is None else args.purge_pause,
        "slices": slices,
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m bench table-size``: measure, print the section, write the results JSON."""
    args = parse(argv)
    if args.from_results is not None:
        show(orjson.loads(args.from_results.read_bytes()), publish=args.publish)
        return 0
    summary = measure(args, argv if argv is not None else sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    show(summary, publish=args.publish)
    print(f"\nwritten: {args.out}")
    return 0


def measure(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Fill, measure each size (and the purge); the summary with its targets."""
    kafka, admin_dsn = run.services()
    if not run.dedup_available():
        sys.exit("table-size needs dedup.IdempotentConsumer")
    import dedup

    run_id = uuid.uuid4().hex[:8]
    databases = [f"tsize_{run_id}_sized", f"tsize_{run_id}_empty"]
    sized, empty = (
        Place(dev_services.with_database(admin_dsn, name), kafka, name.replace("_", "-"), tag == 1)
        for tag, name in enumerate(databases)
    )
    began = time.monotonic()
    made: list[str] = []
    sizes: list[dict[str, Any]] = []
    purge: dict[str, Any] | None = None
    try:
        for name, place in zip(databases, (sized, empty), strict=True):
            asyncio.run(dev_database.create(admin_dsn, name))
            asyncio.run(dedup.migrate(place.dsn))
        now = asyncio.run(_fetchrow(sized.dsn, "SELECT now() AS now"))["now"]
        # Every filled key is older than the last 30 days (first_seen grows with i).
        base = now - datetime.timedelta(days=30) - args.size_list[-1] * ROW_SPACING
        stored = 0
        for size in args.size_list:
            print(f"filling processed to {size:,} keys ...", flush=True)
            took = asyncio.run(fill(sized, stored, size, base))
            stored = size
            layout = asyncio.run(_fetchrow(sized.dsn, SIZES_SQL))
            print(f"  filled in {took.get('total_s', 0)}s {took}; {layout}", flush=True)
            pairs = measure_size(sized, empty, args, size, made)
            sizes.append({"keys": size, "fill": took, **layout, "pairs": pairs})
        if args.purge_keys:
            print(f"purging {args.purge_keys:,} keys while dedup_batch runs ...", flush=True)
            purge = purge_while_consuming(sized, args, base, made)
            print(f"  purge: {purge['keys']:,} keys in {purge['seconds']}s", flush=True)
    finally:
        for topic in made:
            asyncio.run(workload.delete_topic(kafka, topic))
        asyncio.run(dev_database.drop(admin_dsn, *databases))
    summary = summarize(sizes, purge)
    summary["config"] = {
        "sizes": args.size_list,
        "messages": args.messages,
        "rounds": args.rounds,
        "purge_keys": args.purge_keys,
        "partitions": args.partitions,
        "duplicate_ratio": args.duplicates,
        "command": " ".join(["python -m bench table-size", *argv]),
        "wall_s": round(time.monotonic() - began),
        "finished": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    summary["machine"] = run.machine()
    return summary


def show(summary: dict[str, Any], *, publish: bool) -> None:
    """Print the section; with ``publish``, write its plot under docs/ too."""
    if publish:
        print(f"written: {plot(summary, run.ROOT / 'docs' / PLOT)}")
    print()
    print(markdown(summary))


def _spread(values: list[float | None]) -> dict[str, float | None]:
    found = [v for v in values if v is not None]
    if not found:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(found), "min": min(found), "max": max(found)}


def _figures(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of one kind of round: msgs/s, claim ms per call, index reads per record."""
    ok = [r for r in results if r.get("ok")]
    return {
        figure: _spread([r.get(figure) for r in ok])["median"]
        for figure in (
            "msgs_per_s",
            "claim_ms",
            "index_reads_per_key",
            "wal_kib_per_record",
            "wal_fpi_per_record",
        )
    } | {"void": len(ok) < len(results)}


def summarize(sizes: list[dict[str, Any]], purge: dict[str, Any] | None) -> dict[str, Any]:
    """Medians per size and of the paired ratios; the two targets with their verdicts."""
    empty_rounds = [p["empty"] for e in sizes for p in e["pairs"]]
    for entry in sizes:
        entry |= _figures([p["sized"] for p in entry["pairs"]])
        entry["empty_msgs_per_s"] = _figures([p["empty"] for p in entry["pairs"]])["msgs_per_s"]
        entry["ratio"] = _spread([p["ratio"] for p in entry["pairs"]])
    summary: dict[str, Any] = {"empty": _figures(empty_rounds), "sizes": sizes, "targets": []}
    if sizes:
        last = sizes[-1]
        summary["targets"].append(
            {
                "name": f"dedup_batch with {last['keys']:,} keys stored / empty table "
                f">= {RATIO_TARGET}",
                "value": last["ratio"]["median"],
                "passed": (last["ratio"]["median"] or 0) >= RATIO_TARGET,
            }
        )
    if purge is not None:
        slices = purge["slices"]
        purge["during"] = _figures([s["during"] for s in slices if s["ratio"] is not None])
        purge["after"] = _figures([s["after"] for s in slices if s["ratio"] is not None])
        purge["ratio"] = _spread([s["ratio"] for s in slices])
        summary["purge"] = purge
        summary["targets"].append(
            {
                "name": f"dedup_batch during purge / right after it >= {PURGE_TARGET}",
                "value": purge["ratio"]["median"],
                "passed": (purge["ratio"]["median"] or 0) >= PURGE_TARGET,
            }
        )
    return summary


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def markdown(summary: dict[str, Any], image: str | None = PLOT) -> str:
    """The docs' section: sizes, figures, targets with verdicts, how to reproduce."""
    cfg = summary["config"]
    sizes = summary["sizes"]
    shared = sizes[0]["shared_buffers_bytes"] if sizes else None
    empty = summary["empty"]
    out = [
        f"`dedup_batch` (dedup's defaults) over {cfg['messages']:,} records of new random "
        f"keys per round, with the `processed` table already holding each number of keys "
        f"(`order-<uuid>`, random). Each of the {cfg['rounds']} rounds per size reads one "
        "topic twice, into this table and into an empty one, back to back: the shared "
        "machine's load drifts over minutes, so each size is judged by the median of those "
        f"paired ratios. Postgres's `shared_buffers`: {_mib(shared)}. The claim is "
        "`fence_and_claim`, one statement per batch of up to 500 keys (mean time per call); "
        "index reads are blocks of the primary key read from outside shared buffers, per "
        "record; WAL and its full-page images are what the server wrote during the round, "
        "per record.",
        "",
        "| keys stored | fill (s) | table | index | msgs/s (median) | empty table, same "
        "rounds | x empty (median, min-max) | claim ms/call | index reads/record "
        "| WAL KiB/record | full-page images/record |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| 0 | - | - | - | {_num(empty['msgs_per_s'])} | - | 1 | {_num(empty['claim_ms'], 1)} "
        f"| {_num(empty['index_reads_per_key'], 3)} "
        f"| {_num(empty.get('wal_kib_per_record'), 1)} "
        f"| {_num(empty.get('wal_fpi_per_record'), 2)} |",
    ]
    for e in sizes:
        r = e["ratio"]
        out.append(
            f"| {e['keys']:,} | {_num(e['fill'].get('total_s'))} | {_mib(e['heap_bytes'])} "
            f"| {_mib(e['index_bytes'])} | {_num(e['msgs_per_s'])} "
            f"| {_num(e['empty_msgs_per_s'])} "
            f"| {_num(r['median'], 2)} ({_num(r['min'], 2)}-{_num(r['max'], 2)}) "
            f"| {_num(e['claim_ms'], 1)} | {_num(e['index_reads_per_key'], 3)} "
            f"| {_num(e.get('wal_kib_per_record'), 1)} "
            f"| {_num(e.get('wal_fpi_per_record'), 2)} |"
        )
    purge = summary.get("purge")
    if purge is not None:
        during, after, r = purge["during"], purge["after"], purge["ratio"]
        out += [
            "",
            f"Purge, at {sizes[-1]['keys']:,} keys: `dedup purge --batch-size "
            f"{purge.get('batch_size', retention.DEFAULT_BATCH_SIZE)} --pause "
            f"{purge.get('pause', retention.DEFAULT_PAUSE)}` deleted {purge['keys']:,} "
            f"expired keys in "
            f"{len(purge['slices'])} slices, {_num(purge['seconds'], 1)} s in all "
            f"({_num(purge['keys_per_s'])} keys/s, {purge['batches']} batches, "
            f"{purge['batches_skipped']} skipped). During each slice `dedup_batch` ran a "
            f"round, and another right after it: {_num(during['msgs_per_s'])} msgs/s during "
            f"(claim {_num(during['claim_ms'], 1)} ms/call) against "
            f"{_num(after['msgs_per_s'])} after (claim {_num(after['claim_ms'], 1)} ms/call); "
            f"ratio {_num(r['median'], 2)} ({_num(r['min'], 2)}-{_num(r['max'], 2)}).",
        ]
    out += ["", "| target | measured | verdict |", "|---|---:|---|"]
    for t in summary["targets"]:
        verdict = "PASS" if t["passed"] else ("not measured" if t["value"] is None else "FAIL")
        out.append(f"| {t['name']} | {_num(t['value'], 2)} | {verdict} |")
    if image and sizes:
        out += ["", f"![dedup_batch throughput against keys stored]({image})"]
    out += [
        "",
        f"Reproduce: `{cfg['command']}` ({cfg['wall_s'] / 60:.0f} minutes here, fills included).",
    ]
    return "\n".join(out)


def plot(summary: dict[str, Any], path: Path) -> Path:
    """dedup_batch's throughput against keys stored, as paired ratios to the empty table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [e for e in summary["sizes"] if e["ratio"]["median"] is not None]
    if not points:
        raise SystemExit("no measured size in these results: nothing to plot")
    xs = [0.0] + [e["keys"] / 1e6 for e in points]
    ys = [1.0] + [e["ratio"]["median"] for e in points]
    low = [0.0] + [e["ratio"]["median"] - e["ratio"]["min"] for e in points]
    high = [0.0] + [e["ratio"]["max"] - e["ratio"]["median"] for e in points]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.errorbar(
        xs, ys, yerr=[low, high], fmt="o-", capsize=3, label="dedup_batch (median, min-max)"
    )
    ax.axhline(RATIO_TARGET, linestyle="--", color="grey", linewidth=1)
    ax.annotate(
        f"target: {RATIO_TARGET}",
        (xs[0], RATIO_TARGET),
        textcoords="offset points",
        xytext=(2, 3),
        fontsize=8,
        color="dimgrey",
    )
    purge = summary.get("purge")
    if purge and purge["ratio"]["median"] is not None:
        ax.plot(
            [xs[-1]],
            [purge["ratio"]["median"]],
            "s",
            color="tab:red",
            label="during purge (x right after it)",
        )
    ax.set_ylim(bottom=0, top=max(1.3, *ys) * 1.05)
    ax.set_xlabel("keys already in processed (millions)")
    ax.set_ylabel("msgs/s, x the empty table's in the same round")
    cfg = summary["config"]
    ax.set_title(
        f"dedup_batch vs table size ({cfg['messages']:,} records a round, {cfg['rounds']} rounds)",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
