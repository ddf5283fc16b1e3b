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

The alert rules (``compose/prometheus/alerts.yml``) are proved the same way: a
Prometheus with those rules scrapes a service through normal traffic (no alert),
a dead letter (DedupDeadLetter, nothing else), then a backlog behind a locked
account (the two lag rules).  Their ``for:`` durations are minutes, longer than
a test, so that Prometheus is given a copy of the file with every ``for:`` set
to :data:`FOR_IN_TEST` (one mechanical substitution, :func:`rules_for_the_test`);
the expressions and thresholds are the file's.  promtool checks the file and
runs its unit tests (``alerts_test.yml``), which cover the rules no test can
plant on a live service (lease losses, reconcile mismatches, stale rejections)
and the real ``for:`` durations.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import math
import os
import re
import shutil
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import yaml

from dedup_dev import children, dashboard, helpers, kafka
from dedup_dev import docs as docs_support
from dedup_dev import service_process as service_support
from dedup_dev.kafka import Topics
from dedup_dev.services import ROOT

DASHBOARD = ROOT / "compose" / "grafana" / "dashboards" / "dedup.json"
ALERTS = ROOT / "compose" / "prometheus" / "alerts.yml"
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
# The alert test's rule evaluations: twice a second, so a rule answers soon after a scrape.
EVALUATION_MS = 500
# Every `for:` of the rules as the alert test runs them: two evaluations.
FOR_IN_TEST = f"{2 * EVALUATION_MS}ms"


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

    async def _data(self, path: str) -> Any:
        body = json.loads(await asyncio.to_thread(self._get, path))
        assert body["status"] == "success", (path, body)
        return body["data"]

    async def alerts(self) -> dict[str, list[dict[str, Any]]]:
        """The alerts pending or firing, by name."""
        found: dict[str, list[dict[str, Any]]] = {}
        for alert in (await self._data("/api/v1/alerts"))["alerts"]:
            found.setdefault(alert["labels"]["alertname"], []).append(alert)
        return found

    async def rules(self) -> list[dict[str, Any]]:
        """Every alert rule as last evaluated: health, lastEvaluation, ..."""
        groups = (await self._data("/api/v1/rules"))["groups"]
        return [rule for group in groups for rule in group["rules"]]


def configuration(metrics_port: int, evaluation: str, rule_file: Path | None = None) -> str:
    """A prometheus.yml scraping the service on ``metrics_port`` every SCRAPE_MS."""
    rules = f"rule_files: ['{rule_file}']\n" if rule_file is not None else ""
    return (
        f"global: {{scrape_interval: {SCRAPE_MS}ms, evaluation_interval: {evaluation}}}\n"
        f"{rules}"
        "scrape_configs:\n"
        f"  - job_name: {JOB}\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n"
    )


