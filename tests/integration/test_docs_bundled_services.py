"""Every snippet of docs/howto/bundled-services.md runs, in page order, against fresh services.

Commands run in /bin/sh with the test's DSN, Kafka and topics (the page's
``*_TOPIC`` variables); services are started as the page starts them and
stopped with SIGTERM.  The receiver's port 8080 becomes a free one, and the
OTLP endpoint a collector stand-in that records what it is sent.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import os
import re
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from dedup_services import otel

from dedup_dev import docs as docs_support
from dedup_dev import helpers
from dedup_dev import service_process as service_support
from dedup_dev.kafka import Topics
from dedup_dev.services import ROOT

PAGE = ROOT / "docs" / "howto" / "bundled-services.md"

# This page runs on the run's one docs database, after the pages before it (tests/conftest.py).
pytestmark = pytest.mark.docs_page
SERVICES = ("payments", "coupons", "notifications")
DAY = dt.date(2026, 11, 30)


class Collector:
    """Answers 200 to every OTLP/HTTP export and records the paths posted to."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while head := await reader.readuntil(b"\r\n\r\n"):
            lines = head.decode("latin-1").split("\r\n")
            self.paths.append(lines[0].split()[1])
            headers = dict(line.lower().split(":", 1) for line in lines[1:] if ":" in line)
            await reader.readexactly(int(headers.get("content-length", "0")))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            if reader.at_eof():
                break
        writer.close()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()


NOTIFICATION_KEY = "notifications:n-1:0"
"""The outbox row key of the page's notification (namespace, key, first row)."""


async def count(pool: Any, sql: str, n: int) -> bool:
    return bool(await pool.fetchval(f"SELECT count(*) = $1 FROM ({sql}) AS q", n))


