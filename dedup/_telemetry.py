"""OpenTelemetry for dedup: one tracer, one meter, and the span events of transitions.

dedup depends on ``opentelemetry-api`` only.  Until an application installs
a tracer provider (the SDK's), dedup builds no span (:func:`tracing`) and its
metrics go to the API's no-op proxies; with the SDK, spans and metrics go
wherever the application's providers send them.

Spans follow the OpenTelemetry semantic conventions (:data:`semconv.SCHEMA_URL`): a
batch is a CONSUMER span ``process <topic>`` (messaging conventions for Kafka),
dedup's transaction an INTERNAL span ``dedup transaction`` under it, and each
statement dedup sends a CLIENT span (database conventions for PostgreSQL).
Each state transition is a span event named ``dedup.<transition>`` with
``dedup.*`` attributes.  Every span and metric is listed in
``docs/reference/telemetry.md`` (a test checks the page against what is emitted).

Which conventions, and ``OTEL_SEMCONV_STABILITY_OPT_IN``: :mod:`dedup._semconv`;
the CLIENT spans of statements: :mod:`dedup.data._db_telemetry`.

Telemetry never fails a batch: whatever a producer put in its headers, and
whatever an installed SDK does, a fault here is counted in
``dedup.telemetry.faults`` (by ``dedup.fault`` kind), logged once per kind, and
the message is processed as if tracing were off.
"""

from __future__ import annotations

import codecs
import contextlib
import importlib.metadata
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from opentelemetry import context, metrics, propagate, trace

from dedup import _semconv as semconv

log = logging.getLogger("dedup.telemetry")

INSTRUMENTATION = "dedup"
MAX_LINKS = 128
"""Most producer links on one batch span: the SDK's default limit, past which it drops
links without a word.  dedup stops there and sets ``dedup.links.dropped`` on the span to
the number of further messages that carried a trace context."""
MAX_KEY_ATTRIBUTE = 256
"""Most characters of ``messaging.kafka.message.key``; a longer key is cut."""
MAX_CONTEXT_HEADER = 4096
"""Most bytes of a trace context header read for a link; a longer one is a fault."""

Headers = Sequence[tuple[str, "bytes | None"]]


def _version() -> str:
    try:
        return importlib.metadata.version("dedup-kafka")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


VERSION = _version()
tracer = trace.get_tracer(INSTRUMENTATION, VERSION, schema_url=semconv.SCHEMA_URL)
meter = metrics.get_meter(INSTRUMENTATION, VERSION, schema_url=semconv.SCHEMA_URL)


class Instrument(NamedTuple):
    """One metric dedup emits (the rows of docs/reference/telemetry.md)."""

    name: str
    """The OpenTelemetry name."""
    kind: str
    """``counter``, ``histogram`` or ``gauge`` (observable)."""
    unit: str
    """UCUM unit, or a ``{count}`` annotation."""
    description: str
    """What it counts or measures."""


INSTRUMENTS: list[Instrument] = []
"""Every metric dedup emits, in the order they are made."""


def _counter(name: str, unit: str, description: str) -> metrics.Counter:
    INSTRUMENTS.append(Instrument(name, "counter", unit, description))
    return meter.create_counter(name, unit=unit, description=description)


def _histogram(
    name: str, unit: str, description: str, buckets: Sequence[float] = semconv.DURATION_BUCKETS
) -> metrics.Histogram:
    INSTRUMENTS.append(Instrument(name, "histogram", unit, description))
    return meter.create_histogram(
        name, unit=unit, description=description, explicit_bucket_boundaries_advisory=buckets
    )


# The conventions' own metrics.
process_duration = _histogram(
    "messaging.process.duration", "s", "time to process a batch of messages (one try)"
)
consumed = _counter(
    "messaging.client.consumed.messages", "{message}", "messages handed to dedup by the client"
)
db_duration = _histogram(
    "db.client.operation.duration", "s", "time of one statement dedup sent to Postgres"
)
# dedup's counters: what happened to messages, batches, leases and checks.
processed = _counter("dedup.messages.processed", "{message}", "messages applied once")
duplicates = _counter("dedup.messages.duplicates", "{message}", "redelivered copies suppressed")
conflicts = _counter("dedup.messages.conflicts", "{message}", "same key, different payload")
dead_lettered = _counter("dedup.messages.dead_lettered", "{message}", "messages dead-lettered")
stale_rejections = _counter(
    "dedup.stale_rejections", "{batch}", "writes refused by a fencing token"
)
deadlocks = _counter(
    "dedup.deadlocks",
    "{batch}",
    "transactions that deadlocked with another and ran again after a backoff",
)
retries = _counter(
    "dedup.retries", "{retry}", "batches, messages and partition takeovers tried again"
)
lost_to_retention = _counter(
    "dedup.offsets.lost_to_retention", "{message}", "records retention deleted, never applied"
)


