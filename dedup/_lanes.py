"""Lanes: the consumer's Postgres connections, one per batch transaction in flight.

A lane keeps its connection from one transaction to the next.  :class:`Lanes`
lends them to the partition workers, so at most ``concurrency`` batches run at
once, and says when their handlers must take turns: when two lanes'
transactions deadlock (handlers that update the same hot rows in different
orders), the lanes turn *serial* for a cool-down that doubles while deadlocks
keep coming, and the batch that lost runs again at once, under a turn.

Serial lanes still run side by side, but their handlers take turns: a batch
claims its keys, then waits for its :class:`Turn` before its handler runs, and
keeps it until its transaction ends.  So the next batch's BEGIN and claim run
while the current one's handler does.  The turn is first the consumer's own
(an asyncio lock), then the group's (a transaction-scoped advisory lock,
``serialize_group`` in the named queries), so consumers of the group that
deadlocked each other take turns too.  That lock is taken after the claim's
locks, yet can't close a cycle: whoever holds it has claimed already, and
none of its remaining statements waits for a claim.  A batch that waits
first drops its claim's snapshot (``drop_snapshot``): held, it would keep
Postgres from pruning the dead versions the handler that runs meanwhile
leaves on the hot rows, and make every update of theirs slower.  It runs that
statement again every third of the idle timeout while it waits, so the server
never cuts a session that only waits for its turn.

Lanes also let small batches ride together.  On a live stream each fetch
brings a few records of several partitions, and a transaction per partition
would cost several times the transactions of a hand-written loop that
commits each fetch at once.  A worker that gets a lane first gathers the
small batches of other partitions (:meth:`Lanes.gather`): those waiting for
a lane, and those that come for one in the same turn of the event loop.  Its
transaction fences, claims and handles each partition's batch as if alone,
then commits them all.  Only small batches ride (:data:`RIDER_SHARE`): a
backlog's run side by side, each on its own lane.

So once the lanes are serial a hot-row batch costs at most one retry: run
again under a turn, its handler meets no other turn's rows, and a
transaction begun before the lanes turned serial gives its rows up within
:data:`LOCK_WAIT` (below).

Postgres looks for a deadlock only after a lock wait of ``deadlock_timeout``
(1 s by default, settable by superusers only), once per waiting transaction:
four lanes tangled on hot rows untangle one second at a time.  So a
transaction on a shared lane waits at most :data:`LOCK_WAIT` for a row lock
(``lock_timeout``, set for that transaction only by the batch's first
statement); past it the batch runs again, like one that deadlocked (see
:func:`contended`).  A deadlock turns the lanes serial at once, and so does
a batch that waits again when it runs again; other lock waits do at their
second *incident* within :data:`LOCK_WAITS_WINDOW`.  One slow
COMMIT (a checkpoint's flush, a paused process) makes every lane queued
behind its rows wait past :data:`LOCK_WAIT` at about the same moment: that
is one incident, a hiccup, and turning serial for a cool-down would cost a
live stream far more than the hiccup did.  Handlers tangled on hot rows
meet again within a second.  A lane lent while the lanes are serial, or the
only one, waits as long as the session's own ``lock_timeout`` says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from dedup import _db as db

log = logging.getLogger("dedup.lanes")

SERIAL_COOLDOWN = 30.0
"""Seconds the lanes stay serial after a deadlock (doubling, up to MAX_SERIAL_COOLDOWN)."""
MAX_SERIAL_COOLDOWN = 600.0
LOCK_WAIT = 0.2
"""Seconds a transaction on a shared lane waits for a row lock before it runs again."""
RIDER_SHARE = 10
"""Only batches of at most 1/RIDER_SHARE of ``batch_size`` ride (or gather): a backlog's
batches are larger, and run faster side by side on their own lanes."""
RIDERS_PAUSE = 30.0
"""Seconds nobody rides after a shared transaction's handlers ran too long."""
LOCK_WAIT_INCIDENT = 2 * LOCK_WAIT
"""Lock waits within this many seconds of an incident's first are the same incident."""
LOCK_WAITS_WINDOW = 10.0
"""A second incident of lock waits this soon after the first turns the lanes serial."""


def contended(exc: BaseException, shared: bool) -> bool:
    """True when ``exc`` says a batch ran into another transaction's row locks.

    A deadlock, or, on a lane lent shared, a lock wait past :data:`LOCK_WAIT`.
    Such a batch runs again under a turn, and :meth:`Lanes.deadlocked` is told.
    """
    if isinstance(exc, asyncpg.DeadlockDetectedError):
        return True
    return shared and isinstance(exc, asyncpg.LockNotAvailableError)


