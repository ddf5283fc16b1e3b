"""The limits of dedup's inputs, and the checks that refuse a value past one at construction.

Every name and key dedup stores sits in a B-tree index: ``processed`` (namespace,
key), ``dead_letters`` (namespace, topic, ...), ``partitions`` (group, topic,
...), ``tasks`` (task, business key), ``leases`` (resource) and ``events``
(namespace, key; resource).  Postgres refuses an index entry past
:data:`BTREE_ENTRY_BYTES`, and whether a value fits depends on how well it
compresses.  So the limits count UTF-8 bytes, before any compression, and are
small enough that the longest allowed combination fits every index with room
to spare (tests/unit/test_limits.py adds them up per index).

A value Postgres text can't hold (a NUL, a lone surrogate) is refused the same
way, naming the setting and where the character is.
"""

from __future__ import annotations

import math
from typing import Any

from dedup import _errors as errors
from dedup import keys

BTREE_ENTRY_BYTES = 2704
"""Bytes of the largest B-tree index entry Postgres takes with 8 kB pages (a third of a
page, less headers); past it an insert fails with ``index row size exceeds maximum``."""
MAX_NAME_BYTES = 255
"""UTF-8 bytes of a name: a namespace, a consumer group, a task code, a holder."""
MAX_TOPIC_BYTES = 249
"""UTF-8 bytes of a topic name: Kafka's own limit, checked before anything connects."""
MAX_BUSINESS_KEY_BYTES = 1024
"""UTF-8 bytes of a task's business key.  The longest combination, the lease resource
``task:<task>:<business key>``, is then 1,285 bytes: under half of a B-tree entry."""
MAX_RESOURCE_BYTES = 1536
"""UTF-8 bytes of a lease resource given to :class:`dedup.Leases` (a task's takes 1,285)."""
MIN_LEASE_TTL = 0.1
"""Seconds, the shortest ttl of a :class:`dedup.Leases` lease: one round trip to Postgres
takes a good part of it already (and 1e-9 s rounds to a lease expired when granted)."""
MAX_LEASE_TTL = 7 * 86_400.0
"""Seconds, a week: the longest a vanished holder can keep a resource from everyone else.
The watchdog renews a held lease, so a long job never needs a long ttl."""

_SHOWN_CHARS = 60
"""Characters of a refused value an error shows: the start names it, the rest is noise."""


def check_text(setting: str, value: Any, limit: int) -> str:
    """``value`` if it is non-empty text Postgres can store in at most ``limit`` UTF-8 bytes.

    Otherwise a ConfigurationError that names ``setting``, its length in bytes
    and the limit, or the position of the NUL or lone surrogate.
    """
    if not isinstance(value, str):
        raise errors.ConfigurationError(
            f"{setting} must be a str, not {type(value).__name__} {keys.shorten(repr(value))}"
        )
    if not value:
        raise errors.ConfigurationError(f"{setting} must not be empty")
    shown = keys.shorten(repr(value), _SHOWN_CHARS)
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise errors.ConfigurationError(
            f"{setting}={shown} has a lone surrogate ({value[exc.start]!r}) at character "
            f"{exc.start}: it is not UTF-8 text, and Postgres text holds only UTF-8"
        ) from None
    if "\x00" in value:
        raise errors.ConfigurationError(
            f"{setting}={shown} has a NUL character at character {value.index(chr(0))}: "
            "Postgres text can't hold one"
        )
    if size > limit:
        raise errors.ConfigurationError(
            f"{setting}={shown} is {size:,} bytes of UTF-8; at most {limit:,} are allowed "
            "(dedup indexes it, and a Postgres index entry is limited)"
        )
    return value


def check_lease(
    resource: str, holder: str, ttl: float, namespace: str | None, key: str | None
) -> None:
    """Refuse the arguments of a lease (:meth:`dedup.Leases.acquire`) past their limits."""
    check_text("resource", resource, MAX_RESOURCE_BYTES)
    check_text("holder", holder, MAX_NAME_BYTES)
    check_number("ttl", ttl, MIN_LEASE_TTL, MAX_LEASE_TTL, whole=False)
    # The audit trail indexes (namespace, key): a task code and business key at most.
    if namespace is not None:
        check_text("namespace", namespace, MAX_NAME_BYTES)
    if key is not None:
        check_text("key", key, MAX_BUSINESS_KEY_BYTES)


def check_number(name: str, value: Any, low: float, high: float, *, whole: bool) -> None:
    """Refuse ``value`` unless it is a number (a whole one if ``whole``) from ``low`` to ``high``.

    NaN and infinities are refused too, naming the setting and the range.
    """
    kinds = (int,) if whole else (int, float)
    if (
        isinstance(value, bool)
        or not isinstance(value, kinds)
        or (isinstance(value, float) and not math.isfinite(value))
        or not low <= value <= high
    ):
        kind = "a whole number" if whole else "a number of seconds"
        raise errors.ConfigurationError(
            f"{name}={value!r}: expected {kind} from {low:g} to {high:g}"
        )
