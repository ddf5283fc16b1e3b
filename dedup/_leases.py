"""Leases with fencing tokens, kept in Postgres and timed by the database's clock.

A lease gives one holder a resource for a time-to-live.  Each acquisition
hands out a token one larger than the resource's previous one, so a token
orders every holder the resource ever had.  All times (acquired, renewed,
expires) are the database's ``clock_timestamp()``: a worker whose own clock is
hours off gets exactly the same lease as any other.

A lease alone does not stop a paused holder from writing after it expired; the
fence does.  :meth:`Leases.check` is a conditional UPDATE of the lease row
inside the caller's transaction: it passes only while the token is current and
the lease is live, and the row lock it takes makes a takeover wait until that
transaction ends.  Rows outside dedup's tables can carry the token too
(:func:`fenced_upsert`), so a downstream store refuses a stale writer by itself.

:class:`Watchdog` renews a held lease at a fraction of its TTL and tells the
holder (a callback) the moment it cannot.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import inspect
import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import asyncpg

from dedup import _errors as errors
from dedup import _limits as limits
from dedup import _telemetry as telemetry
from dedup.data import _db as db
from dedup.data import _events as events
from dedup.data import _sql as sql

log = logging.getLogger("dedup.leases")

DEFAULT_RENEW_FRACTION = 1 / 3
"""A watchdog renews after this fraction of the TTL, leaving two more tries before expiry."""
LOSS_RECORD_TIMEOUT = 5.0
"""Seconds the ``lease_lost`` event may take to be written.  A lease is often lost because
Postgres can't be reached: past this the event is given up (and logged), so nothing that
waits for the report (a watchdog's stop, a runner's outcome) waits for the network."""


def default_holder() -> str:
    """``hostname:pid:xxxxxx``, the default name of a holder in leases and events.

    Host and process tell machines apart in the audit trail; six random hex
    digits tell apart two holders of one process (two consumers, a consumer
    and a task runner).
    """
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass(frozen=True, slots=True)
class Lease:
    """One holder's hold on a resource, as the database granted it."""

    resource: str
    """What is held, e.g. ``task:statements:2024-05-31``."""
    holder: str
    """Who holds it."""
    token: int
    """The fencing token: larger than every token issued for the resource before."""
    ttl: float
    """Seconds the lease lasts after each acquisition or renewal."""
    acquired_at: dt.datetime
    """When it was acquired (database clock)."""
    renewed_at: dt.datetime
    """When it was last renewed (database clock)."""
    expires_at: dt.datetime
    """When it ends unless renewed (database clock)."""
    namespace: str | None = None
    """For the audit trail: the task code (or consumer namespace) the lease serves."""
    key: str | None = None
    """For the audit trail: the business key the lease serves."""


def _identity(lease: Lease) -> dict[str, Any]:
    """The fields of an event that say which lease, and whose, it is about."""
    return {f: getattr(lease, f) for f in ("namespace", "key", "resource", "holder", "token")}


LostCallback = Callable[[Lease, errors.StaleTokenError], object]
"""Called once when a held lease is lost; may return an awaitable."""


def _lease(row: asyncpg.Record, namespace: str | None, key: str | None) -> Lease:
    return Lease(
        resource=row["resource"],
        holder=row["holder"],
        token=row["token"],
        ttl=row["ttl"].total_seconds(),
        acquired_at=row["acquired_at"],
        renewed_at=row["renewed_at"],
        expires_at=row["expires_at"],
        namespace=namespace,
        key=key,
    )


@contextlib.asynccontextmanager
async def _transaction(
    conn: asyncpg.Connection, settings: Mapping[str, str]
) -> AsyncIterator[asyncpg.Connection]:
    """The caller's open transaction, or a new one (with ``settings``): never a savepoint."""
    if conn.is_in_transaction():
        yield conn
        return
    async with db.transaction(conn, settings):
        yield conn


