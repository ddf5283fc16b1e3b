"""How results are shown: the terminal table, docs/performance.md's table, and the plot.

``python -m bench.report [RESULTS.json]`` prints the table of a finished run;
with ``--publish`` it also writes docs/performance-results.json,
docs/img/throughput-vs-batch.png and the generated part of docs/performance.md.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import orjson

from bench import arms

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGE = "performance.md"
RESULTS_COPY = "performance-results.json"
PLOT = "img/throughput-vs-batch.png"
BEGIN = "<!-- bench:throughput:begin -->"
END = "<!-- bench:throughput:end -->"


LANE_STATS = ("deadlocks",)
"""consumer.stats counts of batches that ran into another lane's locks and ran again alone."""


def _num(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def progress_line(rnd: int, rounds: int, result: dict[str, Any]) -> str:
    """One line per finished arm run."""
    head = f"round {rnd}/{rounds}  {result['arm']:<22}"
    if "error" in result:
        return f"{head} FAILED {result['error'].splitlines()[-1] if result['error'] else ''}"
    verdict = "ok" if result["ok"] else f"VOID ({result['check']})"
    counted = result.get("stats", {})
    lanes = "".join(f"{k.replace('_', ' ')} {counted[k]}  " for k in LANE_STATS if k in counted)
    return (
        f"{head} {_num(result['msgs_per_s']):>9} msg/s  p50 {_num(result['p50_ms'], 1):>7} ms  "
        f"p99 {_num(result['p99_ms'], 1):>7} ms  cpu {result['cpu_s_per_10k']:.3f} s/10k  "
        f"rss {result['peak_rss_mb']:.0f} MiB  {lanes}{verdict}"
    )


def rows(summary: dict[str, Any]) -> list[list[str]]:
    """The table as text cells, header first."""
    header = [
        "arm",
        "msgs/s (median)",
        "min-max",
        "spread",
        "p50 ms",
        "p99 ms",
        "CPU s/10k",
        "peak RSS MiB",
        "x handwritten",
        "x naive",
    ]
    out = [header]
    ratios = summary["ratios"]
    for name, entry in summary["arms"].items():
        spread = entry.get("msgs_per_s_summary")
        if entry["void"]:
            throughput = "VOID"
        else:
            throughput = _num(entry["msgs_per_s"])
        out.append(
            [
                name,
                throughput,
                f"{_num(spread['min'])}-{_num(spread['max'])}" if spread else "-",
                f"{spread['spread_pct']:.0f}%" if spread else "-",
                _num(entry["p50_ms"], 1),
                _num(entry["p99_ms"], 1),
                _num(entry["cpu_s_per_10k"], 3),
                _num(entry["peak_rss_mb"], 0),
                _ratio(ratios, name, "handwritten"),
                _ratio(ratios, name, "naive"),
            ]
        )
    return out


def _ratio(ratios: dict[str, Any], num: str, den: str) -> str:
    found = ratios.get(f"{num}/{den}")
    return "-" if found is None else f"{found['median']:.2f}"


def target_lines(summary: dict[str, Any]) -> list[str]:
    """One line per target: the ratio, the threshold, PASS/FAIL."""
    lines = []
    for t in summary["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(f"{t['ratio']} = {value} (target >= {t['threshold']}): {t['status'].upper()}")
    return lines


def table(summary: dict[str, Any]) -> str:
    """The terminal table, the targets under it."""
    cells = rows(summary)
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = []
    for n, row in enumerate(cells):
        padded = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(padded))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    cfg = summary.get("config", {})
    if cfg:
        lines.append("")
        if cfg.get("distinct_keys") is not None:
            lines.append(
                f"{cfg['messages']:,} records ({cfg['distinct_keys']:,} distinct keys), "
                f"{cfg['partitions']} partitions, {cfg['rounds']} rounds; ratios are medians of "
                "round-by-round ratios"
            )
        lines += per_message_lines(summary)
        lines += hot_lines(summary)
    lines += ["", *target_lines(summary)]
    return "\n".join(lines)


def per_message_lines(summary: dict[str, Any]) -> list[str]:
    """What the one-transaction-per-message arms consumed, when it was a topic of its own."""
    small = summary.get("config", {}).get("per_message")
    if not small:
        return []
    return [
        f"{', '.join(arms.PER_MESSAGE_ARMS)}, dedup_batch@1 and @10: their own topic of "
        f"{small['messages']:,} records ({small['distinct_keys']:,} distinct keys), the same "
        "workload"
    ]


def hot_lines(summary: dict[str, Any]) -> list[str]:
    """What the hot-row arms consumed, and the deadlocks their consumers counted per round."""
    hot = summary.get("config", {}).get("hot_rows")
    if not hot:
        return []
    lines = [
        f"{', '.join(arms.HOT_ARMS)}: their own topic, {hot['messages']:,} payments "
        f"({hot['distinct_keys']:,} distinct) on {hot['accounts']} accounts, the README's "
        "per-message handler"
    ]
    for name in arms.HOT_ARMS:
        entry = summary["arms"].get(name, {})
        for stat in LANE_STATS:
            if stat in entry:
                counted = ", ".join("-" if d is None else str(d) for d in entry[stat])
                lines.append(f"{name}: {stat.replace('_', ' ')} per round {counted}")
    return lines


def markdown(summary: dict[str, Any]) -> str:
    """The generated part of docs/performance.md."""
    cells = rows(summary)
    out = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(cells[0])]
    out += ["| " + " | ".join(r) + " |" for r in cells[1:]]
    out += ["", "| target | measured | verdict |", "|---|---|---|"]
    for t in summary["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        out.append(f"| {t['ratio']} >= {t['threshold']} | {value} | {t['status'].upper()} |")
    cfg, mach, ver = summary["config"], summary["machine"], summary["versions"]
    out += [
        "",
        f"Measured {cfg['finished']} with `{cfg['command']}`: {cfg['messages']:,} records of "
        f"~{cfg['record_bytes']} bytes ({cfg['distinct_keys'] or 0:,} distinct keys), "
        f"{cfg['partitions']} partitions, {cfg['rounds']} rounds.",
        *(["", "; ".join(per_message_lines(summary)) + "."] if per_message_lines(summary) else []),
        *(["", "; ".join(hot_lines(summary)) + "."] if hot_lines(summary) else []),
        "",
        f"Machine: {mach['cpu']}, {mach['logical_cpus']} logical CPUs, {mach['memory_gib']} GiB, "
        f"{mach['os']}, Python {mach['python']}; load average at start "
        f"{', '.join(map(str, mach['load_avg_at_start']))}.",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in ver.items()) + ".",
    ]
    sweep = sweep_points(summary)
    if sweep:
        out += ["", "| dedup_batch batch_size | msgs/s (median) |", "|---|---|"]
        out += [f"| {size} | {_num(rate)} |" for size, rate in sweep]
    return "\n".join(out)


