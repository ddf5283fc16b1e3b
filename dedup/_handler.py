"""Calling the user's handler inside a batch's transaction, and telling its failures apart.

A handler's failure (an exception, its deadline passed, a cancellation of its
own, a transaction it tried to end, a statement or a result it forgot to
await) is its fault: the lane isolates the
message and dead-letters it.  A lost connection is an outage, retried.  The
difference is drawn here, where the handler is called.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable, Iterable

import asyncpg

from dedup import _errors as errors
from dedup import _guard as guard
from dedup import _message as message_
from dedup import _results as results
from dedup.data import _conninfo as conninfo
from dedup.data import _db as db

MessageHandler = Callable[[message_.Message, message_.Tx], Awaitable[object]]
BatchHandler = Callable[[list[message_.Message], message_.Tx], Awaitable[object]]


async def run(
    handler: MessageHandler | BatchHandler,
    *,
    batch_handler: bool,
    msgs: list[message_.Message],
    conn: asyncpg.Connection,
    token: int,
    deadline_s: float | None,
    namespace: str = "",
    schema: str = "dedup",
) -> None:
    """Run ``handler`` on ``msgs`` (once for a batch handler, else once per message, in order);
    ``tx.token`` is ``token``, the token every one of ``msgs`` runs under.

    A per-message handler's exception carries the failing message's offset
    (see :func:`failed_offset`), so the lane can split the batch around it.
    """
    guarded = guard.GuardedConnection(conn)
    if batch_handler:
        tx = message_.Tx(conn=guarded, token=token, namespace=namespace, schema=schema)
        await call(handler(msgs, tx), guarded, deadline_s)  # type: ignore[arg-type]
        return
    for msg in msgs:
        # Its own Tx: tx.publish names the message the record comes from.
        tx = message_.Tx(conn=guarded, token=token, namespace=namespace, schema=schema, source=msg)
        try:
            await call(handler(msg, tx), guarded, deadline_s)  # type: ignore[arg-type]
        except Exception as exc:
            failed_on(exc, msg)
            raise


def failed_on(exc: Exception, msg: message_.Message) -> None:
    """Note on ``exc`` that a per-message handler raised it for ``msg`` (read back by
    :func:`failed_offset` and :func:`failed_partition`), so the lane splits around it."""
    with contextlib.suppress(AttributeError):
        exc._dedup_offset = msg.offset  # type: ignore[attr-defined]
        exc._dedup_partition = (msg.topic, msg.partition)  # type: ignore[attr-defined]


async def call(
    call: Awaitable[object], conn: guard.GuardedConnection, deadline_s: float | None
) -> None:
    """Await one handler call within ``deadline_s`` seconds; leave the transaction open or raise.

    Past the deadline the handler is cancelled and HandlerError raised.  A
    ``CancelledError`` the handler raises on its own (a cancelled HTTP call,
    say) is a handler failure too; only a cancellation of dedup's own task
    (shutdown, revoke) goes through as one.  So is a result that can still be
    awaited (``return tx.conn.execute(...)``, a missing ``await``) and a
    statement on ``tx.conn`` never awaited: neither ran, and committing would
    claim the key without its write.

    ``SystemExit`` and ``KeyboardInterrupt`` go through: the transaction rolls
    back and the process ends, as the handler asked.  The consumer counts such
    exits across restarts and dead-letters the message after ``max_attempts``
    of them (see :mod:`dedup.consumer._lanes`).
    """
    try:
        async with asyncio.timeout(deadline_s) as deadline:
            result = await call
    except TimeoutError as exc:
        if not deadline.expired():
            raise  # the handler's own TimeoutError: an error like any other
        raise errors.HandlerError(
            f"the handler did not finish within handler_timeout={deadline_s:g}s; it was cancelled"
        ) from exc
    except asyncpg.InterfaceError as exc:
        if conn.is_closed():
            raise  # the connection was lost: retried like any outage
        # The handler misused the connection (a nested transaction of another
        # isolation level, say): its fault, not an outage to retry forever.
        raise errors.HandlerError(f"the handler misused its connection: {exc}") from exc
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        raise errors.HandlerError(
            "the handler raised CancelledError though dedup did not cancel it "
            "(a timeout or a cancelled call inside the handler?)"
        ) from exc
    if inspect.isawaitable(result):
        _discard(result)
        raise errors.HandlerError(
            f"the handler returned {type(result).__name__} {result!r:.80} instead of awaiting "
            "it: a missing `await` (nothing it would have done ran)"
        )
    conn.check_done()


def _discard(awaitable: Awaitable[object]) -> None:
    """Close or cancel an awaitable nobody will await, so it neither runs nor warns."""
    if inspect.iscoroutine(awaitable):
        awaitable.close()
    elif isinstance(awaitable, asyncio.Future):
        awaitable.cancel()


class HandlerExit(BaseException):
    """A handler raised ``SystemExit`` or ``KeyboardInterrupt``: the lane's task ends with
    this (asyncio would stop the event loop at once on the original), and the consumer
    stops as on SIGTERM, then raises ``exit`` from :meth:`IdempotentConsumer.run`.
    """

    def __init__(self, exit: SystemExit | KeyboardInterrupt) -> None:
        super().__init__(exit)
        self.exit = exit


def lost_connection(conn: asyncpg.Connection, exc: BaseException) -> bool:
    """True when the handler's ``exc`` came from dedup's connection being lost: an outage
    to run again on a fresh connection, not the handler's failure."""
    return db.is_broken(conn, exc) and db.is_retriable(exc)