def partition_attributes(group_id: str, tp: Any) -> dict[str, Any]:
    """A partition's attributes on gauges and counters (``tp``: a TopicPartition)."""
    return {"messaging.system": "kafka", "messaging.consumer.group.name": group_id} | {
        "messaging.destination.name": tp.topic,
        "messaging.destination.partition.id": str(tp.partition),
    }


def counting(attributes: dict[str, Any]) -> dict[str, Any]:
    """Start a topic's counters at 0 and return their ``attributes``.

    A counter that was never added to is no series at all in Prometheus: a
    dashboard's deadlock panel would show "no data" instead of 0, and after a
    restart the first dead letter would be a new series already at 1, which an
    ``increase()`` alert never sees grow.  The consumer calls this for each of
    its topics when it starts, and again for each partition it is assigned, with
    the attributes its increments use (:func:`dedup.consumer._turn.counted`).
    """
    for counter in (
        processed,
        duplicates,
        conflicts,
        dead_lettered,
        stale_rejections,
        deadlocks,
        retries,
    ):
        counter.add(0, attributes)
    return attributes


lease_losses = _counter("dedup.lease.losses", "{lease}", "leases lost by their holder")
reconcile_mismatches = _counter(
    "dedup.reconcile.mismatches", "{check}", "reconciliation mismatches"
)
leases_too_short = _counter(
    "dedup.task.leases_too_short",
    "{run}",
    "runs started with a lease ttl under 1.5 x the task's p95 duration",
)
timeouts_too_short = _counter(
    "dedup.task.timeouts_too_short",
    "{run}",
    "runs fired by a schedule whose declared platform timeout is under the task's p95 duration",
)
# Histograms: how big, how long, how late.
batch_size = _histogram(
    "dedup.batch.size", "{message}", "messages per transaction", buckets=semconv.SIZE_BUCKETS
)
transaction_duration = _histogram(
    "dedup.transaction.duration", "s", "time of one batch transaction, COMMIT included"
)
end_to_end_lag = _histogram("dedup.message.lag", "s", "from the record's timestamp to its commit")
task_duration = _histogram(
    "dedup.task.duration",
    "s",
    "time of one task run, from its start to its success or failure (database time)",
    buckets=semconv.TASK_DURATION_BUCKETS,
)
faults = _counter(
    "dedup.telemetry.faults",
    "{fault}",
    "telemetry not recorded (a bad trace header, an SDK error); messages went on",
)


class Positions(Protocol):
    """What the consumer's partitions tell the observable gauges (``consumer._partitions``)."""

    def lag(self) -> Iterable[tuple[int, Mapping[str, Any]]]:
        """Per partition: the log-end offset minus the offset stored in Postgres."""

    def oldest_unapplied(self, now: float) -> Iterable[tuple[float, Mapping[str, Any]]]:
        """Per partition: seconds since the timestamp of the oldest record fetched, not applied."""


_watched: weakref.WeakSet[Positions] = weakref.WeakSet()


def watch(positions: Positions) -> None:
    """Report ``positions`` on the lag gauges until :func:`unwatch` (or until it is gone)."""
    _watched.add(positions)


def unwatch(positions: Positions) -> None:
    """Stop reporting ``positions``."""
    _watched.discard(positions)


def _observe_lag(_: metrics.CallbackOptions) -> Iterator[metrics.Observation]:
    # The SDK calls this on its reader's thread: read, never wait, never raise.
    try:
        for positions in list(_watched):
            for value, attributes in positions.lag():
                yield metrics.Observation(value, attributes)
    except Exception as exc:
        fault("metric", f"dedup.consumer.lag not observed: {exc!r}", exc)


def _observe_age(_: metrics.CallbackOptions) -> Iterator[metrics.Observation]:
    try:
        now = time.time()
        for positions in list(_watched):
            for value, attributes in positions.oldest_unapplied(now):
                yield metrics.Observation(value, attributes)
    except Exception as exc:
        fault("metric", f"dedup.consumer.oldest_unapplied.age not observed: {exc!r}", exc)


def _gauge(
    name: str,
    unit: str,
    description: str,
    callback: Callable[[metrics.CallbackOptions], Iterable[metrics.Observation]],
) -> metrics.ObservableGauge:
    INSTRUMENTS.append(Instrument(name, "gauge", unit, description))
    return meter.create_observable_gauge(
        name, callbacks=[callback], unit=unit, description=description
    )


