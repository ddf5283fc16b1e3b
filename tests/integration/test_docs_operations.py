"""Every snippet of docs/operations.md runs as written, through pgbouncer in transaction mode.

In page order: the pgbouncer settings shown are the ones ``compose/local/up
pgbouncer`` runs with; that command starts (or finds) it; the tables are made;
the example service runs a job and consumes through pgbouncer until SIGTERM;
then the ``dedup`` commands run through it.  The page's topic and group
``payments`` become this test's own.

The metrics section's app runs too, with a real consumer, and serves what
Prometheus would scrape (its port the test's own).
"""

from __future__ import annotations

import asyncio
import configparser
import os
import signal
import sys
import urllib.request
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import parser

from dedup_dev import docs as docs_support
from dedup_dev import helpers
from dedup_dev.kafka import Topics
from dedup_dev.services import ROOT, Services

PAGE = ROOT / "docs" / "operations.md"
DASHBOARD = "## Dashboard and metrics endpoint"
METRICS = "### Your own consumer's metrics"
FAILOVER = "## Against a replicated Postgres"
SERVICES_DIR = Path(os.environ.get("DEDUP_SERVICES_DIR") or ROOT / ".services")
# Where the local pgbouncer's settings differ by machine, not by meaning.
LOCAL_SETTINGS = {"listen_port"}


def check_settings(shown: str) -> None:
    """The page's pgbouncer.ini is what compose/local/up wrote, but for machine-local values."""
    page, ours = configparser.ConfigParser(), configparser.ConfigParser()
    page.read_string(shown)
    ours.read(SERVICES_DIR / "pgbouncer" / "pgbouncer.ini")
    assert set(page["databases"]) == set(ours["databases"]) == {"*"}
    for name, value in page["pgbouncer"].items():
        if name not in LOCAL_SETTINGS:
            assert ours["pgbouncer"][name] == value, name
    assert "ignore_startup_parameters" not in ours["pgbouncer"], "dedup needs none"


async def run_console(text: str, env: dict[str, str], ours: Any) -> None:
    for command, expected in docs_support.console(text):
        done = await asyncio.to_thread(docs_support.run, ours(command), env)
        assert docs_support.expected_pattern(ours(expected)).fullmatch(done), (
            f"`{command}` printed:\n{done}\nthe page says:\n{expected}"
        )


async def test_every_snippet_of_the_pooler_section_runs_as_written(
    services: Services,
    bootstrap_servers: str,
    topics: Topics,
    pool: Any,
    pgbouncer_dsn: str,
    tmp_path: Path,
) -> None:
    topic = await topics.create()
    group = f"g-{topic}"

    def ours(text: str) -> str:
        """A console line or its output, with the port the local pgbouncer listens on."""
        if "127.0.0.1:6432/" not in text:
            return text
        port = (SERVICES_DIR / "pgbouncer" / "port").read_text().strip()
        return text.replace("127.0.0.1:6432/", f"127.0.0.1:{port}/")

    # The dashboard section's command runs in tests/integration/test_prometheus.py, the
    # failover section's against a real standby in tests/chaos/test_docs_failover.py.
    text = docs_support.outside(PAGE.read_text(encoding="utf-8"), DASHBOARD)
    text = docs_support.outside(text, FAILOVER)
    # The metrics section's app runs below; its alert rules in test_prometheus.py.
    text = docs_support.outside(text, "## Metrics and alerts")
    blocks = docs_support.checked_snippets(PAGE.name, text)
    assert [language for language, _ in blocks] == ["ini", "console", "sql", "python", "console"]
    (_, ini), (_, start), (_, tables), (_, service), (_, commands) = blocks

    # compose/local/up pgbouncer, for the Postgres the tests' databases are made on.
    env = docs_support.shell_env(services.dsn, bootstrap_servers)
    if "DEDUP_SERVICES_DIR" in os.environ:
        env["DEDUP_SERVICES_DIR"] = os.environ["DEDUP_SERVICES_DIR"]
    await run_console(start, env, ours)
    check_settings(ini)

    await pool.execute(tables)
    payments = [("pay-1", 100), ("pay-1", 100), ("pay-2", 40)]  # pay-1 delivered twice
    await helpers.produce(
        bootstrap_servers,
        topic,
        [(None, orjson.dumps({"payment_id": p, "amount": a})) for p, a in payments],
    )
    service = service.replace('topics=["payments"]', f'topics=["{topic}"]')
    (tmp_path / "service.py").write_text(service.replace('"payments"', f'"{group}"'))
    env = docs_support.shell_env(services.dsn, bootstrap_servers)
    env["DEDUP_PGBOUNCER_DSN"] = pgbouncer_dsn
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "service.py",
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await helpers.wait_for(
            lambda: pool.fetchval(
                "SELECT duplicates = 1 FROM dedup.processed WHERE idempotency_key = 'pay-1'"
            ),
            what="pay-1 applied, its copy suppressed",
        )
        await helpers.wait_for(
            lambda: pool.fetchval("SELECT count(*) = 2 FROM payments_seen"), what="pay-2"
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert out.decode() == "open-day 2026-11-30: succeeded\n"
    assert [tuple(r) for r in await pool.fetch("SELECT day FROM days")] == [("2026-11-30",)]
    seen = await pool.fetch("SELECT payment_id, amount FROM payments_seen ORDER BY 1")
    assert [tuple(r) for r in seen] == [("pay-1", 100), ("pay-2", 40)]

    env = docs_support.shell_env(pgbouncer_dsn, bootstrap_servers)
    env["DEDUP_PGBOUNCER_DSN"] = pgbouncer_dsn
    await run_console(commands, env, ours)


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of each sample the app serves at /metrics."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return [
        (sample.name, sample.labels, sample.value)
        for family in parser.text_string_to_metric_families(text)
        for sample in family.samples
    ]


