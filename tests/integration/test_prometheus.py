"""Every panel of the Grafana dashboard answers from a real Prometheus scraping a bundled service.

Debian's ``prometheus`` (``compose/local/prometheus`` installs it) scrapes
``dedup run dedup_services.payments --metrics-port N`` four times a second while the test
sends payments with replays, conflicting copies, malformed ones and one that
an account's newer fence refuses.  Then each target of each panel of
``compose/grafana/dashboards/dedup.json`` is evaluated through Prometheus's
HTTP API, with Grafana's variables replaced: each must return data, and each
quantile must lie between 0 and the time the test watched the run take.
Last, the panels are drawn from Prometheus's data over the run
(``dedup_dev.dashboard``, matplotlib: no Grafana here) into a PNG, which
``DEDUP_DASHBOARD_PNG=docs/img/dashboard.png`` keeps as the page's picture.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import orjson

from dedup_dev import children, dashboard, helpers, kafka
from dedup_dev import docs as docs_support
from dedup_dev import service_process as service_support
from dedup_dev.kafka import Topics
from dedup_dev.services import ROOT

DASHBOARD = ROOT / "compose" / "grafana" / "dashboards" / "dedup.json"
PAGE = ROOT / "docs" / "operations.md"
JOB = "dedup-payments"
DAY = "2026-11-30"
ACCOUNTS = [f"acc-{i}" for i in range(6)]
PAYMENTS = 300
# Set to a path (docs/img/dashboard.png), the rendered dashboard is written there too.
PICTURE_VARIABLE = "DEDUP_DASHBOARD_PNG"
PICTURE = "docs/img/dashboard.png"
# Four scrapes a second: the run lasts seconds, and its picture needs points.
SCRAPE_MS = 250
# Grafana's $__rate_interval for that scrape interval: four scrapes.
RATE_INTERVAL = f"{4 * SCRAPE_MS}ms"


def dashboard_section() -> str:
    return docs_support.section(PAGE.read_text(encoding="utf-8"), "## Dashboard and metrics")


def documented_command(port: int) -> list[str]:
    """docs/operations.md's command that serves a service's metrics, on ``port``."""
    [(language, command), _] = docs_support.checked_snippets(PAGE.name, dashboard_section())
    assert language == "sh" and command.startswith("dedup run dedup_services.payments "), command
    words = command.split()
    assert words[-2:] == ["--metrics-port", "9464"], command
    return [*words[1:-1], str(port)]


def check_documented_picture() -> None:
    """The page shows PICTURE, and its second command is this test writing it there."""
    section = dashboard_section()
    [_, (language, command)] = docs_support.checked_snippets(PAGE.name, section)
    this_test = Path(__file__).relative_to(ROOT)
    assert language == "sh", language
    assert command.strip() == f"{PICTURE_VARIABLE}={PICTURE} pytest {this_test}", command
    shown = Path(PICTURE).relative_to("docs")
    assert f"]({shown})" in section, f"the page does not show {shown}"


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]


def payment(pid: str, account: str, amount: Any) -> bytes:
    return orjson.dumps({"payment_id": pid, "account": account, "amount": amount, "date": DAY})


class Prometheus:
    """A Prometheus server of the test's own: its port, data and scrape configuration."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def _get(self, path: str, **params: str) -> bytes:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as answer:  # noqa: S310 (our own server)
            return bytes(answer.read())

    async def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` evaluates to now."""
        body = json.loads(await asyncio.to_thread(self._get, "/api/v1/query", query=expr))
        assert body["status"] == "success", (expr, body)
        return list(body["data"]["result"])

    async def ready(self) -> bool:
        try:
            await asyncio.to_thread(self._get, "/-/ready")
        except (OSError, ValueError):
            return False
        return True


async def scraped(prometheus: Prometheus) -> None:
    """Wait for Prometheus to scrape the service once more."""
    now = time.time()
    await helpers.wait_for(
        lambda: prometheus.query(f'timestamp(up{{job="{JOB}"}}) > {now}'),
        what="a scrape",
    )


async def binary() -> str:
    code, out, err = await service_support.run(
        str(ROOT / "compose" / "local" / "prometheus"),
        env=service_support.environment(""),
        via_shell=True,
        within=300,
    )
    assert code == 0, err
    return out.strip()


async def test_every_dashboard_panel_answers_from_a_real_prometheus(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any, tmp_path: Path
) -> None:
    prometheus_bin = await binary()
    topic = await topics.create(partitions=3)
    group = f"g-{topic}"
    metrics_port, prometheus_port = helpers.free_port(), helpers.free_port()
    (tmp_path / "prometheus.yml").write_text(
        f"global: {{scrape_interval: {SCRAPE_MS}ms, evaluation_interval: 1s}}\n"
        "scrape_configs:\n"
        f"  - job_name: {JOB}\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n"
    )
    env = service_support.environment(dsn, bootstrap_servers, PAYMENTS_TOPIC=topic)
    argv = (*documented_command(metrics_port), "--group", group, "--max-attempts", "2")
    async with contextlib.AsyncExitStack() as stack:
        service = await stack.enter_async_context(service_support.child(*argv, env=env))
        prometheus_process = await children.Child.spawn(
            (
                prometheus_bin,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{prometheus_port}",
                "--log.level=warn",
            ),
            env=service_support.environment(""),
        )
        stack.push_async_callback(prometheus_process.close)
        prometheus = Prometheus(prometheus_port)
        await helpers.wait_for(prometheus.ready, what="prometheus ready", within=30)
        await helpers.wait_for(
            lambda: pool.fetchval("SELECT to_regclass('payments.accounts') IS NOT NULL"),
            what="the payments migration",
        )
        await pool.executemany(
            "INSERT INTO payments.accounts (account, balance) VALUES ($1, $2)",
            [(account, 10**9) for account in [*ACCOUNTS, "acc-stale"]],
        )
        await helpers.wait_for(
            lambda: prometheus.query(f'up{{job="{JOB}"}} == 1'), what="a first scrape"
        )
        started, drawn_from = time.monotonic(), time.time()
        # Keyed by payment: every account is written from every partition at once.
        load = [
            (f"p{i}".encode(), payment(f"p{i}", ACCOUNTS[i % len(ACCOUNTS)], 1 + i % 7))
            for i in range(PAYMENTS)
        ]
        conflicts = [(f"p{i}".encode(), payment(f"p{i}", ACCOUNTS[0], 1000)) for i in range(5)]
        malformed = [(b"bad", payment(f"bad{i}", ACCOUNTS[0], "ten")) for i in range(3)]
        half = PAYMENTS // 2
        # Two waves, a scrape after each: every counter and histogram grows between
        # two scrapes, so each rate and quantile has something to say.
        for wave, (payments, replays, bad) in enumerate(
            [
                (load[:half], load[:30], [*conflicts[:2], *malformed[:1]]),
                (load[half:], load[half : half + 30], [*conflicts[2:], *malformed[1:]]),
            ]
        ):
            await kafka.produce(bootstrap_servers, topic, payments)
            await kafka.produce(bootstrap_servers, topic, [*replays, *bad])
            decided = half * (wave + 1)
            await helpers.wait_for(
                lambda n=decided: pool.fetchval("SELECT count(*) = $1 FROM payments.payments", n),
                what=f"wave {wave}: {decided} payments decided",
            )
            letters = 3 * (wave + 1) + 2 * wave
            await helpers.wait_for(
                lambda n=letters: pool.fetchval("SELECT count(*) = $1 FROM dedup.dead_letters", n),
                what=f"wave {wave}: conflicts and malformed payments dead-lettered",
            )
            await scraped(prometheus)
        # Last, a newer owner of partitions 0 and then 1 debited acc-stale: this service's
        # batch is refused and the partition given up (until a rebalance hands it back).
        for partition in (0, 1):
            await pool.execute(
                "UPDATE payments.accounts SET fence_resource = $1, fence_token = 2147483647"
                " WHERE account = 'acc-stale'",
                f"{group}:{topic}:{partition}",
            )
            await kafka.produce(
                bootstrap_servers,
                topic,
                [(b"s", payment(f"s{partition}", "acc-stale", 1))],
                partition=partition,
            )
            await helpers.wait_for(
                lambda n=partition + 1: pool.fetchval(
                    "SELECT count(*) = $1 FROM dedup.events WHERE kind = 'stale_rejected'", n
                ),
                what=f"a stale rejection on partition {partition}",
            )
            await scraped(prometheus)
        elapsed = time.monotonic() - started
        window = f"{math.ceil(time.monotonic() - started) + 5}s"
        answers: dict[str, list[dict[str, Any]]] = {}
        for title, expr in panel_queries():
            promql = expr.replace("$__rate_interval", window).replace("$job", JOB)
            answers[f"{title}: {promql}"] = await prometheus.query(promql)
        assert service.alive and prometheus_process.alive, await service.stderr()
        by_name = await prometheus.query(f'count by (__name__) ({{job="{JOB}"}})')
        names = sorted(series["metric"]["__name__"] for series in by_name)
        picture = tmp_path / "dashboard.png"
        figure = await asyncio.to_thread(
            dashboard.render,
            json.loads(DASHBOARD.read_text(encoding="utf-8")),
            prometheus.url,
            drawn_from,
            time.time(),
            picture,
            variables={"job": JOB, "__rate_interval": RATE_INTERVAL},
            step=SCRAPE_MS / 1000,
        )

    # One panel drawn per panel of the dashboard, each with lines from Prometheus's data.
    panels = json.loads(DASHBOARD.read_text(encoding="utf-8"))["panels"]
    assert [ax.get_title(loc="left") for ax in figure.axes] == [p["title"] for p in panels]
    undrawn = [ax.get_title(loc="left") for ax in figure.axes if not ax.get_lines()]
    assert not undrawn, f"panels drawn without data: {undrawn}"
    assert picture.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    check_documented_picture()
    if kept := os.environ.get(PICTURE_VARIABLE):
        await asyncio.to_thread(shutil.copyfile, picture, kept)

    for query, result in answers.items():
        if "histogram_quantile" not in query:
            continue
        for series in result:
            value = float(series["value"][1])
            # A quantile of what the test watched: not negative, not longer than the run.
            assert 0 <= value <= elapsed, (query, value, elapsed)

    empty = [query for query, result in answers.items() if not result]
    assert not empty, "panels without data:\n" + "\n".join([*empty, "scraped:", *names])


async def test_the_compose_prometheus_configuration_is_valid() -> None:
    # The file `docker compose up` hands Prometheus, checked by Prometheus's own tool.
    promtool = str(Path(await binary()).with_name("promtool"))
    config = ROOT / "compose" / "prometheus" / "prometheus.yml"
    done = await asyncio.to_thread(
        subprocess.run,
        [promtool, "check", "config", "--syntax-only", str(config)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