outbox_published = _counter(
    "dedup.outbox.published", "{record}", "outbox records the relay published to Kafka"
)
outbox_deliveries = _counter(
    "dedup.outbox.deliveries", "{message}", "the HTTP dispatcher's sends, by outcome"
)
outbox_backlog: dict[str, tuple[int, float]] = {}
"""Per relay name: (pending records, age of the oldest in seconds), as it last read them."""


def _observe_backlog(_: metrics.CallbackOptions) -> Iterator[metrics.Observation]:
    for name, (pending, _oldest) in list(outbox_backlog.items()):
        yield metrics.Observation(pending, {"dedup.relay": name})


def _observe_backlog_age(_: metrics.CallbackOptions) -> Iterator[metrics.Observation]:
    for name, (_pending, oldest) in list(outbox_backlog.items()):
        yield metrics.Observation(oldest, {"dedup.relay": name})


consumer_lag = _gauge(
    "dedup.consumer.lag",
    "{message}",
    "per partition: the log-end offset minus the offset stored in Postgres",
    _observe_lag,
)
oldest_unapplied_age = _gauge(
    "dedup.consumer.oldest_unapplied.age",
    "s",
    "per partition: age of the oldest record fetched and not yet committed (0: none)",
    _observe_age,
)

outbox_pending = _gauge(
    "dedup.outbox.pending",
    "{record}",
    "per relay: outbox records written and not yet published",
    _observe_backlog,
)
outbox_oldest_age = _gauge(
    "dedup.outbox.oldest.age",
    "s",
    "per relay: age of the oldest record not yet published (0: none)",
    _observe_backlog_age,
)

_logged_faults: set[str] = set()


def fault(kind: str, what: str, exc: BaseException | None = None) -> None:
    """Count a telemetry fault of ``kind``; log the first of each kind, the rest at debug."""
    with contextlib.suppress(Exception):  # a broken meter is one more fault, not an error
        faults.add(1, {"dedup.fault": kind})
    if kind in _logged_faults:
        log.debug("telemetry fault (%s): %s", kind, what)
        return
    _logged_faults.add(kind)
    log.warning(
        "telemetry fault (%s): %s; the message is processed all the same (logged once per "
        "kind, counted in dedup.telemetry.faults)",
        kind,
        what,
        exc_info=exc,
    )


def transition(name: str, attributes: Mapping[str, Any] | None = None) -> None:
    """Add the span event ``dedup.<name>`` to the current span, if it is recording.

    ``attributes`` keys are given without the ``dedup.`` prefix; ``None`` values
    are left out.
    """
    span = trace.get_current_span()
    try:
        if not span.is_recording():
            return
        attrs = {f"dedup.{k}": v for k, v in (attributes or {}).items() if v is not None}
        span.add_event(f"dedup.{name}", attrs)
    except Exception as exc:
        fault("event", f"span event dedup.{name} not recorded: {exc!r}", exc)


_traced = False


def tracing() -> bool:
    """True once the application installed a tracer provider (the SDK's, say).

    Until then every span is a no-op, and dedup builds none: on a turn of one
    message, a span's attributes cost more than the rest of dedup's work.  A
    process's provider is set once (OpenTelemetry ignores a second one), so
    once True this stays True without asking again.
    """
    global _traced
    if not _traced:
        provider = trace.get_tracer_provider()
        _traced = not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))
    return _traced


@contextlib.contextmanager
def consumer_span(
    name: str, attributes: Mapping[str, Any], links: Sequence[trace.Link] = ()
) -> Iterator[trace.Span]:
    """A CONSUMER span made current for the block; an SDK that fails leaves no span."""
    with _current(start(name, trace.SpanKind.CONSUMER, attributes, links)) as span:
        yield span


@contextlib.contextmanager
def internal_span(name: str, attributes: Mapping[str, Any]) -> Iterator[trace.Span]:
    """An INTERNAL span made current for the block (dedup's own work, such as its transaction)."""
    with _current(start(name, trace.SpanKind.INTERNAL, attributes)) as span:
        yield span


@contextlib.contextmanager
def _current(span: trace.Span) -> Iterator[trace.Span]:
    if span is trace.INVALID_SPAN:
        yield span  # no span to make current (tracing is off, or the SDK failed)
        return
    with _ending(span):
        token = context.attach(trace.set_span_in_context(span))
        try:
            yield span
        finally:
            context.detach(token)


def record(instrument: metrics.Histogram, value: float, attributes: Mapping[str, Any]) -> None:
    """Record a histogram point; an SDK that fails is a fault, not an error."""
    try:
        instrument.record(value, attributes)
    except Exception as exc:
        fault("metric", f"a histogram point not recorded: {exc!r}", exc)


