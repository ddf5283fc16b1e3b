"""The asyncpg connection beneath what a caller hands dedup, inside the caller's transaction.

dedup's SQL runs on asyncpg.  A caller may hold an asyncpg connection (or a
pool's connection proxy), or an SQLAlchemy ``AsyncConnection`` or
``AsyncSession`` on the asyncpg dialect (the ``dedup-kafka[sqlalchemy]`` extra):
dedup then runs on the driver connection beneath it, in the same transaction.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from dedup import _errors as errors
from dedup.data import _db as db


async def in_transaction(conn: Any, what: str) -> asyncpg.Connection:
    """The asyncpg connection of ``conn``, which must be inside a transaction.

    ``what`` names the caller in errors (``dedup.claim``).  Raise
    :class:`dedup.ConfigurationError` when ``conn`` is no connection dedup can
    use, or when no transaction is open on it.
    """
    if hasattr(conn, "is_in_transaction") and hasattr(conn, "fetch"):  # asyncpg, or a proxy
        if not conn.is_in_transaction():
            raise errors.ConfigurationError(
                f"{what} must run inside your transaction, so its claims commit or roll back "
                "with your writes: call it inside `async with conn.transaction():`"
            )
        return conn
    sqlalchemy = await _sqlalchemy_connection(conn, what)
    if sqlalchemy is None:
        raise errors.ConfigurationError(
            f"{what}: conn is a {type(conn).__module__}.{type(conn).__qualname__}; expected "
            "an asyncpg connection, or an SQLAlchemy AsyncConnection or AsyncSession "
            "(pip install 'dedup-kafka[sqlalchemy]')"
        )
    return sqlalchemy


async def _sqlalchemy_connection(conn: Any, what: str) -> asyncpg.Connection | None:
    """The driver connection of an SQLAlchemy async connection or session; None if neither."""
    try:
        from sqlalchemy.ext import asyncio as sa_asyncio
    except ImportError:
        return None
    if isinstance(conn, sa_asyncio.AsyncSession):
        if not conn.in_transaction():
            raise errors.ConfigurationError(
                f"{what} must run inside the session's transaction, so its claims commit or "
                "roll back with your writes: call it inside `async with session.begin():`"
            )
        conn = await conn.connection()
    if not isinstance(conn, sa_asyncio.AsyncConnection):
        return None
    if not conn.in_transaction():
        raise errors.ConfigurationError(
            f"{what} must run inside the connection's transaction, so its claims commit or "
            "roll back with your writes: call it inside `async with engine.begin() as conn:`"
        )
    if conn.dialect.driver != "asyncpg":
        raise errors.ConfigurationError(
            f"{what}: the SQLAlchemy engine uses the {conn.dialect.driver!r} driver; dedup "
            "runs on asyncpg: create_async_engine('postgresql+asyncpg://...')"
        )
    raw = await conn.get_raw_connection()
    driver: asyncpg.Connection = raw.driver_connection
    if not driver.is_in_transaction():
        # SQLAlchemy's asyncpg adapter sends BEGIN with its first statement.
        # dedup's statements go to the driver directly, so that BEGIN must go first.
        await conn.exec_driver_sql(db.queries().nothing.sql)
    if not driver.is_in_transaction():
        raise errors.ConfigurationError(
            f"{what}: the SQLAlchemy connection runs in AUTOCOMMIT, so nothing would be "
            "atomic; use a connection or session with a transaction"
        )
    return driver
