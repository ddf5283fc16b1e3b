"""Durations and points in time as operators type them on the command line.

- a duration is one or more ``<number><unit>`` parts, unit ``s``, ``m``, ``h`` or
  ``d``: ``30d``, ``12h``, ``1d12h``, ``90s``;
- a point in time is an ISO 8601 date or date-time (``2026-11-30``,
  ``2026-11-30T10:00:00Z``, ``2026-11-30 10:00+01:00``; without an offset it is
  UTC), or a duration meaning that long before the database's ``now()``.

The parsers raise :class:`ValueError` with a message naming the input, which
argparse shows as ``argument --since: ...``.
"""

from __future__ import annotations

import datetime
import re

_PART = re.compile(r"(\d+)([smhd])")
_DURATION = re.compile(r"(?:\d+[smhd])+")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}

MAX_DURATION = datetime.timedelta(days=36500)
"""The longest duration accepted (100 years): longer than any retention or audit
window, so a longer one is a typo; and far from where ``now()`` minus it would
leave the dates Python and Postgres hold (year 1)."""

TimeSpec = datetime.datetime | datetime.timedelta
"""An absolute time, or a duration before the database's ``now()``."""


def parse_duration(text: str) -> datetime.timedelta:
    """``30d`` -> 30 days; a positive duration or :class:`ValueError`."""
    spec = text.strip().lower()
    parts = _PART.findall(spec)
    if not parts or "".join(n + u for n, u in parts) != spec:
        raise ValueError(
            f"invalid duration {text!r}: use a number and a unit s, m, h or d (30d, 12h, 1d12h)"
        )
    try:
        total = sum(
            (datetime.timedelta(**{_UNITS[unit]: int(number)}) for number, unit in parts),
            datetime.timedelta(),
        )
    except OverflowError:
        total = MAX_DURATION + datetime.timedelta(days=1)
    if not datetime.timedelta() < total <= MAX_DURATION:
        raise ValueError(
            f"invalid duration {text!r}: expected more than 0s and at most "
            f"{format_duration(MAX_DURATION)}"
        )
    return total


def format_duration(value: datetime.timedelta | None) -> str | None:
    """A duration as :func:`parse_duration` reads it: 30 days -> ``30d``, 90 min -> ``1h30m``."""
    if value is None:
        return None
    seconds = int(value.total_seconds())
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size:
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    return "".join(parts) or "0s"


def parse_time(text: str) -> TimeSpec:
    """An ISO 8601 date or date-time (UTC unless it says otherwise), or a duration ago."""
    spec = text.strip()
    if _DURATION.fullmatch(spec.lower()):
        return parse_duration(spec)  # its own error names the allowed range
    try:
        value = datetime.datetime.fromisoformat(spec)
    except ValueError:
        raise ValueError(
            f"invalid time {text!r}: use an ISO 8601 date or date-time "
            "(2026-11-30, 2026-11-30T10:00:00Z) or a duration ago (2h, 7d)"
        ) from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.UTC)
    try:
        value.astimezone(datetime.UTC)
    except OverflowError:
        # 9999-12-31T23:00-02:00 is past the last date a datetime holds in UTC.
        raise ValueError(f"invalid time {text!r}: outside the years 1 to 9999 in UTC") from None
    return value


def resolve(spec: TimeSpec | None, now: datetime.datetime) -> datetime.datetime | None:
    """The absolute time of ``spec``; durations count back from ``now`` (the database's)."""
    if spec is None or isinstance(spec, datetime.datetime):
        return spec
    return now - spec