def set_attribute(span: trace.Span, key: str, value: Any) -> None:
    try:
        span.set_attribute(key, value)
    except Exception as exc:
        fault("span", f"attribute {key} not set: {exc!r}", exc)


@contextlib.contextmanager
def _ending(span: trace.Span) -> Iterator[trace.Span]:
    """Record the block's error on ``span`` and end it; the block's error goes on as it was."""
    try:
        yield span
    except BaseException as exc:
        record_error(span, exc)
        raise
    finally:
        end(span)


def start(
    name: str,
    kind: trace.SpanKind,
    attributes: Mapping[str, Any],
    links: Sequence[trace.Link] = (),
) -> trace.Span:
    """A span (not made current); :data:`trace.INVALID_SPAN` while tracing is off."""
    if not tracing():
        return trace.INVALID_SPAN
    try:
        if semconv.DUPLICATED:
            attributes = semconv.with_old_names(attributes)
        return tracer.start_span(name, kind=kind, attributes=attributes, links=links)
    except Exception as exc:
        fault("span", f"span {name!r} not started: {exc!r}", exc)
        return trace.INVALID_SPAN


def record_error(span: trace.Span, exc: BaseException) -> None:
    try:
        if not span.is_recording():
            return
        kind = semconv.error_type(exc)
        span.set_attribute("error.type", kind)
        span.record_exception(exc)
        span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
    except Exception as failed:
        fault("span", f"error not recorded on a span: {failed!r}", failed)


def end(span: trace.Span) -> None:
    try:
        span.end()
    except Exception as exc:
        fault("span", f"span not ended: {exc!r}", exc)


def current_trace_id() -> str | None:
    """The current trace id as 32 hex digits, or None outside a sampled span."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def extract_link(headers: Headers) -> trace.Link | None:
    """A span link to the producer's context carried in Kafka headers, if any; never raises.

    The headers read are those the installed propagator knows (``traceparent``
    and ``tracestate`` by default), the last of a repeated name winning.  A
    null or oversized value is a ``trace_context`` fault; a value that does not
    parse is no context, as the propagator has it.
    """
    try:
        return _link(headers, _context_fields())
    except Exception as exc:
        fault("propagator", f"trace context not read from headers: {exc!r}", exc)
        return None


def producer_links(each_headers: Iterable[Headers]) -> tuple[list[trace.Link], int]:
    """Links to the producers' contexts of a batch, at most MAX_LINKS; and how many were left out.

    Past the cap, a message counts as left out when it carries a header the
    propagator reads (its value is not parsed).
    """
    links: list[trace.Link] = []
    dropped = 0
    try:
        fields = _context_fields()
        for headers in each_headers:
            if not headers:
                continue
            if len(links) < MAX_LINKS:
                link = _link(headers, fields)
                if link is not None:
                    links.append(link)
            elif any(name.lower() in fields for name, _ in headers):
                dropped += 1
    except Exception as exc:
        fault("propagator", f"producer links not read: {exc!r}", exc)
    return links, dropped


def _context_fields() -> set[str]:
    """The header names the installed propagator reads, lower case."""
    return {f.lower() for f in propagate.get_global_textmap().fields}


def _link(headers: Headers, fields: set[str]) -> trace.Link | None:
    carrier: dict[str, str] = {}
    for name, value in headers:
        lower = name.lower()
        if lower not in fields:
            continue
        if value is None or len(value) > MAX_CONTEXT_HEADER:
            size = "null" if value is None else f"{len(value)} bytes"
            fault("trace_context", f"header {name!r} is not a trace context ({size})")
            continue
        carrier[lower] = bytes(value).decode("latin-1")
    if not carrier:
        return None
    span_context = trace.get_current_span(propagate.extract(carrier)).get_span_context()
    # The span context carries the producer's tracestate (vendor data a backend may
    # need to follow the link); it goes on the link as it came.
    return trace.Link(span_context) if span_context.is_valid else None


def key_attribute(key: bytes) -> str | None:
    """``messaging.kafka.message.key``: the key as UTF-8 text, cut to MAX_KEY_ATTRIBUTE characters.

    None for a key that is not UTF-8 text (in its first MAX_KEY_ATTRIBUTE characters).
    """
    limit = MAX_KEY_ATTRIBUTE * 4  # bytes enough for that many characters
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(key[:limit], len(key) <= limit)
    except UnicodeDecodeError:
        return None
    return text[:MAX_KEY_ATTRIBUTE]


def inject_headers(
    headers: Iterable[tuple[str, bytes]] = (), ctx: context.Context | None = None
) -> list[tuple[str, bytes]]:
    """Kafka headers with the current (or given) trace context added, for producers."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return [*headers, *((k, v.encode("latin-1")) for k, v in carrier.items())]
