"""Live-stream latency: a producer at a steady rate while one arm consumes a fresh topic.

``python -m bench live`` runs, for each rate and round, each arm in its own
process on a fresh topic and a fresh database.  The arm joins its group
first; once it holds its partitions this process produces the workload at
the rate asked, spread evenly over time.  Latency per applied record runs
from its CreateTime (set by the producer when ``send`` is called) to the
COMMIT of the transaction that applied it, both on this machine's wall
clock; the first ``--warmup`` seconds of records are left out (connections
and statements warming up, the group settling).

Targets (issue 19): at every rate, dedup_batch's p99 is at most 1.5 x the
hand-written loop's; at 1,000 msg/s, dedup_batch's p50 is under 10 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import DefaultPartitioner

from bench import arms, run, workload
from dedup_dev import database as dev_database
from dedup_dev import services as dev_services

LIVE_ARMS = ("handwritten", "handwritten_concurrent", "dedup_batch")
DEFAULT_RATES = (1000, 5000)
DEFAULT_OUT = run.ROOT / "bench" / "results-live.json"
P99_RATIO = 1.5
"""dedup_batch's p99 may be at most this many times handwritten's, at the same rate."""
P50_RATE = 1000
P50_LIMIT_MS = 10.0
"""dedup_batch's p50 at P50_RATE msg/s must be under this."""
TICK_S = 0.005
"""The producer sends what is due every tick: the rate is even down to 5 ms."""
JOIN_TIMEOUT_S = 60.0


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The options of ``python -m bench live``."""
    parser = argparse.ArgumentParser(prog="python -m bench live", description=__doc__)
    parser.add_argument(
        "--rates",
        default=",".join(map(str, DEFAULT_RATES)),
        help="comma-separated msg/s (default %(default)s)",
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds left out at the start")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--arms",
        default=",".join(LIVE_ARMS),
        help="comma-separated (default %(default)s); dedup_batch[concurrency=1] is dedup_batch "
        "with that IdempotentConsumer option",
    )
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--duplicates", type=float, default=0.10)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--query-times", action="store_true", help="also time each SQL statement of each arm"
    )
    parser.add_argument(
        "--dedup-option",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="an IdempotentConsumer option for dedup_batch, e.g. concurrency=1 (repeatable)",
    )
    args = parser.parse_args(argv)
    try:
        args.dedup_options = {
            name: orjson.loads(value)
            for name, value in (o.split("=", 1) for o in args.dedup_option)
        }
    except ValueError as exc:
        parser.error(f"--dedup-option takes NAME=JSON: {exc}")
    args.rates = [int(r) for r in args.rates.split(",") if r.strip()]
    args.arms = [a.strip() for a in re.split(r",(?![^\[]*\])", args.arms) if a.strip()]
    try:
        variants = [variant(a) for a in args.arms]
    except ValueError as exc:
        parser.error(f"--arms: {exc}")
    unknown = {base for base, _ in variants} - set(arms.ARMS)
    if unknown:
        parser.error(f"unknown arms: {', '.join(sorted(unknown))}")
    return args


def variant(label: str) -> tuple[str, dict[str, Any]]:
    """``dedup_batch[concurrency=1]``: the arm and its IdempotentConsumer options (JSON values)."""
    found = re.fullmatch(r"(\w+)(?:\[(.*)\])?", label)
    if found is None:
        raise ValueError(f"not an arm: {label!r}")
    options = {}
    for pair in filter(None, (found.group(2) or "").split(",")):
        name, _, value = pair.partition("=")
        options[name.strip()] = orjson.loads(value)
    return found.group(1), options


def main(argv: list[str] | None = None) -> int:
    """``python -m bench live``: run, print the table and targets, write results-live.json."""
    args = parse(argv)
    summary = measure(args)
    shown = argv if argv is not None else sys.argv[2:]
    summary["config"]["command"] = " ".join(["python -m bench live", *shown])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    print()
    print(table(summary))
    print(f"\nwritten: {args.out}")
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every arm at every rate, round after round (arms alternate within a round)."""
    kafka, admin_dsn = run.services()
    run_id = uuid.uuid4().hex[:8]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for rate in args.rates:
        messages = round(rate * (args.seconds + args.warmup))
        records, expected = workload.generate(messages, args.duplicates, seed=rate % 97)
        print(f"live {run_id}: {rate:,} msg/s, {messages:,} records per run", flush=True)
        by_arm = results.setdefault(str(rate), {a: [] for a in args.arms})
        for rnd in range(1, args.rounds + 1):
            for arm in args.arms:
                result = one_run(
                    args,
                    kafka,
                    admin_dsn,
                    f"{run_id}_a{args.arms.index(arm)}_{rate}_r{rnd}",
                    arm,
                    rate,
                    records,
                    expected,
                )
                result["round"] = rnd
                result["arm"] = arm  # the label, options and all
                by_arm[arm].append(result)
                print(progress_line(rnd, args.rounds, rate, result), flush=True)
    found = summarize(results)
    return {
        "rates": found,
        "targets": targets(found),
        "config": {
            "rates": args.rates,
            "seconds": args.seconds,
            "warmup_s": args.warmup,
            "rounds": args.rounds,
            "partitions": args.partitions,
            "duplicate_ratio": args.duplicates,
        },
        "machine": run.machine(),
    }


