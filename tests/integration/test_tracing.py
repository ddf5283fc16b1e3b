"""Traces and metrics of the consumer, read back from the OpenTelemetry SDK's in-memory exporters.

One batch holds a fresh message produced inside a trace, its duplicate, a
second fresh message, a conflicting copy of it and a poison message.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer
from opentelemetry import trace
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import dedup
from dedup import _telemetry as telemetry
from dedup_dev import effects as support
from dedup_dev import helpers
from dedup_dev.kafka import Topics
from dedup_dev.services import ROOT


def counter_totals(reader: InMemoryMetricReader) -> Counter[str]:
    """Sum of every dedup counter's data points, by metric name."""
    totals: Counter[str] = Counter()
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name.startswith("dedup."):
                    for point in metric.data.data_points:
                        totals[metric.name] += getattr(point, "value", getattr(point, "count", 0))
    return totals


async def test_a_mixed_batch_is_traced_with_conventions_events_and_links(
    bootstrap_servers: str,
    topics: Topics,
    pool: Any,
    spans: InMemorySpanExporter,
    metric_reader: InMemoryMetricReader,
) -> None:
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    before = counter_totals(metric_reader)
    with telemetry.tracer.start_as_current_span("checkout", kind=trace.SpanKind.PRODUCER) as up:
        headers = [*telemetry.inject_headers(), ("tracestate", b"vendor=v1")]
        producer_trace = up.get_span_context().trace_id
    first = orjson.dumps({"id": "t1", "amount": 1})
    await helpers.produce(bootstrap_servers, topic, [(b"t1", first)], headers=headers)
    await helpers.produce(
        bootstrap_servers,
        topic,
        [
            (b"t1", first),
            (b"t2", orjson.dumps({"id": "t2", "amount": 2})),
            (b"t2", orjson.dumps({"id": "t2", "amount": 999})),
            (b"t3", b"{broken"),
        ],
    )
    consumer = support.consumer(support.record_effects, topic, bootstrap_servers, pool)
    async with support.running(consumer):
        await helpers.wait_for(lambda: _handled(consumer, 5), what="5 messages")
        # Everything fetched is applied: no lag, nothing waiting.
        gauges = gauge_values(metric_reader, topic)
        assert gauges["dedup.consumer.lag"] == 0
        assert gauges["dedup.consumer.oldest_unapplied.age"] == 0

    finished = spans.get_finished_spans()
    process = [s for s in finished if s.name == f"process {topic}"]
    assert process and all(s.kind is trace.SpanKind.CONSUMER for s in process)
    for span in process:
        attrs = span.attributes or {}
        assert attrs["messaging.system"] == "kafka"
        assert attrs["messaging.destination.name"] == topic
        assert attrs["messaging.destination.partition.id"] == "0"
        assert attrs["messaging.consumer.group.name"] == f"g-{topic}"
        assert attrs["messaging.operation.type"] == "process"
        # Single-message spans have an offset, batch spans a count: never both.
        assert ("messaging.kafka.offset" in attrs) != ("messaging.batch.message_count" in attrs)
    assert sum(int(s.attributes.get("messaging.batch.message_count", 1)) for s in process) == 5  # type: ignore[union-attr]

    # The producer's trace is linked from the batch that carried its message, tracestate kept.
    linked = [link for s in process for link in s.links]
    assert [link.context.trace_id for link in linked] == [producer_trace]
    assert dict(linked[0].context.trace_state) == {"vendor": "v1"}

    # dedup's transaction is an INTERNAL span under each process span; its
    # statements CLIENT spans under it, BEGIN to COMMIT.
    process_ids = {s.context.span_id for s in process}
    transactions = [s for s in finished if s.name == "dedup transaction"]
    assert transactions and all(s.kind is trace.SpanKind.INTERNAL for s in transactions)
    assert all(s.parent is not None and s.parent.span_id in process_ids for s in transactions)
    transaction_ids = {s.context.span_id for s in transactions}
    db_spans = [
        s
        for s in finished
        if s.kind is trace.SpanKind.CLIENT and s.parent and s.parent.span_id in transaction_ids
    ]
    names = [s.name for s in db_spans]
    assert names[0] == "BEGIN" and names[-1] == "COMMIT"
    assert "UPDATE dedup.partitions INSERT dedup.processed" in names
    database = await pool.fetchval("SELECT current_database()")
    for span in db_spans:
        attrs = span.attributes or {}
        assert attrs["db.system.name"] == "postgresql"
        assert attrs["db.namespace"] == f"{database}|dedup"
        assert attrs["db.query.summary"] == span.name
        assert attrs["server.address"] and isinstance(attrs["server.port"], int)
        assert attrs["db.operation.name"] == span.name.split()[0]

    # Every span and metric emitted is in the reference, with its kind and attributes.
    check_reference(finished, metric_reader)

    events = {e.name: e for s in transactions for e in s.events}
    assert {
        "dedup.claimed",
        "dedup.applied",
        "dedup.duplicate",
        "dedup.conflict",
        "dedup.dead_lettered",
    } <= set(events)
    duplicate = events["dedup.duplicate"].attributes or {}  # one per batch, with the count
    assert duplicate["dedup.namespace"] == f"g-{topic}"
    assert duplicate["dedup.count"] == 1
    assert list(duplicate["dedup.keys"]) == ["t1"]  # type: ignore[arg-type]
    assert duplicate["dedup.token"] == 1
    reasons = [
        str((e.attributes or {})["dedup.reason"])
        for s in transactions
        for e in s.events
        if e.name == "dedup.dead_lettered"
    ]
    assert len(reasons) == 2
    assert any("invalid JSON" in r for r in reasons)
    assert any(r.startswith("conflict: key 't2'") for r in reasons)

    assign = [s for s in finished if s.name == "dedup assign"]
    acquired = [e for s in assign for e in s.events if e.name == "dedup.partition_acquired"]
    assert acquired and (acquired[0].attributes or {})["dedup.token"] == 1

    # The events table carries the trace id of the batch that wrote each row;
    # duplicates are counted on the key's row, not written as events.
    assert await pool.fetchval("SELECT count(*) FROM dedup.events WHERE kind = 'duplicate'") == 0
    row = await pool.fetchrow("SELECT trace_id FROM dedup.events WHERE kind = 'conflict'")
    assert row["trace_id"] in {format(s.context.trace_id, "032x") for s in process}

    after = counter_totals(metric_reader)
    delta = {name: after[name] - before[name] for name in after}
    assert delta["dedup.messages.processed"] == 2
    assert delta["dedup.messages.duplicates"] == 1
    assert delta["dedup.messages.conflicts"] == 1
    assert delta["dedup.messages.dead_lettered"] == 2  # the conflict and the poison
    assert delta["dedup.batch.size"] >= 1  # histogram: count of batches recorded
    messaging = {
        "messaging.system": "kafka",
        "messaging.consumer.group.name": f"g-{topic}",
        "messaging.destination.name": topic,
    }
    assert point_total(metric_reader, "dedup.messages.processed", messaging) == 2
    assert point_total(metric_reader, "messaging.client.consumed.messages", messaging) == 5
    assert point_total(metric_reader, "messaging.process.duration", messaging) >= 1