class Leases:
    """Acquire, renew, release and check leases in one schema.

    Methods that take ``conn`` run on it, inside its transaction when one is
    open (so a lease can change together with other rows); without ``conn``
    they use a connection of ``pool`` and commit by themselves.  The
    transactions they open run with ``transaction_settings`` (``SET LOCAL``;
    :class:`dedup.TaskRunner` gives dedup's idle-in-transaction timeout when
    the pool is its own).
    """

    def __init__(
        self,
        pool: Any,
        *,
        schema: str = sql.DEFAULT_SCHEMA,
        transaction_settings: Mapping[str, str] | None = None,
    ) -> None:
        self.pool = pool
        """The asyncpg pool used when no connection is given."""
        self.schema = schema
        """The schema of the ``leases`` and ``events`` tables."""
        self.transaction_settings = dict(transaction_settings or {})
        """Postgres settings of the transactions opened here, e.g. a lock or idle timeout."""
        self._q = sql.Queries(schema)

    @contextlib.asynccontextmanager
    async def _conn(self, conn: asyncpg.Connection | None) -> AsyncIterator[asyncpg.Connection]:
        if conn is not None:
            async with _transaction(conn, self.transaction_settings):
                yield conn
            return
        async with self.pool.acquire() as own, db.transaction(own, self.transaction_settings):
            yield own

    async def _record(
        self, conn: asyncpg.Connection, lease: Lease, kind: str, **detail: Any
    ) -> None:
        await events.record(
            conn,
            self.schema,
            [events.Event(subject="lease", kind=kind, detail=detail, **_identity(lease))],
        )

    async def acquire(
        self,
        resource: str,
        holder: str,
        ttl: float,
        *,
        conn: asyncpg.Connection | None = None,
        namespace: str | None = None,
        key: str | None = None,
    ) -> Lease | None:
        """Take ``resource`` for ``ttl`` seconds if it is free or its lease expired.

        Returns the new lease (its token one past the resource's last), or None
        while another holder's lease is live.  A holder's own live lease counts
        as taken too: holders are not re-entrant, so N machines that share a
        holder name still exclude each other.
        """
        limits.check_lease(resource, holder, ttl, namespace, key)
        async with self._conn(conn) as c:
            row = await self._q.lease_acquire.fetchrow(
                c, resource=resource, holder=holder, ttl=float(ttl)
            )
            if row is None:
                return None
            lease = _lease(row, namespace, key)
            await self._record(c, lease, "lease_acquired", ttl=lease.ttl)
        return lease

    async def renew(
        self, lease: Lease, *, ttl: float | None = None, conn: asyncpg.Connection | None = None
    ) -> Lease:
        """Extend ``lease`` by its TTL (or ``ttl``) from now, by the database clock.

        Raises :class:`dedup.StaleTokenError` when the lease expired or a newer
        holder took the resource: an expired lease is never revived.
        """
        if ttl is not None:
            limits.check_number("ttl", ttl, limits.MIN_LEASE_TTL, limits.MAX_LEASE_TTL, whole=False)
        async with self._conn(conn) as c:
            row = await self._q.lease_renew.fetchrow(
                c,
                resource=lease.resource,
                token=lease.token,
                ttl=None if ttl is None else float(ttl),
            )
            if row is None:
                raise await self.stale_error(c, lease)
            renewed = _lease(row, lease.namespace, lease.key)
            await self._record(
                c, renewed, "lease_renewed", expires_at=renewed.expires_at.isoformat()
            )
        return renewed

    async def release(self, lease: Lease, *, conn: asyncpg.Connection | None = None) -> bool:
        """End ``lease`` now so the next holder need not wait; False if it was no longer held."""
        async with self._conn(conn) as c:
            released = await self._q.lease_release.fetchval(
                c, resource=lease.resource, token=lease.token
            )
            if released is None:
                return False
            await self._record(c, lease, "lease_released")
        return True

    async def check(self, conn: asyncpg.Connection, lease: Lease) -> None:
        """The fence: raise :class:`dedup.StaleTokenError` unless ``lease`` is still current.

        Runs inside the caller's open transaction (required): on success the
        lease row stays locked until that transaction ends, so no takeover can
        commit in between; on failure the caller must roll back.  Call it last,
        right before COMMIT, so the lock is held for as short as possible.
        """
        if not conn.is_in_transaction():
            raise errors.ConfigurationError(
                "check(conn, lease) must run inside the transaction of the writes it guards: "
                "open `async with conn.transaction():` first"
            )
        held = await self._q.lease_fence.fetchval(conn, resource=lease.resource, token=lease.token)
        if held is None:
            telemetry.stale_rejections.add(1, {"dedup.subject": "lease"})
            raise await self.stale_error(conn, lease)

    async def current(
        self, resource: str, *, conn: asyncpg.Connection | None = None
    ) -> Lease | None:
        """The live lease on ``resource``, or None when it is free."""
        if conn is None:
            async with self.pool.acquire() as own:
                return await self.current(resource, conn=own)
        row = await self._q.lease_get.fetchrow(conn, resource=resource)
        return _lease(row, None, None) if row is not None and row["live"] else None

    async def stale_error(self, conn: asyncpg.Connection, lease: Lease) -> errors.StaleTokenError:
        """The error for ``lease`` once it is no longer current, saying who has it now."""
        row = await self._q.lease_get.fetchrow(conn, resource=lease.resource)
        if row is not None and row["token"] != lease.token:
            why = f"{row['holder']!r} took over with token {row['token']}"
        else:
            why = "it expired before it was renewed"
        return errors.StaleTokenError(
            lease.resource,
            lease.token,
            f"lease on {lease.resource} with fencing token {lease.token} is stale: {why}; "
            "roll back and stop writing",
        )

    async def report_lost(self, lease: Lease, error: errors.StaleTokenError) -> None:
        """Write the ``lease_lost`` event for ``lease`` and count it; never raises.

        The event gets :data:`LOSS_RECORD_TIMEOUT` seconds; after that (Postgres cut
        off, down) only the log line and the counter say it.
        """
        telemetry.lease_losses.add(1)
        log.warning("lost lease %s (token %s): %s", lease.resource, lease.token, error)
        try:
            async with asyncio.timeout(LOSS_RECORD_TIMEOUT), self._conn(None) as c:
                await self._record(c, lease, "lease_lost", reason=str(error))
        except db.DATABASE_ERRORS:
            log.warning("could not record the loss of lease %s", lease.resource, exc_info=True)

    def watch(
        self,
        lease: Lease,
        on_lost: LostCallback,
        *,
        every: float | None = None,
        conn: asyncpg.Connection | None = None,
    ) -> Watchdog:
        """A :class:`Watchdog` for ``lease``; use it as ``async with``."""
        return Watchdog(self, lease, on_lost, every=every, conn=conn)