async def start_prometheus(
    stack: contextlib.AsyncExitStack, directory: Path, config: str
) -> tuple[Prometheus, children.Child]:
    """Debian's Prometheus on a port of its own, with ``config``, its data in ``directory``."""
    port = helpers.free_port()
    (directory / "prometheus.yml").write_text(config)
    process = await children.Child.spawn(
        (
            await binary(),
            f"--config.file={directory / 'prometheus.yml'}",
            f"--storage.tsdb.path={directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ),
        env=service_support.environment(""),
    )
    stack.push_async_callback(process.close)
    prometheus = Prometheus(port)
    await helpers.wait_for(prometheus.ready, what="prometheus ready", within=30)
    return prometheus, process


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


async def start_payments(
    stack: contextlib.AsyncExitStack,
    env: dict[str, str],
    pool: Any,
    group: str,
    *,
    max_attempts: int,
    accounts: list[str],
) -> tuple[int, children.Child]:
    """The page's payments service: its metrics port and process; ``accounts`` funded."""
    metrics_port = helpers.free_port()
    argv = (*documented_command(metrics_port), "--group", group)
    service = await stack.enter_async_context(
        service_support.child(*argv, "--max-attempts", str(max_attempts), env=env)
    )
    await helpers.wait_for(
        lambda: pool.fetchval("SELECT to_regclass('payments.accounts') IS NOT NULL"),
        what="the payments migration",
    )
    await pool.executemany(
        "INSERT INTO payments.accounts (account, balance) VALUES ($1, $2)",
        [(account, 10**9) for account in accounts],
    )
    return metrics_port, service


async def test_every_dashboard_panel_answers_from_a_real_prometheus(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any, tmp_path: Path
) -> None:
    topic = await topics.create(partitions=3)
    group = f"g-{topic}"
    env = service_support.environment(dsn, bootstrap_servers, PAYMENTS_TOPIC=topic)
    async with contextlib.AsyncExitStack() as stack:
        metrics_port, service = await start_payments(
            stack, env, pool, group, max_attempts=2, accounts=[*ACCOUNTS, "acc-stale"]
        )
        prometheus, prometheus_process = await start_prometheus(
            stack, tmp_path, configuration(metrics_port, "1s")
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


def alerts_section() -> str:
    return docs_support.section(PAGE.read_text(encoding="utf-8"), "### Alert rules")


async def test_the_alert_rules_pass_promtool_as_the_page_shows(tmp_path: Path) -> None:
    # The compose file's configuration with its rules, and the rules' unit tests
    # (alerts_test.yml), checked by Prometheus's own tool as the page runs it.
    promtool = Path(await binary()).with_name("promtool")
    [(language, commands)] = docs_support.checked_snippets(PAGE.name, alerts_section())
    assert language == "console", language
    env = docs_support.shell_env("", "")
    env["PATH"] = f"{promtool.parent}{os.pathsep}{env['PATH']}"
    for command, expected in docs_support.console(commands):
        assert command.startswith("promtool "), command
        out = await asyncio.to_thread(docs_support.run, command, env)
        assert docs_support.expected_pattern(expected + "\n").fullmatch(out), (command, out)


def rule_table() -> list[list[str]]:
    """The page's table of alert rules, a list of cells per row."""
    lines = [line for line in alerts_section().splitlines() if line.startswith("| ")]
    return [[cell.strip().strip("`") for cell in line.strip("|").split("|")] for line in lines[2:]]


def alert_rules() -> list[dict[str, Any]]:
    [group] = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))["groups"]
    return list(group["rules"])


def test_the_page_documents_each_alert_rule_as_written() -> None:
    # alert | metric | threshold | window | for | severity, in the file's order.
    rows, rules = rule_table(), alert_rules()
    assert [row[0].split("]")[0].strip("[`") for row in rows] == [r["alert"] for r in rules]
    for row, rule in zip(rows, rules, strict=True):
        _, metric, threshold, window, for_, severity = row
        expr = " ".join(rule["expr"].split())
        assert metric in expr, (rule["alert"], metric)
        assert expr.endswith(threshold), (rule["alert"], threshold, expr)
        assert (f"[{window}]" in expr) if window != "none" else "[" not in expr, rule["alert"]
        assert for_ == rule.get("for", "none"), rule["alert"]
        assert severity == rule["labels"]["severity"], rule["alert"]
        assert rule["annotations"]["runbook_url"].endswith(
            "docs/operations.md#" + rule["alert"].lower()
        ), rule["alert"]
        assert f"\n#### {rule['alert']}\n" in alerts_section(), f"no section on {rule['alert']}"


def rules_for_the_test() -> str:
    """alerts.yml with every ``for:`` set to FOR_IN_TEST: nothing else changes."""
    text = ALERTS.read_text(encoding="utf-8")
    shortened = re.sub(r"^(\s+for: )\S+$", rf"\g<1>{FOR_IN_TEST}", text, flags=re.MULTILINE)
    assert shortened.count(f"for: {FOR_IN_TEST}") == sum(1 for r in alert_rules() if "for" in r)
    return shortened


def threshold(alert: str) -> int:
    """The number the rule ``alert`` compares its metric with (``... > N``)."""
    [rule] = [r for r in alert_rules() if r["alert"] == alert]
    found = re.search(r"> (\d+)$", rule["expr"].strip())
    assert found, rule["expr"]
    return int(found[1])


async def evaluated_since(prometheus: Prometheus, moment: float) -> bool:
    """Every rule was evaluated after ``moment`` (a Unix time), and without an error."""
    rules = await prometheus.rules()
    for rule in rules:
        assert rule["health"] != "err", rule
    # RFC 3339 with nanoseconds: the seconds are enough here.
    evaluations = [re.sub(r"\.\d+", "", r["lastEvaluation"]) for r in rules]
    return all(
        dt.datetime.fromisoformat(e.replace("Z", "+00:00")).timestamp() > moment
        for e in evaluations
    )


