"""``dedup reconcile`` and ``dedup.reconcile``: a clean run passes, a planted mismatch is named.

The mismatch is planted the way it happens: a result row goes missing.  The
report names the task code and the business date and gives both figures and
the difference; an event and a metric record it; the command exits 1.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import sys
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from dedup_services import payments, statements
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import dedup
from dedup.cli import _main as cli
from dedup.operations import _reconciliation as reconciliation
from dedup_dev import service_process as service_support
from tests.integration.test_service_statements import DAY, ledger
from tests.integration.test_tracing import counter_totals, series


async def reconcile_events(pool: Any) -> list[tuple[str, str, str, dict[str, Any]]]:
    rows = await pool.fetch(
        "SELECT kind, namespace, key, detail FROM dedup.events WHERE subject = 'reconcile'"
        " ORDER BY id"
    )
    return [tuple(r) for r in rows]


async def test_the_cli_passes_a_clean_run_and_names_a_planted_mismatch(dsn: str, pool: Any) -> None:
    await ledger(pool)
    await dedup.TaskRunner(pool=pool).run(statements.TASK, DAY, statements.job)
    env = service_support.environment(dsn)
    # No --module: the bundled services register their checks as entry points.
    command = ("reconcile", "--task", "statements", "--date", DAY)

    code, out, err = await service_support.run(*command, env=env)
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == "reconcile statements 2026-11-30: OK"

    await pool.execute("DELETE FROM statements.statements WHERE account = 'acc-2'")
    code, out, _ = await service_support.run(*command, env=env)
    assert code == 1
    assert out.splitlines() == [
        "reconcile statements 2026-11-30: MISMATCH",
        "SIDE        COUNTS                                 ROWS  TOTAL",
        "source      accounts with payments, month to date     2    560",
        "result      statements written                        1    500",
        "difference  result - source                          -1    -60",
    ]
    code, out, _ = await service_support.run(*command, "--format", "json", env=env)
    assert code == 1
    assert orjson.loads(out) == {
        "task": "statements",
        "business_date": DAY,
        "ok": False,
        "exact": False,
        "source": {"label": "accounts with payments, month to date", "rows": 2, "total": 560},
        "result": {"label": "statements written", "rows": 1, "total": 500},
        "difference": {"rows": -1, "total": -60},
    }
    found = await reconcile_events(pool)
    assert [(kind, task, key) for kind, task, key, _ in found] == [
        ("reconcile_ok", "statements", DAY),
        ("reconcile_mismatch", "statements", DAY),
        ("reconcile_mismatch", "statements", DAY),
    ]
    assert found[1][3] == {
        "source_rows": 2,
        "source_total": 560,
        "result_rows": 1,
        "result_total": 500,
        "rows_difference": -1,
        "total_difference": -60,
    }


async def test_the_library_call_counts_a_mismatch_and_traces_it(
    pool: Any, metric_reader: InMemoryMetricReader, spans: InMemorySpanExporter
) -> None:
    await payments.SERVICE.migrate(pool)
    await pool.execute(
        "INSERT INTO payments.payments (payment_id, account, amount, business_date, status, token)"
        " VALUES ('p1', 'a', 300, $1, 'applied', 1), ('p2', 'a', 20, $1, 'applied', 1),"
        "        ('p3', 'a', 5, $1, 'rejected', 1)",
        dt.date(2026, 11, 30),
    )
    await pool.execute(
        "INSERT INTO payments.postings (payment_id, account, amount, balance_after, business_date,"
        " token) VALUES ('p1', 'a', 300, 0, $1, 1), ('p2', 'a', 20, 0, $1, 1)",
        dt.date(2026, 11, 30),
    )
    before = counter_totals(metric_reader)["dedup.reconcile.mismatches"]
    clean = await dedup.reconcile(pool, "payments", dt.date(2026, 11, 30))
    assert clean.ok and clean.source == clean.result == reconciliation.Figures(2, 320)

    await pool.execute("DELETE FROM payments.postings WHERE payment_id = 'p2'")
    report = await dedup.reconcile(pool, "payments", "2026-11-30", holder="nightly")
    assert not report.ok
    assert (report.task, report.business_date) == ("payments", dt.date(2026, 11, 30))
    assert (report.source.rows, report.source.total) == (2, 320)
    assert (report.result.rows, report.result.total) == (1, 300)
    assert (report.rows_difference, report.total_difference) == (-1, -20)
    assert counter_totals(metric_reader)["dedup.reconcile.mismatches"] == before + 1
    traced = [s for s in spans.get_finished_spans() if s.name == "reconcile payments"]
    assert [s.attributes["dedup.reconcile.ok"] for s in traced] == [True, False]
    assert [e.name for e in traced[1].events] == ["dedup.reconcile_mismatch"]
    holder = await pool.fetchval(
        "SELECT holder FROM dedup.events WHERE kind = 'reconcile_mismatch'"
    )
    assert holder == "nightly"


async def test_a_check_that_passes_starts_its_tasks_mismatch_count_at_zero(
    pool: Any, metric_reader: InMemoryMetricReader
) -> None:
    # So that Prometheus has the series before the first mismatch, and sees it grow.
    task = f"zero-{uuid.uuid4().hex[:8]}"
    day = "SELECT 2, 10 FROM (SELECT $1::date) AS day"
    check = dedup.ReconcileCheck(task=task, source=day, result=day)
    assert (await dedup.reconcile(pool, check, "2024-01-31")).ok
    assert series(metric_reader, {"dedup.task": task}) == {"dedup.reconcile.mismatches": 0}
    apart = dedup.ReconcileCheck(task=task, source=day, result=day.replace("10", "7"))
    assert not (await dedup.reconcile(pool, apart, "2024-01-31")).ok
    assert series(metric_reader, {"dedup.task": task}) == {"dedup.reconcile.mismatches": 1}


@pytest.fixture
def check_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module of the user's, next to where the command runs, declaring RECONCILE as a dict."""
    name = f"nightly_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "TASK = 'orders'\n"
        "RECONCILE = {\n"
        "    'source': 'SELECT count(*), sum(n) FROM orders_in WHERE day = $1',\n"
        "    'result': 'SELECT count(*), sum(n) FROM orders_out WHERE day = $1',\n"
        "}\n"
    )
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


