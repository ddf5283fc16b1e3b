"""Every snippet of docs/howto/reconcile.md runs, in page order, and prints what the page shows.

On the docs' database, whatever pages ran before: the page's own ledger (of
October: the bundled services' page has November's), written to statements
by the page's command; the page's outputs are compared with the real ones line for
line, the planted mismatch is the page's own DELETE, the user's check module,
its tables and its entry point are the page's, run from a project folder.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

import orjson
import pytest

import dedup
from dedup_dev import docs as docs_support
from dedup_dev import service_process as service_support
from dedup_dev.services import ROOT

PAGE = ROOT / "docs" / "howto" / "reconcile.md"
DAY = "2026-10-31"
"""The page's business date (the bundled services' page has November's)."""

# This page runs on the run's one docs database, after the pages before it (tests/conftest.py).
pytestmark = pytest.mark.docs_page


async def test_every_snippet_of_the_reconcile_howto_works(
    dsn: str, pool: Any, tmp_path: Path
) -> None:
    blocks = docs_support.snippets(PAGE)
    assert [lang for lang, _ in blocks] == [
        *("sh", "sql", "sh"),  # the page's own ledger and statements
        *("sh", "text", "sql", "text", "sh", "json", "sql", "sh"),
        *("python", "sql", "sh", "text", "toml", "python"),
    ]
    (
        migrations,
        the_ledger,
        write_statements,
        command,
        ok_output,
        lose_a_row,
        mismatch_output,
        json_command,
        json_output,
        events_query,
        list_command,
        module,
        day_tables,
        module_command,
        module_output,
        entry_points,
        library,
    ) = (body for _, body in blocks)
    env = {
        **service_support.environment(dsn),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }

    async def sh(text: str, cwd: Path = ROOT) -> tuple[int, str, str]:
        return await service_support.run(text, env=env, via_shell=True, cwd=cwd)

    # The page's migrations, ledger and statements run.
    code, _, err = await sh(migrations)
    assert code == 0, err
    await pool.execute(the_ledger)
    code, out, err = await sh(write_statements)
    assert code == 0, (out, err)
    written = await pool.fetch(
        "SELECT account, payments, rejected, total FROM statements.statements"
        " WHERE business_date = $1 ORDER BY account",
        dt.date.fromisoformat(DAY),
    )
    assert [tuple(r) for r in written] == [("acc-1", 1, 0, 2500), ("acc-2", 1, 1, 400)]

    earlier = len(await pool.fetch(events_query))  # the pages before this one may have run checks
    assert await sh(command) == (0, ok_output, "")
    await pool.execute(lose_a_row)
    assert await sh(command) == (1, mismatch_output, "")
    code, out, _ = await sh(json_command)
    assert code == 1 and orjson.loads(out) == orjson.loads(json_output)

    recorded = (await pool.fetch(events_query))[earlier:]
    assert [(r["kind"], r["task"], r["business_date"]) for r in recorded] == [
        ("reconcile_ok", "statements", DAY),
        ("reconcile_mismatch", "statements", DAY),
        ("reconcile_mismatch", "statements", DAY),
    ]
    assert recorded[2]["detail"]["total_difference"] == -400

    code, out, _ = await sh(list_command)
    assert code == 0
    assert [line.split("\t")[0] for line in out.splitlines()] == [
        "coupons",
        "notifications",
        "payments",
        "statements",
    ]

    # A check of the user's own, in a module of their project, run from there.
    project = tmp_path / "project"
    project.mkdir()
    assert module.startswith("# nightly_checks.py\n")
    (project / "nightly_checks.py").write_text(module)
    await pool.execute(day_tables)
    code, out, err = await sh(module_command, cwd=project)
    assert code == 0, err
    assert out == module_output
    # The entry point names the same declaration.
    (entry,) = tomllib.loads(entry_points)["project"]["entry-points"]["dedup.reconcile"].items()
    sys.path.insert(0, str(project))
    try:
        check = importlib.metadata.EntryPoint(entry[0], entry[1], "dedup.reconcile").load()
    finally:
        sys.path.remove(str(project))
        sys.modules.pop("nightly_checks", None)
    assert isinstance(check, dedup.ReconcileCheck) and check.task == entry[0] == "order-invoices"

    # From Python: the same report, and the exit code of a mismatch.
    code, out, err = await service_support.run(
        "-c", library, env=env, program=sys.executable, cwd=tmp_path
    )
    assert code == 1, err
    assert out.splitlines() == [
        *mismatch_output.splitlines(),
        "missing: 1 statements, 400 in total",
    ]
