"""``dedup diagnose``: which layer failed, named from a task's runs and the business table."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

import dedup

TABLES = """
CREATE TABLE statements_in (day date NOT NULL, account text NOT NULL);
CREATE TABLE statements_out (day date NOT NULL, account text NOT NULL, token bigint NOT NULL);
INSERT INTO statements_in VALUES ('2024-05-01', 'acme'), ('2024-05-02', 'acme'),
                                 ('2024-05-03', 'acme');
"""


@pytest.fixture
def check_module(tmp_path: Path) -> Iterator[str]:
    """The user's module declaring the task's reconcile check."""
    name = f"statements_checks_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "TASK = 'statements'\n"
        "RECONCILE = {\n"
        "    'source': 'SELECT count(*), NULL FROM statements_in WHERE day = $1',\n"
        "    'result': 'SELECT count(*), NULL FROM statements_out WHERE day = $1',\n"
        "}\n"
    )
    yield name
    sys.modules.pop(name, None)


async def send(run: dedup.TaskRun) -> None:
    """Not idempotent on purpose: each run adds the day's statement again."""
    async with run.transaction() as conn:
        await conn.execute(
            "INSERT INTO statements_out VALUES ($1::text::date, 'acme', $2)",
            run.business_key,
            run.token,
        )


async def plant_two_holders(pool: Any) -> None:
    """What two schedulers that do not share a lease leave: two starts 0.1 s apart."""
    await pool.execute(
        """
        INSERT INTO dedup.events (at, subject, kind, namespace, key, resource, holder, token,
                                  from_state, to_state, detail)
        VALUES (t0, 'task', 'task_started', 'statements', '2024-05-01', r, 'cron-a', 1,
                'pending', 'running', '{"forced": false}'),
               (t0 + interval '0.1 s', 'task', 'task_started', 'statements', '2024-05-01', r,
                'cron-b', 2, 'pending', 'running', '{"forced": false}'),
               (t0 + interval '5 s', 'task', 'task_succeeded', 'statements', '2024-05-01', r,
                'cron-a', 1, 'running', 'succeeded', '{}'),
               (t0 + interval '5.1 s', 'task', 'task_succeeded', 'statements', '2024-05-01', r,
                'cron-b', 2, 'running', 'succeeded', '{}')
        """.replace("t0", "'2024-05-02 00:00:00+00'::timestamptz").replace(
            " r,", " 'task:statements:2024-05-01',"
        )
    )
    await pool.execute(
        "INSERT INTO statements_out VALUES ('2024-05-01', 'acme', 1), ('2024-05-01', 'acme', 2)"
    )


def diagnose(dsn: str, cwd: Path, module: str, day: str) -> tuple[int, dict[str, Any], str]:
    args = ["--task", "statements", "--date", day, "--module", module, "--dsn", dsn]
    run = [sys.executable, "-m", "dedup", "diagnose", *args]
    as_json = subprocess.run(
        [*run, "--format", "json"], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    text = subprocess.run(run, cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    assert as_json.returncode == text.returncode, (as_json, text)
    return text.returncode, orjson.loads(as_json.stdout), text.stdout


async def test_diagnose_names_the_layer_of_three_planted_histories(
    dsn: str, pool: Any, tmp_path: Path, check_module: str
) -> None:
    await pool.execute(TABLES)
    await plant_two_holders(pool)
    await dedup.TaskRunner(pool=pool, holder="scheduler-1").run("statements", "2024-05-02", send)
    await dedup.TaskRunner(pool=pool, holder="ops-laptop").run(
        "statements", "2024-05-02", send, force=True
    )
    await dedup.TaskRunner(pool=pool, holder="scheduler-1").run("statements", "2024-05-03", send)

    triggered = diagnose(dsn, tmp_path, check_module, "2024-05-01")
    executed = diagnose(dsn, tmp_path, check_module, "2024-05-02")
    clean = diagnose(dsn, tmp_path, check_module, "2024-05-03")

    code, found, text = triggered
    assert (code, found["finding"]) == (1, "duplicate_triggering"), text
    assert [(r["holder"], r["token"]) for r in found["runs"]] == [("cron-a", 1), ("cron-b", 2)]
    assert text.startswith(
        "task statements 2024-05-01: duplicate_triggering: 2 holders started the same period: "
        "cron-b (token 2) at 2024-05-02T00:00:00.100000+00:00 while cron-a (token 1,"
    )
    assert (found["source_rows"], found["result_rows"]) == (1, 2)

    code, found, text = executed
    assert (code, found["finding"]) == (1, "duplicate_execution"), text
    assert "succeeded 2 times; forced by ops-laptop" in found["summary"]
    assert [(r["holder"], r["token"], r["forced"]) for r in found["runs"]] == [
        ("scheduler-1", 1, False),
        ("ops-laptop", 2, True),
    ]
    assert "  result 2 rows for the date, source 1" in text.splitlines()

    code, found, text = clean
    assert (code, found["finding"], found["summary"]) == (
        0,
        "none",
        "one run at a time, one success",
    ), text


async def test_the_business_table_is_the_authority_when_the_runs_look_clean(
    dsn: str, pool: Any, tmp_path: Path, check_module: str
) -> None:
    await pool.execute(TABLES)
    await dedup.TaskRunner(pool=pool).run("statements", "2024-05-03", send)
    # A hand-written fix that inserted the statement again, outside any run.
    await pool.execute("INSERT INTO statements_out VALUES ('2024-05-03', 'acme', 0)")

    code, found, text = diagnose(dsn, tmp_path, check_module, "2024-05-03")

    assert (code, found["finding"]) == (1, "duplicate_execution"), text
    assert "the table is the authority" in found["summary"]