async def test_the_metrics_snippet_serves_a_consumers_metrics_for_prometheus(
    bootstrap_servers: str, topics: Topics, dsn: str, tmp_path: Path
) -> None:
    topic = await topics.create()
    group = f"g-{topic}"
    port = helpers.free_port()
    section = docs_support.section(PAGE.read_text(encoding="utf-8"), METRICS)
    [(language, app)] = docs_support.checked_snippets(PAGE.name, section)
    assert language == "python", language
    for shown, ours in [
        ('topics=["payments"]', f'topics=["{topic}"]'),
        ('group_id="payments"', f'group_id="{group}"'),
        ("METRICS_PORT = 9464", f"METRICS_PORT = {port}"),
    ]:
        assert app.count(shown) == 1, shown
        app = app.replace(shown, ours)
    (tmp_path / "app.py").write_text(app, encoding="utf-8")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "app.py",
        cwd=tmp_path,
        env=docs_support.shell_env(dsn, bootstrap_servers),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    ours = {"messaging_destination_name": topic, "messaging_consumer_group_name": group}

    async def counters() -> dict[str, float]:
        """The consumer's message counters on this topic, as /metrics shows them."""
        try:
            samples = await asyncio.to_thread(scrape, port)
        except OSError:
            return {}  # not serving yet
        return {
            name: value
            for name, labels, value in samples
            if name.startswith("dedup_messages_") and ours.items() <= labels.items()
        }

    zero = dict.fromkeys(
        f"dedup_messages_{c}_total"
        for c in ("processed", "duplicates", "conflicts", "dead_lettered")
    )
    try:
        # Started, nothing consumed yet: the counters are there, at 0.
        assert await helpers.wait_for(counters, what="the counters") == dict.fromkeys(zero, 0.0)
        await helpers.produce(
            bootstrap_servers, topic, [(None, orjson.dumps({"payment_id": "pay-1"}))]
        )
        counted = {**dict.fromkeys(zero, 0.0), "dedup_messages_processed_total": 1.0}
        await helpers.wait_for(
            lambda: helpers.equal(counters(), counted), what="pay-1 counted at /metrics"
        )
        names = {name for name, _, _ in await asyncio.to_thread(scrape, port)}
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert {"dedup_transaction_duration_seconds_bucket", "dedup_consumer_lag"} <= names, names
