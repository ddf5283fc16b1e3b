"""``make bench`` and ``make bench-full``: every section of the benchmark, every target.

``python -m bench quick`` (``make bench``) runs every section small: under ten
minutes on the 2-core machine, every arm, every target printed with its
figure and verdict.  ``python -m bench full`` (``make bench-full``) is the long
run; with ``--publish`` it writes docs/performance.md's generated blocks, the
results files and the plots.

A section is one part of the benchmark with its own harness (:data:`SECTIONS`);
adding one (the table-size run, say) is adding an entry there and a
``<!-- bench:NAME:begin -->`` / ``<!-- bench:NAME:end -->`` pair to the page.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench import live, relay, report, run, table_size

Summary = dict[str, Any]
Verdict = dict[str, Any]
"""``{"target": what, "value": figure or None, "limit": ">= 0.8", "status": pass|fail|n/a}``."""


@dataclass(frozen=True)
class Section:
    """One part of the benchmark, as the suite runs, judges and publishes it."""

    name: str
    """Its key in the results and its block's name in the page (``bench:NAME:begin``)."""
    quick: tuple[str, ...]
    """Its command-line arguments in ``python -m bench quick``."""
    full: tuple[str, ...]
    """... and in ``python -m bench full``."""
    measure: Callable[[list[str]], Summary]
    """Runs it with those arguments (the suite's overrides appended); its summary."""
    targets: Callable[[Summary], list[Verdict]]
    """Its targets, judged."""
    table: Callable[[Summary], str]
    """What it prints."""
    markdown: Callable[[Summary], str]
    """Its generated block of docs/performance.md."""
    publish: Callable[[Summary, Path], list[Path]]
    """Writes its results copy and plots under docs/; what it wrote."""
    overrides: Callable[[argparse.Namespace], list[str]]
    """The suite's options that apply to it, as its own arguments."""


def _throughput_measure(argv: list[str]) -> Summary:
    return run.measure(run.parse(argv), argv)


def _throughput_targets(summary: Summary) -> list[Verdict]:
    return [
        {
            "target": f"throughput: {t['ratio']}",
            "value": t["value"],
            "limit": f">= {t['threshold']}",
            "status": t["status"],
        }
        for t in summary["targets"]
    ]


def _throughput_publish(summary: Summary, docs: Path) -> list[Path]:
    copy = docs / report.RESULTS_COPY
    copy.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2) + b"\n")
    return [
        copy,
        *([report.plot(summary, docs / report.PLOT)] if report.sweep_points(summary) else []),
    ]


def _throughput_overrides(args: argparse.Namespace) -> list[str]:
    # --messages sizes all three topics: a shrunk run is shrunk everywhere.
    sizes = ("--messages", "--per-message-messages", "--hot-messages")
    return [
        *([arg for size in sizes for arg in (size, str(args.messages))] if args.messages else []),
        *(["--rounds", str(args.rounds)] if args.rounds else []),
    ]


def _live_measure(argv: list[str]) -> Summary:
    summary = live.measure(live.parse(argv))
    summary["config"]["command"] = " ".join(["python -m bench live", *argv])
    return summary


def _live_targets(summary: Summary) -> list[Verdict]:
    return list(summary["targets"])


LIVE_RESULTS = "performance-live-results.json"


def _live_publish(summary: Summary, docs: Path) -> list[Path]:
    copy = docs / LIVE_RESULTS
    copy.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2) + b"\n")
    drawn = live.plot(summary, docs / live.PLOT)
    return [copy, *([drawn] if drawn else [])]


def _live_overrides(args: argparse.Namespace) -> list[str]:
    return [
        *(["--rounds", str(args.rounds)] if args.rounds else []),
        *(["--seconds", str(args.seconds)] if args.seconds else []),
        *(["--rates", args.rates] if args.rates else []),
    ]


def _table_size_measure(argv: list[str]) -> Summary:
    return table_size.measure(table_size.parse(argv), argv)


def _table_size_targets(summary: Summary) -> list[Verdict]:
    return [
        {
            "target": f"table size: {t['name'].rsplit(' >= ', 1)[0]}",
            "value": t["value"],
            "limit": f">= {t['name'].rsplit(' >= ', 1)[1]}",
            "status": "n/a" if t["value"] is None else "pass" if t["passed"] else "fail",
        }
        for t in summary["targets"]
    ]


