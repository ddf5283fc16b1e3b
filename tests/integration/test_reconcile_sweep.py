"""``dedup reconcile --all`` and ``--since``: the daily sweep of every declared task."""

from __future__ import annotations

import datetime as dt
import http.server
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import orjson
import pytest

import dedup
from dedup_dev import helpers, task_worker

DAY = "2024-05-31"

TABLES = """
CREATE TABLE figures (task text, side text, day date, amount numeric);
-- orders: exact.  refunds: one refund of 80 missing (over its threshold of 10).
-- postings: 2 rows and 0.5 % of the total missing (within 5 rows / 1 %).
INSERT INTO figures
SELECT 'orders', side, '2024-05-31', 10 FROM generate_series(1, 3), unnest('{in,out}'::text[]) side;
INSERT INTO figures VALUES ('refunds', 'in', '2024-05-31', 80), ('refunds', 'in', '2024-05-31', 20),
                           ('refunds', 'out', '2024-05-31', 20);
INSERT INTO figures SELECT 'postings', 'in', '2024-05-31', 1 FROM generate_series(1, 400);
INSERT INTO figures SELECT 'postings', 'out', '2024-05-31', 1 FROM generate_series(1, 398);
"""


def side(task: str, name: str) -> str:
    return (
        f"SELECT count(*), coalesce(sum(amount), 0) FROM figures"
        f" WHERE task = '{task}' AND side = '{name}' AND day = $1"
    )


@pytest.fixture
def checks(tmp_path: Path) -> Iterator[str]:
    """The user's module declaring three tasks' checks, two of them with thresholds."""
    name = f"nightly_{uuid.uuid4().hex[:8]}"
    declared = [
        {"task": "orders", "source": side("orders", "in"), "result": side("orders", "out")},
        {
            "task": "refunds",
            "source": side("refunds", "in"),
            "result": side("refunds", "out"),
            "max_total_difference": 10,
        },
        {
            "task": "postings",
            "source": side("postings", "in"),
            "result": side("postings", "out"),
            "max_rows_difference": 5,
            "max_total_fraction": 0.01,
        },
    ]
    (tmp_path / f"{name}.py").write_text(f"RECONCILE = {declared!r}\n")
    yield name
    sys.modules.pop(name, None)


def sweep(dsn: str, cwd: Path, module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "dedup",
            "reconcile",
            "--all",
            "--module",
            module,
            "--dsn",
            dsn,
            *args,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_the_sweep_flags_the_mismatch_over_its_threshold_and_names_task_and_date(
    dsn: str, pool: Any, tmp_path: Path, checks: str
) -> None:
    await pool.execute(TABLES)

    found = sweep(dsn, tmp_path, checks, "--date", DAY)
    as_json = orjson.loads(sweep(dsn, tmp_path, checks, "--date", DAY, "--format", "json").stdout)

    assert found.returncode == 1, found
    assert found.stdout.splitlines() == [
        f"reconcile orders {DAY}: OK",
        f"reconcile postings {DAY}: OK within thresholds (rows -2, total -2)",
        f"reconcile refunds {DAY}: MISMATCH (rows -1, total -80)",
        "3 checks (3 tasks, 1 dates): 1 mismatches",
    ]
    assert [(r["task"], r["ok"], r["exact"]) for r in as_json["reports"]] == [
        ("orders", True, True),
        ("postings", True, False),
        ("refunds", False, False),
    ]
    mismatches = await pool.fetch(
        "SELECT namespace, key FROM dedup.events WHERE kind = 'reconcile_mismatch'"
    )
    # Once per sweep (the text and the JSON one), each naming the task and the date.
    assert [tuple(m) for m in mismatches] == [("refunds", DAY)] * 2


class Receiver(http.server.BaseHTTPRequestHandler):
    """An alerting endpoint: keeps every POST (its Idempotency-Key and body)."""

    posts: ClassVar[list[tuple[str | None, Any]]] = []
    answer = 204

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.posts.append((self.headers["Idempotency-Key"], orjson.loads(body)))
        self.send_response(self.answer)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[tuple[str | None, Any]]]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    Receiver.posts, Receiver.answer = [], 204
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/alerts", Receiver.posts
    server.shutdown()
    server.server_close()


async def test_the_mismatch_over_its_threshold_alerts_once_when_the_sweep_runs_twice(
    dsn: str, pool: Any, tmp_path: Path, checks: str, receiver: tuple[str, list[Any]]
) -> None:
    await pool.execute(TABLES)
    url, posts = receiver

    first = sweep(dsn, tmp_path, checks, "--date", DAY, "--alert-url", url)
    second = sweep(dsn, tmp_path, checks, "--date", DAY, "--alert-url", url)

    assert (first.returncode, second.returncode) == (1, 1), (first, second)
    assert f"alert reconcile:refunds:{DAY}: sent" in first.stdout.splitlines()
    assert "alert" not in second.stdout  # nothing new to send
    [(key, alert)] = posts  # refunds only: postings is within its thresholds
    assert key == f"reconcile:refunds:{DAY}"
    assert (alert["task"], alert["business_date"], alert["alert"]) == (
        "refunds",
        DAY,
        "reconcile_mismatch",
    )
    assert alert["difference"] == {"rows": -1, "total": -80}
    rows = await pool.fetch("SELECT key, status, attempts FROM dedup.outbox")
    assert [tuple(r) for r in rows] == [(f"reconcile:refunds:{DAY}", "sent", 1)]


