"""Every command in docs/performance.md runs, shrunk to a few hundred records.

The page's commands are the benchmark's real invocations; here each one runs
against the test services with ``--messages``/``--rounds`` overridden (argparse
keeps the last value), its output going to a temporary folder, so the docs
cannot drift from what the harness accepts and prints.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from dedup_dev.services import ROOT, Services

PAGE = ROOT / "docs" / "performance.md"
SHRINK = ["--messages", "400", "--rounds", "1"]
LIVE_SHRINK = ["--rates", "1000", "--seconds", "1"]
"""A live run of 1 s at 1,000 msg/s (after the profile's warm-up) per arm."""
SUITE_SHRINK = [*LIVE_SHRINK, "--keys", "20000"]
"""make bench / bench-full: the live run above, and 20,000 keys stored for the table-size run."""


def commands() -> list[list[str]]:
    """The shell commands of the page's ```sh blocks, split into words."""
    blocks = re.findall(r"```sh\n(.*?)```", PAGE.read_text(), re.DOTALL)
    return [shlex.split(line) for block in blocks for line in block.splitlines() if line.strip()]


MAKE_TARGETS = {"bench": ["quick"], "bench-full": ["full", "--publish"], "bench-soak": ["soak"]}


def as_python(words: list[str]) -> list[str]:
    """``make bench[-full|-soak] BENCH_ARGS=...`` or ``.venv/bin/python -m ...`` as our argv."""
    if words[0] == "make":
        target, *rest = words[1:]
        bench_args = [w.removeprefix("BENCH_ARGS=") for w in rest if w.startswith("BENCH_ARGS=")]
        extra = shlex.split(bench_args[0]) if bench_args else []
        return [sys.executable, "-m", "bench", *MAKE_TARGETS[target], *extra]
    assert words[0] == ".venv/bin/python", f"unexpected command in {PAGE.name}: {words}"
    return [sys.executable, *words[1:]]


def run(argv: list[str], services: Services, exits: tuple[int, ...] = (0,)) -> str:
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": services.bootstrap_servers,
        "DEDUP_DSN": services.dsn,
    }
    done = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode in exits, (
        f"{argv} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )
    return done.stdout


def test_the_page_lists_the_commands_this_test_runs() -> None:
    found = {" ".join(w[:3]) for w in commands()}
    assert found == {
        "make bench",
        "make bench-full",
        "make bench BENCH_ARGS=--sections live --rounds 2",
        ".venv/bin/python -m bench",
        ".venv/bin/python -m bench.report",
        "make bench-soak",
        "make bench-soak BENCH_ARGS=--messages 200000 --interval 2",
    }


@pytest.mark.parametrize(
    ("target", "module"),
    [
        ("bench", "bench quick"),
        ("bench-full", "bench full --publish"),
        ("bench-soak", "bench soak"),
    ],
)
def test_make_targets_pass_bench_args_to_the_harness(target: str, module: str) -> None:
    # make's own recipe, printed but not run: BENCH_ARGS reach `python -m bench`.
    dry = subprocess.run(
        ["make", "-n", target, "BENCH_ARGS=--messages 7 --rounds 1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert re.search(rf"python -m {module} --messages 7 --rounds 1$", dry.stdout, re.MULTILINE)


@pytest.mark.slow
@pytest.mark.parametrize(
    "words",
    [c for c in commands() if "bench.report" not in c and "bench-soak" not in c],
    ids=lambda w: " ".join(w)[:60],
)
def test_benchmark_commands(words: list[str], services: Services, tmp_path: Path) -> None:
    argv = as_python(words)
    suite = argv[3] in ("quick", "full")
    live = argv[3] == "live"
    if live:
        argv += [*LIVE_SHRINK, "--rounds", "1"]
    else:
        argv += [*SHRINK, *(SUITE_SHRINK if suite else [])]
    argv += ["--out", str(tmp_path / "results.json")]
    if "--profile" in argv:
        argv += ["--profile", str(tmp_path / "profiles")]
    if "--publish" in argv:
        # make bench-full's throughput section is make bench's, run longer: here only
        # its live section, published into a copy of the page.
        argv += ["--sections", "live"]
        docs = tmp_path / "docs"
        docs.mkdir()
        shutil.copy(PAGE, docs / PAGE.name)
        argv += ["--docs", str(docs)]
    out = run(argv, services)
    results = orjson.loads((tmp_path / "results.json").read_bytes())
    if live:
        assert_live(results, out)
        return
    if suite:
        assert_suite(results, out, argv)
        if "throughput" not in results["sections"]:
            return
    summary = results["sections"]["throughput"] if suite else results
    assert "msgs/s (median)" in out
    assert summary["config"]["messages"] == 400
    assert summary["arms"], out
    for name, entry in summary["arms"].items():
        assert not entry["void"], f"{name}: {entry.get('why_void')}"
        assert entry["msgs_per_s"] > 0
    assert {"machine", "versions", "ratios", "targets"} <= set(summary)
    if "--profile" in argv:
        assert sorted(p.name for p in (tmp_path / "profiles").iterdir())


def assert_live(results: dict[str, Any], out: str) -> None:
    """A live run: every arm measured at every rate, with its percentiles; the targets judged."""
    assert "p99.9 ms" in out
    for by_arm in results["rates"].values():
        for name, entry in by_arm.items():
            assert not entry["void"], f"{name}: {entry.get('why_void')}"
            assert 0 < entry["p50_ms"] <= entry["p99_ms"] <= entry["p999_ms"]
    assert {t["status"] for t in results["targets"]} <= {"pass", "fail"}


def assert_suite(results: dict[str, Any], out: str, argv: list[str]) -> None:
    """quick/full: each section's results, every target printed with its verdict."""
    assert "== every target" in out
    for verdict in results["targets"]:
        assert verdict["target"] in out
    if "live" in results["sections"]:
        assert_live(results["sections"]["live"], out)
    if "--publish" in argv:
        docs = Path(argv[argv.index("--docs") + 1])
        page = (docs / PAGE.name).read_text()
        assert "From one run of `make bench-full" in page
        assert (docs / "img" / "live-latency.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_report_publishes_table_plot_and_copy(services: Services, tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    arms = ["--arms", "raw", "--batch-sizes", "10,100"]
    run([sys.executable, "-m", "bench", *SHRINK, *arms, "--out", str(results)], services)
    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy(PAGE, docs / PAGE.name)
    (words,) = [c for c in commands() if "bench.report" in c]
    argv = [*as_python(words), "--docs", str(docs)]
    argv[argv.index("bench/results.json")] = str(results)
    out = run(argv, services)
    page = (docs / PAGE.name).read_text()
    assert "| dedup_batch batch_size | msgs/s (median) |" in page
    assert "| raw |" in page
    assert (docs / "img" / "throughput-vs-batch.png").read_bytes()[:4] == b"\x89PNG"
    assert orjson.loads((docs / "performance-results.json").read_bytes())["arms"]["raw"]
    assert "written:" in out


@pytest.mark.slow
@pytest.mark.parametrize(
    "words", [c for c in commands() if "bench-soak" in c], ids=lambda w: " ".join(w)[:60]
)
def test_soak_commands(words: list[str], services: Services, tmp_path: Path) -> None:
    out_file = tmp_path / "soak.json"
    argv = [*as_python(words), "--messages", "20000", "--interval", "0.1", "--out", str(out_file)]
    # So short a soak is mostly start-up, so its memory verdict may go either way (exit 1);
    # what must hold is that it samples, checks the arm and says so.
    out = run(argv, services, exits=(0, 1))
    soak = orjson.loads(out_file.read_bytes())
    assert len(soak["samples"]) >= 4, out
    assert soak["arm"]["ok"], soak["arm"]
    assert re.search(r"^memory: first quarter peak .* (FLAT|NOT FLAT)$", out, re.MULTILINE), out
    assert re.search(r"^soak (PASSED|FAILED)", out, re.MULTILINE)