STARTED_AT_ZERO = [
    "dedup.messages.processed",
    "dedup.messages.duplicates",
    "dedup.messages.conflicts",
    "dedup.messages.dead_lettered",
    "dedup.stale_rejections",
    "dedup.deadlocks",
    "dedup.retries",
]


def series(reader: InMemoryMetricReader, attributes: dict[str, Any]) -> dict[str, float]:
    """The value of each counter's point whose attributes are exactly ``attributes``."""
    return {
        name: point.value
        for name, kind, point in points(reader)
        if kind == "Sum" and dict(point.attributes or {}) == attributes
    }


async def test_a_started_consumer_counts_from_zero_on_the_series_it_adds_to(
    bootstrap_servers: str, topics: Topics, pool: Any, metric_reader: InMemoryMetricReader
) -> None:
    # A counter never added to is no series in Prometheus: an increase() alert would
    # miss the first dead letter after a restart, which would appear already at 1.
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    consumer = support.consumer(support.record_effect, topic, bootstrap_servers, pool)
    labels = {
        "messaging.system": "kafka",
        "messaging.consumer.group.name": f"g-{topic}",
        "messaging.destination.name": topic,
        "dedup.namespace": f"g-{topic}",
    }

    async def holding() -> bool:
        return consumer.assignment == {(topic, 0)}

    async with support.running(consumer):
        await helpers.wait_for(holding, what="the partition held")
        assert series(metric_reader, labels) == dict.fromkeys(STARTED_AT_ZERO, 0)
        await helpers.produce(
            bootstrap_servers,
            topic,
            [(b"z1", orjson.dumps({"id": "z1", "amount": 1})), (b"z2", b"{broken")],
        )
        await helpers.wait_for(lambda: _handled(consumer, 2), what="2 messages")
    # The increments landed on the very series that started at 0.
    counted = series(metric_reader, labels)
    assert counted == {
        **dict.fromkeys(STARTED_AT_ZERO, 0),
        "dedup.messages.processed": 1,
        "dedup.messages.dead_lettered": 1,
    }