async def dedup_cli(*argv: str) -> int:
    """``dedup ARGV`` in this process (in a thread: it runs its own event loop)."""
    return await asyncio.to_thread(cli.main, list(argv))


async def test_a_check_declared_in_a_module_as_a_mapping(
    dsn: str, pool: Any, check_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await pool.execute(
        "CREATE TABLE orders_in (day date, n numeric);"
        "CREATE TABLE orders_out (day date, n numeric);"
        "INSERT INTO orders_in VALUES ('2026-11-30', 1.5), ('2026-11-30', 2);"
        "INSERT INTO orders_out VALUES ('2026-11-30', 1.5), ('2026-11-29', 2);"
    )
    args = ("reconcile", "--dsn", dsn, "--module", check_module, "--date", DAY)
    assert await dedup_cli(*args, "--task", "orders") == 1
    assert capsys.readouterr().out.splitlines() == [
        "reconcile orders 2026-11-30: MISMATCH",
        "SIDE        COUNTS           ROWS  TOTAL",
        "source      source              2    3.5",
        "result      result              1    1.5",
        "difference  result - source    -1     -2",
    ]
    assert await dedup_cli(*args, "--task", "orders", "--date", "2026-11-29") == 1
    assert await dedup_cli(*args, "--task", "orders", "--date", "2026-11-28") == 0
    assert "reconcile orders 2026-11-28: OK" in capsys.readouterr().out

    assert await dedup_cli("reconcile", "--module", check_module, "--list") == 0
    listed = capsys.readouterr().out.split()
    assert {"orders", "payments", "coupons", "notifications", "statements"} <= set(listed)


async def test_bad_usage_exits_2_and_says_why(
    dsn: str, pool: Any, check_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ("reconcile", "--dsn", dsn, "--date", DAY)
    assert await dedup_cli(*base, "--task", "nope") == 2
    err = capsys.readouterr().err
    assert "no reconcile check for task 'nope'" in err
    assert "coupons, notifications, payments, statements" in err

    # A query that fails (here: the service's tables were never created).
    assert await dedup_cli(*base, "--module", check_module, "--task", "orders") == 2
    err = capsys.readouterr().err
    assert "reconcile orders: the source query failed (UndefinedTableError" in err

    with pytest.raises(SystemExit) as exited:
        await dedup_cli("reconcile", "--task", "payments", "--date", "30/11/2026")
    assert exited.value.code == 2
    assert "invalid business date '30/11/2026': expected YYYY-MM-DD" in capsys.readouterr().err

    with pytest.raises(dedup.ConfigurationError, match="two reconcile checks for task 'payments'"):
        reconciliation.Registry(
            [payments.RECONCILE, reconciliation.Check("payments", "SELECT 1, 1", "SELECT 1, 1")]
        )
