"""OpenTelemetry for dedup: one tracer, one meter, and the span events of transitions.

dedup depends on ``opentelemetry-api`` only.  Until an application installs
the SDK, every call here is a no-op proxy; with the SDK, spans and metrics go
wherever the application's providers send them.

Spans follow the messaging conventions for Kafka (``process <topic>``,
CONSUMER kind, ``messaging.*`` attributes).  Each state transition is a span
event named ``dedup.<transition>`` with ``dedup.*`` attributes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from opentelemetry import context, metrics, propagate, trace

INSTRUMENTATION = "dedup"

tracer = trace.get_tracer(INSTRUMENTATION)
meter = metrics.get_meter(INSTRUMENTATION)

processed = meter.create_counter(
    "dedup.messages.processed", unit="{message}", description="messages applied once"
)
duplicates = meter.create_counter(
    "dedup.messages.duplicates", unit="{message}", description="redelivered copies suppressed"
)
conflicts = meter.create_counter(
    "dedup.messages.conflicts", unit="{message}", description="same key, different payload"
)
dead_lettered = meter.create_counter(
    "dedup.messages.dead_lettered", unit="{message}", description="messages dead-lettered"
)
stale_rejections = meter.create_counter(
    "dedup.stale_rejections", unit="{batch}", description="writes refused by a fencing token"
)
deadlocks = meter.create_counter(
    "dedup.deadlocks",
    unit="{batch}",
    description="batches that deadlocked with another lane and ran again alone",
)
lease_losses = meter.create_counter(
    "dedup.lease.losses", unit="{lease}", description="leases lost by their holder"
)
reconcile_mismatches = meter.create_counter(
    "dedup.reconcile.mismatches", unit="{check}", description="reconciliation mismatches"
)
batch_size = meter.create_histogram(
    "dedup.batch.size", unit="{message}", description="messages per transaction"
)
transaction_duration = meter.create_histogram(
    "dedup.transaction.duration", unit="s", description="time of one batch transaction"
)
end_to_end_lag = meter.create_histogram(
    "dedup.message.lag", unit="s", description="from the record's timestamp to its commit"
)


def transition(name: str, attributes: Mapping[str, Any] | None = None) -> None:
    """Add the span event ``dedup.<name>`` to the current span, if it is recording.

    ``attributes`` keys are given without the ``dedup.`` prefix; ``None`` values
    are left out.
    """
    span = trace.get_current_span()
    if not span.is_recording():
        return
    attrs = {f"dedup.{k}": v for k, v in (attributes or {}).items() if v is not None}
    span.add_event(f"dedup.{name}", attrs)


@contextlib.contextmanager
def client_span(name: str, attributes: Mapping[str, Any]) -> Iterator[trace.Span]:
    """A CLIENT span for database work, child of the current span but not made current.

    Transitions recorded meanwhile stay on the span the caller is in (the
    ``process <topic>`` span), where a reader of the trace looks for them.
    """
    span = tracer.start_span(
        name,
        kind=trace.SpanKind.CLIENT,
        attributes={"db.system.name": "postgresql", **attributes},
    )
    try:
        yield span
    except BaseException as exc:
        span.record_exception(exc)
        span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        span.end()


def current_trace_id() -> str | None:
    """The current trace id as 32 hex digits, or None outside a sampled span."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def extract_link(headers: Iterable[tuple[str, bytes]]) -> trace.Link | None:
    """A span link to the producer's context carried in Kafka headers, if any."""
    carrier = {k.lower(): v.decode("latin-1") for k, v in headers if k.lower() == "traceparent"}
    if not carrier:
        return None
    span_context = trace.get_current_span(propagate.extract(carrier)).get_span_context()
    return trace.Link(span_context) if span_context.is_valid else None


def inject_headers(
    headers: Iterable[tuple[str, bytes]] = (), ctx: context.Context | None = None
) -> list[tuple[str, bytes]]:
    """Kafka headers with the current (or given) trace context added, for producers."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return [*headers, *((k, v.encode("latin-1")) for k, v in carrier.items())]