def _table_size_overrides(args: argparse.Namespace) -> list[str]:
    return [
        *(["--rounds", str(args.rounds)] if args.rounds else []),
        *(["--messages", str(args.messages)] if args.messages else []),
        # One size, half of it purged.
        *(["--sizes", f"0,{args.keys}", "--purge-keys", str(args.keys // 2)] if args.keys else []),
    ]


TABLE_SIZE_RESULTS = "performance-table-size-results.json"


def _table_size_publish(summary: Summary, docs: Path) -> list[Path]:
    copy = docs / TABLE_SIZE_RESULTS
    copy.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2) + b"\n")
    return [copy, table_size.plot(summary, docs / table_size.PLOT)]


def _relay_measure(argv: list[str]) -> Summary:
    return relay.measure(relay.parse(argv), argv)


def _relay_overrides(args: argparse.Namespace) -> list[str]:
    return ["--rounds", str(args.rounds)] if args.rounds else []


RELAY_RESULTS = "performance-relay-results.json"


def _relay_publish(summary: Summary, docs: Path) -> list[Path]:
    copy = docs / RELAY_RESULTS
    copy.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2) + b"\n")
    return [copy]


SECTIONS: list[Section] = [
    Section(
        name="throughput",
        # Every arm; the per-message arms on a topic of their own, small enough
        # that naive (~1,000 msg/s here) takes seconds; no batch-size sweep.
        quick=(
            "--messages", "30000", "--per-message-messages", "4000", "--hot-messages", "10000",
            "--rounds", "2", "--batch-sizes", "",
        ),
        full=(
            "--messages", "200000", "--per-message-messages", "20000", "--hot-messages", "50000",
            "--rounds", "3",
        ),
        measure=_throughput_measure,
        targets=_throughput_targets,
        table=report.table,
        markdown=report.markdown,
        publish=_throughput_publish,
        overrides=_throughput_overrides,
    ),
    Section(
        name="live",
        quick=("--rates", "1000,5000", "--seconds", "8", "--warmup", "2", "--rounds", "1"),
        # 10,000 msg/s outran every arm here (the producer reached ~8,200).
        full=("--rates", "1000,2500,5000", "--seconds", "20", "--warmup", "5", "--rounds", "2"),
        measure=_live_measure,
        targets=_live_targets,
        table=live.table,
        markdown=live.markdown,
        publish=_live_publish,
        overrides=_live_overrides,
    ),
    Section(
        name="table-size",
        # Quick: a million keys stored, enough to see the claim's index leave the
        # cache's sweet spot; full: the 10 M and 50 M (a 10 M purge).
        quick=(
            "--sizes", "0,1000000", "--messages", "30000", "--rounds", "1",
            "--purge-keys", "500000",
        ),
        full=(
            "--sizes", "0,10000000,50000000", "--messages", "100000", "--rounds", "2",
            "--purge-keys", "10000000",
        ),
        measure=_table_size_measure,
        targets=_table_size_targets,
        table=lambda summary: table_size.markdown(summary, image=None),
        markdown=table_size.markdown,
        publish=_table_size_publish,
        overrides=_table_size_overrides,
    ),
    Section(
        name="relay",
        quick=("--records", "20000", "--rounds", "1"),
        full=("--records", "100000", "--rounds", "3"),
        measure=_relay_measure,
        # No target: the page says what each mode costs against a bare producer.
        targets=lambda summary: [],
        table=relay.markdown,
        markdown=relay.markdown,
        publish=_relay_publish,
        overrides=_relay_overrides,
    ),
]  # fmt: skip
"""The sections, in the order they run."""


