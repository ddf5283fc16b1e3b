"""The connection a handler gets: dedup's transaction stays dedup's.

The idempotency keys are claimed in the transaction the handler writes in, so
a handler that ran ``COMMIT`` would commit the claims of messages whose
handlers have not run yet, and one that ran ``ROLLBACK`` would drop the claims
and let its later writes commit on their own.  ``tx.conn`` therefore refuses
statements that end the transaction (``COMMIT``, ``END``, ``ROLLBACK``,
``ABORT``, ``PREPARE TRANSACTION``) and closing the connection, with an error
that names what was tried; the batch rolls back like after any handler error.
Savepoints are fine: ``tx.conn.transaction()`` is one (:class:`Savepoint`,
as asyncpg's nested transactions are), and so is ``ROLLBACK TO``.  After the
handler, :meth:`GuardedConnection.check_done` makes sure the transaction is
still open, whatever way it was ended, and that every statement the handler
started on ``tx.conn`` was awaited: a forgotten ``await`` would otherwise
commit the claim without the write it guards.
"""

from __future__ import annotations

import functools
import inspect
import re
import types
from collections.abc import Callable, Coroutine
from typing import Any

import asyncpg

from dedup import _errors as errors
from dedup.data import _sql as sql

_ENDS_TRANSACTION = re.compile(
    r"(commit|end|abort|prepare\s+transaction|rollback(?!\s+to\b))\b", re.IGNORECASE
)
_DOLLAR_TAG = re.compile(r"\$(?:[A-Za-z_][A-Za-z_0-9]*)?\$")


def _checked(name: str) -> Callable[..., Coroutine[Any, Any, Any]]:
    """A method that checks its statement, then runs the connection's method ``name``.

    Each call's coroutine is kept until :meth:`GuardedConnection.check_done`, which
    looks for one the handler never awaited.
    """

    async def run(self: GuardedConnection, query: str, *args: Any, **kwargs: Any) -> Any:
        return await getattr(self._conn, name)(query, *args, **kwargs)

    def method(
        self: GuardedConnection, query: str, *args: Any, **kwargs: Any
    ) -> Coroutine[Any, Any, Any]:
        check_statement(query)
        call = run(self, query, *args, **kwargs)
        self._calls.append((name, call))
        return call

    method.__name__ = method.__qualname__ = name
    return method