def one_run(
    args: argparse.Namespace,
    kafka: str,
    admin_dsn: str,
    tag: str,
    label: str,
    rate: int,
    records: list[tuple[bytes, bytes]],
    expected: workload.Workload,
) -> dict[str, Any]:
    """One arm on a fresh topic while records are produced at ``rate``: the arm's result."""
    arm, options = variant(label)
    topic = asyncio.run(workload.create_topic(kafka, args.partitions, prefix="live"))
    database = f"bench_live_{tag}"
    ready = Path(tempfile.gettempdir()) / f"bench-live-{tag}.joined"
    placed = place(records, args.partitions)
    ends: dict[str, int] = {}
    for partition, _, _ in placed:
        ends[str(partition)] = ends.get(str(partition), 0) + 1
    cfg = arms.Config(
        arm=arm,
        bootstrap_servers=kafka,
        topic=topic,
        group_id=f"bench-live-{tag}",
        dsn=dev_services.with_database(admin_dsn, database),
        workload=expected.as_dict(),
        end_offsets=ends,
        query_times=args.query_times,
        dedup_options={**args.dedup_options, **options},
        ready_file=str(ready),
        live=True,
        warmup_s=args.warmup,
        timeout_s=max(300.0, 10 * len(records) / rate),
    )
    asyncio.run(dev_database.create(admin_dsn, database))
    # The arm's log goes to a file: a pipe nobody reads until the end could fill
    # and stall the arm mid-run.
    log = tempfile.TemporaryFile("w+")
    try:
        with tempfile.NamedTemporaryFile("wb", suffix=".json", delete=False) as f:
            f.write(orjson.dumps(cfg.__dict__))
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.arms", f.name],
            cwd=run.ROOT,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        try:
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            while proc.poll() is None and not ready.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            sent = asyncio.run(produce_steadily(kafka, topic, placed, rate))
            out, _ = proc.communicate(timeout=cfg.timeout_s + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return {"arm": arm, "ok": False, "error": f"killed after {cfg.timeout_s + 60:.0f}s"}
        finally:
            Path(f.name).unlink()
        lines = out.strip().splitlines()
        if proc.returncode != 0 or not lines:
            log.seek(0)
            tail = "\n".join(log.read().strip().splitlines()[-15:])
            return {"arm": arm, "ok": False, "error": f"exit {proc.returncode}: {tail}"}
        result: dict[str, Any] = orjson.loads(lines[-1])
        result["producer"] = sent
        # How many transactions the arm needed for the stream: what dedup's
        # per-partition batches cost at a low rate.
        result["tx_per_s"] = round(result["transactions"] / result["elapsed_s"], 1)
        return result
    finally:
        log.close()
        ready.unlink(missing_ok=True)
        asyncio.run(dev_database.drop(admin_dsn, database))
        asyncio.run(workload.delete_topic(kafka, topic))


def place(records: list[tuple[bytes, bytes]], partitions: int) -> list[tuple[int, bytes, bytes]]:
    """Each record with the partition Kafka's default partitioner gives its key."""
    every = list(range(partitions))
    choose = DefaultPartitioner()
    return [(choose(key, every, every), key, value) for key, value in records]


async def produce_steadily(
    kafka: str, topic: str, placed: list[tuple[int, bytes, bytes]], rate: int
) -> dict[str, float]:
    """Send the records at ``rate`` msg/s, evenly; what the producer achieved.

    Every TICK_S the records due by then are handed to the producer (which sends
    them as soon as it can, linger 0); a producer that falls behind its
    schedule shows it in ``behind_max_s``.
    """
    producer = AIOKafkaProducer(bootstrap_servers=kafka, linger_ms=0, acks=1)
    await producer.start()
    try:
        futures = []
        started = time.monotonic()
        behind = 0.0
        i = 0
        while i < len(placed):
            now = time.monotonic()
            due = min(len(placed), int((now - started) * rate) + 1)
            behind = max(behind, now - started - i / rate)
            while i < due:
                partition, key, value = placed[i]
                futures.append(await producer.send(topic, value, key=key, partition=partition))
                i += 1
            await asyncio.sleep(max(0.0, started + i / rate - time.monotonic(), TICK_S / 10))
        await asyncio.gather(*futures)
        took = time.monotonic() - started
    finally:
        await producer.stop()
    return {"achieved_rate": round(len(placed) / took, 1), "behind_max_s": round(behind, 3)}


FIGURES = ("p50_ms", "p99_ms", "p999_ms", "max_ms", "tx_per_s")


def summarize(results: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per rate and arm: the median over rounds of each percentile, and each round's."""
    out: dict[str, Any] = {}
    for rate, by_arm in results.items():
        entry: dict[str, Any] = {}
        for arm, runs in by_arm.items():
            good = [r for r in runs if r.get("ok")]
            figures: dict[str, Any] = {
                "void": len(good) < len(runs),
                "rounds": runs,
            }
            if figures["void"]:
                figures["why_void"] = [
                    r.get("check") or r.get("error") for r in runs if not r.get("ok")
                ]
            for figure in FIGURES:
                values = [r[figure] for r in good if r.get(figure) is not None]
                figures[figure] = statistics.median(values) if values else None
            rates = [r["producer"]["achieved_rate"] for r in good if "producer" in r]
            figures["achieved_rate"] = min(rates) if rates else None
            entry[arm] = figures
        out[rate] = entry
    return out


def targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The live-stream targets with their figures and verdicts (``n/a``: an arm missing)."""
    found = []
    for rate, by_arm in summary.items():
        dedup, hand = by_arm.get("dedup_batch"), by_arm.get("handwritten")
        value = None
        if dedup and hand and not dedup["void"] and not hand["void"]:
            ratios = [
                d["p99_ms"] / h["p99_ms"]
                for d, h in zip(dedup["rounds"], hand["rounds"], strict=False)
                if d.get("p99_ms") and h.get("p99_ms")
            ]
            value = statistics.median(ratios) if ratios else None
        found.append(
            {
                "target": f"live {int(rate):,} msg/s: dedup_batch p99 / handwritten p99",
                "value": value,
                "limit": f"<= {P99_RATIO}",
                "status": _status(value, value is not None and value <= P99_RATIO),
            }
        )
    at = summary.get(str(P50_RATE), {}).get("dedup_batch")
    p50 = None if not at or at["void"] else at["p50_ms"]
    found.append(
        {
            "target": f"live {P50_RATE:,} msg/s: dedup_batch p50 (ms)",
            "value": p50,
            "limit": f"< {P50_LIMIT_MS:g}",
            "status": _status(p50, p50 is not None and p50 < P50_LIMIT_MS),
        }
    )
    return found


def _status(value: float | None, passed: bool) -> str:
    if value is None:
        return "n/a"
    return "pass" if passed else "fail"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def progress_line(rnd: int, rounds: int, rate: int, result: dict[str, Any]) -> str:
    """One line per finished run."""
    head = f"round {rnd}/{rounds}  {rate:>6,} msg/s  {result['arm']:<24}"
    if "error" in result:
        return f"{head} FAILED {result['error'].splitlines()[-1] if result['error'] else ''}"
    verdict = "ok" if result["ok"] else f"VOID ({result['check']})"
    produced = result.get("producer", {}).get("achieved_rate", 0)
    return (
        f"{head} p50 {_ms(result.get('p50_ms')):>7} ms  p99 {_ms(result.get('p99_ms')):>7} ms  "
        f"p99.9 {_ms(result.get('p999_ms')):>7} ms  (produced at {produced:,.0f} msg/s)  {verdict}"
    )


def rows(summary: dict[str, Any]) -> list[list[str]]:
    """The table as text cells, header first."""
    out = [
        ["rate msg/s", "arm", "p50 ms", "p99 ms", "p99.9 ms", "max ms", "tx/s", "produced msg/s"]
    ]
    for rate, by_arm in summary["rates"].items():
        for arm, entry in by_arm.items():
            out.append(
                [
                    f"{int(rate):,}",
                    arm,
                    *(
                        ("VOID", "", "", "", "")
                        if entry["void"]
                        else tuple(_ms(entry[f]) for f in FIGURES)
                    ),
                    "-" if entry["achieved_rate"] is None else f"{entry['achieved_rate']:,.0f}",
                ]
            )
    return out


def target_lines(summary: dict[str, Any]) -> list[str]:
    """One line per target: figure, limit, verdict."""
    lines = []
    for t in summary["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(f"{t['target']} = {value} (target {t['limit']}): {t['status'].upper()}")
    return lines


def table(summary: dict[str, Any]) -> str:
    """The terminal table, the targets under it."""
    cells = rows(summary)
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = []
    for n, row in enumerate(cells):
        lines.append(
            "  ".join(
                c.rjust(w) if i != 1 else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join([*lines, "", *target_lines(summary)])


PLOT = "img/live-latency.png"
"""The latency distribution of the live runs, under docs/."""


def markdown(summary: dict[str, Any]) -> str:
    """The live section's generated part of docs/performance.md."""
    cells = rows(summary)
    out = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(cells[0])]
    out += ["| " + " | ".join(r) + " |" for r in cells[1:]]
    out += ["", "| target | measured | verdict |", "|---|---|---|"]
    for t in summary["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        out.append(f"| {t['target']} {t['limit']} | {value} | {t['status'].upper()} |")
    cfg = summary["config"]
    out += [
        "",
        f"Measured with `{cfg['command']}`: {cfg['seconds']:g} s per run after a "
        f"{cfg['warmup_s']:g} s warm-up, {cfg['rounds']} rounds, {cfg['partitions']} partitions, "
        f"{cfg['duplicate_ratio']:.0%} redeliveries; medians over the rounds.",
    ]
    if any(_curves(summary)):
        out += ["", f"![latency distribution of the live stream]({PLOT})"]
    return "\n".join(out)


def _curves(summary: dict[str, Any]) -> list[tuple[str, str, list[list[float]]]]:
    """(rate, arm, cdf) of each arm's median round (by p99) at each rate."""
    found = []
    for rate, by_arm in summary["rates"].items():
        for arm, entry in by_arm.items():
            runs = sorted(
                (r for r in entry["rounds"] if r.get("ok") and r.get("cdf_ms")),
                key=lambda r: r["p99_ms"],
            )
            if runs:
                found.append((rate, arm, runs[len(runs) // 2]["cdf_ms"]))
    return found


def plot(summary: dict[str, Any], path: Path) -> Path | None:
    """Latency distribution per rate (one panel each), an arm per line; None: nothing to plot."""
    curves = _curves(summary)
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(dict.fromkeys(rate for rate, _, _ in curves))
    fig, axes = plt.subplots(
        1, len(rates), figsize=(4.2 * len(rates), 3.8), dpi=120, sharey=True, squeeze=False
    )
    for ax, rate in zip(axes[0], rates, strict=True):
        for r, arm, cdf in curves:
            if r == rate:
                ax.plot([ms for _, ms in cdf], [q for q, _ in cdf], label=arm)
        ax.set_xscale("log")
        ax.set_title(f"{int(rate):,} msg/s", fontsize=10)
        ax.set_xlabel("CreateTime to COMMIT (ms)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("percentile")
    axes[0][-1].legend(loc="lower right", fontsize=8)
    fig.suptitle("Live stream: latency distribution (median round)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
