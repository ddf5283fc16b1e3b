"""CLIENT spans and ``db.client.operation.duration`` for each statement dedup sends.

Every named query (:class:`dedup._sql.Query`) runs inside :func:`db_call`, and
so do a consumer batch's BEGIN, COMMIT and ROLLBACK (:mod:`dedup._turn`).
The handler's own statements are the application's to trace.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, Protocol

from opentelemetry import trace

from dedup import _semconv as semconv
from dedup import _telemetry as telemetry


class Statement(Protocol):
    """What a CLIENT span says of one statement (:class:`dedup._sql.Query` is one)."""

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


@contextlib.contextmanager
def db_call(conn: Any, statement: Statement) -> Iterator[None]:
    """A CLIENT span and a ``db.client.operation.duration`` point around one statement.

    Not made current: the transitions recorded meanwhile stay on the span the
    caller is in, where a reader of the trace looks for them.
    """
    server = _server(conn, statement.schema)
    attributes = {
        **server,
        "db.operation.name": statement.operation,
        "db.query.summary": statement.summary,
    }
    span = telemetry.start(statement.summary, trace.SpanKind.CLIENT, attributes)
    started = time.perf_counter()
    failed: str | None = None
    try:
        yield
    except BaseException as exc:
        failed = semconv.error_type(exc)
        telemetry.record_error(span, exc)
        sqlstate = getattr(exc, "sqlstate", None)
        if isinstance(sqlstate, str):
            telemetry.set_attribute(span, "db.response.status_code", sqlstate)
        raise
    finally:
        telemetry.end(span)
        point = {k: attributes[k] for k in semconv.DB_METRIC_ATTRIBUTES if k in attributes}
        if failed is not None:
            point["error.type"] = failed
        telemetry.record(telemetry.db_duration, time.perf_counter() - started, point)


def _server(conn: Any, schema: str | None) -> Mapping[str, Any]:
    """The ``db.*`` and ``server.*`` attributes of ``conn`` (a connection, a proxy or a pool).

    asyncpg keeps where it connected on the connection (``_addr``, ``_params``)
    and on a pool (``_working_addr``, ``_working_params``); reading them costs
    no round trip.
    """
    try:
        addr = getattr(conn, "_addr", None) or getattr(conn, "_working_addr", None)
        params = getattr(conn, "_params", None) or getattr(conn, "_working_params", None)
        database = getattr(params, "database", None)
        if isinstance(addr, tuple) and len(addr) >= 2:
            return semconv.server_attributes(database, schema, str(addr[0]), int(addr[1]))
        return semconv.server_attributes(database, schema, str(addr) if addr else None, None)
    except Exception as exc:
        telemetry.fault("span", f"database address not read: {exc!r}", exc)
        return semconv.server_attributes(None, schema, None, None)
