"""The OpenTelemetry SDK for a service process, configured by the standard ``OTEL_*`` variables.

dedup depends on the OpenTelemetry API only; its spans and metrics go nowhere
until an application installs the SDK.  A bundled service does, here:

- ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER``: ``console``, ``otlp``
  or ``none``, comma-separated for several.  When unset: ``otlp`` if an OTLP
  endpoint is configured (``OTEL_EXPORTER_OTLP_ENDPOINT`` or the signal's own
  ``..._TRACES_ENDPOINT`` / ``..._METRICS_ENDPOINT``), else ``none``, so a
  service without a collector does not log export failures every few seconds.
- ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``: the resource; the
  service name defaults to the service's own (``dedup-payments``).
- The OTLP exporter is http/protobuf and reads its own variables (endpoint,
  headers, timeout); ``OTEL_METRIC_EXPORT_INTERVAL`` sets the metric period.
- ``OTEL_SDK_DISABLED=true`` installs nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import dedup

EXPORTERS = ("console", "otlp", "none")


def exporters(signal: str) -> list[str]:
    """The exporters chosen for ``signal`` (``traces`` or ``metrics``)."""
    variable = f"OTEL_{signal.upper()}_EXPORTER"
    raw = os.environ.get(variable, "").strip()
    if not raw:
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
            f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"
        )
        return ["otlp"] if endpoint else []
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise dedup.ConfigurationError(
            f"{variable}={raw!r}: unknown exporter {', '.join(unknown)}; "
            f"expected {', '.join(EXPORTERS)}"
        )
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    if "otlp" in names and protocol != "http/protobuf":
        raise dedup.ConfigurationError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: only http/protobuf is installed"
        )
    return [n for n in names if n != "none"]


def setup(service_name: str) -> Callable[[], None]:
    """Install the SDK's tracer and meter providers; return the function that flushes them."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return lambda: None
    # The SDK is the application's dependency (dedup-kafka[otel]), imported only when used.
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricExporter
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader as Reader
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SpanExporter,
    )

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    shutdowns: list[Callable[[], object]] = []

    span_exporters: list[SpanExporter] = []
    for name in exporters("traces"):
        if name == "console":
            span_exporters.append(ConsoleSpanExporter())
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            span_exporters.append(OTLPSpanExporter())
    if span_exporters:
        tracer_provider = TracerProvider(resource=resource)
        for span_exporter in span_exporters:
            tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
        trace.set_tracer_provider(tracer_provider)
        shutdowns.append(tracer_provider.shutdown)

    metric_exporters: list[MetricExporter] = []
    for name in exporters("metrics"):
        if name == "console":
            metric_exporters.append(ConsoleMetricExporter())
        else:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter,
            )

            metric_exporters.append(OTLPMetricExporter())
    if metric_exporters:
        meter_provider = MeterProvider(
            resource=resource, metric_readers=[Reader(e) for e in metric_exporters]
        )
        metrics.set_meter_provider(meter_provider)
        shutdowns.append(meter_provider.shutdown)

    def shutdown() -> None:
        for stop in reversed(shutdowns):
            stop()

    return shutdown
