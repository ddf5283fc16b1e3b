"""Telemetry never fails a batch: bad headers, odd keys and a broken SDK are faults, not errors."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import asyncpg
import prometheus_client
import pytest
from opentelemetry import metrics
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import dedup
from dedup import _semconv as semconv
from dedup import _telemetry as telemetry
from dedup.data import _sql as sql
from dedup_dev import docs as docs_support


def traceparent(n: int) -> tuple[str, bytes]:
    return ("traceparent", f"00-{n + 1:032x}-{n + 1:016x}-01".encode())


def test_links_stop_at_the_cap_and_count_the_rest() -> None:
    batch = [[traceparent(n)] for n in range(telemetry.MAX_LINKS + 5)]
    batch += [[], [("other", b"x")]]  # no trace context: neither linked nor dropped
    links, dropped = telemetry.producer_links(batch)
    assert len(links) == telemetry.MAX_LINKS == 128
    assert [link.context.trace_id for link in links[:2]] == [1, 2]
    assert dropped == 5


def test_unreadable_trace_headers_give_no_link_and_count_a_fault(monkeypatch: Any) -> None:
    counted: list[str] = []
    monkeypatch.setattr(telemetry, "fault", lambda kind, *_: counted.append(kind))
    assert telemetry.extract_link([("traceparent", None)]) is None
    assert telemetry.extract_link([("TraceParent", b"0" * 5000)]) is None
    assert telemetry.extract_link([("traceparent", b"\xff\xfe not one")]) is None
    assert counted == ["trace_context", "trace_context"]  # a value that does not parse: no fault
    # A repeated header: the readable copy is used, the null one counted.
    link = telemetry.extract_link([traceparent(6), ("traceparent", None)])
    assert link is not None and link.context.trace_id == 7
    assert counted == ["trace_context"] * 3


def test_a_propagator_that_raises_is_a_fault_logged_once(
    monkeypatch: Any, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("propagator bug")

    monkeypatch.setattr(telemetry.propagate, "extract", broken)
    monkeypatch.setattr(telemetry, "_logged_faults", set())
    with caplog.at_level(logging.DEBUG, logger="dedup.telemetry"):
        for _ in range(3):
            assert telemetry.extract_link([traceparent(1)]) is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "telemetry fault (propagator)" in warnings[0].getMessage()
    assert len(caplog.records) == 3  # the others at debug


def test_a_tracer_that_raises_leaves_the_work_and_its_errors_alone(monkeypatch: Any) -> None:
    class Broken:
        def start_span(self, *_: Any, **__: Any) -> Any:
            raise RuntimeError("SDK bug")

    monkeypatch.setattr(telemetry, "tracer", Broken())
    ran = []
    with telemetry.consumer_span("process t", {}) as span:
        ran.append(span.is_recording())
    assert ran == [False]
    with pytest.raises(KeyError), telemetry.internal_span("dedup transaction", {}):
        raise KeyError("the handler's own error")


def test_the_key_attribute_is_utf8_text_cut_to_its_cap() -> None:
    cap = telemetry.MAX_KEY_ATTRIBUTE
    assert telemetry.key_attribute(b"acct-7") == "acct-7"
    assert telemetry.key_attribute(b"\xff\xfe") is None
    assert telemetry.key_attribute("é".encode() * 5000) == "é" * cap
    assert telemetry.key_attribute(b"k" * 1_000_000) == "k" * cap
    # Cut inside a character, or bad bytes past the cut: the readable start is kept.
    assert telemetry.key_attribute(b"a" + "€".encode() * 600) == "a" + "€" * (cap - 1)
    assert telemetry.key_attribute(b"b" * 2000 + b"\xff") == "b" * cap
    assert telemetry.key_attribute(b"ok\xe2\x82") is None  # a short key cut mid-character


REFERENCE = Path(__file__).parents[2] / "docs" / "reference" / "telemetry.md"


def reference_rows(section: str) -> list[list[str]]:
    """The cells of the table between ``<!-- section:begin -->`` and ``<!-- section:end -->``."""
    text = REFERENCE.read_text(encoding="utf-8")
    table = text.split(f"<!-- {section}:begin -->")[1].split(f"<!-- {section}:end -->")[0]
    lines = [line for line in table.strip().splitlines()[2:]]
    return [
        [cell.strip().replace("`", "") for cell in line.strip("|").split("|")] for line in lines
    ]


def test_the_reference_lists_every_metric_the_library_makes_as_made() -> None:
    documented = [(r[0], r[1], r[2], r[4]) for r in reference_rows("metrics")]
    made = [(i.name, i.kind, i.unit, i.description) for i in telemetry.INSTRUMENTS]
    assert documented == made


OPERATIONS = Path(__file__).parents[2] / "docs" / "operations.md"


def prometheus_names() -> dict[str, str]:
    """Each instrument's name as the SDK's Prometheus exporter writes it (a counter's sample)."""
    registry = prometheus_client.CollectorRegistry()
    reader = PrometheusMetricReader(disable_target_info=True, registry=registry)
    provider = MeterProvider(metric_readers=[reader])
    meter = provider.get_meter("names")
    for instrument in telemetry.INSTRUMENTS:
        name, unit = instrument.name, instrument.unit
        if instrument.kind == "counter":
            meter.create_counter(name, unit=unit).add(1)
        elif instrument.kind == "histogram":
            meter.create_histogram(name, unit=unit).record(1)
        else:
            meter.create_observable_gauge(
                name, callbacks=[lambda _: [metrics.Observation(1)]], unit=unit
            )
    try:
        families = {family.name: family.type for family in registry.collect()}
    finally:
        provider.shutdown()
    # prometheus_client names a counter's family without the _total its samples carry.
    exported = [f"{n}_total" if kind == "counter" else n for n, kind in families.items()]
    assert len(exported) == len(telemetry.INSTRUMENTS), exported
    return dict(zip((i.name for i in telemetry.INSTRUMENTS), exported, strict=True))


def test_operations_lists_every_metric_by_its_prometheus_name() -> None:
    every = docs_support.section(OPERATIONS.read_text(encoding="utf-8"), "### Every metric")
    rows = [line for line in every.splitlines() if line.startswith("| `")]
    listed = {
        cells[1]: cells[0]
        for cells in ([c.strip().strip("`") for c in row.strip("|").split("|")] for row in rows)
    }
    assert len(listed) == len(rows), "a metric listed twice"
    assert listed == prometheus_names()


def test_transaction_durations_from_2ms_to_2s_spread_over_many_buckets(
    metric_reader: InMemoryMetricReader,
) -> None:
    attrs = {"dedup.namespace": "buckets-test"}
    for seconds in (0.002, 0.004, 0.015, 0.04, 0.12, 0.3, 0.8, 2.0):
        telemetry.transaction_duration.record(seconds, attrs)
    data = metric_reader.get_metrics_data()
    assert data is not None
    [point] = [
        p
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "dedup.transaction.duration"
        for p in m.data.data_points
        if dict(p.attributes or {}) == attrs
    ]
    assert list(point.explicit_bounds) == list(semconv.DURATION_BUCKETS)
    assert sum(1 for n in point.bucket_counts if n) >= 5


def test_the_tracer_and_meter_carry_the_version_and_schema_url(
    spans: InMemorySpanExporter,
) -> None:
    with telemetry.internal_span("dedup test", {}):
        pass
    [span] = [s for s in spans.get_finished_spans() if s.name == "dedup test"]
    scope = span.instrumentation_scope
    assert scope is not None
    assert (scope.name, scope.version) == ("dedup", dedup.__version__)
    assert scope.schema_url == "https://opentelemetry.io/schemas/1.44.0"


def test_links_keep_the_producers_tracestate() -> None:
    link = telemetry.extract_link([traceparent(3), ("tracestate", b"vendor=abc,other=1")])
    assert link is not None
    assert dict(link.context.trace_state) == {"vendor": "abc", "other": "1"}


def test_stability_opt_in_is_read_as_the_instrumentations_read_it() -> None:
    assert semconv.duplicated_domains(None) == frozenset()
    assert semconv.duplicated_domains("database,messaging") == frozenset()
    assert semconv.duplicated_domains("http/dup, database/dup,database") == {"database"}
    attrs = {"db.system.name": "postgresql", "messaging.destination.partition.id": "3"}
    assert semconv.with_old_names(attrs, ["database", "messaging"]) == {
        **attrs,
        "db.system": "postgresql",
        "messaging.kafka.destination.partition": 3,
    }


def test_statements_are_summarized_by_operation_and_table() -> None:
    queries = sql.Queries("tenant")
    assert queries.fence_and_claim.operation == "UPDATE"
    assert queries.fence_and_claim.summary == "UPDATE tenant.partitions INSERT tenant.processed"
    assert queries.record_events.summary == "INSERT tenant.events"
    assert queries.lock_keys.summary == "SELECT"


def test_error_type_is_the_sqlstate_or_the_class_name() -> None:
    assert semconv.error_type(asyncpg.DeadlockDetectedError("x")) == "40P01"
    assert semconv.error_type(TimeoutError()) == "TimeoutError"
    assert semconv.error_type(dedup.StaleTokenError("g:t:0", 3)) == "dedup.StaleTokenError"
