"""The connection dedup's statements run on, beneath what a caller hands it, in the caller's
transaction.

dedup's SQL runs through asyncpg's methods (:mod:`dedup.data._sql`).  A caller
may hold:

- an asyncpg connection (or a pool's connection proxy): used as it is;
- a ``psycopg.AsyncConnection`` (``dedup-kafka[psycopg]``): used through
  :class:`dedup.data._psycopg.AsyncAdapter`;
- an SQLAlchemy ``AsyncConnection`` or ``AsyncSession`` on the asyncpg or the
  psycopg dialect (``dedup-kafka[sqlalchemy]``): dedup runs on the driver
  connection beneath it, in the same transaction.

With ``blocking=True`` (``dedup.sync``) the caller holds a blocking connection
instead: a ``psycopg.Connection``, or an SQLAlchemy ``Session`` or
``Connection`` on the psycopg dialect, used through
:class:`dedup.data._psycopg.SyncAdapter`, whose coroutines never suspend.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from dedup import _errors as errors
from dedup.data import _db as db

_EXPECTED = (
    "an asyncpg connection, a psycopg.AsyncConnection, or an SQLAlchemy AsyncConnection or "
    "AsyncSession (pip install 'dedup-kafka[psycopg]' or 'dedup-kafka[sqlalchemy]')"
)
_EXPECTED_BLOCKING = (
    "a psycopg.Connection, or an SQLAlchemy Session or Connection on psycopg "
    "(pip install 'dedup-kafka[psycopg]')"
)
_DIALECTS = "create_async_engine('postgresql+asyncpg://...') or ('postgresql+psycopg://...')"
_DIALECTS_BLOCKING = "create_engine('postgresql+psycopg://...')"


async def in_transaction(
    conn: Any, what: str, *, blocking: bool = False, twin: str | None = None
) -> Any:
    """The connection to run dedup's statements on for ``conn``, inside its transaction.

    An asyncpg connection, or an adapter of :mod:`dedup.data._psycopg`: what
    :mod:`dedup.data._sql`'s queries run on.  ``what`` names the caller in
    errors (``dedup.claim``); ``blocking`` says the caller runs without an
    event loop (``dedup.sync``) and holds a blocking connection; ``twin`` is
    the call to make instead with a connection of the other kind
    (``dedup.sync.claim(conn, records, ...)``), named in that error.  Raise
    :class:`dedup.ConfigurationError` when ``conn`` is no connection dedup can
    use so, or when no transaction is open on it.
    """
    twin = twin or "the other call"
    if hasattr(conn, "is_in_transaction") and hasattr(conn, "fetch"):  # asyncpg, a proxy, ours
        if blocking and not _ours(conn):
            raise _wrong_kind(conn, what, twin, blocking)
        if not conn.is_in_transaction():
            raise _outside(what, "your", "async with conn.transaction():")
        return conn
    found = _psycopg(conn, what, blocking, twin)
    if found is None:
        found = (
            _sqlalchemy_blocking(conn, what, twin)
            if blocking
            else await _sqlalchemy(conn, what, twin)
        )
    if found is None:
        raise errors.ConfigurationError(
            f"{what}: conn is a {_type(conn)}; expected "
            f"{_EXPECTED_BLOCKING if blocking else _EXPECTED}"
        )
    return found


def _type(conn: Any) -> str:
    return f"{type(conn).__module__}.{type(conn).__qualname__}"


def _outside(what: str, whose: str, block: str, also: str = "") -> errors.ConfigurationError:
    """The error of a call outside a transaction: ``block`` is the one to call it in."""
    return errors.ConfigurationError(
        f"{what} must run inside {whose} transaction, so its claims commit or roll back "
        f"with your writes: call it inside `{block}`{also}"
    )


def _ours(conn: Any) -> bool:
    """Whether ``conn`` is already a blocking adapter of ours."""
    try:
        from dedup.data import _psycopg as psycopg_
    except ImportError:
        return False
    return isinstance(conn, psycopg_.SyncAdapter)


def _wrong_kind(conn: Any, what: str, twin: str, blocking: bool) -> errors.ConfigurationError:
    """The error of a connection on an event loop handed to a blocking caller, or the reverse."""
    if blocking:
        return errors.ConfigurationError(
            f"{what}: conn is a {_type(conn)}, which runs on an event loop: call `{twin}` "
            f"in async code; {what} takes {_EXPECTED_BLOCKING}"
        )
    return errors.ConfigurationError(
        f"{what}: conn is a {_type(conn)}, which blocks: call `{twin}` (no await), "
        f"or use an async connection; {what} takes {_EXPECTED}"
    )


def _psycopg(conn: Any, what: str, blocking: bool, twin: str) -> Any:
    """The adapter over a psycopg connection, checked to be in a transaction; None if none."""
    try:
        import psycopg

        from dedup.data import _psycopg as psycopg_
    except ImportError:
        return None
    if isinstance(conn, psycopg.AsyncConnection):
        kind: type[psycopg_.Adapter] = psycopg_.AsyncAdapter
        block = "async with conn.transaction():"
    elif isinstance(conn, psycopg.Connection):
        kind, block = psycopg_.SyncAdapter, "with conn.transaction():"
    else:
        return None
    if blocking != (kind is psycopg_.SyncAdapter):
        raise _wrong_kind(conn, what, twin, blocking)
    adapter = kind(conn)
    if not adapter.is_in_transaction():
        raise _outside(what, "your", block, " (or turn autocommit off)")
    return adapter


def _adapted(driver: Any, what: str, blocking: bool) -> Any:
    """The adapter over the psycopg connection beneath an SQLAlchemy one, in its transaction."""
    from dedup.data import _psycopg as psycopg_

    if driver is None:
        raise errors.ConfigurationError(f"{what}: the SQLAlchemy connection is closed")
    adapter = (psycopg_.SyncAdapter if blocking else psycopg_.AsyncAdapter)(driver)
    if not adapter.is_in_transaction():
        raise _autocommit(what)
    return adapter  # psycopg sends BEGIN with dedup's first statement


def _autocommit(what: str) -> errors.ConfigurationError:
    return errors.ConfigurationError(
        f"{what}: the SQLAlchemy connection runs in AUTOCOMMIT, so nothing would be "
        "atomic; use a connection or session with a transaction"
    )


def _dialect(conn: Any, what: str, drivers: tuple[str, ...], create: str) -> None:
    if conn.dialect.driver not in drivers:
        raise errors.ConfigurationError(
            f"{what}: the SQLAlchemy engine uses the {conn.dialect.driver!r} driver; dedup "
            f"runs on {' or '.join(drivers)}: {create}"
        )


async def _sqlalchemy(conn: Any, what: str, twin: str) -> Any:
    """The driver connection of an SQLAlchemy async connection or session; None if neither."""
    try:
        from sqlalchemy import orm
        from sqlalchemy.engine import Connection
        from sqlalchemy.ext import asyncio as sa_asyncio
    except ImportError:
        return None
    if isinstance(conn, orm.Session | Connection):
        raise _wrong_kind(conn, what, twin, blocking=False)
    if isinstance(conn, sa_asyncio.AsyncSession):
        if not conn.in_transaction():
            raise _outside(what, "the session's", "async with session.begin():")
        conn = await conn.connection()
    if not isinstance(conn, sa_asyncio.AsyncConnection):
        return None
    if not conn.in_transaction():
        raise _outside(what, "the connection's", "async with engine.begin() as conn:")
    _dialect(conn, what, ("asyncpg", "psycopg"), _DIALECTS)
    raw = await conn.get_raw_connection()
    if conn.dialect.driver == "psycopg":
        return _adapted(raw.driver_connection, what, blocking=False)
    driver: asyncpg.Connection = raw.driver_connection
    if not driver.is_in_transaction():
        # SQLAlchemy's asyncpg adapter sends BEGIN with its first statement.
        # dedup's statements go to the driver directly, so that BEGIN must go first.
        await conn.exec_driver_sql(db.queries().nothing.sql)
    if not driver.is_in_transaction():
        raise _autocommit(what)
    return driver


def _sqlalchemy_blocking(conn: Any, what: str, twin: str) -> Any:
    """The adapter over the psycopg connection of an SQLAlchemy ``Session`` or ``Connection``;
    None if neither."""
    try:
        from sqlalchemy import orm
        from sqlalchemy.engine import Connection
        from sqlalchemy.ext import asyncio as sa_asyncio
    except ImportError:
        return None
    if isinstance(conn, sa_asyncio.AsyncSession | sa_asyncio.AsyncConnection):
        raise _wrong_kind(conn, what, twin, blocking=True)
    if isinstance(conn, orm.Session):
        if not conn.in_transaction():
            raise _outside(what, "the session's", "with session.begin():")
        conn = conn.connection()
    if not isinstance(conn, Connection):
        return None
    if not conn.in_transaction():
        raise _outside(what, "the connection's", "with engine.begin() as conn:")
    _dialect(conn, what, ("psycopg",), _DIALECTS_BLOCKING)
    return _adapted(conn.connection.driver_connection, what, blocking=True)
