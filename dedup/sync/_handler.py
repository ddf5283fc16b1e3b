"""A blocking handler called inside dedup's transaction: ``tx.conn``, ``tx``, the deadline.

:class:`dedup.sync.Consumer` runs the consumer's turn (:mod:`dedup.consumer._turn`)
on a blocking psycopg connection; :func:`run` takes the place of
:func:`dedup._handler.run` there, with the same arguments, and calls a plain
``def handler(msg, tx)`` (or a batch handler) where that one awaits:

- ``tx.conn`` is the psycopg connection of dedup's transaction, guarded as
  :mod:`dedup._guard` guards asyncpg's: no ``commit()``, ``rollback()`` or
  ``close()``, no statement that ends the transaction, autocommit untouched;
  ``tx.conn.transaction()`` is a savepoint (psycopg makes one inside an open
  transaction);
- ``tx.lock``, ``tx.publish`` and ``tx.post`` are :class:`dedup.Tx`'s, run to
  their end on the same connection (:func:`dedup.sync._drive.run`);
- ``handler_timeout``: blocking code can't be interrupted, so a call that ran
  past it fails once it returns (the transaction rolls back, the message gets
  its next attempt); one that keeps the transaction idle past the server's
  ``idle_in_transaction_session_timeout`` (``handler_timeout`` + 2 s, set by
  the turn's first statement) has its session ended by the server.

Only imported with psycopg at hand; psycopg itself is only imported when a
handler runs (``import dedup`` needs neither).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

from dedup import _errors as errors
from dedup import _guard as guard
from dedup import _handler as handler_
from dedup import _message as message_
from dedup import _outbox as outbox
from dedup.sync import _drive as drive

if TYPE_CHECKING:
    import psycopg

SAVEPOINT = "with tx.conn.transaction()"
"""How a blocking handler undoes part of its work: named by the errors of ``tx.conn``."""


class Tx:
    """The open transaction a blocking handler writes in (:class:`dedup.sync.Consumer`).

    :class:`dedup.Tx` with a psycopg connection and blocking methods.
    """

    __slots__ = ("_twin", "conn")

    def __init__(self, conn: GuardedConnection, twin: message_.Tx) -> None:
        self.conn = cast("psycopg.Connection[Any]", conn)
        """The psycopg connection, inside the transaction; business writes go here."""
        self._twin = twin  # the same transaction, as dedup.Tx, on dedup's adapter

    @property
    def token(self) -> int:
        """The fencing token the transaction runs under."""
        return self._twin.token

    @property
    def namespace(self) -> str:
        """The namespace the keys are claimed in; :meth:`lock` locks keys of it."""
        return self._twin.namespace

    @property
    def schema(self) -> str:
        """dedup's schema: where :meth:`publish` writes."""
        return self._twin.schema

    @property
    def source(self) -> message_.Message | None:
        """The message a per-message handler was called with (None for a batch handler)."""
        return self._twin.source

    def lock(self, *keys: str) -> None:
        """:meth:`dedup.Tx.lock`: lock ``keys`` of the namespace until the transaction ends."""
        drive.run(self._twin.lock(*keys), "tx.lock")

    def publish(
        self,
        topic: str,
        value: Any,
        *,
        key: bytes | str | None = None,
        headers: outbox.Headers | None = None,
        source: message_.Message | None = None,
    ) -> str:
        """:meth:`dedup.Tx.publish`: a record to ``topic``, written in this transaction and
        sent by ``dedup relay``; returns its row key ``NAMESPACE:KEY:N``."""
        call = self._twin.publish(topic, value, key=key, headers=headers, source=source)
        return drive.run(call, "tx.publish")

    def post(
        self, destination: str, payload: Any, *, source: message_.Message | None = None
    ) -> str:
        """:meth:`dedup.Tx.post`: an HTTP message to ``destination``, written in this
        transaction and POSTed by a :class:`dedup.Dispatcher`; returns its row key."""
        return drive.run(self._twin.post(destination, payload, source=source), "tx.post")

    def __repr__(self) -> str:
        return f"<dedup.sync.Tx token={self.token} namespace={self.namespace!r}>"


async def run(
    handler: Callable[..., object],
    *,
    batch_handler: bool,
    msgs: list[message_.Message],
    conn: Any,
    token: int,
    deadline_s: float | None,
    namespace: str = "",
    schema: str = "dedup",
) -> None:
    """:func:`dedup._handler.run` for a blocking handler, on ``conn``, a
    :class:`dedup.data._psycopg.SyncAdapter` inside dedup's transaction.

    A coroutine that never suspends: the handler is called, not awaited.
    """
    guarded = GuardedConnection(conn.raw)
    if batch_handler:
        twin = message_.Tx(conn=conn, token=token, namespace=namespace, schema=schema)
        call(handler, (msgs, Tx(guarded, twin)), guarded, deadline_s)
        return
    for msg in msgs:
        # Its own Tx: tx.publish names the message the record comes from.
        twin = message_.Tx(conn=conn, token=token, namespace=namespace, schema=schema, source=msg)
        try:
            call(handler, (msg, Tx(guarded, twin)), guarded, deadline_s)
        except Exception as exc:
            handler_.failed_on(exc, msg)
            raise


