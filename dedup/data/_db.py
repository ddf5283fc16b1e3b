"""Connections to Postgres: the pool dedup opens, and which errors are worth retrying."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import sys
from collections.abc import AsyncIterator, Mapping
from typing import Any

import asyncpg
import orjson

from dedup import _errors as errors
from dedup.data import _conninfo as conninfo
from dedup.data import _sql as sql

# SQLSTATE classes and codes after which the same transaction can succeed when
# tried again: connection exceptions (08), serialization failure (40001),
# deadlock (40P01), lock timeout (55P03), shutdown in progress (57P01-57P03),
# too many connections (53300).
_RETRIABLE_STATES = {"40001", "40P01", "55P03", "57P01", "57P02", "57P03", "53300"}

# A paused consumer that still holds row locks inside an open transaction is cut
# off by the server after this long, so a new owner never waits longer.
IDLE_IN_TRANSACTION_TIMEOUT_MS = 10_000

TRANSACTION_SETTINGS: Mapping[str, str] = {
    "idle_in_transaction_session_timeout": str(IDLE_IN_TRANSACTION_TIMEOUT_MS)
}
"""What the transactions dedup opens on a pool of its own run with (``SET LOCAL``).

Settings go per transaction, never per session nor as startup parameters, so
the same code runs directly on Postgres and through a pooler in transaction
mode (pgbouncer), which rejects unknown startup parameters and hands each
transaction whichever server connection is free.
"""

DEFAULT_CONNECT_TIMEOUT = 5.0
"""Seconds to wait for Postgres to accept a connection (asyncpg's ``timeout``,
whose own default is 60 s): a server on the same network answers in
milliseconds, so a few seconds tells a dead or hung one from a slow one without
making every command and restart wait a minute.  Set it with
``pool_options={"timeout": seconds}`` (``--connect-timeout`` on the commands)."""

# Arguments of asyncpg.create_pool that dedup decides for the pool it opens.
_OWN_POOL_ARGUMENTS = frozenset({"dsn", "init_size", "min_size", "max_size", "init"})


async def init_connection(conn: asyncpg.Connection) -> None:
    """Pool ``init`` hook: json and jsonb go through orjson."""
    for name in ("json", "jsonb"):
        await conn.set_type_codec(
            name,
            encoder=lambda value: orjson.dumps(value).decode(),
            decoder=orjson.loads,
            schema="pg_catalog",
        )


async def create_pool(dsn: str, *, min_size: int = 1, max_size: int = 4, **kwargs: Any) -> Any:
    """Open an asyncpg pool for dedup's work, or raise an error that shows the DSN, redacted.

    ``dsn`` is a URL or libpq keyword/value pairs (:mod:`dedup.data._conninfo`).  The
    only startup parameter dedup adds is ``application_name`` (which pgbouncer
    accepts); ``kwargs`` are asyncpg's (``statement_cache_size=0`` for
    pgbouncer in transaction mode; ``timeout``, the connect timeout in seconds,
    default :data:`DEFAULT_CONNECT_TIMEOUT`).
    """
    settings = {"application_name": "dedup"}
    settings.update(kwargs.pop("server_settings", {}))
    kwargs.setdefault("timeout", DEFAULT_CONNECT_TIMEOUT)
    try:
        return await asyncpg.create_pool(
            conninfo.to_url(dsn),
            min_size=min_size,
            max_size=max_size,
            init=init_connection,
            server_settings=settings,
            **kwargs,
        )
    except CONNECT_ERRORS as exc:
        raise connect_error(dsn, exc, timeout=kwargs["timeout"]) from exc


def require_one(dsn: str | None, pool: Any) -> None:
    """Refuse anything but exactly one of ``dsn=`` and ``pool=``."""
    if (dsn is None) == (pool is None):
        raise errors.ConfigurationError("pass exactly one of dsn= or pool=")


@contextlib.asynccontextmanager
async def connection(
    target: Any, *, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
) -> AsyncIterator[asyncpg.Connection]:
    """A connection from a DSN (opened and closed here), a pool, or the connection given.

    A DSN gets a connection without a statement cache (each statement runs
    once anyway), so it works through a pooler in transaction mode too;
    ``connect_timeout`` is how many seconds it may take to open.
    """
    if isinstance(target, str):
        conn = await connect(target, statement_cache_size=0, timeout=connect_timeout)
        try:
            yield conn
        finally:
            await conn.close()
    elif hasattr(target, "acquire"):
        async with target.acquire() as conn:
            yield conn
    else:
        yield target


@contextlib.asynccontextmanager
async def pool_for(dsn: str | None, pool: Any, **options: Any) -> AsyncIterator[Any]:
    """The ``pool`` given, or one opened on ``dsn`` (with ``options``) and closed after."""
    if pool is not None:
        yield pool
        return
    assert dsn is not None  # noqa: S101 (require_one was called)
    opened = await create_pool(dsn, **options)
    try:
        yield opened
    finally:
        await opened.close()


async def connect(dsn: str, **kwargs: Any) -> asyncpg.Connection:
    """One connection (no codecs of dedup's), or the same errors as :func:`create_pool`."""
    kwargs.setdefault("timeout", DEFAULT_CONNECT_TIMEOUT)
    try:
        return await asyncpg.connect(conninfo.to_url(dsn), **kwargs)
    except CONNECT_ERRORS as exc:
        raise connect_error(dsn, exc, timeout=kwargs["timeout"]) from exc


def check_pool_options(options: Mapping[str, Any] | None, *, pool: Any) -> dict[str, Any]:
    """``pool_options`` checked against asyncpg's pool and connection arguments.

    They configure the pool dedup opens for ``dsn=``: with ``pool=`` the pool
    is the caller's to configure, and the pool's size and ``init`` are dedup's.
    """
    if not options:
        return {}
    if pool is not None:
        raise errors.ConfigurationError(
            "pool_options configure the pool dedup opens for dsn=; with pool=, "
            "pass them to asyncpg.create_pool yourself"
        )
    known = set(inspect.signature(asyncpg.create_pool).parameters) | set(
        inspect.signature(asyncpg.connect).parameters
    )
    unknown = sorted(set(options) - (known - _OWN_POOL_ARGUMENTS - {"connect_kwargs"}))
    if unknown:
        raise errors.ConfigurationError(
            f"pool_options: {', '.join(unknown)} not accepted: give options of "
            "asyncpg.create_pool or asyncpg.connect (e.g. statement_cache_size=0); "
            "dedup sizes its pool itself"
        )
    return dict(options)


@functools.cache
def queries() -> sql.Queries:
    """The queries that name no schema (``sql/queries/connections.sql``), built once."""
    return sql.Queries()


async def set_local(conn: asyncpg.Connection, settings: Mapping[str, str]) -> None:
    """Apply ``settings`` for the rest of the open transaction (``SET LOCAL``), in one statement."""
    if not settings:
        return
    await queries().set_local.execute(conn, names=list(settings), values=list(settings.values()))


@contextlib.asynccontextmanager
async def transaction(
    conn: asyncpg.Connection, settings: Mapping[str, str] | None = None
) -> AsyncIterator[asyncpg.Connection]:
    """``conn.transaction()`` whose first statement applies ``settings`` (``SET LOCAL``)."""
    async with conn.transaction():
        await set_local(conn, settings or {})
        yield conn


ABORTED = errors.HandlerError(
    "the transaction was aborted by a statement of the handler's that failed (the handler "
    "caught the error and went on): nothing of the batch can commit; use a savepoint "
    "(a block of tx.conn.transaction()) around a statement that may fail"
)
"""A handler's transaction that can't commit: what the consumer, ``wrap`` and FastStream say."""


@contextlib.asynccontextmanager
async def around_handler(conn: asyncpg.Connection) -> AsyncIterator[asyncpg.Connection]:
    """BEGIN, then COMMIT if the block returns, ROLLBACK if it raises: a handler's transaction.

    Unlike ``conn.transaction()``, it reads the COMMIT's answer: a handler that
    caught a failed statement and returned leaves the transaction aborted, and the
    server answers the COMMIT with ROLLBACK.  asyncpg takes that answer for a
    commit; this raises :data:`ABORTED` (nothing of it committed).  A ROLLBACK on
    a connection that is gone lets the block's own error through.
    """
    await conn.execute(queries().begin.sql)
    try:
        yield conn
    except BaseException as failed:
        if conn.is_in_transaction():
            try:
                await conn.execute(queries().rollback.sql)
            except Exception as exc:
                if not is_broken(conn, exc):
                    raise exc from failed
        raise
    if await conn.execute(queries().commit.sql) != "COMMIT":
        raise ABORTED


def describe_dsn(dsn: str) -> str:
    """The DSN with every password masked, for errors and logs (:func:`conninfo.redact`)."""
    return conninfo.redact(dsn)


CONNECT_ERRORS = (TimeoutError, OSError, ValueError, asyncpg.PostgresError, asyncpg.InterfaceError)
"""What opening a connection can raise: unreachable, refused, or a DSN asyncpg cannot read."""


def connect_error(
    dsn: str, exc: BaseException, *, timeout: float = DEFAULT_CONNECT_TIMEOUT
) -> errors.DedupError:
    """The error to raise when connecting with ``dsn`` failed with ``exc``; no secret in it.

    A DSN that cannot be read, a failed authentication or a database that
    does not exist is a :class:`~dedup.ConfigurationError`; anything
    else (refused, unknown host, timeout) a :class:`~dedup.ServiceUnavailableError`.
    A timeout names the server that did not answer and the setting that
    bounds the wait (``timeout``, in seconds).
    """
    shown = describe_dsn(dsn)
    if isinstance(exc, TimeoutError):
        # The server took the TCP connection (or the SYN went nowhere) and never
        # answered: starting local services is not the likely fix.
        return errors.ServiceUnavailableError(
            f"Postgres at {conninfo.address(dsn)} did not answer within {timeout:g} s "
            f"(the connect timeout: --connect-timeout or DEDUP_CONNECT_TIMEOUT for the "
            f"dedup commands, pool_options={{'timeout': seconds}} for the library)"
        )
    reason = conninfo.scrub(str(exc) or type(exc).__name__, dsn)
    if isinstance(exc, ValueError):
        return errors.ConfigurationError(
            f"cannot use the dsn setting ({shown}): {reason}; give a postgresql:// URL "
            "or libpq keyword=value pairs"
        )
    state = getattr(exc, "sqlstate", None) or ""
    if state.startswith("28") or state == "3D000":
        # Authentication failed, or no such database: trying again cannot help.
        return errors.ConfigurationError(
            f"Postgres refused the dsn setting ({shown}): {reason}; check the DSN"
        )
    return errors.ServiceUnavailableError(
        f"cannot connect to Postgres with the dsn setting ({shown}): {reason}; "
        "check the DSN, or start the local services with compose/local/up"
    )


DATABASE_ERRORS = (
    OSError,
    TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    # e.g. the server cut the session (idle in transaction) while a consumer was paused
    asyncpg.InternalClientError,
)
"""What talking to Postgres can raise; :func:`is_retriable` tells which are transient."""


def sqlstate(exc: BaseException) -> str:
    """The SQLSTATE of a database error, asyncpg's or psycopg's (``""``: none).

    dedup's rules read errors by their SQLSTATE, so they hold on either driver:
    ``40P01`` is a deadlock whichever class carries it.
    """
    state = getattr(exc, "sqlstate", None)
    return state if isinstance(state, str) else ""


def _psycopg_lost(exc: BaseException) -> bool:
    """True for psycopg's own errors of a connection that went away (no SQLSTATE: the
    client saw the socket close) or is closed; psycopg is only asked once it is imported."""
    psycopg = sys.modules.get("psycopg")
    if psycopg is None:
        return False
    if isinstance(exc, psycopg.InterfaceError):
        return True
    return isinstance(exc, psycopg.OperationalError) and not sqlstate(exc)


def session_timed_out(exc: BaseException, took: float, idle_timeout: float) -> bool:
    """True when the server cut a session for idling in its transaction (``took`` seconds
    after it began, with ``idle_in_transaction_session_timeout`` = ``idle_timeout``)."""
    if sqlstate(exc) == "25P03":  # idle_in_transaction_session_timeout
        return True
    lost = isinstance(exc, asyncpg.ConnectionDoesNotExistError | asyncpg.InterfaceError)
    return (lost or _psycopg_lost(exc)) and took >= idle_timeout


def is_retriable(exc: BaseException) -> bool:
    """True when ``exc`` is a transient failure of Postgres or the network (asyncpg's or
    psycopg's)."""
    if isinstance(exc, errors.DedupError):
        return exc.retriable
    state = sqlstate(exc)
    if state:
        return state.startswith("08") or state in _RETRIABLE_STATES
    return _psycopg_lost(exc) or isinstance(
        exc,
        OSError | asyncio.TimeoutError | asyncpg.InterfaceError | asyncpg.InternalClientError,
    )


def is_broken(conn: asyncpg.Connection, exc: BaseException) -> bool:
    """True when ``exc`` left ``conn`` unusable for good (closed, or released by its pool)."""
    if isinstance(exc, asyncpg.InterfaceError) or _psycopg_lost(exc):
        return True
    try:
        return bool(conn.is_closed())
    except asyncpg.InterfaceError:
        return True
