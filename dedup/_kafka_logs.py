"""aiokafka's log lines, rate-limited: a missing topic must not flood the consumer's log.

While a topic is gone (deleted, about to be recreated), aiokafka logs the same
warning or error on every metadata refresh and fetch: thousands of lines a
minute.  The consumer installs :class:`RateLimit` on aiokafka's loggers: each
line (by logger and message template) passes once per :data:`INTERVAL`, and the
next one that passes says how many like it were held back.
"""

from __future__ import annotations

import logging
import threading
import time

INTERVAL = 30.0
"""Seconds between two lines of the same aiokafka warning or error.  Fixed: often enough to
show the fault persists, rarely enough that one fault is a handful of lines an hour."""

LOGGERS = (
    "aiokafka",
    "aiokafka.cluster",
    "aiokafka.conn",
    "aiokafka.consumer.consumer",
    "aiokafka.consumer.fetcher",
    "aiokafka.consumer.group_coordinator",
    "aiokafka.consumer.subscription_state",
)
"""aiokafka's loggers (a filter on a logger sees only that logger's own records)."""


class RateLimit(logging.Filter):
    """Lets each warning or error (logger and template) through once per ``interval`` seconds."""

    def __init__(self, interval: float = INTERVAL) -> None:
        super().__init__()
        self.interval = interval
        self._last: dict[tuple[str, object], float] = {}
        self._held: dict[tuple[str, object], int] = {}
        self._lock = threading.Lock()  # loggers may be called from any thread

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.msg)
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval:
                self._held[key] = self._held.get(key, 0) + 1
                return False
            self._last[key] = now
            held = self._held.pop(key, 0)
        if held:
            record.msg = f"{record.msg} (and {held} more like it in the last {self.interval:.0f}s)"
        return True


_installed = RateLimit()


def install() -> None:
    """Rate-limit aiokafka's loggers (once per process; a second call changes nothing)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if _installed not in logger.filters:
            logger.addFilter(_installed)
