"""The consumer's retry policy: what each failure of a transaction means, in one table.

A lane (:mod:`dedup.consumer._lanes`) runs one transaction per turn (:mod:`dedup.consumer._turn`).
When it fails, :func:`decide` reads :data:`RULES` from the top and takes the
first rule that matches the error and where it was raised (in the handler, or
in a statement dedup sent):

=====================================  =========  ==========================================
error                                  where      action
=====================================  =========  ==========================================
the fence refused a partition (or     dedup      ``DROP`` it from the turn (another owner has
the handler raised StaleTokenError)               it); the rest runs again at once
deadlock (40P01)                       anywhere   ``AGAIN`` after a backoff; counted in
                                                  ``stats["deadlocks"]`` and ``dedup.deadlocks``
serialization failure (40001)          anywhere   ``AGAIN`` after a backoff
the server cut the session for idling  handler    ``SPLIT``: the handler kept the transaction
in the transaction                                idle past ``handler_timeout``
the server cut the session for idling  dedup      ``AGAIN`` on a fresh connection: the handler
while the handler was within its                  had returned; the network (or a pause) held
deadline                                          a statement (:mod:`dedup.consumer._turn`)
anything else                          handler    ``SPLIT``: a handler failure
the server or the connection went      dedup      ``AGAIN`` on a fresh connection, after a
away (08xxx, 57P01-57P03, 53300,                  backoff, for as long as it takes (an error
OSError, a closed connection)                     the handler raised on a lost connection
                                                  counts as dedup's)
a lock wait past the role's            dedup      ``AGAIN`` after a backoff
``lock_timeout`` (55P03)
anything else                          dedup      ``STOP``: ``run()`` raises it
=====================================  =========  ==========================================

``SPLIT`` is the handler's failure: the turn runs again partition by
partition, then in halves (or around the failing message, when the
per-message handler says which) until the message stands alone; it gets
``max_attempts`` attempts, then is dead-lettered and its partition moves on.
No other action counts against ``max_attempts``.  A lock wait inside the
handler (its own ``NOWAIT`` or ``lock_timeout``) is a handler failure like any
other: dedup sets no ``lock_timeout`` and reads none as contention.

``AGAIN`` waits :func:`backoff` (doubling from :data:`FIRST_BACKOFF` to
:data:`MAX_BACKOFF`, with jitter so two lanes that deadlocked don't meet again
in step).  Nothing turns serial: hot rows have ``tx.lock`` and
``concurrency=1`` (docs/concepts/guarantees.md).
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dedup import _errors as errors
from dedup.data import _db as db

FIRST_BACKOFF = 0.05
"""Seconds before the first run again of a transaction that failed for a transient reason."""
MAX_BACKOFF = 5.0
"""Most seconds between two runs of a transaction that keeps failing for a transient reason."""
HANDLER_BACKOFF = 0.1
"""Seconds before a failing message's second attempt (doubling, up to MAX_BACKOFF)."""


class Action(enum.Enum):
    """What a lane does about a failed transaction."""

    DROP = "drop"
    """Drop the refused partitions from the turn; run the rest again at once."""
    AGAIN = "again"
    """Run the same turn again after :func:`backoff`; not one of the handler's attempts."""
    SPLIT = "split"
    """The handler failed: split the turn to find the message, which gets ``max_attempts``."""
    STOP = "stop"
    """Stop the consumer: ``run()`` raises the error."""


class Refused(Exception):
    """The fence refused some partitions of a turn (the transaction rolled back)."""

    def __init__(self, parts: list[Any]) -> None:
        super().__init__(f"the fence refused {len(parts)} partition(s)")
        self.parts = parts


class HandlerFailed(Exception):
    """The handler raised ``error`` (or broke the transaction's rules) in a turn's transaction."""

    def __init__(self, error: BaseException, partition: Any) -> None:
        super().__init__(str(error))
        self.error = error
        self.partition = partition
        """The part whose handler call failed."""