async def test_every_snippet_of_the_bundled_services_howto_works(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any, tmp_path: Path
) -> None:
    blocks = docs_support.snippets(PAGE)
    assert [lang for lang, _ in blocks] == [
        *("sh", "sh"),  # topics, migrations
        *("json", "sql", "sh", "python", "sql"),  # payments
        *("json", "sh", "sql"),  # coupons
        *("json", "sh", "sh", "sh"),  # notifications
        *("sh", "sh", "sql"),  # statements
        *("sh", "sh", "sh"),  # reconcile, telemetry
    ]
    topic_commands, *text = [body for _, body in blocks]
    # The page's topics under names of this test's own, made by the page's commands.
    names = {name: f"{name}-{uuid.uuid4().hex[:12]}" for name in SERVICES}
    topics.created += names.values()
    env = {
        **service_support.environment(dsn, bootstrap_servers),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        **{f"{name.upper()}_TOPIC": topic for name, topic in names.items()},
    }

    async def sh(command: str) -> tuple[int, str, str]:
        return await service_support.run(command, env=env, via_shell=True)

    def service(command: str, *, sdk_defaults: bool = False) -> Any:
        # Leading VAR=value words go to the environment, as the shell would put
        # them; exec, so that signals reach dedup itself rather than the shell.
        words = command.split()
        assignments = list(itertools.takewhile(lambda w: re.match(r"^[A-Z_]+=", w), words))
        extra = dict(w.split("=", 1) for w in assignments)
        rest = " ".join(words[len(assignments) :])
        # The telemetry commands run with the SDK's defaults, as on the reader's machine.
        base = {k: v for k, v in env.items() if not (sdk_defaults and k.startswith("OTEL_"))}
        return service_support.child(f"exec {rest}", env={**base, **extra}, via_shell=True)

    # Topics, with Kafka's own tool: the page's names become the test's.
    assert [f"--topic {name}" in topic_commands for name in SERVICES] == [True] * 3
    for name, topic in names.items():
        topic_commands = re.sub(rf"--topic {name}\b", f"--topic {topic}", topic_commands)
    code, out, err = await sh(topic_commands)
    assert code == 0, err
    assert out.splitlines() == [f"Created topic {topic}." for topic in names.values()]

    # Migrations, applied once ahead of the services (the accounts need their table).
    code, _, err = await sh(text[0])
    assert code == 0, err
    components = await pool.fetch("SELECT component FROM dedup.migrations")
    assert {r[0] for r in components} >= {
        *("dedup", "payments", "coupons", "notifications", "statements")
    }
    assert await pool.fetchval("SELECT component FROM receiver.migrations") == "receiver"

    # payments: the event is the first of the producer's; accounts, service, producer, query.
    producer = text[4]
    assert orjson.loads(text[1]) in _python_literal(producer, "PAYMENTS")
    await pool.execute(text[2])
    async with service(text[3]) as payments:
        (tmp_path / "send_payments.py").write_text(producer)
        code, _, err = await service_support.run(
            str(tmp_path / "send_payments.py"), env=env, program=sys.executable
        )
        assert code == 0, err
        await helpers.wait_for(
            lambda: count(pool, "SELECT FROM payments.payments", 3), what="3 payments decided"
        )
        assert await payments.stop() == 0, await payments.stderr()
    assert [tuple(r) for r in await pool.fetch(text[5])] == [
        ("pay-1", "acc-1", 2500, "applied", None, 7500),
        (
            "pay-2",
            "acc-2",
            5000,
            "rejected",
            "insufficient funds: balance 1000 < amount 5000",
            1000,
        ),
        ("pay-3", "acc-2", 400, "applied", None, 600),
    ]
    assert (
        await pool.fetchval("SELECT count(*) FROM dedup.processed WHERE namespace = 'payments'")
        == 3
    )

    # coupons: the request, its redelivery, and a second request for the same coupon.
    first = orjson.loads(text[6])
    second = {**first, "request_id": "req-2"}
    async with service(text[7]) as coupons:
        await service_support.produce_events(
            bootstrap_servers, env["COUPONS_TOPIC"], [first, first, second], key="user_id"
        )
        await helpers.wait_for(
            lambda: count(pool, "SELECT FROM coupons.requests", 2), what="2 requests applied"
        )
        assert await coupons.stop() == 0, await coupons.stderr()
    requests = await pool.fetch(text[8])
    assert [(r["request_key"], r["outcome"]) for r in requests] == [
        ("req-1", "issued"),
        ("req-2", "already_issued"),
    ]
    assert len({r["coupon_code"] for r in requests}) == 1

    # notifications: the receiver (on a free port), the consumer and a dispatcher.
    notification = orjson.loads(text[9])
    assert "--port 8080" in text[10] and "http://127.0.0.1:8080/notifications" in text[12]
    async with service(text[10].replace("--port 8080", "--port 0")) as receiver:
        url = (await receiver.expect("receiver listening on "))[1].split()[-1]
        async with (
            service(text[11]) as consumer,
            service(text[12].replace("http://127.0.0.1:8080/notifications", url)) as dispatcher,
        ):
            await service_support.produce_events(
                bootstrap_servers,
                env["NOTIFICATIONS_TOPIC"],
                [notification] * 2,
                key="notification_id",
            )
            await helpers.wait_for(
                lambda: count(
                    pool,
                    "SELECT FROM dedup.outbox WHERE destination = 'notifications'"
                    f" AND status = 'sent' AND key = '{NOTIFICATION_KEY}'",
                    1,
                ),
                what="the notification sent",
            )
            for process in (dispatcher, consumer):
                assert await process.stop() == 0, await process.stderr()
        assert await receiver.stop() == 0, await receiver.stderr()
    # (the outbox how-to, before this page on the docs' database, posts notifications of its own)
    delivered = await pool.fetch(
        "SELECT idempotency_key, payload FROM receiver.notifications WHERE idempotency_key = $1",
        NOTIFICATION_KEY,
    )
    assert [tuple(r) for r in delivered] == [(NOTIFICATION_KEY, notification)]

    # statements: the run, then the same job through dedup task run (skipped: done).
    code, out, err = await sh(text[13])
    assert code == 0 and "statements key 2026-11-30: succeeded (token 1" in out, (out, err)
    code, out, err = await sh(text[14])
    assert code == 0 and "skipped_done (token 1" in out, (out, err)
    assert [tuple(r) for r in await pool.fetch(text[15])] == [
        (DAY, "acc-1", 1, 0, 2500, 1),
        (DAY, "acc-2", 1, 1, 400, 1),
    ]

    # reconcile: both checks pass.
    code, out, err = await sh(text[16])
    assert code == 0, (out, err)
    assert [line for line in out.splitlines() if line.startswith("reconcile")] == [
        "reconcile payments 2026-11-30: OK",
        "reconcile statements 2026-11-30: OK",
    ]

    # telemetry: spans on stdout, then to an OTLP collector.
    async with service(text[17], sdk_defaults=True) as traced:
        await service_support.produce_events(
            bootstrap_servers, env["COUPONS_TOPIC"], [{**first, "request_id": "r3"}], "user_id"
        )
        await helpers.wait_for(
            lambda: count(pool, "SELECT FROM coupons.requests", 3), what="a third request"
        )
        assert await traced.stop() == 0, await traced.stderr()
    assert f'"name": "process {env["COUPONS_TOPIC"]}"' in traced.stdout
    assert '"service.name": "dedup-coupons"' in traced.stdout

    collector = Collector()
    port = await collector.start()
    assert "http://127.0.0.1:4318" in text[18]
    async with service(text[18].replace(":4318", f":{port}"), sdk_defaults=True) as exported:
        await service_support.produce_events(
            bootstrap_servers, env["COUPONS_TOPIC"], [{**first, "request_id": "r4"}], "user_id"
        )
        await helpers.wait_for(
            lambda: count(pool, "SELECT FROM coupons.requests", 4), what="a fourth request"
        )
        assert await exported.stop(signal.SIGTERM) == 0, await exported.stderr()
    await collector.close()
    assert "/v1/traces" in collector.paths and "/v1/metrics" in collector.paths


def test_the_telemetry_section_states_the_flush_deadline() -> None:
    words = " ".join(docs_support.section(PAGE.read_text(encoding="utf-8"), "## Telemetry").split())
    assert (
        f"the exporters get {otel.FLUSH_DEADLINE:g} seconds (`dedup_services.otel.FLUSH_DEADLINE`)"
        in words
    )


def _python_literal(source: str, name: str) -> Any:
    namespace: dict[str, Any] = {}
    exec(source.split("\n\nasync def")[0], namespace)  # noqa: S102 (the page's own code)
    return namespace[name]
