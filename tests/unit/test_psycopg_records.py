"""The rows of dedup's psycopg adapter read as asyncpg's do; psycopg's errors are traced as
asyncpg's are."""

from __future__ import annotations

import psycopg
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dedup.data import _db_telemetry as db_telemetry
from dedup.data import _psycopg as psycopg_


def test_a_record_reads_by_name_and_by_position() -> None:
    row = psycopg_.Record(("a", 1, None), {"key": 0, "n": 1, "gone": 2})
    assert (row["key"], row[1], row[-1], row[:2], len(row), tuple(row)) == (
        "a", 1, None, ("a", 1), 3, ("a", 1, None),
    )  # fmt: skip
    assert (row.get("n"), row.get("nothing", 7)) == (1, 7)
    assert (list(row.keys()), list(row.values())) == (["key", "n", "gone"], ["a", 1, None])
    assert dict(row.items()) == {"key": "a", "n": 1, "gone": None}
    assert repr(row) == "<Record key='a' n=1 gone=None>"
    with pytest.raises(KeyError, match=r"no column 'x' \(columns: \['key', 'n', 'gone'\]\)"):
        row["x"]


def test_a_psycopg_error_marks_its_span_with_its_sqlstate(spans: InMemorySpanExporter) -> None:
    class Located:
        server = ("shop", "10.0.0.7", 5432)

    with pytest.raises(psycopg.errors.UniqueViolation):
        with db_telemetry.db_call(Located(), db_telemetry.Call("INSERT", "INSERT x", "dedup")):
            raise psycopg.errors.UniqueViolation("duplicate key")
    (span,) = [s for s in spans.get_finished_spans() if s.name == "INSERT x"]
    assert span.attributes is not None
    assert (span.attributes["error.type"], span.attributes["db.response.status_code"]) == (
        "23505",
        "23505",
    )
    assert (span.attributes["server.address"], span.attributes["server.port"]) == (
        "10.0.0.7",
        5432,
    )