async def test_an_alert_the_endpoint_did_not_take_is_sent_by_the_next_sweep(
    dsn: str, pool: Any, tmp_path: Path, checks: str, receiver: tuple[str, list[Any]]
) -> None:
    await pool.execute(TABLES)
    url, posts = receiver
    Receiver.answer = 503  # the alerting system is down

    first = sweep(dsn, tmp_path, checks, "--date", DAY, "--alert-url", url)
    Receiver.answer = 204
    second = sweep(dsn, tmp_path, checks, "--date", DAY, "--alert-url", url)

    assert f"alert reconcile:refunds:{DAY}: pending (HTTP 503)" in first.stdout.splitlines()
    assert f"alert reconcile:refunds:{DAY}: sent" in second.stdout.splitlines()
    assert [key for key, _ in posts] == [f"reconcile:refunds:{DAY}"] * 2  # the same alert
    [row] = await pool.fetch("SELECT status, attempts FROM dedup.outbox")
    assert tuple(row) == ("sent", 2)


def test_an_alert_url_that_is_not_http_is_refused_naming_it(
    dsn: str, tmp_path: Path, checks: str
) -> None:
    refused = sweep(dsn, tmp_path, checks, "--date", DAY, "--alert-url", "mailto:ops@example.com")

    assert refused.returncode == 2, refused
    assert "alert url 'mailto:ops@example.com'" in refused.stderr


async def test_since_sweeps_every_date_up_to_today(
    dsn: str, pool: Any, tmp_path: Path, checks: str
) -> None:
    await pool.execute(TABLES)
    today: dt.date = await pool.fetchval("SELECT current_date")
    since = today - dt.timedelta(days=2)

    found = sweep(dsn, tmp_path, checks, "--since", since.isoformat())

    assert found.returncode == 0, found  # nothing on those dates: every figure is 0 = 0
    assert found.stdout.splitlines()[-1] == "9 checks (3 tasks, 3 dates): 0 mismatches"
    assert found.stdout.splitlines()[0] == f"reconcile orders {since.isoformat()}: OK"


def test_a_threshold_that_is_not_a_number_is_refused_naming_it() -> None:
    with pytest.raises(dedup.ConfigurationError, match="refunds: max_total_difference"):
        dedup.ReconcileCheck("refunds", "SELECT 1, 1", "SELECT 1, 1", max_total_difference="10")  # type: ignore[arg-type]


async def test_a_schedule_runs_the_sweep_for_the_day_before_and_alerts_once(
    dsn: str, pool: Any, tmp_path: Path, checks: str, receiver: tuple[str, list[Any]]
) -> None:
    # The figures of yesterday (UTC, the database's), swept by the period of today.
    today: dt.date = await pool.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
    yesterday = (today - dt.timedelta(days=1)).isoformat()
    await pool.execute(TABLES.replace(DAY, yesterday))
    url, posts = receiver
    # The checks module is in tmp_path; the subprocesses import dedup as this one does.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    env |= {"DEDUP_DSN": dsn, "DEDUP_RECONCILE_MODULES": checks, "DEDUP_ALERT_URL": url}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "dedup", *args],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    added = cli(
        "schedule", "add", "sweep", "dedup:sweep_job", "--task", "sweep",
        "--cron", "0 0 * * *", "--start", f"{today.isoformat()}T00:00:00+00:00",
    )  # fmt: skip
    assert added.returncode == 0, added
    scheduler = await task_worker.start("schedule", "run", "--poll-interval", "0.2", env=env)

    async def swept() -> Any:
        await scheduler.running()
        return await pool.fetchval(
            "SELECT result FROM dedup.tasks WHERE task = 'sweep' AND state = 'succeeded'"
        )

    result = await helpers.wait_for(swept, what="the scheduled sweep to succeed")
    scheduler.proc.send_signal(signal.SIGTERM)
    code, out, err = await scheduler.finish()
    assert code == 0, out + err
    assert result == {
        "date": yesterday,
        "checks": 3,
        "mismatches": ["refunds"],
        "alerts": {f"reconcile:refunds:{yesterday}": "sent"},
    }
    # A forced rerun of the period sweeps again and alerts no more.
    again = cli("schedule", "backfill", "sweep", "--from", today.isoformat(), "--to",
                today.isoformat(), "--force")  # fmt: skip
    assert again.returncode == 0, again
    assert [key for key, _ in posts] == [f"reconcile:refunds:{yesterday}"]
    mismatches = await pool.fetch(
        "SELECT namespace, key FROM dedup.events WHERE kind = 'reconcile_mismatch'"
    )
    assert [tuple(m) for m in mismatches] == [("refunds", yesterday)] * 2