def failed_letter(
    msg: message_.Message, error: BaseException, attempts: int, secrets: Iterable[str] = ()
) -> results.DeadLetter:
    """The dead letter of ``msg``, whose handler failed ``attempts`` times, the last with
    ``error`` (described as :func:`describe` does, ``secrets`` masked)."""
    return results.DeadLetter(
        msg,
        f"handler failed {attempts} times",
        error=describe(error, secrets),
        attempts=attempts,
    )


def failed_offset(exc: BaseException) -> int | None:
    """The offset of the message whose (per-message) handler raised ``exc``, if known."""
    offset = getattr(exc, "_dedup_offset", None)
    return offset if isinstance(offset, int) else None


def failed_partition(exc: BaseException) -> tuple[str, int] | None:
    """The (topic, partition) of the message whose handler raised ``exc``, if known."""
    where = getattr(exc, "_dedup_partition", None)
    return where if isinstance(where, tuple) else None


MAX_ERROR_LENGTH = 500
"""Most characters of :func:`describe`'s text (a dead letter's ``error``): a type and a
message of a few sentences fit whole; a message that quotes a whole payload or a
response body is cut, its end shown as :data:`CUT`."""
CUT = "..."
"""What ends a description cut at :data:`MAX_ERROR_LENGTH`."""


def describe(value: BaseException, secrets: Iterable[str] = ()) -> str:
    """An exception as ``TypeName: message``, for dead letters, logs and span events.

    Credentials the message quotes are masked (:func:`dedup.data._conninfo.mask_credentials`:
    URL passwords, ``password=`` pairs, bearer tokens, and each of ``secrets``, the
    passwords the caller was configured with) before the text is cut to
    :data:`MAX_ERROR_LENGTH` characters, so a cut never leaves part of one.
    """
    try:
        message = str(value)
    except Exception:  # a broken __str__ must not lose the dead letter
        message = "(the exception's message could not be read)"
    text = f"{type(value).__name__}: {message}" if message else type(value).__name__
    text = conninfo.mask_credentials(text, secrets)
    if len(text) <= MAX_ERROR_LENGTH:
        return text
    return text[: MAX_ERROR_LENGTH - len(CUT)] + CUT
