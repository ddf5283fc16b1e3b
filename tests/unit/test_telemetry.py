"""Telemetry never fails a batch: bad headers, odd keys and a broken SDK are faults, not errors."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from dedup import _telemetry as telemetry


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
    with pytest.raises(KeyError), telemetry.client_span("BATCH", {}):
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