def call(
    handler: Callable[..., object],
    args: tuple[Any, ...],
    conn: GuardedConnection,
    deadline_s: float | None,
) -> None:
    """One call of a blocking handler; raise HandlerError when it broke the transaction's
    rules or ran past ``deadline_s`` seconds (found once it returned)."""
    started = time.monotonic()
    result = handler(*args)
    took = time.monotonic() - started
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()  # it never ran: no "never awaited" warning
        raise errors.HandlerError(
            f"the handler returned {type(result).__name__} {result!r:.80}: dedup.sync.Consumer "
            "calls a blocking handler (def, not async def); an async handler runs on "
            "dedup.IdempotentConsumer"
        )
    if deadline_s is not None and took > deadline_s:
        raise errors.HandlerError(
            f"the handler ran {took:.1f}s, past handler_timeout={deadline_s:g}s: a blocking "
            "handler can't be interrupted, so the call failed once it returned"
        )
    conn.check_done()


def _text(query: Any, conn: psycopg.Connection[Any]) -> str:
    """A statement as text, whatever psycopg takes: str, bytes, a ``psycopg.sql`` object."""
    if isinstance(query, str):
        return query
    if isinstance(query, bytes | bytearray | memoryview):
        return bytes(query).decode(errors="replace")
    as_string = getattr(query, "as_string", None)
    return str(as_string(conn)) if callable(as_string) else str(query)


class GuardedConnection:
    """``tx.conn`` of a blocking handler: the psycopg connection of dedup's transaction,
    minus ways to end it. Every other attribute is the connection's own."""

    __slots__ = ("_conn",)

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def __repr__(self) -> str:
        return f"<dedup transaction on {self._conn!r}>"

    def _check(self, query: Any) -> None:
        guard.check_statement(_text(query, self._conn), SAVEPOINT)

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> GuardedCursor:
        self._check(query)
        return GuardedCursor(self, self._conn.execute(query, params, **kwargs))

    def cursor(self, *args: Any, **kwargs: Any) -> GuardedCursor:
        return GuardedCursor(self, self._conn.cursor(*args, **kwargs))

    def transaction(self, *args: Any, **kwargs: Any) -> Any:
        """A savepoint inside dedup's transaction (psycopg's ``transaction()`` in one)."""
        return self._conn.transaction(*args, **kwargs)

    def commit(self) -> None:
        raise self._ends("commit()")

    def rollback(self) -> None:
        raise self._ends("rollback()")

    def close(self) -> None:
        raise errors.HandlerError(
            "the handler tried to close dedup's connection; it belongs to the batch's transaction"
        )

    @property
    def autocommit(self) -> bool:
        return bool(self._conn.autocommit)

    @autocommit.setter
    def autocommit(self, value: bool) -> None:
        raise self._changes("autocommit")

    def set_autocommit(self, value: bool) -> None:
        raise self._changes("autocommit")

    def set_isolation_level(self, value: Any) -> None:
        raise self._changes("isolation_level")

    def set_read_only(self, value: Any) -> None:
        raise self._changes("read_only")

    def set_deferrable(self, value: Any) -> None:
        raise self._changes("deferrable")

    def _ends(self, what: str) -> errors.HandlerError:
        return errors.HandlerError(
            f"the handler called tx.conn.{what}: dedup owns the batch's transaction (the "
            "idempotency keys are claimed in it) and commits it after the handler returns; "
            f"use a savepoint ({SAVEPOINT}) to undo part of your work"
        )

    def _changes(self, what: str) -> errors.HandlerError:
        return errors.HandlerError(
            f"the handler tried to set tx.conn's {what}: the connection belongs to dedup's "
            "open transaction"
        )

    def check_done(self) -> None:
        """Raise HandlerError if the handler left dedup's transaction ended, or a statement
        running (an aborted transaction fails at the COMMIT: the handler's failure too)."""
        from psycopg import pq

        status = self._conn.info.transaction_status
        if status == pq.TransactionStatus.IDLE:
            raise errors.HandlerError(
                "the handler ended dedup's transaction (COMMIT, ROLLBACK or END); "
                "dedup commits it after the handler returns"
            )
        if status == pq.TransactionStatus.ACTIVE:
            raise errors.HandlerError(
                "the handler left a statement running on tx.conn (an open pipeline or COPY?)"
            )


class GuardedCursor:
    """A cursor of ``tx.conn``: its statements checked as ``tx.conn.execute``'s are."""

    __slots__ = ("_conn", "_cursor")

    def __init__(self, conn: GuardedConnection, cursor: Any) -> None:
        self._conn = conn
        self._cursor = cursor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cursor, name)

    def __repr__(self) -> str:
        return repr(self._cursor)

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> GuardedCursor:
        self._conn._check(query)
        self._cursor.execute(query, params, **kwargs)
        return self

    def executemany(self, query: Any, params_seq: Sequence[Any], **kwargs: Any) -> None:
        self._conn._check(query)
        self._cursor.executemany(query, params_seq, **kwargs)

    def copy(self, statement: Any, *args: Any, **kwargs: Any) -> Any:
        self._conn._check(statement)
        return self._cursor.copy(statement, *args, **kwargs)

    @property
    def connection(self) -> GuardedConnection:
        return self._conn

    def __iter__(self) -> Iterator[Any]:
        return iter(self._cursor)

    def __enter__(self) -> GuardedCursor:
        return self

    def __exit__(self, *exc: object) -> None:
        self._cursor.close()
