"""What one batch is and did: the fence it runs under, its dead letters, its result.

Values only, shared by the statements (:mod:`dedup._store`), the consumer's
transactions (:mod:`dedup.consumer._turn`) and ``wrap``/``claim`` (:mod:`dedup._wrap`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from dedup import _message as message_


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message that will not be applied, and why."""

    msg: message_.Message
    """The whole record."""
    reason: str
    """Why, in words an operator can act on."""
    error: str | None = None
    """The exception, if one was raised."""
    attempts: int = 1
    """How many times it was tried."""


@dataclass(frozen=True, slots=True)
class Fence:
    """The partition lease a consumer batch runs under."""

    group_id: str
    """The consumer group."""
    token: int
    """This holder's fencing token for the partition."""
    expected: int | None
    """The partition's ``next_offset`` as this holder last left it (None: never set)."""


class Position(NamedTuple):
    """A partition's row in ``partitions``: who holds it, and where its offset stands."""

    holder: str
    """The consumer (or ``dedup offsets`` command) that took it last."""
    token: int
    """The current fencing token."""
    next_offset: int | None
    """The next offset to consume (None: never set)."""


@dataclass(slots=True)
class BatchResult:
    """What one committed batch (one partition's part of a transaction) did."""

    applied: list[message_.Message] = field(default_factory=list)
    duplicates: list[message_.Message] = field(default_factory=list)
    conflicts: list[message_.Message] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    next_offset: int | None = None
    """Where the partition's offset stands once this batch commits."""
