"""What happens inside one batch transaction, for the consumer and for ``wrap``.

The caller opens the transaction; :meth:`Store.apply` then, on that connection:

1. fences and claims in one statement (``fence_and_claim``): the partition's
   offset moves only under the current token, and the batch's keys are claimed
   with one set-based ``INSERT ... ON CONFLICT``;
2. runs the handler for the fresh keys only, in offset order;
3. writes dead letters and the events of duplicates, conflicts and dead letters.

If the fence fails nothing was written and :class:`dedup.StaleTokenError` is
raised, so the caller's transaction rolls back.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import asyncpg

from dedup import _errors as errors
from dedup import _events as events
from dedup import _guard as guard
from dedup import _message as message_
from dedup import _sql as sql
from dedup import _telemetry as telemetry

log = logging.getLogger("dedup.store")

MessageHandler = Callable[[message_.Message, message_.Tx], Awaitable[object]]
BatchHandler = Callable[[list[message_.Message], message_.Tx], Awaitable[object]]

CONFLICT_POLICIES = ("dead_letter", "record")

DUPLICATE_KEYS_SHOWN = 20
"""How many keys a batch's ``dedup.duplicate`` span event lists (its count has them all)."""


def payload_hash(value: bytes) -> bytes:
    """The 16-byte BLAKE2b digest stored with each key to tell duplicates from conflicts."""
    return hashlib.blake2b(value, digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message that will not be applied, and why."""

    msg: message_.Message
    """The whole record."""
    reason: str
    """Why, in words an operator can act on."""
    error: str | None = None
    """The exception, if one was raised."""
    attempts: int = 1
    """How many times it was tried."""


@dataclass(frozen=True, slots=True)
class Fence:
    """The partition lease a consumer batch runs under."""

    group_id: str
    """The consumer group."""
    token: int
    """This holder's fencing token for the partition."""
    expected: int | None
    """The partition's ``next_offset`` as this holder last left it (None: never set)."""


class Position(NamedTuple):
    """A partition's row in ``partitions``: who holds it, and where its offset stands."""

    holder: str
    """The consumer (or ``dedup offsets`` command) that took it last."""
    token: int
    """The current fencing token."""
    next_offset: int | None
    """The next offset to consume (None: never set)."""


@dataclass(slots=True)
class BatchResult:
    """What one committed batch did."""

    applied: list[message_.Message] = field(default_factory=list)
    duplicates: list[message_.Message] = field(default_factory=list)
    conflicts: list[message_.Message] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    next_offset: int | None = None
    """Where the partition's offset stands once this batch commits."""


class Store:
    """dedup's writes for one namespace, rendered for one schema."""

    def __init__(
        self,
        *,
        schema_name: str,
        namespace: str,
        conflict_policy: str = "dead_letter",
    ) -> None:
        if conflict_policy not in CONFLICT_POLICIES:
            raise errors.ConfigurationError(
                f"on_conflict={conflict_policy!r}: expected one of {', '.join(CONFLICT_POLICIES)}"
            )
        self.schema_name = schema_name
        self.namespace = namespace
        self.conflict_policy = conflict_policy
        self.queries = sql.Queries(schema_name)

    async def take_partitions(
        self,
        conn: asyncpg.Connection,
        group_id: str,
        holder: str,
        partitions: Sequence[tuple[str, int]],
    ) -> dict[tuple[str, int], tuple[int, int | None]]:
        """Take ``partitions`` with fresh tokens; return ``{(topic, p): (token, next_offset)}``."""
        rows = await conn.fetch(
            self.queries.take_partitions,
            group_id,
            holder,
            [t for t, _ in partitions],
            [p for _, p in partitions],
        )
        taken = {(r["topic"], r["partition"]): (r["token"], r["next_offset"]) for r in rows}
        await events.record(
            conn,
            self.schema_name,
            [
                events.Event(
                    "partition",
                    "partition_acquired",
                    namespace=self.namespace,
                    resource=f"{group_id}:{topic}:{part}",
                    holder=holder,
                    token=token,
                    detail={"next_offset": next_offset},
                )
                for (topic, part), (token, next_offset) in taken.items()
            ],
        )
        return taken

    async def position(
        self, conn: asyncpg.Connection, group_id: str, topic: str, partition: int
    ) -> Position | None:
        """Who holds the partition and where its offset stands, or None if it has no row."""
        row = await conn.fetchrow(self.queries.partition_position, group_id, topic, partition)
        return None if row is None else Position(row["holder"], row["token"], row["next_offset"])

    async def positions(
        self, conn: asyncpg.Connection, group_id: str, partitions: Sequence[tuple[str, int]]
    ) -> dict[tuple[str, int], Position]:
        """:meth:`position` of each of ``partitions`` that has a row, in one statement."""
        rows = await conn.fetch(
            self.queries.partition_positions,
            group_id,
            [t for t, _ in partitions],
            [p for _, p in partitions],
        )
        return {
            (r["topic"], r["partition"]): Position(r["holder"], r["token"], r["next_offset"])
            for r in rows
        }

    async def serialize(self, conn: asyncpg.Connection, group_id: str) -> None:
        """Wait, inside the open transaction, until no other serial batch of the group runs."""
        await conn.execute(self.queries.serialize_group, group_id)

    async def advance(
        self, conn: asyncpg.Connection, fence: Fence, topic: str, partition: int, next_offset: int
    ) -> None:
        """Move the partition's offset to ``next_offset`` under ``fence``, claiming nothing.

        For records Kafka never hands out (transaction markers, aborted
        transactions, compacted gaps).  Raises :class:`dedup.StaleTokenError`
        when the fence does not hold.
        """
        done = await conn.execute(
            self.queries.advance_partition,
            fence.group_id,
            topic,
            partition,
            next_offset,
            fence.token,
            fence.expected,
        )
        if done != "UPDATE 1":
            raise errors.StaleTokenError(f"{fence.group_id}:{topic}:{partition}", fence.token)

    async def apply(
        self,
        conn: asyncpg.Connection,
        msgs: Sequence[message_.Message],
        *,
        handler: MessageHandler | BatchHandler,
        batch_handler: bool,
        fence: Fence | None,
        dead: Sequence[DeadLetter] = (),
        group_id: str | None = None,
        handler_timeout: float | None = None,
        idle_timeout: float | None = None,
        lock_timeout: float | None = None,
    ) -> BatchResult:
        """Apply one batch inside the caller's open transaction (see the module docstring).

        ``msgs`` have their idempotency keys set; ``dead`` are messages of the same
        partition to dead-letter instead of applying.  All of them are consecutive
        records of one partition.  ``idle_timeout`` and ``lock_timeout`` (seconds)
        are the transaction's ``idle_in_transaction_session_timeout`` and
        ``lock_timeout`` from its first statement on (None: the session's own).
        """
        result = BatchResult(dead_letters=list(dead))
        first, copies = _first_copies(msgs)
        offsets = [m.offset for m in msgs] + [d.msg.offset for d in dead]
        if not offsets:
            return result
        result.next_offset = max(offsets) + 1
        any_msg = msgs[0] if msgs else dead[0].msg
        # Claim in key order: two batches that share keys then lock them in the
        # same order and can't deadlock.
        keys = sorted(first)
        rows = await conn.fetch(
            self.queries.fence_and_claim,
            fence.group_id if fence else None,
            any_msg.topic,
            any_msg.partition,
            result.next_offset,
            fence.token if fence else None,
            fence.expected if fence else None,
            self.namespace,
            keys,
            [first[k][0].offset for k in keys],
            [first[k][1] for k in keys],
            _milliseconds(idle_timeout),
            _milliseconds(lock_timeout),
        )
        if fence is not None and rows[0]["fenced"] == 0:
            raise errors.StaleTokenError(
                f"{fence.group_id}:{any_msg.topic}:{any_msg.partition}", fence.token
            )
        await self._sort_claimed(conn, result, rows, first, copies)

        if result.applied:
            tx = message_.Tx(conn=guard.GuardedConnection(conn), token=fence.token if fence else 0)
            if batch_handler:
                await call_handler(handler(result.applied, tx), conn, handler_timeout)  # type: ignore[arg-type]
            else:
                for msg in result.applied:
                    try:
                        await call_handler(handler(msg, tx), conn, handler_timeout)  # type: ignore[arg-type]
                    except Exception as exc:
                        with contextlib.suppress(AttributeError):
                            exc._dedup_offset = msg.offset  # type: ignore[attr-defined]
                        raise

            telemetry.transition(
                "applied", {"namespace": self.namespace, "count": len(result.applied)}
            )
        await self._record(conn, result, fence, group_id)
        return result

    async def claim(
        self,
        conn: asyncpg.Connection,
        msgs: Sequence[message_.Message],
        *,
        dead: Sequence[DeadLetter] = (),
    ) -> BatchResult:
        """Claim the keys of ``msgs`` inside the caller's open transaction; run nothing.

        For :func:`dedup.claim`: the caller applies ``result.applied`` itself, in
        the same transaction.  ``msgs`` have their idempotency keys set and may
        come from any topics and partitions; ``dead`` are dead-lettered.  Keys
        are claimed, and duplicates, conflicts and dead letters recorded, with
        the consumer's statements and rules, in one round trip for the claim.
        """
        result = BatchResult(dead_letters=list(dead))
        first, copies = _first_copies(msgs)
        if first:
            keys = sorted(first)  # key order: concurrent claims can't deadlock
            found = [first[k][0] for k in keys]
            rows = await conn.fetch(
                self.queries.claim_keys,
                self.namespace,
                keys,
                [m.topic for m in found],
                [m.partition for m in found],
                [m.offset for m in found],
                [first[k][1] for k in keys],
            )
            await self._sort_claimed(conn, result, rows, first, copies)
        await self._record(conn, result, None, None)
        return result

    async def _record(
        self,
        conn: asyncpg.Connection,
        result: BatchResult,
        fence: Fence | None,
        group_id: str | None,
    ) -> None:
        """Write the batch's dead letters, and the events of its conflicts and dead letters."""
        if result.dead_letters:
            await self._dead_letter(conn, result.dead_letters, fence, group_id)
        await events.record(conn, self.schema_name, self._events(result, fence))

    async def _sort_claimed(
        self,
        conn: asyncpg.Connection,
        result: BatchResult,
        rows: Sequence[asyncpg.Record],
        first: dict[str, tuple[message_.Message, bytes]],
        copies: list[tuple[message_.Message, bytes]],
    ) -> None:
        """File each claimed key's message as applied (fresh), a duplicate or a conflict."""
        # What each key now holds: its payload hash and where that payload came from.
        stored: dict[str, tuple[bytes, str]] = {}
        for row in rows:
            key = row["idempotency_key"]
            if key is None:  # the batch had no keys to claim, only dead letters
                continue
            msg, digest = first[key]
            if row["fresh"]:
                result.applied.append(msg)
                stored[key] = (digest, msg.where)
                continue
            stored[key] = (
                row["payload_hash"],
                f"{row['topic']}:{row['partition']}:{row['offset']}",
            )
            self._classify(result, msg, digest, stored[key])
        if copies:
            await self._count_copies(conn, result, copies, stored)
        result.applied.sort(key=lambda m: (m.topic, m.partition, m.offset))
        # Per batch, not per message: a span event per message would cost more
        # than the rest of the happy path.
        telemetry.transition("claimed", {"namespace": self.namespace, "count": len(result.applied)})

    def _classify(
        self,
        result: BatchResult,
        msg: message_.Message,
        digest: bytes,
        stored: tuple[bytes, str],
    ) -> bool:
        """File a copy of a claimed key as a duplicate or a conflict; True if a duplicate."""
        stored_digest, original = stored
        if digest == stored_digest:
            result.duplicates.append(msg)
            return True
        self._conflict(result, msg, original)
        return False

    async def _count_copies(
        self,
        conn: asyncpg.Connection,
        result: BatchResult,
        copies: list[tuple[message_.Message, bytes]],
        stored: dict[str, tuple[bytes, str]],
    ) -> None:
        """Classify the batch's further copies of a key and count them on its row."""
        counts: dict[str, list[int]] = {}  # key -> [duplicates, conflicts]
        for msg, digest in copies:
            duplicate = self._classify(result, msg, digest, stored[msg.idempotency_key])
            counts.setdefault(msg.idempotency_key, [0, 0])[0 if duplicate else 1] += 1
        keys = sorted(counts)
        await conn.execute(
            self.queries.count_copies,
            self.namespace,
            keys,
            [counts[k][0] for k in keys],
            [counts[k][1] for k in keys],
        )

    def _conflict(self, result: BatchResult, msg: message_.Message, original: str) -> None:
        result.conflicts.append(msg)
        if self.conflict_policy == "dead_letter":
            result.dead_letters.append(
                DeadLetter(
                    msg,
                    f"conflict: key {msg.idempotency_key!r} was applied from {original} "
                    "with a different payload",
                )
            )

    async def _dead_letter(
        self,
        conn: asyncpg.Connection,
        dead: Sequence[DeadLetter],
        fence: Fence | None,
        group_id: str | None,
    ) -> None:
        await conn.executemany(
            self.queries.dead_letter,
            [
                (
                    self.namespace,
                    fence.group_id if fence else group_id,
                    d.msg.topic,
                    d.msg.partition,
                    d.msg.offset,
                    d.msg.timestamp,
                    d.msg.key,
                    None if d.msg.tombstone else d.msg.value,  # a tombstone stays null
                    [name for name, _ in d.msg.raw_headers],
                    [value for _, value in d.msg.raw_headers],
                    d.msg.idempotency_key or None,
                    d.reason,
                    d.error,
                    d.attempts,
                    fence.token if fence else None,
                )
                for d in dead
            ],
        )

    def _events(self, result: BatchResult, fence: Fence | None) -> list[events.Event]:
        token = fence.token if fence else None

        def event(kind: str, msg: message_.Message, **detail: Any) -> events.Event:
            return events.Event(
                "message",
                kind,
                namespace=self.namespace,
                key=msg.idempotency_key or None,
                resource=f"{msg.topic}:{msg.partition}",
                token=token,
                detail={"offset": msg.offset, **detail},
            )

        # Duplicates are the happy path: counted on the key's row and in one span
        # event per batch, never written here (a replay would double the writes).
        if result.duplicates:
            telemetry.transition(
                "duplicate",
                {
                    "namespace": self.namespace,
                    "token": token,
                    "count": len(result.duplicates),
                    "keys": [m.idempotency_key for m in result.duplicates[:DUPLICATE_KEYS_SHOWN]],
                },
            )
        made = [event("conflict", m) for m in result.conflicts]
        made += [
            event("dead_lettered", d.msg, reason=d.reason, attempts=d.attempts)
            for d in result.dead_letters
        ]
        return made


def _first_copies(
    msgs: Sequence[message_.Message],
) -> tuple[dict[str, tuple[message_.Message, bytes]], list[tuple[message_.Message, bytes]]]:
    """Each key's first message with its payload hash, and the later copies of a key."""
    first: dict[str, tuple[message_.Message, bytes]] = {}
    copies: list[tuple[message_.Message, bytes]] = []
    for msg in msgs:
        digest = payload_hash(msg.value)
        if msg.idempotency_key in first:
            copies.append((msg, digest))
        else:
            first[msg.idempotency_key] = (msg, digest)
    return first, copies


async def call_handler(
    call: Awaitable[object], conn: asyncpg.Connection, deadline_s: float | None
) -> None:
    """Await one handler call within ``deadline_s`` seconds; leave the transaction open or raise.

    Past the deadline the handler is cancelled and HandlerError raised.  A
    ``CancelledError`` the handler raises on its own (a cancelled HTTP call,
    say) is a handler failure too; only a cancellation of dedup's own task
    (shutdown, revoke) goes through as one.
    """
    try:
        async with asyncio.timeout(deadline_s) as deadline:
            await call
    except TimeoutError as exc:
        if not deadline.expired():
            raise  # the handler's own TimeoutError: an error like any other
        raise errors.HandlerError(
            f"the handler did not finish within handler_timeout={deadline_s:g}s; it was cancelled"
        ) from exc
    except asyncpg.InterfaceError as exc:
        if conn.is_closed():
            raise  # the connection was lost: retried like any outage
        # The handler misused the connection (a nested transaction of another
        # isolation level, say): its fault, not an outage to retry forever.
        raise errors.HandlerError(f"the handler misused its connection: {exc}") from exc
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        raise errors.HandlerError(
            "the handler raised CancelledError though dedup did not cancel it "
            "(a timeout or a cancelled call inside the handler?)"
        ) from exc
    guard.check_open(conn)


def failed_offset(exc: BaseException) -> int | None:
    """The offset of the message whose (per-message) handler raised ``exc``, if known."""
    offset = getattr(exc, "_dedup_offset", None)
    return offset if isinstance(offset, int) else None


def _milliseconds(seconds: float | None) -> str | None:
    """A setting's value in ms, as text (None stays None: the session's own value)."""
    return None if seconds is None else str(round(seconds * 1000))


def describe(value: Any) -> str:
    """A short, payload-free description of an exception for dead letters and logs."""
    text = f"{type(value).__name__}: {value}"
    return text if len(text) <= 500 else text[:497] + "..."
