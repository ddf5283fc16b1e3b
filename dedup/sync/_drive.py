"""Run one of dedup's coroutines to its end in the calling thread, without an event loop.

dedup's statements are coroutines (:mod:`dedup.data._sql`).  On a blocking
driver (:class:`dedup.data._psycopg.SyncAdapter`) their awaits never suspend:
each statement blocks until Postgres answers, then the coroutine goes on.  So
a coroutine of dedup's that only talks to such a connection runs to its end
on the first ``send(None)``, and its result rides on the ``StopIteration``.
That is how ``dedup.sync`` calls the same code as ``dedup`` (one copy of the
logic, the driver alone differs), in a Django view, a Celery task or a
Flask request, with or without an event loop in the thread, and without
touching one.

A coroutine that does suspend wants something only an event loop gives (a
socket of an async driver, a timer): it is closed (its ``finally`` blocks run)
and :func:`run` raises ``RuntimeError``.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], what: str) -> T:
    """The result of ``coro``, run to its end now; what it raises propagates.

    ``what`` names the call in the error raised when ``coro`` suspends (it
    awaited something that needs an event loop): ``RuntimeError``, after
    ``coro`` is closed and what it waited on cancelled.
    """
    try:
        waited = coro.send(None)
    except StopIteration as done:
        result: T = done.value
        return result
    cancel = getattr(waited, "cancel", None)
    if callable(cancel):  # an asyncio future: nobody will wait for it now
        cancel()
    problem = RuntimeError(
        f"{what} waited on an event loop (it awaited {waited!r}), which it runs without: "
        "give it a blocking connection (psycopg.Connection), or await the async call"
    )
    try:
        coro.close()
    except RuntimeError as exc:  # it awaited again while closing
        raise problem from exc
    raise problem
