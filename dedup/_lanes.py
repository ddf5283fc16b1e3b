"""Lanes: the consumer's Postgres connections, one per batch transaction in flight.

A lane keeps its connection from one transaction to the next.  :class:`Lanes`
lends them to the partition workers, so at most ``concurrency`` batches run at
once, and says when their handlers must take turns: when two lanes'
transactions deadlock (handlers that update the same hot rows in different
orders), the batch that lost runs again *alone*, with no other lane's
transaction open, and the lanes then turn *serial* for a cool-down that doubles
while deadlocks keep coming.  A hot-row workload so costs at most one retry per
deadlocked batch, and never storms.

Serial lanes still run side by side, but only one transaction of the group at
a time runs its handler: each takes the group's transaction-scoped advisory
lock (``serialize_group`` in the named queries) after its claim and before its
handler, and keeps it until it ends.  So the next batch's BEGIN and claim run
while the current one's handler does, which makes a hot-row workload on the
default lanes faster than on one lane (``make bench``, arm ``hot_rows``); and
since every consumer of the group takes the same lock, consumers that
deadlocked each other take turns across processes too.  The lock is taken
after the claim's locks, yet it can't close a cycle: whoever holds it has
claimed already, and none of its remaining statements waits for a claim.

Postgres looks for a deadlock only after a lock wait of ``deadlock_timeout``
(1 s by default, settable by superusers only), once per waiting transaction:
four lanes tangled on hot rows untangle one second at a time.  So a
transaction on a shared lane waits at most :data:`LOCK_WAIT` for a row lock
(``lock_timeout``, set for that transaction only by the batch's first
statement); past it the batch is handled as if it had deadlocked (see
:func:`contended`).  A lane lent alone, or while the lanes are serial, waits as
long as the session's own ``lock_timeout`` says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg

log = logging.getLogger("dedup.lanes")

SERIAL_COOLDOWN = 30.0
"""Seconds the lanes stay serial after a deadlock (doubling, up to MAX_SERIAL_COOLDOWN)."""
MAX_SERIAL_COOLDOWN = 600.0
LOCK_WAIT = 0.2
"""Seconds a transaction on a shared lane waits for a row lock before its batch runs again alone."""


def contended(exc: BaseException, shared: bool) -> bool:
    """True when ``exc`` says a batch ran into another transaction's row locks.

    A deadlock, or, on a lane lent shared, a lock wait past :data:`LOCK_WAIT`.
    Such a batch runs again alone, and :meth:`Lanes.deadlocked` is told.
    """
    if isinstance(exc, asyncpg.DeadlockDetectedError):
        return True
    return shared and isinstance(exc, asyncpg.LockNotAvailableError)


class Lane:
    """A connection of the consumer's, kept from one transaction to the next."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._conn: asyncpg.Connection | None = None
        self.shared = False
        """Lent while other lanes may run: the batch's lock waits are cut at LOCK_WAIT."""

    async def connection(self) -> asyncpg.Connection:
        """The lane's connection, (re)acquired from the pool when it has none or lost it.

        Nothing is set on the session: each transaction sets what it needs
        (``SET LOCAL``), which a pooler in transaction mode keeps too.
        """
        if self._conn is None or not _usable(self._conn):
            await self.release()
            self._conn = await self._pool.acquire()
        return self._conn

    async def release(self) -> None:
        """Give the connection back (after a transient failure: start again on a fresh one)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await self._pool.release(conn, timeout=5)

    def terminate(self) -> None:
        """Close the connection at once: the server rolls back whatever it had open."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.terminate()


class Lanes:
    """Lends lanes: up to ``size`` side by side, one alone to a batch that deadlocked."""

    def __init__(self, pool: Any, size: int) -> None:
        self.size = size
        self._free = [Lane(pool) for _ in range(size)]
        self._all = list(self._free)
        self._busy = 0
        self._exclusive_waiting = 0
        self._exclusive = False
        self._serial_until = 0.0
        self._cooldown = SERIAL_COOLDOWN
        self._changed = asyncio.Condition()

    @property
    def serial(self) -> bool:
        """True while handlers take turns (after a deadlock; see the module docstring)."""
        return time.monotonic() < self._serial_until

    @contextlib.asynccontextmanager
    async def lane(self, *, alone: bool = False) -> AsyncIterator[Lane]:
        """Borrow a lane; ``alone=True`` waits until no other lane's transaction is open."""
        async with self._changed:
            if alone:
                self._exclusive_waiting += 1
                try:
                    await self._changed.wait_for(lambda: self._busy == 0 and not self._exclusive)
                finally:
                    self._exclusive_waiting -= 1
                self._exclusive = True
            else:
                await self._changed.wait_for(self._may_share)
            self._busy += 1
            lane = self._free.pop()
            lane.shared = self.size > 1 and not alone and not self.serial
        try:
            yield lane
        finally:
            async with self._changed:
                self._busy -= 1
                self._exclusive = self._exclusive and not alone
                self._free.append(lane)
                self._changed.notify_all()

    def _may_share(self) -> bool:
        return not (self._exclusive or self._exclusive_waiting or not self._free)

    def deadlocked(self) -> None:
        """Two lanes deadlocked: handlers take turns for a while (longer each time it recurs)."""
        now = time.monotonic()
        if now < self._serial_until:
            # A transaction opened before the lanes turned serial: the same
            # tangle as the deadlock that started the cool-down, not a new one.
            return
        if now < self._serial_until + self._cooldown:
            self._cooldown = min(self._cooldown * 2, MAX_SERIAL_COOLDOWN)
        else:
            self._cooldown = SERIAL_COOLDOWN
        self._serial_until = now + self._cooldown
        log.info("lanes ran into each other's locks; handlers take turns for %.0fs", self._cooldown)

    async def close(self) -> None:
        """Give every lane's connection back."""
        for lane in self._all:
            await lane.release()

    def terminate(self) -> None:
        """Close every lane's connection at once (a shutdown that ran out of time)."""
        for lane in self._all:
            lane.terminate()


def _usable(conn: asyncpg.Connection) -> bool:
    # asyncpg detaches a pooled connection that the server closed; asking a
    # detached proxy anything raises InterfaceError.
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:
        return False