class Turn:
    """A serial batch's turn to run its handler: the consumer's, then its group's."""

    def __init__(self, mine: asyncio.Lock, group_id: str) -> None:
        self._mine = mine
        self.group_id = group_id
        """Whose advisory lock is the group's turn (``serialize_group``)."""
        self._held = False

    async def wait(self, keepalive: Callable[[], Awaitable[object]], every: float | None) -> None:
        """Wait for the consumer's turn, calling ``keepalive`` every ``every`` seconds meanwhile.

        The waiting batch's transaction is idle on the server: ``keepalive`` (a
        statement) keeps ``idle_in_transaction_session_timeout`` from cutting it.
        ``asyncio.wait`` on the acquire, not ``wait_for``, which on Python 3.11
        can drop an acquisition that raced its timeout.
        """
        acquire = asyncio.ensure_future(self._mine.acquire())
        try:
            while not (await asyncio.wait({acquire}, timeout=every))[0]:
                await keepalive()
        except BaseException:
            if acquire.done() and not acquire.cancelled() and acquire.exception() is None:
                self._mine.release()
            else:
                acquire.cancel()
            raise
        self._held = True

    def end(self) -> None:
        """The transaction ended (the group's turn with it): the next batch's turn."""
        if self._held:
            self._held = False
            self._mine.release()


@dataclass(eq=False)
class Rider:
    """A worker's batch that may ride in another lane's transaction instead of taking a lane."""

    batch: Any
    """What the gathering worker takes along (the rider's worker, messages, dead letters)."""
    size: int
    """Messages and dead letters in the batch."""
    seat: asyncio.Future[bool] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    """Set when the transaction that took it ended: True committed, False run it alone."""
    boarded: bool = False


class Boarding:
    """A lane's transaction that other partitions' small batches may still board."""

    def __init__(self, room: int) -> None:
        self.room = room
        """Messages the transaction may still take (``batch_size`` in all)."""
        self.riders: list[Rider] = []

    def take(self, rider: Rider) -> bool:
        """Take ``rider`` along if there is room for it."""
        if rider.size > self.room:
            return False
        self.room -= rider.size
        rider.boarded = True
        self.riders.append(rider)
        return True