def points(reader: InMemoryMetricReader) -> list[tuple[str, str, Any]]:
    """Every data point the SDK holds: (metric name, kind, point)."""
    data = reader.get_metrics_data()
    return [
        (metric.name, type(metric.data).__name__, point)
        for resource in (data.resource_metrics if data else [])
        for scope in resource.scope_metrics
        for metric in scope.metrics
        for point in metric.data.data_points
    ]


def point_total(reader: InMemoryMetricReader, name: str, attrs: dict[str, Any]) -> float:
    """The sum (or count) of ``name``'s points whose attributes include ``attrs``."""
    return sum(
        getattr(point, "value", getattr(point, "count", 0))
        for metric, _, point in points(reader)
        if metric == name and attrs.items() <= dict(point.attributes or {}).items()
    )


def gauge_values(reader: InMemoryMetricReader, topic: str) -> dict[str, float]:
    return {
        name: point.value
        for name, kind, point in points(reader)
        if kind == "Gauge" and (point.attributes or {}).get("messaging.destination.name") == topic
    }


REFERENCE = ROOT / "docs" / "reference" / "telemetry.md"
KINDS = {"Sum": "counter", "Histogram": "histogram", "Gauge": "gauge"}


def reference(section: str) -> dict[str, tuple[str, set[str]]]:
    """The reference's table: name -> (kind, attribute names)."""
    text = REFERENCE.read_text(encoding="utf-8")
    table = text.split(f"<!-- {section}:begin -->")[1].split(f"<!-- {section}:end -->")[0]
    found = {}
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = cells[0].strip("`")
        kind = cells[1]
        attrs = cells[2] if section == "spans" else cells[3]
        found[name] = (kind, set(re.findall(r"`([a-z_.]+)`", attrs)))
    return found


def check_reference(finished: Any, reader: InMemoryMetricReader) -> None:
    spans = reference("spans")
    for span in finished:
        scope = span.instrumentation_scope
        if scope is None or scope.name != "dedup" or span.kind is trace.SpanKind.PRODUCER:
            continue  # the test's own producer span is made with dedup's tracer
        if span.kind is trace.SpanKind.CLIENT:
            name = "{db.query.summary}"
        else:
            name = re.sub(r"^(process|task|reconcile) .*", r"\1 {\1}", span.name)
            name = name.replace("{process}", "{topic}").replace("{reconcile}", "{task}")
        assert name in spans, f"span {span.name!r} is not in {REFERENCE.name}"
        kind, attrs = spans[name]
        assert span.kind.name == kind, span.name
        assert set(span.attributes or {}) <= attrs, (span.name, set(span.attributes) - attrs)
    metrics = reference("metrics")
    for name, kind, point in points(reader):
        if not name.startswith(("dedup.", "messaging.", "db.")):
            continue
        assert name in metrics, f"metric {name!r} is not in {REFERENCE.name}"
        documented, attrs = metrics[name]
        assert KINDS[kind] == documented, name
        assert set(point.attributes or {}) <= attrs, (name, set(point.attributes) - attrs)


