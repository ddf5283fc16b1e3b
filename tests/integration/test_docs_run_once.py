"""Every snippet of docs/howto/run-once.md runs, in page order, on the docs' database.

The page's code blocks are taken from the Markdown itself: the table, the job
module, the crontab (its command run the way cron runs it, on three "machines"
at once), the shell line, the Python rerun, the operator's queries and the
downstream service.  A block added to the page without a run here fails the test.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from dedup_dev import docs as docs_support
from dedup_dev import helpers
from dedup_dev.services import ROOT

PAGE = ROOT / "docs" / "howto" / "run-once.md"

# This page runs on the run's one docs database, after the pages before it (tests/conftest.py).
pytestmark = pytest.mark.docs_page
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def snippets() -> list[tuple[str, str]]:
    """(language, text) of each fenced code block of the page, in order."""
    return [(m[1], m[2]) for m in BLOCK.finditer(PAGE.read_text(encoding="utf-8"))]


def crontab(text: str, dsn: str) -> tuple[dict[str, str], list[str]]:
    """The variables and the commands of a crontab, as cron would run them."""
    env: dict[str, str] = {}
    commands = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if re.match(r"^\w+=", line):
            name, _, value = line.partition("=")
            env[name] = value
            continue
        fields = line.split(maxsplit=5)
        assert len(fields) == 6, f"not a crontab entry: {line!r}"
        # cron turns an unescaped % into a newline and drops the backslash of \%
        assert not re.search(r"(?<!\\)%", fields[5]), "unescaped % in a cron command"
        commands.append(fields[5].replace("\\%", "%"))
    assert env.pop("DEDUP_DSN", None), "the crontab sets DEDUP_DSN"
    env["DEDUP_DSN"] = dsn  # the test's own database instead of the example's
    return env, commands


async def sh(command: str, *, cwd: Path, env: dict[str, str]) -> tuple[int, str, str]:
    """Run ``command`` with /bin/sh: (exit code, stdout, stderr)."""
    return await run("/bin/sh", "-c", command, cwd=cwd, env=env)


async def run(*argv: str, cwd: Path, env: dict[str, str]) -> tuple[int, str, str]:
    """Run ``argv``: (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_every_snippet_of_the_run_once_howto_works(
    dsn: str, pool: Any, tmp_path: Path
) -> None:
    blocks = snippets()
    assert [lang for lang, _ in blocks] == [
        "sql",
        "python",
        "cron",
        "sh",
        "python",
        "sql",
        "console",
        "python",
        "sh",
        "sh",
        "python",
        "sql",
        "python",
        "sh",
        "sql",
        "sh",
    ]
    texts = [text for _, text in blocks]
    table, job, cron, shell, rerun, queries, events, downstream = texts[:8]
    schedule, scheduler, embedded, schedule_events = texts[8:12]
    batch_job, batch_run, step_events, stats = texts[12:]

    # 1. The table.
    await pool.execute(table)

    # 2. The job module, where the cron line finds it: $HOME/billing, with its venv.
    home = tmp_path
    billing = home / "billing"
    (billing / ".venv" / "bin").mkdir(parents=True)
    assert job.startswith("# myjobs.py\n")
    (billing / "myjobs.py").write_text(job)
    dedup_script = Path(sys.executable).parent / "dedup"
    assert dedup_script.exists(), "the dedup entry point is installed (pip install -e .)"
    (billing / ".venv" / "bin" / "dedup").symlink_to(dedup_script)

    # 3. The cron line fires on three machines at once: one runs the job.
    variables, [command] = crontab(cron, dsn)
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", **variables}
    fired = await asyncio.gather(*(sh(command, cwd=home, env=env) for _ in range(3)))
    codes = sorted(code for code, _, _ in fired)
    assert codes[0] == 0 and set(codes[1:]) <= {3, 4}, fired
    key = await pool.fetchval(
        "SELECT business_key FROM dedup.tasks WHERE task = 'customer-statements'"
    )
    assert dt.date.fromisoformat(key) == dt.date.today() - dt.timedelta(days=1)
    assert await pool.fetch(
        "SELECT account, total, fence_token FROM customer_statements ORDER BY account"
    ) == [("acme", 120, 1), ("globex", 80, 1)]

    # 4. The shell line: the run, then a rerun that skips, both count as success.
    first = await sh(shell, cwd=billing, env=env)
    again = await sh(shell, cwd=billing, env=env)
    assert first[0] == 0 and "succeeded (token 1" in first[1], first
    assert again[0] == 0 and "skipped_done (token 1" in again[1], again

    # 5. The forced rerun from Python: the next token, the next attempt.
    code, out, err = await run(sys.executable, "-c", rerun, cwd=billing, env=env)
    assert code == 0, err
    assert out.split() == ["succeeded", "2", "2"]

    # 6. The operator's queries show the forced run and its story.
    tasks_query, events_query = (q for q in queries.split(";") if q.strip())
    tasks = await pool.fetch(tasks_query)
    assert [(t["business_key"], t["state"], t["token"], t["forced"]) for t in tasks] == [
        ("2024-05-31", "succeeded", 2, True),
        (key, "succeeded", 1, False),
    ]
    assert tasks[0]["result"] == {"statements": 2}
    story = await pool.fetch(events_query)
    forced = [e for e in story if e["kind"] == "task_started" and e["detail"]["forced"]]
    assert [(e["holder"], e["token"], e["from_state"]) for e in forced] == [
        ("ops-laptop", 2, "succeeded")
    ]
    # The same story, from `dedup events`.
    [(command, expected)] = docs_support.console(events)
    code, out, err = await sh(command, cwd=billing, env=env)
    assert code == 0, err
    # (a table's widths follow its values: the holders' names are this machine's)
    pattern = docs_support.expected_pattern(docs_support.columns(expected))
    assert pattern.fullmatch(docs_support.columns(out)), f"{command}:\n{out}\npage:\n{expected}"

    # 7. The downstream service refuses the older token and accepts the newer.
    namespace: dict[str, Any] = {}
    exec(downstream, namespace)  # noqa: S102 (the page's own example)
    accept = namespace["accept_statement"]
    day = dt.date(2024, 5, 31)
    async with pool.acquire() as conn:
        assert await accept(conn, day, "acme", 999, 1) == 409
        assert await accept(conn, day, "acme", 121, 2) == 200
        assert await accept(conn, day, "acme", 122, 3) == 200
        assert await accept(conn, day, "acme", 999, 2) == 409
    assert await pool.fetchrow(
        "SELECT total, fence_token FROM customer_statements"
        " WHERE business_date = $1 AND account = 'acme'",
        day,
    ) == (122, 3)

    # 8. The schedule and its backfill: the 29th and 30th run, the 31st was done.
    code, out, err = await sh(schedule, cwd=billing, env=env)
    assert code == 0, err
    assert out.splitlines()[0] == "schedule customer-statements: added"
    assert [line.split()[4] for line in out.splitlines()[1:]] == [
        "succeeded",
        "succeeded",
        "skipped_done",
    ]
    again = await sh(schedule, cwd=billing, env=env)
    assert again[0] == 0, again
    assert again[1].splitlines()[0] == "schedule customer-statements: unchanged"
    assert [line.split()[4] for line in again[1].splitlines()[1:]] == ["skipped_done"] * 3
    days = await pool.fetch(
        "SELECT DISTINCT business_date FROM customer_statements ORDER BY business_date"
    )
    assert [d["business_date"] for d in days][:3] == [dt.date(2024, 5, d) for d in (29, 30, 31)]

    # 9. The scheduler, on three machines and embedded; each stops on SIGTERM.
    connected = "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'dedup'"
    before = await pool.fetchval(connected)
    started = [
        await asyncio.create_subprocess_exec(
            "/bin/sh",
            "-c",
            f"exec {scheduler.strip()}",
            cwd=billing,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        for _ in range(3)
    ]
    started.append(
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            embedded,
            cwd=billing,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    )

    async def all_polling() -> bool:
        for proc in started:
            assert proc.returncode is None, await proc.communicate()
        # Each scheduler, once running, holds two connections: its rounds' and its runner's.
        return bool(await pool.fetchval(connected) >= before + 8)

    await helpers.wait_for(all_polling, within=30, what="the schedulers connected")
    for proc in started:
        proc.send_signal(signal.SIGTERM)
    ended = [await asyncio.wait_for(proc.communicate(), 30) for proc in started]
    assert [proc.returncode for proc in started] == [0, 0, 0, 0], ended

    # 10. The schedule's story.
    story = await pool.fetch(schedule_events)
    assert [e["kind"] for e in story] == [
        "schedule_added",
        "schedule_backfill",
        "schedule_backfill",
    ]

    # 11. The job in steps fails at its third batch; the rerun sends batches 3-5 only.
    assert batch_job.startswith("# batchjobs.py\n")
    (billing / "batchjobs.py").write_text(batch_job)
    await pool.execute(REFUSE_ACCT_101)
    failed = await sh(batch_run, cwd=billing, env=env)
    assert failed[0] == 1 and "refused acct-101" in failed[2], failed
    await pool.execute("DROP TRIGGER refuse_acct_101 ON customer_statements")
    rerun_done = await sh(batch_run, cwd=billing, env=env)
    assert rerun_done[0] == 0 and "succeeded (token 2" in rerun_done[1], rerun_done
    steps = [tuple(r) for r in await pool.fetch(step_events)]
    assert steps == [
        ("task_step_done", 1, "accounts-0"),
        ("task_step_done", 1, "accounts-50"),
        ("task_step_skipped", 2, "accounts-0"),
        ("task_step_skipped", 2, "accounts-50"),
        ("task_step_done", 2, "accounts-100"),
        ("task_step_done", 2, "accounts-150"),
        ("task_step_done", 2, "accounts-200"),
    ]
    sent = await pool.fetch(
        "SELECT fence_token, count(*) FROM customer_statements WHERE business_date = '2024-06-30'"
        " GROUP BY fence_token ORDER BY fence_token"
    )
    assert [tuple(r) for r in sent] == [(1, 100), (2, 150)]  # each account once
    result = await pool.fetchval(
        "SELECT result FROM dedup.tasks"
        " WHERE task = 'customer-statements' AND business_key = '2024-06-30'"
    )
    assert result == {"batches_sent": 3}

    # 12. The stats of the task's runs: the batch job's rerun, the forced run,
    # the backfill; each well under the 600 s timeout.
    code, out, err = await sh(stats, cwd=billing, env=env)
    assert code == 0, (out, err)
    first, second, third = out.splitlines()
    assert re.fullmatch(r"task customer-statements: \d+ successful runs; duration p50 .*", first), (
        out
    )
    assert second == "lease ttl 30.0 s, renewed every 10.0 s while a run lasts"  # the batch run's
    assert third == "platform timeout 600.0 s (--timeout)"


# The downstream failure of section 8's first run: the third batch's first account.
REFUSE_ACCT_101 = """
CREATE FUNCTION refuse_acct_101() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'refused acct-101';
END $$;
CREATE TRIGGER refuse_acct_101 BEFORE INSERT ON customer_statements
    FOR EACH ROW WHEN (NEW.account = 'acct-101') EXECUTE FUNCTION refuse_acct_101();
"""