class GuardedConnection:
    """``tx.conn``: the asyncpg connection of dedup's transaction, minus ways to end it.

    Every other attribute is the connection's own.
    """

    __slots__ = ("_calls", "_conn")

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn
        self._calls: list[tuple[str, Coroutine[Any, Any, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def __repr__(self) -> str:
        return f"<dedup transaction on {self._conn!r}>"

    # Each runs the connection's own method once the statement passed the check.
    execute = _checked("execute")
    executemany = _checked("executemany")
    fetch = _checked("fetch")
    fetchrow = _checked("fetchrow")
    fetchval = _checked("fetchval")
    fetchmany = _checked("fetchmany")
    prepare = _checked("prepare")

    def cursor(self, query: str, *args: Any, **kwargs: Any) -> Any:
        check_statement(query)
        return self._conn.cursor(query, *args, **kwargs)

    def transaction(
        self, *, isolation: str | None = None, readonly: bool = False, deferrable: bool = False
    ) -> Savepoint:
        """A savepoint inside dedup's transaction, as asyncpg's nested ``transaction()`` is.

        A savepoint can't change the transaction's isolation level or access mode.
        """
        if isolation is not None or readonly or deferrable:
            raise errors.HandlerError(
                "the handler asked tx.conn.transaction() for an isolation level or access mode: "
                "it runs inside dedup's transaction, where a nested transaction is a savepoint"
            )
        return Savepoint(self._conn)

    async def close(self, **kwargs: Any) -> None:
        raise errors.HandlerError(
            "the handler tried to close dedup's connection; it belongs to the batch's transaction"
        )

    def terminate(self) -> None:
        raise errors.HandlerError(
            "the handler tried to terminate dedup's connection; "
            "it belongs to the batch's transaction"
        )

    async def reset(self, **kwargs: Any) -> None:
        raise errors.HandlerError("the handler tried to reset dedup's connection")

    def check_done(self) -> None:
        """Raise HandlerError if the handler left a statement un-awaited or the transaction ended.

        An un-awaited statement never ran, so committing would claim the key
        without the write: the batch must roll back instead.
        """
        calls, self._calls = self._calls, []
        forgotten = [name for name, call in calls if _never_started(call)]
        for _, call in calls:
            if _never_started(call):
                call.close()  # no "never awaited" warning: the error below says it
        if forgotten:
            raise errors.HandlerError(
                f"the handler called tx.conn.{forgotten[0]}() without awaiting it "
                f"({len(forgotten)} statement(s) never ran): a missing `await`"
            )
        check_open(self._conn)


_QUERIES = sql.Queries()  # the schema-less ones (connections.sql)


class Savepoint:
    """``tx.conn.transaction()``: a savepoint, released when the block ends, rolled back to
    when it raises (``start``/``commit``/``rollback`` for use without ``async with``)."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn

    async def start(self) -> None:
        await _QUERIES.savepoint.execute(self._conn)

    async def commit(self) -> None:
        await _QUERIES.release_savepoint.execute(self._conn)

    async def rollback(self) -> None:
        await _QUERIES.rollback_to_savepoint.execute(self._conn)

    async def __aenter__(self) -> Savepoint:
        await self.start()
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        if kind is None:
            await self.commit()
        else:
            await self.rollback()


def _never_started(call: Coroutine[Any, Any, Any]) -> bool:
    return inspect.getcoroutinestate(call) == inspect.CORO_CREATED


def check_statement(sql: str, savepoint: str = "async with tx.conn.transaction()") -> None:
    """Raise HandlerError if any statement of ``sql`` would end the transaction; the error
    names ``savepoint``, the way to undo part of the handler's work instead."""
    word = _ending_word(sql)
    if word is not None:
        raise errors.HandlerError(
            f"the handler ran {word}: dedup owns the batch's transaction (the idempotency "
            "keys are claimed in it) and commits it after the handler returns; use a "
            f"savepoint ({savepoint}) to undo part of your work"
        )


@functools.lru_cache(maxsize=1024)
def _ending_word(sql: str) -> str | None:
    """The first word of ``sql`` that ends the transaction (``COMMIT``...), or None.

    Kept per text: a handler sends the same few statements again and again.
    """
    for start in _statement_starts(sql):
        found = _ENDS_TRANSACTION.match(sql, _skip_space_and_comments(sql, start))
        if found:
            return " ".join(found.group(1).upper().split())
    return None


def check_open(conn: asyncpg.Connection) -> None:
    """Raise HandlerError if the handler left dedup's transaction ended."""
    if not conn.is_in_transaction():
        raise errors.HandlerError(
            "the handler ended dedup's transaction (COMMIT, ROLLBACK or END); "
            "dedup commits it after the handler returns"
        )


def _statement_starts(sql: str) -> list[int]:
    """Where each statement of ``sql`` starts: 0, and after every ``;`` outside quotes."""
    if ";" not in sql:
        return [0]
    starts = [0]
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c == ";":
            starts.append(i + 1)
            i += 1
        elif c == "'":
            escapes = i > 0 and sql[i - 1] in "eE"
            i = _skip_quoted(sql, i + 1, "'", escapes)
        elif c == '"':
            i = _skip_quoted(sql, i + 1, '"', False)
        elif sql.startswith("--", i):
            end = sql.find("\n", i)
            i = n if end < 0 else end + 1
        elif sql.startswith("/*", i):
            i = _skip_block_comment(sql, i)
        elif c == "$" and not _in_word(sql, i) and (tag := _DOLLAR_TAG.match(sql, i)):
            end = sql.find(tag.group(0), tag.end())
            i = n if end < 0 else end + len(tag.group(0))
        else:
            i += 1
    return starts


def _skip_space_and_comments(sql: str, i: int) -> int:
    n = len(sql)
    while i < n:
        if sql[i].isspace():
            i += 1
        elif sql.startswith("--", i):
            end = sql.find("\n", i)
            i = n if end < 0 else end + 1
        elif sql.startswith("/*", i):
            i = _skip_block_comment(sql, i)
        else:
            break
    return i


def _in_word(sql: str, i: int) -> bool:
    """True when ``sql[i]`` continues an identifier (``a$b$`` is no dollar quote)."""
    return i > 0 and (sql[i - 1].isalnum() or sql[i - 1] in "_$")


def _skip_quoted(sql: str, i: int, quote: str, escapes: bool) -> int:
    n = len(sql)
    while i < n:
        c = sql[i]
        if escapes and c == "\\":
            i += 2
        elif c == quote:
            if sql.startswith(quote * 2, i):
                i += 2
            else:
                return i + 1
        else:
            i += 1
    return n


def _skip_block_comment(sql: str, i: int) -> int:
    depth, i, n = 0, i, len(sql)
    while i < n:
        if sql.startswith("/*", i):
            depth += 1
            i += 2
        elif sql.startswith("*/", i):
            depth -= 1
            i += 2
            if depth == 0:
                return i
        else:
            i += 1
    return n