class Lane:
    """A connection of the consumer's, kept from one transaction to the next."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._conn: asyncpg.Connection | None = None
        self._dirty = False
        self.shared = False
        """Lent while other lanes may run: the batch's lock waits are cut at LOCK_WAIT."""

    async def connection(self) -> asyncpg.Connection:
        """The lane's connection, (re)acquired from the pool when it has none or lost it.

        Nothing is set on the session: each transaction sets what it needs
        (``SET LOCAL``), which a pooler in transaction mode keeps too.  What a
        handler set on it is reset first (:meth:`used`).
        """
        if self._conn is not None and self._dirty:
            await self._reset()
        if self._conn is None or not _usable(self._conn):
            await self.release()
            self._conn = await self._pool.acquire()
        return self._conn

    def used(self) -> None:
        """A handler ran on the connection: reset its session before the lane's next use."""
        self._dirty = True

    async def _reset(self) -> None:
        """Undo what a handler set on the session (:meth:`used`), before the next transaction.

        The lane keeps its connection, so a handler's ``SET search_path``,
        ``SET ROLE`` or ``SET SESSION CHARACTERISTICS`` would otherwise meet every
        later message.  This runs what asyncpg's pool runs when a connection is
        given back (``Connection.get_reset_query``: ``RESET ALL``, advisory locks
        unlocked, cursors closed, ``UNLISTEN *``), and ``RESET ROLE``, which
        ``RESET ALL`` leaves alone.  Settings the pool or the DSN gives the
        session at connect time (``server_settings``) are its defaults, and stay.
        A connection that fails here is given back: the next transaction gets a
        fresh one.
        """
        conn, self._dirty = self._conn, False
        if conn is None or not _usable(conn):
            return
        try:
            await db.queries().reset_session.execute(conn)
        except Exception:
            log.warning("resetting a lane's session failed; taking a fresh connection")
            await self.release()

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
    """Lends up to ``size`` lanes side by side; after a deadlock, hands out turns."""

    def __init__(self, pool: Any, size: int) -> None:
        self.size = size
        self._free = [Lane(pool) for _ in range(size)]
        self._all = list(self._free)
        self._serial_until = 0.0
        self._cooldown = SERIAL_COOLDOWN
        self._incident = -LOCK_WAITS_WINDOW  # when the last incident of lock waits began
        self._no_riders_until = 0.0
        self._changed = asyncio.Condition()
        self._turns = asyncio.Lock()
        self._boarding: Boarding | None = None
        self._waiting: list[Rider] = []

    @property
    def serial(self) -> bool:
        """True while handlers take turns (after a deadlock; see the module docstring)."""
        return time.monotonic() < self._serial_until

    def turn(self, group_id: str) -> Turn | None:
        """The turn a batch starting now waits for before its handler (None: no turns)."""
        return Turn(self._turns, group_id) if self.serial else None

    @contextlib.asynccontextmanager
    async def lane(self) -> AsyncIterator[Lane]:
        """Borrow a lane, waiting for one to be free."""
        async with self.lane_or_ride(None) as lane:
            assert lane is not None  # noqa: S101 - only a rider rides
            yield lane

    @contextlib.asynccontextmanager
    async def lane_or_ride(self, rider: Rider | None) -> AsyncIterator[Lane | None]:
        """Borrow a lane, or let ``rider`` ride in another lane's transaction.

        The rider boards a transaction being gathered (:meth:`gather`) when one
        has room, at once or while it waits for a lane: then this yields None,
        and the rider's ``seat`` tells how it went.
        """
        async with self._changed:
            if rider is None or self._boarding is None or not self._boarding.take(rider):
                if rider is not None:
                    self._waiting.append(rider)
                try:
                    await self._changed.wait_for(
                        lambda: bool(self._free) or (rider is not None and rider.boarded)
                    )
                finally:
                    if rider is not None and not rider.boarded:
                        self._waiting.remove(rider)
            if rider is not None and rider.boarded:
                lane = None
            else:
                lane = self._free.pop()
                lane.shared = self.size > 1 and not self.serial
        if lane is None:
            yield None
            return
        try:
            yield lane
        finally:
            async with self._changed:
                self._free.append(lane)
                self._changed.notify()

    async def gather(self, room: int) -> list[Rider]:
        """Take other partitions' batches along in the transaction a lane is about to run.

        Called with a lane in hand, for a batch that leaves ``room`` messages
        of ``batch_size``.  The riders are the small batches of workers waiting
        for a lane, and of those that come for one during one turn of the event
        loop: the records of one fetch reach every partition's worker in the
        same turn.  So a live stream costs about one transaction per fetch, as a
        hand-written loop's does, not one per partition.  Only small batches
        gather or ride (:data:`RIDER_SHARE`, the worker's choice); nobody rides
        while the lanes are serial (handlers take turns there).

        The caller tells each rider's ``seat`` how its transaction went (:func:`tell`).
        """
        if room <= 0 or self.serial or self._boarding is not None:
            return []
        if time.monotonic() < self._no_riders_until:
            return []
        boarding = Boarding(room)
        async with self._changed:
            for rider in [r for r in self._waiting if boarding.take(r)]:
                self._waiting.remove(rider)
            if boarding.riders:
                self._changed.notify_all()
        self._boarding = boarding
        try:
            await asyncio.sleep(0)
        except BaseException:
            tell(boarding.riders, False)
            raise
        finally:
            self._boarding = None
        return boarding.riders

    def riders_too_slow(self) -> None:
        """A shared transaction's handlers ran past their time: its batches' handlers would
        rather run side by side on the lanes, so nobody rides for :data:`RIDERS_PAUSE`."""
        self._no_riders_until = time.monotonic() + RIDERS_PAUSE
        log.info("handlers too slow to share a transaction; nobody rides for %.0fs", RIDERS_PAUSE)

    def waited(self) -> None:
        """A batch on a shared lane waited past LOCK_WAIT: serial at the second incident."""
        now = time.monotonic()
        since = now - self._incident
        if since <= LOCK_WAIT_INCIDENT:
            return  # other lanes queued behind the same rows
        if since <= LOCK_WAITS_WINDOW:
            self.deadlocked()
        else:
            log.info("a lock wait past %.1fs; the batch runs again beside the others", LOCK_WAIT)
        self._incident = now

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


def tell(riders: list[Rider], committed: bool) -> None:
    """Tell the workers of batches that rode in a transaction how it went."""
    for rider in riders:
        if not rider.seat.done():  # a rider cancelled meanwhile is not waiting any more
            rider.seat.set_result(committed)


def _usable(conn: asyncpg.Connection) -> bool:
    # asyncpg detaches a pooled connection that the server closed; asking a
    # detached proxy anything raises InterfaceError.
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:
        return False
