"""The benchmark run: fill one topic, then run the arms in turn, round after round.

Arms alternate (A B C ... A B C ...) so that whatever else the shared machine
does hits every arm alike; each arm runs in its own process, with a fresh
consumer group and a fresh database.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench import arms, report, stats, workload
from dedup_dev import database as dev_database
from dedup_dev import services as dev_services

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results.json"
DEFAULT_BATCH_SIZES = (1, 10, 100, 500, 1000)


def services() -> tuple[str, str]:
    """Kafka and Postgres: from the environment, else from compose/local's .services/env."""
    found = dev_services.configured()
    if found is None:
        sys.exit(f"no Kafka/Postgres: {dev_services.HOW_TO_START} (make bench starts them)")
    return found.bootstrap_servers, found.dsn


def dedup_available() -> bool:
    """True once the library exposes IdempotentConsumer (the dedup arms need it)."""
    try:
        import dedup
    except ImportError:
        return False
    return hasattr(dedup, "IdempotentConsumer")


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu_model = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu_model,
        "logical_cpus": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


async def server_versions(kafka: str, dsn: str) -> dict[str, str]:
    """Postgres's version, and the client libraries'."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        pg = await conn.fetchval("SHOW server_version")
    finally:
        await conn.close()
    found = {"postgres": pg}
    # Reported by import name: the library is installed as dedup-kafka.
    dists = {"dedup": "dedup-kafka"} | {
        d: d for d in ("aiokafka", "asyncpg", "orjson", "opentelemetry-sdk")
    }
    for name, dist in dists.items():
        try:
            found[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    found["git"] = git_state()
    kafka_libs = Path.home() / ".cache" / "dedup"
    brokers = sorted(p.name for p in kafka_libs.glob("kafka-*")) if kafka_libs.exists() else []
    found["kafka"] = brokers[-1].removeprefix("kafka-") if brokers else "unknown"
    return found


def git_state() -> str:
    """The checkout measured: commit, plus "+changes" when dedup/ or sql/ differ from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "dedup", "sql"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}+changes" if dirty else head


def run_arm(
    cfg: arms.Config, admin_dsn: str, database: str, profile: Path | None = None
) -> dict[str, Any]:
    """Run one arm in its own process on a fresh database; its result (or the failure).

    With ``profile``, the process runs under pyinstrument and its report is
    written there (the figures are then slowed by the profiler).
    """
    asyncio.run(dev_database.create(admin_dsn, database))
    try:
        return arm_process(cfg, profile)
    finally:
        asyncio.run(dev_database.drop(admin_dsn, database))


def arm_process(cfg: arms.Config, profile: Path | None = None) -> dict[str, Any]:
    """Run one arm in its own process on the database ``cfg.dsn`` names, as it is."""
    with tempfile.NamedTemporaryFile("wb", suffix=".json", delete=False) as f:
        f.write(orjson.dumps(cfg.__dict__))
    started = time.monotonic()
    command = [sys.executable, "-m", "bench.arms", f.name]
    if profile is not None:
        profile.parent.mkdir(parents=True, exist_ok=True)
        command[1:1] = ["-m", "pyinstrument", "-r", "text", "--show-all", "-o", str(profile)]
    try:
        proc = subprocess.run(
            command,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=cfg.timeout_s + 60,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"arm": cfg.arm, "ok": False, "error": f"killed after {cfg.timeout_s + 60:.0f}s"}
    finally:
        Path(f.name).unlink()
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        return {"arm": cfg.arm, "ok": False, "error": f"exit {proc.returncode}: {tail}"}
    result: dict[str, Any] = orjson.loads(lines[-1])
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


@dataclass(frozen=True)
class Feed:
    """A filled topic and what a correct consumer of it leaves behind."""

    topic: str
    """The topic's name."""
    end_offsets: dict[str, int]
    """Partition (as a string) -> end offset once filled."""
    expected: workload.Workload
    """The check's expectations."""


def fill(
    kafka: str,
    partitions: int,
    records: list[tuple[bytes, bytes]],
    expected: workload.Workload,
    made: list[str],
) -> Feed:
    """A new topic holding ``records``; its name goes into ``made`` at once, for the cleanup."""
    topic = asyncio.run(workload.create_topic(kafka, partitions))
    made.append(topic)
    started = time.monotonic()
    end_offsets = asyncio.run(workload.produce(kafka, topic, partitions, records))
    print(f"filled {topic} in {time.monotonic() - started:.1f}s")
    return Feed(topic, end_offsets, expected)


