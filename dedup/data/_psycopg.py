"""dedup's statements on psycopg 3: asyncpg's face over a psycopg connection.

Every named query (:class:`dedup.data._sql.Query`) runs as it runs on asyncpg,
through ``conn.fetch``, ``fetchrow``, ``fetchval``, ``execute`` and
``executemany`` with positional ``$1, $2, ...`` parameters.  An adapter here
offers those five over a ``psycopg.AsyncConnection`` (:class:`AsyncAdapter`)
or a blocking ``psycopg.Connection`` (:class:`SyncAdapter`), so the same
statements, and the same code around them, run on either driver:

- the SQL goes as it is: psycopg's raw cursors (``psycopg.AsyncRawCursor``,
  psycopg 3.2 and later) take PostgreSQL's own ``$n`` placeholders, so nothing
  is rewritten and a ``%`` in a statement is only a ``%``;
- each row is a :class:`Record`, read by column name or position, as an
  asyncpg ``Record`` is;
- the values are those of an asyncpg connection without codecs: ``json`` and
  ``jsonb`` come back as text, lists go as binary arrays (loaders and dumpers
  registered on dedup's own cursors only; the connection's adapters stay the
  caller's);
- the statements run in the caller's transaction, under the connection's own
  settings (``prepare_threshold`` among them: ``None`` behind pgbouncer in
  transaction mode).

:class:`SyncAdapter`'s methods are coroutines that never suspend: they call the
blocking driver and return, so ``dedup.sync`` drives dedup's coroutines to
their end without an event loop (:mod:`dedup.sync._drive`).

Database errors surface as psycopg raises them (``psycopg.errors.*``, each
with its ``sqlstate``), as asyncpg's do on asyncpg.

Imported only when a psycopg connection is in hand (``dedup-kafka[psycopg]``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import pq
from psycopg.rows import RowMaker
from psycopg.types.array import ListBinaryDumper
from psycopg.types.string import TextLoader

from dedup.data import _db_telemetry as db_telemetry

_AS_TEXT = ("json", "jsonb")
"""Types psycopg decodes by default and asyncpg, without codecs, returns as text."""


class Record:
    """One row: by column name (``row["token"]``) or position (``row[0]``), like asyncpg's.

    Iterating gives the values (``tuple(row)``); ``keys()``, ``values()``,
    ``items()`` and ``get()`` are a mapping's.
    """

    __slots__ = ("_index", "_values")

    def __init__(self, values: tuple[Any, ...], index: Mapping[str, int]) -> None:
        self._values = values
        self._index = index

    def __getitem__(self, key: int | slice | str) -> Any:
        if isinstance(key, str):
            try:
                return self._values[self._index[key]]
            except KeyError:
                raise KeyError(f"no column {key!r} (columns: {list(self._index)})") from None
        return self._values[key]

    def get(self, key: str, default: Any = None) -> Any:
        """The value of column ``key``, or ``default`` when there is no such column."""
        i = self._index.get(key)
        return default if i is None else self._values[i]

    def keys(self) -> Iterator[str]:
        """The column names, in order."""
        return iter(self._index)

    def values(self) -> Iterator[Any]:
        """The values, in column order."""
        return iter(self._values)

    def items(self) -> Iterator[tuple[str, Any]]:
        """``(name, value)`` of each column, in order."""
        return zip(self._index, self._values, strict=True)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return "<Record " + " ".join(f"{k}={v!r}" for k, v in self.items()) + ">"


def _records(cursor: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any]) -> RowMaker[Record]:
    """psycopg's row factory for :class:`Record` rows: the column index, built once a result."""
    index = {column.name: i for i, column in enumerate(cursor.description or ())}

    def make(values: Sequence[Any]) -> Record:
        return Record(tuple(values), index)

    return make


def _as_asyncpg_does(cursor: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any]) -> None:
    """Make ``cursor`` (dedup's own) load what asyncpg without codecs returns as text, and
    send lists as asyncpg does, as binary arrays: psycopg's text arrays quote element by
    element in Python, about four times as slow (a consumer's claim sends three lists of
    ``batch_size``)."""
    adapters = cursor.adapters
    for name in _AS_TEXT:
        adapters.register_loader(name, TextLoader)
    adapters.register_dumper(list, ListBinaryDumper)


