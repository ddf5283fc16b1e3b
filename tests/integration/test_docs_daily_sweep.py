"""Every snippet of docs/howto/daily-sweep.md runs, in page order, and prints what the page shows.

The page's checks module and tables; the statements of its diagnose section
are written by real task runs: the scheduled one, then an operator's forced
rerun that sends one account's statement again.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

import dedup
from dedup_dev import docs as docs_support
from dedup_dev.services import ROOT
from tests.integration.test_reconcile_sweep import receiver

PAGE = ROOT / "docs" / "howto" / "daily-sweep.md"

# This page runs on the run's one docs database, after the pages before it (tests/conftest.py).
pytestmark = pytest.mark.docs_page
DAY = "2024-05-31"
__all__ = ["receiver"]  # the fixture, shared with the sweep's tests


async def send_all(run: dedup.TaskRun) -> None:
    async with run.transaction() as conn:
        await conn.execute(
            "INSERT INTO daily_statements VALUES ('2024-05-31', 'acme', 120, $1),"
            " ('2024-05-31', 'globex', 80, $1)",
            run.token,
        )


async def resend_acme(run: dedup.TaskRun) -> None:
    """The operator's rerun: acme's statement once more, as a new row."""
    async with run.transaction() as conn:
        await conn.execute(
            "INSERT INTO daily_statements VALUES ('2024-05-31', 'acme', 120, $1)", run.token
        )


async def test_every_snippet_of_the_daily_sweep_howto_works(
    dsn: str,
    bootstrap_servers: str,
    pool: Any,
    tmp_path: Path,
    receiver: tuple[str, list[tuple[str | None, Any]]],
) -> None:
    blocks = docs_support.snippets(PAGE)
    assert [lang for lang, _ in blocks] == [
        *("python", "sql", "console", "sh", "console", "console", "console")
    ]
    module, tables, sweep, every_morning, diagnose, alerts, scheduled = (b for _, b in blocks)
    assert module.startswith("# nightly.py\n")
    (tmp_path / "nightly.py").write_text(module)
    await pool.execute(tables)
    # What the task's runs wrote: once by the schedule, then acme again by a forced rerun.
    await dedup.TaskRunner(pool=pool, holder="scheduler-1").run("daily-statements", DAY, send_all)
    await dedup.TaskRunner(pool=pool, holder="ops-laptop").run(
        "daily-statements", DAY, resend_acme, force=True
    )
    env = docs_support.shell_env(dsn, bootstrap_servers)

    for command, expected in [*docs_support.console(sweep), *docs_support.console(diagnose)]:
        out = docs_support.run(command, env, cwd=tmp_path)
        assert docs_support.expected_pattern(expected + "\n").fullmatch(out), (
            f"`{command}` printed:\n{out}\nthe page says:\n{expected}"
        )

    recorded = await pool.fetch(
        "SELECT kind, namespace, key FROM dedup.events WHERE subject = 'reconcile'"
        " AND namespace IN ('fx_rates', 'daily-statements') ORDER BY id"
    )
    assert [tuple(r) for r in recorded] == [
        ("reconcile_mismatch", "daily-statements", DAY),
        ("reconcile_ok", "fx_rates", DAY),
    ]

    # Every morning, for the day before: no figures that day, and no rates either.
    yesterday = (await pool.fetchval("SELECT current_date")) - dt.timedelta(days=1)
    out = docs_support.run(every_morning, env, cwd=tmp_path)
    assert f"reconcile fx_rates {yesterday.isoformat()}: MISMATCH (rows -200)" in (
        out.splitlines()
    ), out

    # Section 4: the alert, once for two sweeps.
    env["ALERT_URL"], posts = receiver
    for command, expected in docs_support.console(alerts):
        out = docs_support.run(command, env, cwd=tmp_path)
        assert docs_support.expected_pattern(expected + "\n").fullmatch(out), (
            f"`{command}` printed:\n{out}\nthe page says:\n{expected}"
        )
    [(key, alert)] = posts
    assert (key, alert["task"], alert["business_date"]) == (
        f"reconcile:daily-statements:{DAY}",
        "daily-statements",
        DAY,
    )

    # Section 5: the sweep as a schedule's job, in one shell (its export holds).
    commands = docs_support.console(scheduled)
    out = docs_support.run("\n".join(c for c, _ in commands), env, cwd=tmp_path)
    expected = "\n".join(e for _, e in commands if e)
    assert docs_support.expected_pattern(expected + "\n").fullmatch(out), out
    assert len(posts) == 1, "the alert was sent once already: the scheduled sweep sends none"
    result = await pool.fetchval(
        "SELECT result FROM dedup.tasks WHERE task = 'sweep' AND business_key = '2024-06-01'"
    )
    assert result == {
        "date": DAY,
        "checks": 2,
        "mismatches": ["daily-statements"],
        "alerts": {},
    }
