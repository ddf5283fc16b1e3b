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

from tests.chaos import report, scenarios
from tests.chaos.services import ROOT, ChaosServices

pytestmark = pytest.mark.chaos

PAGE = report.DOCS


def commands() -> list[str]:
    """The lines of the page's ```sh blocks, in order."""
    blocks = re.findall(r"```sh\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.DOTALL)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_the_page_shows_a_full_matrix_table_without_loss() -> None:
    text = PAGE.read_text(encoding="utf-8")
    block = text.split(report.TABLE_START, 1)[1].split(report.TABLE_END, 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("| ") and "---" not in line]
    header, *body = ([cell.strip() for cell in row.strip("|").split("|")] for row in rows)
    assert [row[0] for row in body] == list(scenarios.SCENARIOS)
    column = {name: i for i, name in enumerate(header)}
    for row in body:
        assert row[column["lost"]] == "0", row
        assert row[column["doubled"]] == "0", row
        assert row[column["stale writes committed"]] == "0", row
        assert int(row[column["faults"]]) > 0, row
        runs = int(row[column["runs (seeds)"]].split()[0])
        assert runs >= len(scenarios.SEEDS["full"]), f"not a full-matrix row: {row}"
    assert "Matrix `full`" in block and "0 with violations" in block


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
