"""CLIENT spans and ``db.client.operation.duration`` for each statement dedup sends.

Every named query (:class:`dedup.data._sql.Query`) runs inside :func:`db_call`, and
so do a consumer batch's BEGIN, COMMIT and ROLLBACK (:mod:`dedup.consumer._turn`).
The handler's own statements are the application's to trace.
"""

from __future__ import annotations

import functools
import time
import weakref
from typing import Any, NamedTuple, Protocol

import asyncpg
import asyncpg.pool
from opentelemetry import trace

from dedup import _semconv as semconv
from dedup import _telemetry as telemetry


class Statement(Protocol):
    """What a CLIENT span says of one statement (:class:`dedup.data._sql.Query` is one)."""

    @property
    def operation(self) -> str:
        """``db.operation.name``: the statement's first operation (``SELECT``, ``COMMIT``)."""

    @property
    def summary(self) -> str:
        """``db.query.summary``, also the span's name: operations and tables, in order."""

    @property
    def schema(self) -> str | None:
        """dedup's schema, the second half of ``db.namespace`` (None: the database only)."""


class Call(NamedTuple):
    """A statement that is not a named query: BEGIN, COMMIT, ROLLBACK."""

    operation: str
    summary: str
    schema: str | None


class db_call:  # lower case: it replaced a function of that name, and reads as one
    """A CLIENT span and a ``db.client.operation.duration`` point around one statement.

    Not made current: the transitions recorded meanwhile stay on the span the
    caller is in, where a reader of the trace looks for them.  The span only
    while tracing is on (:func:`dedup._telemetry.tracing`); the metric point
    always, its attributes built once per server and statement.
    """

    __slots__ = ("_attributes", "_point", "_span", "_started", "_traced")

    def __init__(self, conn: Any, statement: Statement, traced: bool | None = None) -> None:
        """``traced``: whether tracing is on, when the caller already asked
        (:func:`dedup._telemetry.tracing`; None: ask)."""
        self._attributes, self._point = _attributes(
            _server(conn), statement.schema, statement.operation, statement.summary
        )
        self._span: trace.Span | None = None
        self._started = 0.0
        self._traced = traced

    def __enter__(self) -> None:
        if self._traced if self._traced is not None else telemetry.tracing():
            self._span = telemetry.start(
                self._attributes["db.query.summary"], trace.SpanKind.CLIENT, self._attributes
            )
        self._started = time.perf_counter()

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        took = time.perf_counter() - self._started
        point = self._point
        span = self._span
        if exc is not None:
            point = {**point, "error.type": semconv.error_type(exc)}
            if span is not None:
                telemetry.record_error(span, exc)
                sqlstate = getattr(exc, "sqlstate", None)
                if isinstance(sqlstate, str):
                    telemetry.set_attribute(span, "db.response.status_code", sqlstate)
        if span is not None:
            telemetry.end(span)
        telemetry.record(telemetry.db_duration, took, point)


Server = tuple["str | None", "str | None", "int | None"]
"""Where a connection is: its database, host and port."""


@functools.lru_cache(maxsize=256)
def _attributes(
    server: Server, schema: str | None, operation: str, summary: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A statement's span attributes and its metric point's (shared: never changed)."""
    attributes = {
        **semconv.server_attributes(server[0], schema, server[1], server[2]),
        "db.operation.name": operation,
        "db.query.summary": summary,
    }
    point = {k: attributes[k] for k in semconv.DB_METRIC_ATTRIBUTES if k in attributes}
    return attributes, point


_servers: weakref.WeakKeyDictionary[asyncpg.Connection, Server] = weakref.WeakKeyDictionary()
"""Where each connection is, read once: a connection never moves."""


def _server(conn: Any) -> Server:
    """The database, host and port of ``conn`` (a connection, a proxy, a pool, an adapter).

    asyncpg keeps where it connected on the connection (``_addr``, ``_params``)
    and on a pool (``_working_addr``, ``_working_params``); a psycopg adapter
    (:mod:`dedup.data._psycopg`) has them from libpq (``server``).  Reading them
    costs no round trip.  A connection's answer is kept (a pool's may change).
    """
    raw = (
        getattr(conn, "_con", None) if isinstance(conn, asyncpg.pool.PoolConnectionProxy) else conn
    )
    if not isinstance(raw, asyncpg.Connection):
        located = getattr(conn, "server", None)  # an adapter of dedup.data._psycopg knows it
        return located if isinstance(located, tuple) else _read_server(conn)
    found = _servers.get(raw)
    if found is None:
        found = _servers[raw] = _read_server(raw)
    return found


def _read_server(conn: Any) -> Server:
    try:
        addr = getattr(conn, "_addr", None) or getattr(conn, "_working_addr", None)
        params = getattr(conn, "_params", None) or getattr(conn, "_working_params", None)
        database = getattr(params, "database", None)
        if isinstance(addr, tuple) and len(addr) >= 2:
            return database, str(addr[0]), int(addr[1])
        return database, str(addr) if addr else None, None
    except Exception as exc:
        telemetry.fault("span", f"database address not read: {exc!r}", exc)
        return None, None, None
