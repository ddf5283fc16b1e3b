"""The memory soak: millions of records through dedup_batch, RSS sampled all along.

``python -m bench soak`` (``make bench-soak``) fills one topic (default two
million records, the same workload as the benchmark), runs the dedup_batch arm
in its own process and samples that process's RSS every few seconds.  Memory is
flat when the last quarter's peak is within 10% of the first quarter's; the
samples are printed and written to bench/results-soak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

from bench import arms, run, stats, workload
from dedup_dev import database as dev_database
from dedup_dev import services as dev_services

DEFAULT_OUT = run.ROOT / "bench" / "results-soak.json"


def rss_mb(pid: int) -> float | None:
    """The resident set size of process ``pid`` in MiB; None once it is gone."""
    status = Path(f"/proc/{pid}/status")
    if Path("/proc/self/status").exists():
        try:
            text = status.read_text()
        except FileNotFoundError:
            return None
        for line in text.splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return None
    import psutil  # type: ignore[import-untyped,unused-ignore]  # not Linux: dedup[bench]

    try:
        return float(psutil.Process(pid).memory_info().rss) / 2**20
    except psutil.NoSuchProcess:
        return None


def main(argv: list[str] | None = None) -> int:
    """Run the soak; exit 0 when memory stayed flat and the check passed, 1 otherwise."""
    parser = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__)
    parser.add_argument("--messages", type=int, default=2_000_000)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--duplicates", type=float, default=0.10)
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    kafka, admin_dsn = run.services()
    if not run.dedup_available():
        sys.exit("the soak needs dedup.IdempotentConsumer")
    run_id = uuid.uuid4().hex[:8]
    records, expected = workload.generate(args.messages, args.duplicates)
    topic = asyncio.run(workload.create_topic(kafka, args.partitions, prefix="soak"))
    print(f"soak {run_id}: topic {topic}, filling {args.messages:,} records ...", flush=True)
    try:
        started = time.monotonic()
        end_offsets = asyncio.run(workload.produce(kafka, topic, args.partitions, records))
        del records
        print(f"filled in {time.monotonic() - started:.0f}s", flush=True)
        samples, result = _soak(args, kafka, admin_dsn, run_id, topic, expected, end_offsets)
    finally:
        asyncio.run(workload.delete_topic(kafka, topic))
    return _verdict(args, samples, result)


def _soak(
    args: argparse.Namespace,
    kafka: str,
    admin_dsn: str,
    run_id: str,
    topic: str,
    expected: workload.Workload,
    end_offsets: dict[str, int],
) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """Run dedup_batch over the topic in a child process; its RSS samples and its result."""
    database = f"soak_{run_id}"
    ready = Path(tempfile.gettempdir()) / f"soak-{run_id}.consuming"
    cfg = arms.Config(
        arm="dedup_batch",
        bootstrap_servers=kafka,
        topic=topic,
        group_id=f"soak-{run_id}",
        dsn=dev_services.with_database(admin_dsn, database),
        workload=expected.as_dict(),
        end_offsets=end_offsets,
        measure_latency=False,
        ready_file=str(ready),
        timeout_s=6 * 3600,
    )
    samples: list[dict[str, float]] = []
    result: dict[str, Any] = {}
    asyncio.run(dev_database.create(admin_dsn, database))
    try:
        with tempfile.NamedTemporaryFile("wb", suffix=".json", delete=False) as f:
            f.write(orjson.dumps(cfg.__dict__))
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.arms", f.name],
            cwd=run.ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        # Start-up (imports, joining the group) is not part of the soak: sample
        # from the first fetched record on.
        while proc.poll() is None and not ready.exists():
            time.sleep(0.05)
        t0 = time.monotonic()
        while proc.poll() is None:
            rss = rss_mb(proc.pid)
            if rss is None:
                break
            sample = {"t_s": round(time.monotonic() - t0, 1), "rss_mb": round(rss, 1)}
            samples.append(sample)
            print(f"  t={sample['t_s']:>7.1f}s  rss={sample['rss_mb']:>7.1f} MiB", flush=True)
            try:
                proc.wait(timeout=args.interval)
            except subprocess.TimeoutExpired:
                pass
        out, _ = proc.communicate()
        Path(f.name).unlink()
        lines = out.strip().splitlines()
        if proc.returncode == 0 and lines:
            result = orjson.loads(lines[-1])
        else:
            result = {"ok": False, "error": f"the arm exited {proc.returncode}"}
    finally:
        ready.unlink(missing_ok=True)
        asyncio.run(dev_database.drop(admin_dsn, database))
    return samples, result


def _verdict(
    args: argparse.Namespace, samples: list[dict[str, float]], result: dict[str, Any]
) -> int:
    """Judge, print and save the soak; the exit status."""
    series = [s["rss_mb"] for s in samples]
    if len(series) >= 4:
        flat, first, last = stats.rss_flat(series, args.tolerance)
        verdict = (
            f"first quarter peak {first:.1f} MiB, last quarter peak {last:.1f} MiB "
            f"({100 * (last / first - 1):+.1f}%, limit +{100 * args.tolerance:.0f}%)"
        )
    else:
        flat, first, last = False, 0.0, 0.0
        verdict = f"only {len(series)} samples: run longer or sample more often (--interval)"
    passed = flat and bool(result.get("ok"))
    summary = {
        "messages": args.messages,
        "interval_s": args.interval,
        "samples": samples,
        "first_quarter_peak_mb": first,
        "last_quarter_peak_mb": last,
        "flat": flat,
        "arm": result,
        "passed": passed,
        "machine": run.machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    print(
        f"\ndedup_batch: {result.get('msgs_per_s', '-')} msg/s over {args.messages:,} records; "
        f"check: {result.get('check') or result.get('error')}"
    )
    print(f"memory: {verdict}: {'FLAT' if flat else 'NOT FLAT'}")
    print(f"soak {'PASSED' if passed else 'FAILED'}; samples written to {args.out}")
    return 0 if passed else 1