def arm_list(requested: list[str], batch_sizes: list[int]) -> list[tuple[str, int | None]]:
    """``(name, batch_size)`` for each arm of a round, the batch-size sweep last."""
    have_dedup = dedup_available()
    chosen: list[tuple[str, int | None]] = []
    for name in requested:
        if name in arms.DEDUP_ARMS and not have_dedup:
            print(f"note: {name} skipped: dedup.IdempotentConsumer is not there yet")
            continue
        chosen.append((name, None))
    if have_dedup:
        chosen += [(f"{arms.SWEEP_PREFIX}{n}", n) for n in batch_sizes]
    return chosen


def main(argv: list[str] | None = None) -> int:
    """``python -m bench``: run the benchmark, print the table, write results.json."""
    args = parse(argv)
    summary = measure(args, argv)
    write(summary, args.out, publish=args.publish)
    return 0


FEEDS = ("main", "per_message", "hot")
"""The topics of a run: the main one, the per-message arms' (``--per-message-messages``),
the hot-row arms'."""


def feed_of(name: str, batch_size: int | None) -> str:
    """Which topic arm ``name`` (of ``batch_size``, in the sweep) reads."""
    if name in arms.HOT_ARMS:
        return "hot"
    if name in arms.PER_MESSAGE_ARMS or (batch_size is not None and batch_size <= 10):
        return "per_message"
    return "main"


def measure(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    """Fill the topics, run the rounds, delete the topics: the summary of the run."""
    hot_messages = args.hot_messages or min(args.messages, arms.HOT_MESSAGES)
    per_message = args.per_message_messages or args.messages
    kafka, admin_dsn = services()
    plan = arm_list(args.requested, args.sizes)
    wanted = {feed_of(name, size) for name, size in plan}

    run_id = uuid.uuid4().hex[:8]
    sizes = {"main": args.messages, "per_message": per_message, "hot": hot_messages}
    generated = {
        kind: workload.generate(
            sizes[kind],
            args.duplicates,
            **({"accounts": workload.HOT_ACCOUNTS} if kind == "hot" else {}),
        )
        for kind in FEEDS
        if kind in wanted
    }
    print(f"run {run_id}: {args.partitions} partitions")
    for kind, (_, expected) in generated.items():
        what = {
            "main": "records",
            "per_message": "records for the per-message arms",
            "hot": f"hot-row payments on {workload.HOT_ACCOUNTS} accounts",
        }[kind]
        print(f"  {expected.messages:,} {what} ({expected.distinct:,} distinct keys)")
    topics: list[str] = []
    try:
        feeds = {
            kind: fill(kafka, args.partitions, records, expected, topics)
            for kind, (records, expected) in generated.items()
        }
        del generated
        results = run_rounds(args, plan, feeds, Target(run_id, kafka, admin_dsn))
    finally:
        for topic in topics:
            asyncio.run(workload.delete_topic(kafka, topic))

    summary = summarize(results)
    summary["config"] = run_config(args, argv, feeds)
    summary["machine"] = machine()
    summary["versions"] = asyncio.run(server_versions(kafka, admin_dsn))
    return summary


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The options; ``requested``: the arms asked for, in order; ``sizes``: the sweep's."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--messages", type=int, default=200_000, help="records in the topic")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of all arms")
    parser.add_argument(
        "--arms",
        help=f"comma-separated, from {', '.join(arms.ARMS)} (default: all)",
    )
    parser.add_argument(
        "--batch-sizes",
        help="dedup_batch batch sizes for the plot ('' for none; default "
        f"{','.join(map(str, DEFAULT_BATCH_SIZES))} when --arms is not given, else none)",
    )
    parser.add_argument(
        "--hot-messages",
        type=int,
        help="payments in the hot-row arms' topic (default: --messages, at most "
        f"{arms.HOT_MESSAGES:,})",
    )
    parser.add_argument(
        "--per-message-messages",
        type=int,
        help="records in the topic of the one-transaction-per-message arms (naive, "
        "dedup_per_message, dedup_batch@1 and @10; default: --messages)",
    )
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--duplicates", type=float, default=0.10, help="share of duplicate keys")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results JSON")
    parser.add_argument(
        "--publish", action="store_true", help="also update docs/performance.md and its plot"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="run each arm under pyinstrument and write its report to DIR (slows the arms)",
    )
    parser.add_argument(
        "--query-times",
        action="store_true",
        help="also report the time each arm spends in each SQL statement",
    )
    args = parser.parse_args(argv)
    requested = [a.strip() for a in (args.arms or ",".join(arms.ARMS)).split(",") if a.strip()]
    unknown = set(requested) - set(arms.ARMS)
    if unknown:
        parser.error(f"unknown arms: {', '.join(sorted(unknown))}")
    batch_sizes = args.batch_sizes
    if batch_sizes is None:
        # Arms named on the command line are a run of those arms alone.
        batch_sizes = "" if args.arms is not None else ",".join(map(str, DEFAULT_BATCH_SIZES))
    args.requested = requested
    args.sizes = [int(s) for s in batch_sizes.split(",") if s.strip()]
    return args


