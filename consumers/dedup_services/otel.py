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
  A port that cannot be bound (another process holds it) is a
  ``dedup.ConfigurationError`` naming it.
- ``OTEL_SDK_DISABLED=true`` installs nothing.

On stop the exporters get :data:`FLUSH_DEADLINE` to send what they hold, and
the Prometheus endpoint is closed: a stopped service exits, its port free.

A service started under ``opentelemetry-instrument`` finds the SDK installed
already and leaves it as it is.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import dedup

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    Provider = TracerProvider | MeterProvider | LoggerProvider

log = logging.getLogger(__name__)

PROMETHEUS = "prometheus"
"""The metrics exporter name of opentelemetry-exporter-prometheus (a pull endpoint)."""

SIGNALS = ("traces", "metrics", "logs")
"""The signals of ``OTEL_<SIGNAL>_EXPORTER``."""

FLUSH_DEADLINE = 2.0
"""Seconds a stopping service gives its exporters, all signals at once, to send what they hold.

A collector answers an export in milliseconds; one that is down makes the OTLP
exporters retry for up to ``OTEL_EXPORTER_OTLP_TIMEOUT`` (10 s).  Past the
deadline the process exits anyway and what was not sent is lost, with a warning:
a stopped service must not stay alive, holding its metrics port, for telemetry.
"""

_SERVE = "start_http_server"
"""What the exporter's reader calls to serve ``/metrics`` (prometheus_client's, imported there)."""

PORTS = range(1, 65536)
"""The TCP ports ``--metrics-port`` takes (0 would bind one at random no scraper knows)."""


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


def setup(service_name: str, *, metrics_port: int | None = None) -> Callable[[], None]:
    """Install the SDK from the ``OTEL_*`` variables; return the function that flushes it.

    ``metrics_port`` is ``--metrics-port``: metrics for Prometheus on that port
    (:func:`serve_metrics`).  The function returned waits at most
    :data:`FLUSH_DEADLINE` for the exporters and closes the Prometheus endpoint.
    """
    if metrics_port is not None:
        if disabled():
            raise dedup.ConfigurationError(
                "--metrics-port with OTEL_SDK_DISABLED=true: the SDK that would serve"
                " the metrics is disabled; unset one of them"
            )
        if metrics_port not in PORTS:
            raise dedup.ConfigurationError(
                f"--metrics-port {metrics_port}: expected a TCP port,"
                f" {PORTS.start} to {PORTS.stop - 1}"
            )
        serve_metrics(metrics_port)
    if disabled():
        return lambda: None
    # The SDK is the application's dependency (the services' distribution), imported only here.
    from opentelemetry import trace
    from opentelemetry.distro import OpenTelemetryConfigurator, OpenTelemetryDistro
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider

    if isinstance(trace.get_tracer_provider(), TracerProvider):
        # opentelemetry-instrument (or the embedding application) installed it: theirs to flush.
        return lambda: None
    # A name from OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES wins; else the service's own.
    if str(Resource.create().attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        os.environ["OTEL_SERVICE_NAME"] = service_name
    default_exporters()
    given = f"--metrics-port {metrics_port}" if metrics_port is not None else None
    servers: list[WSGIServer] = []
    try:
        # What opentelemetry-instrument runs: the distro's defaults, then the SDK's configurator.
        OpenTelemetryDistro().configure()
        with _kept(servers, given):
            OpenTelemetryConfigurator().configure()  # type: ignore[no-untyped-call]  # (no hints)
    except BaseException:
        _flush(_installed(), servers)
        raise
    providers = _installed()
    return lambda: _flush(providers, servers)


def _flush(providers: Sequence[Provider], servers: Sequence[WSGIServer] = ()) -> None:
    """Shut the providers down, all at once, for at most :data:`FLUSH_DEADLINE`; close the servers.

    A provider's shutdown sends what its exporters hold and may wait on a
    collector for longer than the deadline (the SDK bounds none of it), so each
    runs in a daemon thread: one still running at the deadline is left to die
    with the process, and its exit-time flush, which would wait again, is dropped.
    """
    deadline = time.monotonic() + FLUSH_DEADLINE
    threads = [
        threading.Thread(target=p.shutdown, name=f"flush {type(p).__name__}", daemon=True)
        for p in providers
    ]
    for thread in threads:
        thread.start()
    for server in servers:
        server.shutdown()
        server.server_close()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    late = [p for p, thread in zip(providers, threads, strict=True) if thread.is_alive()]
    for provider in late:
        atexit.unregister(provider.shutdown)
    if late:
        log.warning(
            "telemetry: %s did not finish sending within %ss; what they held is lost",
            ", ".join(type(p).__name__ for p in late),
            FLUSH_DEADLINE,
        )


def _installed() -> list[Provider]:
    """The SDK's providers now installed globally."""
    from opentelemetry import _logs, metrics, trace
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    providers: list[Provider] = []
    for provider in (
        trace.get_tracer_provider(),
        metrics.get_meter_provider(),
        _logs.get_logger_provider(),
    ):
        if isinstance(provider, TracerProvider | MeterProvider | LoggerProvider):
            providers.append(provider)
    return providers


@contextmanager
def _kept(servers: list[WSGIServer], given: str | None) -> Iterator[None]:
    """Keep the HTTP servers the ``prometheus`` exporter starts, to close them on stop.

    Its reader (the ``prometheus`` entry point) starts ``/metrics`` and drops the
    server, which its shutdown then leaves serving.  A port it cannot bind is a
    ConfigurationError naming the port and where it was given (``given``).
    """
    from opentelemetry.exporter import prometheus as exporter

    start: Callable[..., tuple[WSGIServer, threading.Thread]] = getattr(exporter, _SERVE)

    def start_and_keep(port: int, addr: str, **options: Any) -> tuple[WSGIServer, threading.Thread]:
        try:
            server, thread = start(port, addr, **options)
        except OSError as exc:
            where = given or f"metrics port {port} (OTEL_EXPORTER_PROMETHEUS_PORT)"
            reason = (
                "the port is already in use; stop what listens there or pick another port"
                if exc.errno == errno.EADDRINUSE
                else exc.strerror or str(exc)
            )
            raise dedup.ConfigurationError(
                f"{where}: cannot serve metrics on {addr}:{port}: {reason}"
            ) from exc
        servers.append(server)
        return server, thread

    setattr(exporter, _SERVE, start_and_keep)
    try:
        yield
    finally:
        setattr(exporter, _SERVE, start)