async def firing(prometheus: Prometheus, *names: str) -> dict[str, list[dict[str, Any]]]:
    """The alerts pending or firing, once each of ``names`` fires (else nothing)."""
    alerts = await prometheus.alerts()
    fired = all(any(a["state"] == "firing" for a in alerts.get(name, [])) for name in names)
    return alerts if fired else {}


async def test_the_alert_rules_fire_on_a_dead_letter_and_a_backlog_and_not_before(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any, tmp_path: Path
) -> None:
    topic = await topics.create(partitions=2)
    rules = tmp_path / "alerts.yml"
    rules.write_text(rules_for_the_test(), encoding="utf-8")
    env = service_support.environment(dsn, bootstrap_servers, PAYMENTS_TOPIC=topic)
    on_topic = f'{{messaging_destination_name="{topic}"}}'
    async with contextlib.AsyncExitStack() as stack:
        # Dead-lettered at the first failure: the dead letter comes at once.
        metrics_port, service = await start_payments(
            stack, env, pool, f"g-{topic}", max_attempts=1, accounts=["acc-ok", "acc-held"]
        )
        prometheus, _ = await start_prometheus(
            stack, tmp_path, configuration(metrics_port, f"{EVALUATION_MS}ms", rules)
        )

        # Normal traffic, a payment on each partition: every series the rules read
        # is scraped (the lag at 0, the dead letters' counter at 0 before its first),
        # every rule evaluated on them, and none is pending or firing.
        for p in (0, 1):
            await kafka.produce(
                bootstrap_servers, topic, [(b"ok", payment(f"ok-p{p}", "acc-ok", 1))], partition=p
            )
        await helpers.wait_for(
            lambda: prometheus.query(f"count(dedup_consumer_lag{on_topic} == 0) == 2"),
            what="both partitions' lag scraped at 0",
        )
        await helpers.wait_for(
            lambda: prometheus.query(f"dedup_messages_dead_lettered_total{on_topic} == 0"),
            what="the dead letters' counter scraped at 0",
        )
        scraped_at = time.time()
        await helpers.wait_for(lambda: evaluated_since(prometheus, scraped_at), what="a rule run")
        assert await prometheus.alerts() == {}

        # A malformed payment.
        await kafka.produce(
            bootstrap_servers, topic, [(b"bad", payment("bad", "acc-ok", "ten"))], partition=0
        )
        alerts = await helpers.wait_for(
            lambda: firing(prometheus, "DedupDeadLetter"), what="DedupDeadLetter firing"
        )
        assert set(alerts) == {"DedupDeadLetter"}, alerts
        [letter] = alerts["DedupDeadLetter"]
        assert letter["labels"]["messaging_destination_name"] == topic

        # A backlog on partition 1 behind a payment whose account this test keeps
        # locked: one record past the lag threshold, each as old as twice the age
        # threshold (the age is measured from the record's timestamp).  One Kafka
        # transaction, so the consumer fetches it at once and learns the log's end.
        backlog = threshold("DedupConsumerLagHigh") + 1
        produced = time.time() - 2 * threshold("DedupOldestUnappliedTooOld")
        async with pool.acquire() as holder, holder.transaction():
            await holder.execute(
                "SELECT FROM payments.accounts WHERE account = 'acc-held' FOR UPDATE"
            )
            await kafka.produce(
                bootstrap_servers,
                topic,
                [
                    (b"held", payment("held", "acc-held", 1)),
                    *((b"ok", payment(f"b{i}", "acc-ok", 1)) for i in range(backlog - 1)),
                ],
                partition=1,
                timestamp_ms=int(produced * 1000),
                in_transaction=True,
            )
            lag_rules = ("DedupConsumerLagHigh", "DedupOldestUnappliedTooOld")
            alerts = await helpers.wait_for(
                lambda: firing(prometheus, *lag_rules), what="the lag rules firing"
            )
        assert set(alerts) == {"DedupDeadLetter", *lag_rules}, alerts
        for name in lag_rules:
            [alert] = alerts[name]
            assert alert["labels"]["messaging_destination_name"] == topic, alert
            assert alert["labels"]["messaging_destination_partition_id"] == "1", alert
            assert float(alert["value"]) > threshold(name), alert
        assert service.alive, await service.stderr()