@dataclass(frozen=True)
class Target:
    """Where the arms of one run go."""

    run_id: str
    """Names this run's consumer groups and databases."""
    kafka: str
    """Kafka's bootstrap servers."""
    admin_dsn: str
    """A Postgres DSN that may create and drop databases."""


def run_rounds(
    args: argparse.Namespace,
    plan: list[tuple[str, int | None]],
    feeds: dict[str, Feed],
    target: Target,
) -> dict[str, list[dict[str, Any]]]:
    """Every arm of ``plan``, round after round (A B C ... A B C ...): each arm's results."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in plan}
    for rnd in range(1, args.rounds + 1):
        for name, size in plan:
            feed = feeds[feed_of(name, size)]
            tag = name.replace("@", "_bs")
            database = f"bench_{target.run_id}_{tag}_r{rnd}"
            cfg = arms.Config(
                arm=name,
                bootstrap_servers=target.kafka,
                topic=feed.topic,
                group_id=f"bench-{target.run_id}-{tag}-r{rnd}",
                dsn=dev_services.with_database(target.admin_dsn, database),
                workload=feed.expected.as_dict(),
                end_offsets=feed.end_offsets,
                batch_size=size,
                query_times=args.query_times,
            )
            profile = args.profile / f"{tag}-r{rnd}.txt" if args.profile else None
            result = run_arm(cfg, target.admin_dsn, database, profile)
            result["round"] = rnd
            results[name].append(result)
            print(report.progress_line(rnd, args.rounds, result), flush=True)
    return results


def run_config(
    args: argparse.Namespace, argv: list[str] | None, feeds: dict[str, Feed]
) -> dict[str, Any]:
    """What the run measured, for results.json."""
    main = feeds.get("main")
    per_message = feeds.get("per_message")
    hot = feeds.get("hot")
    return {
        "messages": args.messages,
        "distinct_keys": main.expected.distinct if main else None,
        **(
            {
                "per_message": {
                    "messages": per_message.expected.messages,
                    "distinct_keys": per_message.expected.distinct,
                }
            }
            if per_message is not None and per_message is not main
            else {}
        ),
        "duplicate_ratio": args.duplicates,
        "partitions": args.partitions,
        "rounds": args.rounds,
        "record_bytes": 200,
        "handwritten_batch": arms.HANDWRITTEN_BATCH,
        **(
            {
                "hot_rows": {
                    "messages": hot.expected.messages,
                    "distinct_keys": hot.expected.distinct,
                    "accounts": workload.HOT_ACCOUNTS,
                }
            }
            if hot is not None
            else {}
        ),
        "command": "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "finished": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def write(summary: dict[str, Any], out: Path, *, publish: bool) -> None:
    """results.json at ``out``, the table on stdout, and with ``publish`` the docs page."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    print()
    print(report.table(summary))
    print(f"\nwritten: {out}")
    if publish:
        for written in report.publish(summary):
            print(f"written: {written}")


FIGURES = ("msgs_per_s", "p50_ms", "p99_ms", "cpu_s_per_10k", "peak_rss_mb")


def summarize(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per arm: median and spread of each figure; ratios round by round; the targets."""
    summary_arms: dict[str, Any] = {}
    for name, runs in results.items():
        void = any(not r.get("ok") for r in runs)
        entry: dict[str, Any] = {"void": void, "rounds": runs}
        if void:
            entry["why_void"] = [r.get("check") or r.get("error") for r in runs if not r.get("ok")]
        for figure in FIGURES:
            found = stats.summarize([r[figure] for r in runs if r.get(figure) is not None])
            entry[figure] = None if found is None else found.median
            if figure == "msgs_per_s" and found is not None:
                entry["msgs_per_s_summary"] = found.as_dict()
        for stat in report.LANE_STATS:
            # Batches that ran into another lane's locks and ran again alone, round by round.
            if any(stat in r.get("stats", {}) for r in runs):
                entry[stat] = [r.get("stats", {}).get(stat) for r in runs]
        summary_arms[name] = entry
    n_rounds = max((len(runs) for runs in results.values()), default=0)
    per_round: list[dict[str, float | None]] = []
    for i in range(n_rounds):
        figures: dict[str, float | None] = {}
        for name, runs in results.items():
            if i < len(runs) and not summary_arms[name]["void"]:
                figures[name] = runs[i].get("msgs_per_s")
        per_round.append(figures)
    # The hot-row arms read another topic: only their own target compares them.
    ratios = stats.ratios_table(per_round, [a for a in results if a not in arms.HOT_ARMS])
    return {
        "arms": summary_arms,
        "ratios": ratios,
        "targets": stats.evaluate_targets(ratios),
    }