class Watchdog:
    """Renews one lease in the background until stopped or lost.

    It renews every ``every`` seconds (default: a third of the TTL).  When a
    renewal is refused, or the database cannot be reached before the lease
    would expire, the lease is lost: ``on_lost(lease, error)`` is called, once,
    at once, then the ``lease_lost`` event is written (within
    :data:`LOSS_RECORD_TIMEOUT`: the database may be what was lost).  The
    holder must then stop writing; its fence would refuse it anyway.

    Time between renewals is measured with the event loop's monotonic clock,
    and only as a duration, never compared with database times.
    """

    def __init__(
        self,
        leases: Leases,
        lease: Lease,
        on_lost: LostCallback,
        *,
        every: float | None = None,
        conn: asyncpg.Connection | None = None,
    ) -> None:
        self.leases = leases
        self.lease = lease
        """The lease as last renewed."""
        self.lost: errors.StaleTokenError | None = None
        """Why the lease was lost, once it is."""
        self.every = every if every is not None else lease.ttl * DEFAULT_RENEW_FRACTION
        if not 0 < self.every < lease.ttl:
            raise errors.ConfigurationError(
                f"a watchdog must renew more often than the lease's ttl ({lease.ttl}s), "
                f"not every {self.every}s"
            )
        self._on_lost = on_lost
        self._conn = conn
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Watchdog:
        # dedup.lease.losses at 0 from here on, so that an alert on its increase sees the first.
        telemetry.lease_losses.add(0)
        self._task = asyncio.create_task(self._run(), name=f"dedup-watchdog {self.lease.resource}")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Stop renewing (after a renewal in flight finishes); the lease stays until released."""
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        # Measured before the acquisition's answer came back would be better still;
        # the lease's own renewed_at is a database time and can't be compared.
        deadline = loop.time() + self.lease.ttl
        wait = self.every
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=wait)
            if self._stop.is_set():
                return
            sent = loop.time()
            try:
                # Even past the local deadline (a paused process) the database has the
                # last word, and names the holder that took over.
                self.lease = await asyncio.wait_for(
                    self.leases.renew(self.lease, conn=self._conn),
                    timeout=max(deadline - sent, self.every),
                )
            except errors.StaleTokenError as exc:
                await self._lose(exc)
                return
            except db.DATABASE_ERRORS as exc:
                if loop.time() >= deadline:
                    lost = errors.StaleTokenError(
                        self.lease.resource,
                        self.lease.token,
                        f"lease on {self.lease.resource} (token {self.lease.token}) could not be "
                        f"renewed before it expired ({exc!r}); stop writing",
                    )
                    lost.__cause__ = exc
                    await self._lose(lost)
                    return
                log.warning("renewing lease %s failed, retrying: %r", self.lease.resource, exc)
                if self._conn is not None and db.is_broken(self._conn, exc):
                    # Its connection broke (a Postgres restart, a failover) and can't
                    # come back: renew on connections from the pool from now on.
                    self._conn = None
                wait = min(self.every, max(deadline - loop.time(), 0.0) / 2)
                continue
            # The database renewed no earlier than we sent the request.
            deadline = sent + self.lease.ttl
            wait = self.every

    async def _lose(self, error: errors.StaleTokenError) -> None:
        self.lost = error
        # The holder first: the event needs the database, which may be what was lost.
        try:
            outcome = self._on_lost(self.lease, error)
            if inspect.isawaitable(outcome):
                await outcome
        finally:
            await self.leases.report_lost(self.lease, error)


@functools.lru_cache(maxsize=64)
def _fenced_upsert_query(
    table: str, key_columns: tuple[str, ...], value_columns: tuple[str, ...], fence_column: str
) -> sql.Query:
    """The ``fenced_upsert`` template of leases.sql, completed for one table."""
    if not key_columns:
        raise errors.ConfigurationError("a fenced row needs at least one key column")
    columns = [*key_columns, *value_columns, fence_column]
    if len(set(columns)) < len(columns):
        raise errors.ConfigurationError(
            f"fenced row of {table}: columns {columns} repeat one (the key, the values "
            f"and the fence column {fence_column!r} must differ)"
        )
    quoted = {c: sql.identifier(c, "column name") for c in columns}
    updated = [quoted[c] for c in [*value_columns, fence_column]]
    return sql.template(
        "fenced_upsert",
        table=sql.identifier(table, "table name"),
        columns=", ".join(quoted.values()),
        values=", ".join(f":{c}" for c in columns),
        keys=", ".join(quoted[c] for c in key_columns),
        updated=", ".join(updated),
        excluded=", ".join(f"EXCLUDED.{c}" for c in updated),
        fence=quoted[fence_column],
    )


async def fenced_upsert(
    conn: asyncpg.Connection,
    table: str,
    key: Mapping[str, Any],
    values: Mapping[str, Any],
    *,
    token: int,
    resource: str,
    fence_column: str = "fence_token",
) -> None:
    """Write one business row unless it already carries a newer fencing token.

    The row keeps the token of the run that last wrote it; a writer whose
    token is lower (a holder that was paused and superseded) is refused with
    :class:`dedup.StaleTokenError`, so the caller's transaction rolls back.
    This is the ``UPDATE ... WHERE id = $1 AND fence_token <= $token`` pattern,
    as an upsert so the first write needs no separate INSERT.  The table needs
    a unique constraint on the key columns and a bigint ``fence_column``.
    Table and column names are validated and quoted; values are always
    parameters.
    """
    query = _fenced_upsert_query(table, tuple(key), tuple(values), fence_column)
    if await query.fetchval(conn, **key, **values, **{fence_column: token}) is None:
        telemetry.stale_rejections.add(1, {"dedup.subject": "row"})
        raise errors.StaleTokenError(
            resource,
            token,
            f"{table} row {dict(key)!r} was written under a newer fencing token than {token} "
            f"(lease on {resource}): roll back and stop writing",
        )
