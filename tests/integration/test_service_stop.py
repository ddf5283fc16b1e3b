"""A bundled service's stop is bounded, its telemetry's too: restarted at once, it serves again.

``dedup run dedup_services.payments --metrics-port N`` as a real process: after
SIGTERM it exits within the flush deadline (``dedup_services.otel.FLUSH_DEADLINE``)
and its port is free, with the services' default exporters (none) and with an
OTLP endpoint where no collector listens.  A metrics port another process holds
is one line on stderr naming it.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import urllib.request
from typing import Any

import pytest
from dedup_services import otel

from dedup_dev import children, helpers
from dedup_dev import service_process as service_support
from dedup_dev.kafka import Topics

STOP_WITHIN = otel.FLUSH_DEADLINE + 2.0
"""Seconds from SIGTERM to exit: the exporters' deadline, plus the consumer leaving its group
and the interpreter's exit (under a second).  The distro's default otlp exporter, with
no collector, kept a stopped service alive about 9 s."""

SCRAPE_TIMEOUT = 5.0
"""Seconds one GET of /metrics may take."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def metrics_of(port: int) -> str:
    """The body of http://localhost:port/metrics, or "" while nothing answers there."""

    def get() -> str:
        url = f"http://localhost:{port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT) as answer:
                return bytes(answer.read()).decode()
        except OSError:
            return ""

    return await asyncio.to_thread(get)


async def serving(port: int, service: children.Child, instance: str) -> bool:
    """/metrics on ``port`` shows the instance's metrics (target_info); fails once it exited.

    The endpoint answers a moment before the SDK's metrics are hooked to it:
    until then it serves only prometheus_client's own (process, gc).
    """
    assert service.alive, f"exited ({service.proc.returncode}):\n{await service.stderr()}"
    return f'service_instance_id="{instance}"' in await metrics_of(port)


async def consuming(service: children.Child) -> bool:
    """The service's consumer holds its partition (its SIGTERM handler is installed)."""
    return " took [(" in service.stderr_tail()


async def stop_in_time(service: children.Child) -> str:
    """SIGTERM, exit code 0 within STOP_WITHIN; its stderr."""
    try:
        code = await service.stop(signal.SIGTERM, within=STOP_WITHIN)
    except TimeoutError:
        pytest.fail(f"still running {STOP_WITHIN}s after SIGTERM:\n{service.stderr_tail()}")
    err = await service.stderr()
    assert code == 0, err
    assert "payments: stopped;" in err and "Traceback" not in err, err
    return err


async def test_a_service_restarted_at_once_serves_metrics_on_the_same_port(
    bootstrap_servers: str, topics: Topics, dsn: str
) -> None:
    topic = await topics.create()
    port = free_port()
    command = ("run", "dedup_services.payments", "--metrics-port", str(port))

    def env(instance: str) -> dict[str, str]:
        # No OTEL_* but the instance's name, shown in /metrics as a label of target_info.
        attributes = f"service.instance.id={instance}"
        return service_support.environment(
            dsn, bootstrap_servers, PAYMENTS_TOPIC=topic, OTEL_RESOURCE_ATTRIBUTES=attributes
        )

    async with service_support.child(*command, env=env("first")) as first:
        await helpers.wait_for(lambda: consuming(first), what="the first one consuming")
        assert await serving(port, first, "first")
        err = await stop_in_time(first)
    # The default exporters are none: nothing tried a collector on localhost:4317.
    assert "4317" not in err and "exporting" not in err, err

    async with service_support.child(*command, env=env("second")) as second:
        await helpers.wait_for(
            lambda: serving(port, second, "second"), what=f"the second one's /metrics on {port}"
        )
        await helpers.wait_for(lambda: consuming(second), what="the second one consuming")
        await stop_in_time(second)


async def test_a_service_stops_within_the_flush_deadline_when_no_collector_answers(
    bootstrap_servers: str, topics: Topics, dsn: str, pool: Any
) -> None:
    topic = await topics.create()
    # An OTLP endpoint is set, so every signal's exporter is otlp; nothing listens there.
    nowhere = f"http://127.0.0.1:{free_port()}"
    env = service_support.environment(
        dsn, bootstrap_servers, PAYMENTS_TOPIC=topic, OTEL_EXPORTER_OTLP_ENDPOINT=nowhere
    )
    async with service_support.child("run", "dedup_services.payments", env=env) as service:
        await helpers.wait_for(lambda: consuming(service), what="the service consuming")
        # A payment of no account: rejected, and its spans wait for the exporter.
        event = {"payment_id": "p1", "account": "acc-9", "amount": 10, "date": "2026-11-30"}
        await service_support.produce_events(bootstrap_servers, topic, [event], key="account")
        await helpers.wait_for(
            lambda: pool.fetchval("SELECT count(*) = 1 FROM payments.payments"),
            what="the payment decided",
        )
        err = await stop_in_time(service)
    assert f"did not finish sending within {otel.FLUSH_DEADLINE}s" in err, err


async def test_a_metrics_port_already_in_use_is_one_line_naming_it(dsn: str) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = int(held.getsockname()[1])
        env = service_support.environment(
            dsn, DEDUP_LOG_LEVEL="WARNING", OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1"
        )
        code, out, err = await service_support.run(
            "run", "dedup_services.payments", "--metrics-port", str(port), env=env
        )
    assert code == 2, (out, err)
    assert err.splitlines() == [
        f"dedup run: --metrics-port {port}: cannot serve metrics on 127.0.0.1:{port}:"
        " the port is already in use; stop what listens there or pick another port"
    ]


async def test_a_metrics_port_out_of_range_is_refused(dsn: str) -> None:
    env = service_support.environment(dsn, DEDUP_LOG_LEVEL="WARNING")
    code, _, err = await service_support.run(
        "run", "dedup_services.payments", "--metrics-port", "65536", env=env
    )
    assert (code, err.splitlines()) == (
        2,
        ["dedup run: --metrics-port 65536: expected a TCP port, 1 to 65535"],
    )