async def _handled(consumer: dedup.IdempotentConsumer, n: int) -> bool:
    return consumer.stats["messages"] >= n


def process_spans(spans: InMemorySpanExporter, topic: str) -> list[Any]:
    return [s for s in spans.get_finished_spans() if s.name == f"process {topic}"]


async def test_a_null_traceparent_is_a_counted_telemetry_fault_not_a_failed_message(
    bootstrap_servers: str,
    topics: Topics,
    pool: Any,
    spans: InMemorySpanExporter,
    metric_reader: InMemoryMetricReader,
) -> None:
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    before = counter_totals(metric_reader)
    headers: list[tuple[str, Any]] = [("traceparent", None)]
    await helpers.produce(
        bootstrap_servers, topic, [(b"n1", orjson.dumps({"id": "n1"}))], headers=headers
    )
    consumer = support.consumer(support.record_effects, topic, bootstrap_servers, pool)
    async with support.running(consumer):
        await helpers.wait_for(lambda: _handled(consumer, 1), what="the message")

    assert await support.effect_counts(pool) == (1, 1)
    assert await pool.fetchval("SELECT count(*) FROM dedup.dead_letters") == 0
    assert (consumer.stats["dead_lettered"], consumer.stats["retries"]) == (0, 0)
    [span] = process_spans(spans, topic)  # one transaction: the batch was never split
    assert span.status.is_ok and not span.links
    after = counter_totals(metric_reader)
    assert after["dedup.telemetry.faults"] - before["dedup.telemetry.faults"] == 1


async def test_headers_and_keys_of_any_shape_never_fail_a_message(
    bootstrap_servers: str,
    topics: Topics,
    pool: Any,
    spans: InMemorySpanExporter,
    metric_reader: InMemoryMetricReader,
) -> None:
    topic = await topics.create()
    await pool.execute(support.EFFECTS)
    with telemetry.tracer.start_as_current_span("upstream", kind=trace.SpanKind.PRODUCER) as up:
        [traceparent] = telemetry.inject_headers()
        upstream = up.get_span_context().trace_id
    shapes: list[tuple[bytes, list[tuple[str, Any]]]] = [
        (b"\xff\xfe", [("blob", b"\x00\xff"), ("blob", b"again"), ("Trace", b"\xc3")]),
        (b"k" * 100_000, [("huge", b"x" * 500_000)]),
        ("ключ".encode(), [("traceparent", b"0" * 10_000)]),
        (b"plain", [traceparent, ("traceparent", None)]),
    ]
    before = counter_totals(metric_reader)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap_servers, max_request_size=2**21)
    await producer.start()
    try:
        for n, (key, headers) in enumerate(shapes):
            value = orjson.dumps({"id": f"s{n}"})
            await producer.send_and_wait(topic, value, key=key, headers=headers)
    finally:
        await producer.stop()
    consumer = support.consumer(support.record_effect, topic, bootstrap_servers, pool, batch_size=1)
    async with support.running(consumer):
        await helpers.wait_for(lambda: _handled(consumer, len(shapes)), what="every message")

    assert await support.effect_counts(pool) == (4, 4)
    assert consumer.stats["dead_lettered"] == 0
    by_offset = {s.attributes["messaging.kafka.offset"]: s for s in process_spans(spans, topic)}  # type: ignore[index]
    keys = [(by_offset[n].attributes or {}).get("messaging.kafka.message.key") for n in range(4)]
    assert keys == [None, "k" * telemetry.MAX_KEY_ATTRIBUTE, "ключ", "plain"]
    # The null copy of a repeated traceparent is left out; the readable one is linked.
    assert [[link.context.trace_id for link in by_offset[n].links] for n in range(4)] == [
        [],
        [],
        [],
        [upstream],
    ]
    after = counter_totals(metric_reader)
    # The oversized traceparent and the null one; the others are no trace context at all.
    assert after["dedup.telemetry.faults"] - before["dedup.telemetry.faults"] == 2
