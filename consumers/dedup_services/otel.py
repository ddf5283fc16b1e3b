"""The OpenTelemetry SDK for a service process, configured as ``opentelemetry-instrument`` does.

dedup depends on the OpenTelemetry API only; its spans and metrics go nowhere
until an application installs the SDK.  A bundled service does, here, with the
SDK's own configurator and the defaults of the OpenTelemetry distro, so every
standard ``OTEL_*`` variable means what it means under ``opentelemetry-instrument``,
but for one default: a service exports nothing it was not told to.

- ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` / ``OTEL_LOGS_EXPORTER``:
  ``otlp``, ``console``, ``prometheus`` (metrics) or ``none``, comma-separated
  for several.  Unset, a signal's exporter is ``none``, or ``otlp`` when an OTLP
  endpoint is set for it (``OTEL_EXPORTER_OTLP_ENDPOINT`` or the signal's own
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ...): the distro's ``otlp`` with no
  collector would retry every export to ``localhost:4317``.
- ``OTEL_EXPORTER_OTLP_PROTOCOL`` (and the per-signal ones): ``grpc`` (the
  distro's default, port 4317) or ``http/protobuf`` (port 4318); the
  ``OTEL_EXPORTER_OTLP_*`` endpoint, headers, timeout and compression variables.
- ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``: the resource; the
  service name defaults to the service's own (``dedup-payments``).
- ``OTEL_METRIC_EXPORT_INTERVAL``, ``OTEL_TRACES_SAMPLER``, ...: as the SDK reads them.
- ``OTEL_EXPORTER_PROMETHEUS_HOST`` / ``_PORT``: where the ``prometheus``
  exporter serves ``/metrics`` (``--metrics-port`` sets the port and adds the exporter).
- ``OTEL_SDK_DISABLED=true`` installs nothing.

A service started under ``opentelemetry-instrument`` finds the SDK installed
already and leaves it as it is.
"""

from __future__ import annotations

import os
from collections.abc import Callable

PROMETHEUS = "prometheus"
"""The metrics exporter name of opentelemetry-exporter-prometheus (a pull endpoint)."""

SIGNALS = ("traces", "metrics", "logs")
"""The signals of ``OTEL_<SIGNAL>_EXPORTER``."""


def disabled() -> bool:
    """``OTEL_SDK_DISABLED=true``: the SDK is not to be installed."""
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def serve_metrics(port: int) -> None:
    """Make the SDK serve metrics for Prometheus on ``port``, besides any other exporter.

    The standard variables do it: ``OTEL_EXPORTER_PROMETHEUS_PORT``, and
    ``prometheus`` in ``OTEL_METRICS_EXPORTER``.  An unset (or ``none``)
    exporter list becomes ``prometheus`` alone, whatever OTLP endpoint is set:
    who asks for a scrape endpoint has said where metrics go.
    """
    os.environ["OTEL_EXPORTER_PROMETHEUS_PORT"] = str(port)
    raw = os.environ.get("OTEL_METRICS_EXPORTER", "")
    names = [n.strip() for n in raw.split(",") if n.strip() and n.strip().lower() != "none"]
    if PROMETHEUS not in names:
        names.append(PROMETHEUS)
    os.environ["OTEL_METRICS_EXPORTER"] = ",".join(names)


def default_exporters() -> None:
    """An unset ``OTEL_<SIGNAL>_EXPORTER``: ``otlp`` if an OTLP endpoint is set, else ``none``."""
    for signal in SIGNALS:
        variable = f"OTEL_{signal.upper()}_EXPORTER"
        if os.environ.get(variable, "").strip():
            continue
        endpoints = ("OTEL_EXPORTER_OTLP_ENDPOINT", f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
        sent = any(os.environ.get(name, "").strip() for name in endpoints)
        os.environ[variable] = "otlp" if sent else "none"


def setup(service_name: str) -> Callable[[], None]:
    """Install the SDK from the ``OTEL_*`` variables; return the function that flushes it."""
    if disabled():
        return lambda: None
    # The SDK is the application's dependency (the services' distribution), imported only here.
    from opentelemetry import _logs, metrics, trace
    from opentelemetry.distro import OpenTelemetryConfigurator, OpenTelemetryDistro
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider

    if isinstance(trace.get_tracer_provider(), TracerProvider):
        # opentelemetry-instrument (or the embedding application) installed it: theirs to flush.
        return lambda: None
    # A name from OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES wins; else the service's own.
    if str(Resource.create().attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        os.environ["OTEL_SERVICE_NAME"] = service_name
    default_exporters()
    # What opentelemetry-instrument runs: the distro's defaults, then the SDK's configurator.
    OpenTelemetryDistro().configure()
    OpenTelemetryConfigurator().configure()  # type: ignore[no-untyped-call]  # (the distro has no hints here)
    providers: list[TracerProvider | MeterProvider | LoggerProvider] = []
    for provider in (
        trace.get_tracer_provider(),
        metrics.get_meter_provider(),
        _logs.get_logger_provider(),
    ):
        if isinstance(provider, TracerProvider | MeterProvider | LoggerProvider):
            providers.append(provider)

    def shutdown() -> None:
        for provider in providers:
            provider.shutdown()

    return shutdown
