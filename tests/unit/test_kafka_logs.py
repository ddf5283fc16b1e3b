"""aiokafka's repeated warnings pass once per interval, the next one with a count."""

from __future__ import annotations

import logging

import pytest

from dedup import _kafka_logs as kafka_logs


def line(msg: str, level: int = logging.ERROR, name: str = "aiokafka.cluster") -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, ("t",), None)


def test_a_repeated_line_passes_once_per_interval_then_says_how_many_were_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(kafka_logs.time, "monotonic", lambda: now[0])
    limit = kafka_logs.RateLimit(interval=30.0)
    passed = [limit.filter(line("Topic %s not found")) for _ in range(1000)]
    assert passed.count(True) == 1
    # Another message, another logger, and INFO lines are not held by it.
    assert limit.filter(line("Unexpected error %s"))
    assert limit.filter(line("Topic %s not found", name="aiokafka.consumer.fetcher"))
    assert all(limit.filter(line("Topic %s not found", logging.INFO)) for _ in range(3))
    now[0] += 30.0
    after = line("Topic %s not found")
    assert limit.filter(after)
    assert after.getMessage() == "Topic t not found (and 999 more like it in the last 30s)"


def test_install_puts_one_filter_on_each_aiokafka_logger() -> None:
    kafka_logs.install()
    kafka_logs.install()
    for name in kafka_logs.LOGGERS:
        limits = [f for f in logging.getLogger(name).filters if isinstance(f, kafka_logs.RateLimit)]
        assert len(limits) == 1, name
