"""dedup_services.otel: the services' default exporters, and a flush that closes /metrics.

The SDK is installed in a child interpreter (its providers are global, once
per process); the defaults are read from the environment it would see.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from dedup_services import otel

EXPORTERS = [f"OTEL_{signal.upper()}_EXPORTER" for signal in otel.SIGNALS]
CHILD_TIMEOUT = 60
"""Seconds the child interpreter may take (it imports the SDK and flushes it)."""


@pytest.fixture
def no_otel(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    # Those the code sets too: undone after the test, like the ones it found.
    written = [*EXPORTERS, "OTEL_EXPORTER_PROMETHEUS_PORT"]
    for name in {*written, *(n for n in os.environ if n.startswith("OTEL_"))}:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def exporters() -> list[str]:
    return [os.environ[name] for name in EXPORTERS]


def test_with_no_otel_variable_a_service_exports_nothing(no_otel: pytest.MonkeyPatch) -> None:
    otel.default_exporters()
    assert exporters() == ["none", "none", "none"]


def test_an_otlp_endpoint_makes_otlp_the_default(no_otel: pytest.MonkeyPatch) -> None:
    no_otel.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    otel.default_exporters()
    assert exporters() == ["otlp", "otlp", "otlp"]


def test_a_signals_own_endpoint_makes_otlp_its_default_only(no_otel: pytest.MonkeyPatch) -> None:
    no_otel.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces")
    otel.default_exporters()
    assert exporters() == ["otlp", "none", "none"]


def test_an_exporter_set_by_the_user_stays(no_otel: pytest.MonkeyPatch) -> None:
    no_otel.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    no_otel.setenv("OTEL_TRACES_EXPORTER", "console")
    no_otel.setenv("OTEL_LOGS_EXPORTER", "none")
    otel.serve_metrics(9464)
    otel.default_exporters()
    assert exporters() == ["console", "prometheus", "none"]


def test_the_flush_closes_the_metrics_endpoint() -> None:
    script = textwrap.dedent(
        """
        import socket, sys, urllib.request
        from dedup_services import otel

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}/metrics"
        flush = otel.setup("dedup-test", metrics_port=port)
        with urllib.request.urlopen(url, timeout=5) as answer:
            print("before", answer.status)
        flush()
        try:
            urllib.request.urlopen(url, timeout=5)
        except OSError as exc:
            print("after", type(exc.reason).__name__)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_EXPORTER_PROMETHEUS_HOST"] = "127.0.0.1"
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=False,
        timeout=CHILD_TIMEOUT,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["before 200", "after ConnectionRefusedError"]