class Adapter:
    """asyncpg's five methods over a psycopg connection, in the caller's transaction.

    :class:`AsyncAdapter` and :class:`SyncAdapter` differ only in how a
    statement is sent (:meth:`_run`, :meth:`_run_many`).
    """

    def __init__(self, conn: psycopg.AsyncConnection[Any] | psycopg.Connection[Any]) -> None:
        self.raw = conn
        """The caller's psycopg connection."""
        info = conn.info
        self.server: db_telemetry.Server = (info.dbname, info.host, info.port)
        """Where it is connected (libpq knows: no round trip), for the statements' CLIENT spans
        (:mod:`dedup.data._db_telemetry`)."""

    def is_closed(self) -> bool:
        """Whether the connection is closed, or was lost (libpq saw it break)."""
        return bool(self.raw.closed)

    def is_in_transaction(self) -> bool:
        """Whether dedup's statements run in a transaction that the caller ends.

        True inside ``conn.transaction()``, after a statement of the caller's
        with autocommit off, or before one (psycopg then begins the
        transaction with dedup's first statement, and the caller commits it).
        False only with autocommit on and no transaction open: each
        statement would commit on its own.
        """
        idle = self.raw.info.transaction_status == pq.TransactionStatus.IDLE
        return not (idle and self.raw.autocommit)

    async def fetch(self, sql: str, *args: Any) -> list[Record]:
        """The rows of ``sql`` run with ``args``."""
        return (await self._run(sql, args))[1]

    async def fetchrow(self, sql: str, *args: Any) -> Record | None:
        """The first row of ``sql``, or None."""
        rows = (await self._run(sql, args))[1]
        return rows[0] if rows else None

    async def fetchval(self, sql: str, *args: Any) -> Any:
        """The first column of the first row of ``sql``, or None."""
        rows = (await self._run(sql, args))[1]
        return rows[0][0] if rows else None

    async def execute(self, sql: str, *args: Any) -> str:
        """Run ``sql``; its status, as asyncpg gives it (``UPDATE 3``)."""
        return (await self._run(sql, args))[0]

    async def executemany(self, sql: str, args: Iterable[Sequence[Any]]) -> None:
        """Run ``sql`` once per sequence of ``args`` (pipelined where libpq can)."""
        await self._run_many(sql, list(args))

    async def _run(self, sql: str, args: Sequence[Any]) -> tuple[str, list[Record]]:
        raise NotImplementedError

    async def _run_many(self, sql: str, args: list[Sequence[Any]]) -> None:
        raise NotImplementedError


class AsyncAdapter(Adapter):
    """:class:`Adapter` over a ``psycopg.AsyncConnection``."""

    raw: psycopg.AsyncConnection[Any]

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        super().__init__(conn)

    async def _run(self, sql: str, args: Sequence[Any]) -> tuple[str, list[Record]]:
        async with psycopg.AsyncRawCursor(self.raw, row_factory=_records) as cursor:
            _as_asyncpg_does(cursor)
            # No arguments: the simple protocol, as asyncpg's execute() (several statements).
            await cursor.execute(sql, args or None)
            rows = await cursor.fetchall() if cursor.description is not None else []
            return cursor.statusmessage or "", rows

    async def _run_many(self, sql: str, args: list[Sequence[Any]]) -> None:
        async with psycopg.AsyncRawCursor(self.raw, row_factory=_records) as cursor:
            _as_asyncpg_does(cursor)
            await cursor.executemany(sql, args)


class SyncAdapter(Adapter):
    """:class:`Adapter` over a blocking ``psycopg.Connection``: its coroutines never suspend."""

    raw: psycopg.Connection[Any]

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        super().__init__(conn)

    async def _run(self, sql: str, args: Sequence[Any]) -> tuple[str, list[Record]]:
        with psycopg.RawCursor(self.raw, row_factory=_records) as cursor:
            _as_asyncpg_does(cursor)
            cursor.execute(sql, args or None)
            rows = cursor.fetchall() if cursor.description is not None else []
            return cursor.statusmessage or "", rows

    async def _run_many(self, sql: str, args: list[Sequence[Any]]) -> None:
        with psycopg.RawCursor(self.raw, row_factory=_records) as cursor:
            _as_asyncpg_does(cursor)
            cursor.executemany(sql, args)