def sweep_points(summary: dict[str, Any]) -> list[tuple[int, float | None]]:
    """``(batch_size, median msgs/s)`` of the dedup_batch@N arms, by batch size."""
    points = []
    for name, entry in summary["arms"].items():
        if name.startswith(arms.SWEEP_PREFIX):
            rate = None if entry["void"] else entry["msgs_per_s"]
            points.append((int(name.removeprefix(arms.SWEEP_PREFIX)), rate))
    return sorted(points)


def plot(summary: dict[str, Any], path: Path) -> Path:
    """Throughput of dedup_batch against batch size, handwritten and naive as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(s, r) for s, r in sweep_points(summary) if r is not None]
    if not points:
        raise SystemExit("no dedup_batch@N arms in these results: nothing to plot")
    spans = [summary["arms"][f"{arms.SWEEP_PREFIX}{s}"]["msgs_per_s_summary"] for s, _ in points]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.errorbar(
        [s for s, _ in points],
        [r for _, r in points],
        yerr=[
            [r - sp["min"] for (_, r), sp in zip(points, spans, strict=True)],
            [sp["max"] - r for (_, r), sp in zip(points, spans, strict=True)],
        ],
        fmt="o-",
        capsize=3,
        label="dedup_batch (median, min-max over rounds)",
    )
    for ref, style in (("handwritten", "--"), ("naive", ":"), ("raw", "-.")):
        entry = summary["arms"].get(ref)
        if entry and not entry["void"] and entry["msgs_per_s"]:
            ax.axhline(entry["msgs_per_s"], linestyle=style, color="grey", linewidth=1)
            ax.annotate(
                f"{ref} ({arms.HANDWRITTEN_BATCH}/tx)" if ref == "handwritten" else ref,
                (points[0][0], entry["msgs_per_s"]),
                textcoords="offset points",
                xytext=(2, 3),
                fontsize=8,
                color="dimgrey",
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks([s for s, _ in points], [str(s) for s, _ in points])
    ax.set_xlabel("batch_size (messages per transaction)")
    ax.set_ylabel("messages/s (median over rounds)")
    cfg = summary["config"]
    ax.set_title(
        f"dedup throughput vs batch size ({cfg['messages']:,} records, {cfg['rounds']} rounds)",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def publish(summary: dict[str, Any], docs: Path = DOCS) -> list[Path]:
    """Write the docs' copy of the results, the plot, and the table into performance.md."""
    page = docs / PAGE
    text = page.read_text()
    block = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.DOTALL)
    if not block.search(text):
        raise SystemExit(f"{page} has no {BEGIN} ... {END} block to replace")
    copy = docs / RESULTS_COPY
    copy.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2) + b"\n")
    written = [copy]
    if sweep_points(summary):
        written.append(plot(summary, docs / PLOT))
    page.write_text(block.sub(lambda _: f"{BEGIN}\n{markdown(summary)}\n{END}", text))
    written.append(page)
    return written


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.report``: show (and optionally publish) a results file."""
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__)
    parser.add_argument("results", type=Path, nargs="?", default=ROOT / "bench" / "results.json")
    parser.add_argument(
        "--publish", action="store_true", help=f"write the table, plot and a copy into {PAGE}"
    )
    parser.add_argument("--docs", type=Path, default=DOCS, help="the docs folder to publish to")
    args = parser.parse_args(argv)
    summary = orjson.loads(args.results.read_bytes())
    print(table(summary))
    if args.publish:
        for path in publish(summary, args.docs):
            print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