def parse(argv: list[str]) -> argparse.Namespace:
    """``quick`` or ``full`` and the options that shrink or pick sections."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("profile", choices=("quick", "full"))
    parser.add_argument(
        "--sections",
        default=",".join(s.name for s in SECTIONS),
        help="comma-separated (default: all, %(default)s)",
    )
    parser.add_argument("--rounds", type=int, help="rounds of every section")
    parser.add_argument(
        "--messages", type=int, help="records of each of the throughput section's topics"
    )
    parser.add_argument("--seconds", type=float, help="measured seconds per live run")
    parser.add_argument("--rates", help="the live section's rates, comma-separated msg/s")
    parser.add_argument("--keys", type=int, help="keys stored in the table-size section's run")
    parser.add_argument(
        "--out", type=Path, default=run.ROOT / "bench" / "results-suite.json", help="results JSON"
    )
    parser.add_argument(
        "--publish",
        action="store_true",
        help="write docs/performance.md's generated blocks, the results copies and the plots",
    )
    parser.add_argument("--docs", type=Path, default=report.DOCS, help="the docs folder")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.sections.split(",") if n.strip()]
    known = {s.name for s in SECTIONS}
    if set(names) - known:
        parser.error(f"unknown sections: {', '.join(sorted(set(names) - known))}")
    args.chosen = [s for s in SECTIONS if s.name in names]
    return args


def main(argv: list[str]) -> int:
    """Run the sections, print every target, write the results (and with --publish, the page)."""
    args = parse(argv)
    started = time.monotonic()
    results: dict[str, Any] = {"profile": args.profile, "sections": {}, "minutes": {}}
    for section in args.chosen:
        section_argv = [*getattr(section, args.profile), *section.overrides(args)]
        shown = " ".join(section_argv) or "(defaults)"
        print(f"== {section.name} ({section.name} arguments: {shown})", flush=True)
        t0 = time.monotonic()
        summary = section.measure(section_argv)
        results["sections"][section.name] = summary
        results["minutes"][section.name] = round((time.monotonic() - t0) / 60, 1)
        print()
        print(section.table(summary), flush=True)
        print()
    results["targets"] = [t for s in args.chosen for t in s.targets(results["sections"][s.name])]
    results["minutes"]["total"] = round((time.monotonic() - started) / 60, 1)
    results["command"] = make_command(args.profile, argv[1:])
    results["finished"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    print(f"== every target ({results['minutes']['total']} minutes)")
    print(target_table(results["targets"]))
    print(f"\nwritten: {args.out}")
    if args.publish:
        for path in publish(results, args.chosen, args.docs):
            print(f"written: {path}")
    return 0


def make_command(profile: str, options: list[str]) -> str:
    """The make command that runs ``python -m bench PROFILE OPTIONS`` (make adds --publish)."""
    extra = [o for o in options if o != "--publish"]
    command = "make bench" if profile == "quick" else "make bench-full"
    return f'{command} BENCH_ARGS="{" ".join(extra)}"' if extra else command


def target_table(verdicts: list[Verdict]) -> str:
    """Every target on a line: what, figure, limit, verdict."""
    width = max((len(t["target"]) for t in verdicts), default=0)
    return "\n".join(
        f"{t['target']:<{width}}  {_figure(t['value']):>8}  (target {t['limit']}): "
        f"{t['status'].upper()}"
        for t in verdicts
    )


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def targets_markdown(results: dict[str, Any]) -> str:
    """The page's table of every target, from one run."""
    out = ["| target | measured | limit | verdict |", "|---|---|---|---|"]
    out += [
        f"| {t['target']} | {_figure(t['value'])} | {t['limit']} | **{t['status'].upper()}** |"
        for t in results["targets"]
    ]
    minutes = ", ".join(f"{k} {v}" for k, v in results["minutes"].items())
    out += [
        "",
        f"From one run of `{results['command']}`, finished {results['finished']} "
        f"(minutes: {minutes}).",
    ]
    return "\n".join(out)


def markers(name: str) -> tuple[str, str]:
    """The comments around section ``name``'s generated block in the page."""
    return f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with block ``name`` holding ``body``; a missing block is an error."""
    begin, end = markers(name)
    block = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.DOTALL)
    if not block.search(text):
        raise SystemExit(f"{report.PAGE} has no {begin} ... {end} block")
    return block.sub(lambda _: f"{begin}\n{body}\n{end}", text)


def publish(results: dict[str, Any], chosen: list[Section], docs: Path) -> list[Path]:
    """Write each section's block, copy and plots, and the targets block."""
    page = docs / report.PAGE
    text = page.read_text()
    written: list[Path] = []
    for section in chosen:
        summary = results["sections"][section.name]
        text = replace_block(text, section.name, section.markdown(summary))
        written += section.publish(summary, docs)
    text = replace_block(text, "targets", targets_markdown(results))
    page.write_text(text)
    return [*written, page]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
