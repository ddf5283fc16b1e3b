"""The commands of docs/reliability.md run, and its table is a full-matrix table with no loss.

``make chaos`` itself takes 20-25 minutes, so it is checked by what it runs
(``make -n chaos`` must expand to the page's description of it); the page's
rerun command runs for real, in its own pytest process, with the one change of
``CHAOS_MATRIX=full`` to ``tiny`` so it stays cheap.  The nested session uses
this session's chaos services and leaves them running.

The table check reads the page as it is on disk: inside ``make chaos`` that is
the previous run's table (the new one is written when the session ends).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.chaos import kafka_cluster, netsplit, report, scenarios
from tests.chaos.services import ROOT, ChaosServices

pytestmark = pytest.mark.chaos

PAGE = report.DOCS


def commands() -> list[str]:
    """The lines of the page's ```sh blocks, in order."""
    blocks = re.findall(r"```sh\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.DOTALL)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def check_table(start: str, end: str, names: list[str]) -> list[dict[str, str]]:
    """The page's table between ``start`` and ``end``: a full-matrix row per scenario of
    ``names``, none with a message lost or doubled or a stale write committed."""
    text = PAGE.read_text(encoding="utf-8")
    block = text.split(start, 1)[1].split(end, 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("| ") and "---" not in line]
    header, *body = ([cell.strip() for cell in row.strip("|").split("|")] for row in rows)
    table = [dict(zip(header, row, strict=True)) for row in body]
    assert [row["scenario"] for row in table] == names
    for row in table:
        assert row["lost"] == "0", row
        assert row["doubled"] == "0", row
        assert row["stale writes committed"] == "0", row
        assert int(row["faults"]) > 0, row
        runs = int(row["runs (seeds)"].split()[0])
        assert runs >= len(scenarios.SEEDS["full"]), f"not a full-matrix row: {row}"
    assert "Matrix `full`" in block and "0 with violations" in block
    return table


def test_the_page_shows_a_full_matrix_table_without_loss() -> None:
    check_table(report.TABLE_START, report.TABLE_END, list(scenarios.SCENARIOS))


def test_every_command_of_the_page_runs(chaos_services: ChaosServices, tmp_path: Path) -> None:
    make_chaos, rerun = commands()
    assert make_chaos == "make chaos"
    recipe = subprocess.run(
        ["make", "-n", "chaos"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "CHAOS_MATRIX=full CHAOS_UPDATE_DOCS=1 .venv/bin/pytest tests/chaos" in recipe

    words = shlex.split(rerun)
    assignments = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
    argv = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
    assert assignments == {"CHAOS_SEED": "12", "CHAOS_MATRIX": "full"}, rerun
    assert argv[0] == ".venv/bin/pytest"
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("CHAOS_") and k != "PYTEST_ADDOPTS"
    }
    env.update(
        assignments,
        CHAOS_MATRIX="tiny",
        CHAOS_REPORT=str(tmp_path / "results.md"),
        CHAOS_SERVICES_DIR=str(chaos_services.directory),
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *argv[1:], "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout, done.stdout[-2000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("chaos kill seed=12"))
    assert " lost=0 doubled=0 " in line and " faults=1 " in line, line
    assert "| kill | 1 (12) |" in (tmp_path / "results.md").read_text()


def test_the_page_shows_a_full_matrix_cluster_table_without_loss() -> None:
    table = check_table(
        kafka_cluster.TABLE_START, kafka_cluster.TABLE_END, list(kafka_cluster.SCENARIOS)
    )
    assert all(row["recovery, worst"].endswith(" s") for row in table), table
    # The page names the settings the cluster runs with: they are compose/local/up's.
    text = PAGE.read_text(encoding="utf-8")
    up = (ROOT / "compose" / "local" / "up").read_text(encoding="utf-8")
    for setting in ("DEDUP_KAFKA_BROKERS", "min.insync.replicas=2", "replication.factor=3"):
        assert setting in up and setting in text, setting


def test_the_page_shows_a_full_matrix_partition_table_without_loss() -> None:
    table = check_table(netsplit.TABLE_START, netsplit.TABLE_END, list(netsplit.SCENARIOS))
    assert all(row["heal → progress, worst"].endswith(" s") for row in table), table
