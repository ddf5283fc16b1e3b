"""dedup_services.otel: the services' default exporters, read from the environment."""

from __future__ import annotations

import os

import pytest
from dedup_services import otel

EXPORTERS = [f"OTEL_{signal.upper()}_EXPORTER" for signal in otel.SIGNALS]


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
