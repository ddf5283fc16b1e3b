"""A statement's CLIENT span and duration point (dedup.data._db_telemetry), and tracing off."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from collections import Counter
from typing import Any

import asyncpg
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dedup.data import _db_telemetry as db_telemetry


class FakeConnection:
    """Where an asyncpg connection says it is connected (all db_call reads of it)."""

    _params = types.SimpleNamespace(database="shop")
    _addr = ("10.0.0.7", 6432)


STATEMENT = db_telemetry.Call("COMMIT", "COMMIT", "dedup")


def duration_points(reader: InMemoryMetricReader) -> Counter[frozenset[tuple[str, Any]]]:
    """``db.client.operation.duration`` counts by attribute set."""
    counts: Counter[frozenset[tuple[str, Any]]] = Counter()
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == "db.client.operation.duration":
                    for point in metric.data.data_points:
                        counts[frozenset(point.attributes.items())] += point.count
    return counts


def test_a_failed_statement_marks_its_own_span_and_point_only(
    spans: InMemorySpanExporter, metric_reader: InMemoryMetricReader
) -> None:
    before = duration_points(metric_reader)
    conn = FakeConnection()
    with pytest.raises(asyncpg.UniqueViolationError):
        with db_telemetry.db_call(conn, STATEMENT):
            raise asyncpg.UniqueViolationError("duplicate key")
    with db_telemetry.db_call(conn, STATEMENT):
        pass

    failed, ok = [s for s in spans.get_finished_spans() if s.name == "COMMIT"]
    assert failed.attributes is not None and ok.attributes is not None
    assert failed.attributes["db.response.status_code"] == "23505"
    assert failed.attributes["error.type"] == "23505"
    assert "error.type" not in ok.attributes
    assert ok.attributes["db.namespace"] == "shop|dedup"
    assert ok.attributes["server.address"] == "10.0.0.7"
    assert ok.attributes["server.port"] == 6432

    added = duration_points(metric_reader) - before
    plain = frozenset(
        {
            "db.system.name": "postgresql",
            "db.namespace": "shop|dedup",
            "db.operation.name": "COMMIT",
            "db.query.summary": "COMMIT",
            "server.address": "10.0.0.7",
            "server.port": 6432,
        }.items()
    )
    # The failure's error.type went on its own point, not on the attributes kept for the next.
    assert added == Counter({plain: 1, plain | {("error.type", "23505")}: 1})


def test_with_no_tracer_provider_no_span_is_built_or_made_current() -> None:
    # A fresh process: the global tracer provider can be set once per process.
    script = textwrap.dedent(
        """
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )
        from dedup import _telemetry as telemetry

        assert not telemetry.tracing()
        outer = trace.get_current_span()
        with telemetry.consumer_span("process t", {"a": 1}) as span:
            assert span is trace.INVALID_SPAN
            assert trace.get_current_span() is outer
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        assert telemetry.tracing()
        with telemetry.consumer_span("process t", {"a": 1}) as span:
            assert trace.get_current_span() is span
        print([s.name for s in exporter.get_finished_spans()])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['process t']"