def _always(_: BaseException) -> bool:
    return True


def _refused(exc: BaseException) -> bool:
    return isinstance(exc, Refused | errors.StaleTokenError)


# By SQLSTATE, so the table holds on asyncpg and psycopg alike (dedup.sync.Consumer).


def _deadlock(exc: BaseException) -> bool:
    return db.sqlstate(exc) == "40P01"


def _serialization(exc: BaseException) -> bool:
    return db.sqlstate(exc) == "40001"


def _session_cut(exc: BaseException) -> bool:
    return db.sqlstate(exc) == "25P03"  # idle_in_transaction_session_timeout


def _lock_wait(exc: BaseException) -> bool:
    return db.sqlstate(exc) == "55P03"


def _gone(exc: BaseException) -> bool:
    """The server or the connection went away (transient; a fresh connection is needed).

    Only for dedup's statements: an error the handler raised while dedup's
    connection was lost reaches the policy as dedup's (:mod:`dedup.consumer._turn`), so a
    handler's own ``OSError`` or ``TimeoutError`` stays the handler's failure.
    """
    return db.is_retriable(exc) and not _lock_wait(exc)


@dataclass(frozen=True)
class Rule:
    """One row of the policy."""

    what: str
    matches: Callable[[BaseException], bool]
    in_handler: bool | None
    """True: only an error the handler raised; False: only one of dedup's statements; None: any."""
    action: Action
    fresh_connection: bool = False
    """Run again on a fresh connection (the lane's was lost)."""
    counted: str | None = "retries"
    """The ``stats`` counter a run again adds to (None: none; a handler's retries count
    as ``retries`` when its message runs again)."""


RULES: tuple[Rule, ...] = (
    Rule("the fence refused a partition", _refused, False, Action.DROP, counted=None),
    Rule("deadlock", _deadlock, None, Action.AGAIN, counted="deadlocks"),
    Rule("serialization failure", _serialization, None, Action.AGAIN),
    Rule("the session was cut while idle", _session_cut, True, Action.SPLIT, counted=None),
    Rule("handler failure", _always, True, Action.SPLIT, counted=None),
    Rule(
        "the session was cut while a statement was held",
        _session_cut,
        False,
        Action.AGAIN,
        fresh_connection=True,
    ),
    Rule("the server or connection went away", _gone, False, Action.AGAIN, fresh_connection=True),
    Rule("lock wait past lock_timeout", _lock_wait, False, Action.AGAIN),
    Rule("unexpected error", _always, False, Action.STOP, counted=None),
)


def decide(exc: BaseException, *, in_handler: bool) -> Rule:
    """The first rule of :data:`RULES` for ``exc``, raised in the handler or not."""
    for rule in RULES:
        if rule.in_handler is not None and rule.in_handler != in_handler:
            continue
        if rule.matches(exc):
            return rule
    raise AssertionError("the last rule matches everything")  # pragma: no cover


def backoff(tries: int, first: float = FIRST_BACKOFF) -> float:
    """Seconds to wait before run ``tries + 1`` (``tries`` >= 1) of a failed transaction."""
    delay = min(first * 2.0 ** (tries - 1), MAX_BACKOFF)
    return delay * random.uniform(0.5, 1.0)  # noqa: S311 - jitter, not secrets


def halves(offsets: list[int], culprit: int | None) -> list[tuple[int, int]]:
    """How to split a partition's failed batch: ``(start, stop)`` index ranges.

    Around the failing message when it is known (before it, it, after it),
    else in halves.
    """
    at = offsets.index(culprit) if culprit in offsets else None
    if at is None:
        half = len(offsets) // 2
        return [(0, half), (half, len(offsets))]
    bounds = [(0, at), (at, at + 1), (at + 1, len(offsets))]
    return [(a, b) for a, b in bounds if b > a]
