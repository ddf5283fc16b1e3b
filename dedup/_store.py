"""What happens inside one batch transaction, for the consumer and for ``wrap``.

The caller opens the transaction; :meth:`Store.apply` then, on that connection:

1. fences and claims in one statement (``fence_and_claim``): the partition's
   offset moves only under the current token, and the batch's keys are claimed
   with one set-based ``INSERT ... ON CONFLICT``;
2. runs the handler for the fresh keys only, in offset order (after a
   deadlock, first waiting for the group's turn: :mod:`dedup._lanes`);
3. writes dead letters and the events of conflicts and dead letters
   (:mod:`dedup._outcomes`).

If the fence fails nothing was written and :class:`dedup.StaleTokenError` is
raised, so the caller's transaction rolls back.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import asyncpg

from dedup import _errors as errors
from dedup import _events as events
from dedup import _faults as faults
from dedup import _handler as handler_
from dedup import _lanes as lanes
from dedup import _message as message_
from dedup import _outcomes as outcomes
from dedup import _sql as sql
from dedup import _telemetry as telemetry

log = logging.getLogger("dedup.store")


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
        self, *, schema: str, namespace: str, on_conflict: str = message_.OnConflict.DEAD_LETTER
    ) -> None:
        self.on_conflict = message_.policy(message_.OnConflict, "on_conflict", on_conflict)
        self.schema = schema
        self.namespace = namespace
        self.queries = sql.Queries(schema)

    async def take_partitions(
        self,
        conn: asyncpg.Connection,
        group_id: str,
        holder: str,
        partitions: Sequence[tuple[str, int]],
    ) -> dict[tuple[str, int], tuple[int, int | None]]:
        """Take ``partitions`` with fresh tokens; return ``{(topic, p): (token, next_offset)}``."""
        rows = await self.queries.take_partitions.fetch(
            conn,
            group_id=group_id,
            holder=holder,
            topics=[t for t, _ in partitions],
            partitions=[p for _, p in partitions],
        )
        taken = {(r["topic"], r["partition"]): (r["token"], r["next_offset"]) for r in rows}
        await events.record(
            conn,
            self.schema,
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
        row = await self.queries.partition_position.fetchrow(
            conn, group_id=group_id, topic=topic, partition=partition
        )
        return None if row is None else Position(row["holder"], row["token"], row["next_offset"])

    async def positions(
        self, conn: asyncpg.Connection, group_id: str, partitions: Sequence[tuple[str, int]]
    ) -> dict[tuple[str, int], Position]:
        """:meth:`position` of each of ``partitions`` that has a row, in one statement.

        The consumer's periodic owner look (fault point ``OWNER_LOOK``).
        """
        await faults.point(
            faults.Point.OWNER_LOOK, conn=conn, group_id=group_id, partitions=partitions
        )
        rows = await self.queries.partition_positions.fetch(
            conn,
            group_id=group_id,
            topics=[t for t, _ in partitions],
            partitions=[p for _, p in partitions],
        )
        return {
            (r["topic"], r["partition"]): Position(r["holder"], r["token"], r["next_offset"])
            for r in rows
        }

    async def stale_rejected(
        self,
        conn: asyncpg.Connection,
        resource: str,
        *,
        holder: str,
        token: int,
        expected: int | None,
    ) -> None:
        """Record that ``resource``'s fence refused ``holder``'s write under ``token``."""
        event = events.Event(
            "partition",
            "stale_rejected",
            namespace=self.namespace,
            resource=resource,
            holder=holder,
            token=token,
            detail={"expected_offset": expected},
        )
        await events.record(conn, self.schema, [event])

    async def mark_start(
        self,
        conn: asyncpg.Connection,
        fence: Fence,
        topic: str,
        partition: int,
        *,
        offset: int,
        stretch: int,
    ) -> tuple[int, bool] | None:
        """Record, committed on its own, that a batch under ``fence`` starts at ``offset``.

        Returns the attempts at that message, this one included, and whether it
        lies in a stretch to apply one message at a time (an earlier holder died
        in it; a death found now opens one of ``stretch`` offsets).  None: the
        fence no longer holds.  See ``mark_start`` in the named queries.
        """
        row = await self.queries.mark_start.fetchrow(
            conn,
            group_id=fence.group_id,
            topic=topic,
            partition=partition,
            token=fence.token,
            offset=offset,
            stretch=stretch,
        )
        return None if row is None else (int(row["starts"]), bool(row["single"]))

    async def unmark_start(
        self, conn: asyncpg.Connection, fence: Fence, topic: str, partition: int, offset: int
    ) -> None:
        """Take back the attempt :meth:`mark_start` counted at ``offset`` (no death cut it)."""
        await self.queries.unmark_start.execute(
            conn,
            group_id=fence.group_id,
            topic=topic,
            partition=partition,
            token=fence.token,
            offset=offset,
        )

    async def advance(
        self, conn: asyncpg.Connection, fence: Fence, topic: str, partition: int, next_offset: int
    ) -> None:
        """Move the partition's offset to ``next_offset`` under ``fence``, claiming nothing.

        For records Kafka never hands out (transaction markers, aborted
        transactions, compacted gaps).  Raises :class:`dedup.StaleTokenError`
        when the fence does not hold.
        """
        spot = dict(conn=conn, fence=fence, topic=topic, partition=partition)
        spot["next_offset"] = next_offset
        await faults.point(faults.Point.BEFORE_FENCE, **spot)
        where = dict(group_id=fence.group_id, topic=topic, partition=partition)
        fenced = await self.queries.advance_partition.fetchval(
            conn, **where, next_offset=next_offset, token=fence.token, expected=fence.expected
        )
        await faults.point(faults.Point.AFTER_FENCE, **spot)
        if fenced is None:
            raise errors.StaleTokenError(f"{fence.group_id}:{topic}:{partition}", fence.token)

    async def apply(
        self,
        conn: asyncpg.Connection,
        msgs: Sequence[message_.Message],
        *,
        handler: handler_.MessageHandler | handler_.BatchHandler,
        batch_handler: bool,
        fence: Fence | None,
        dead: Sequence[DeadLetter] = (),
        handler_timeout: float | None = None,
        idle_timeout: float | None = None,
        lock_timeout: float | None = None,
        turn: lanes.Turn | None = None,
    ) -> BatchResult:
        """Apply one batch inside the caller's open transaction (see the module docstring).

        ``msgs`` have their idempotency keys set; ``dead`` are messages of the same
        partition to dead-letter instead of applying.  All of them are consecutive
        records of one partition.  ``idle_timeout`` and ``lock_timeout`` (seconds)
        are the transaction's ``idle_in_transaction_session_timeout`` and
        ``lock_timeout`` from its first statement on (None: the session's own).
        ``turn``: the handler first waits for it (the lanes turned serial); the
        caller ends it when the transaction ends.
        """
        result = BatchResult(dead_letters=list(dead))
        first, copies = _first_copies(msgs)
        offsets = [m.offset for m in msgs] + [d.msg.offset for d in dead]
        if not offsets:
            return result
        result.next_offset = max(offsets) + 1
        any_msg = msgs[0] if msgs else dead[0].msg
        spot: dict[str, Any] = {"conn": conn, "fence": fence, "topic": any_msg.topic}
        spot.update(partition=any_msg.partition, next_offset=result.next_offset)
        if fence is not None:
            await faults.point(faults.Point.BEFORE_FENCE, **spot)
        # Claim in key order: two batches that share keys then lock them in the
        # same order and can't deadlock.
        keys = sorted(first)
        rows = await self.queries.fence_and_claim.fetch(
            conn,
            group_id=fence.group_id if fence else None,
            topic=any_msg.topic,
            partition=any_msg.partition,
            next_offset=result.next_offset,
            token=fence.token if fence else None,
            expected=fence.expected if fence else None,
            namespace=self.namespace,
            keys=keys,
            offsets=[first[k][0].offset for k in keys],
            hashes=[first[k][1] for k in keys],
            topics=None,
            partitions=None,
            idle_timeout_ms=_milliseconds(idle_timeout),
            lock_timeout_ms=_milliseconds(lock_timeout),
        )
        if fence is not None:
            await faults.point(faults.Point.AFTER_FENCE, **spot)
            if rows[0]["fenced"] == 0:
                raise errors.StaleTokenError(
                    f"{fence.group_id}:{any_msg.topic}:{any_msg.partition}", fence.token
                )
        await self._sort_claimed(conn, result, rows, first, copies)
        if result.applied:
            if turn is not None:
                await self._take_turn(conn, turn, idle_timeout)
            await handler_.run(
                handler,
                batch_handler=batch_handler,
                msgs=result.applied,
                conn=conn,
                token=fence.token if fence else 0,
                deadline_s=handler_timeout,
            )
            telemetry.transition(
                "applied", {"namespace": self.namespace, "count": len(result.applied)}
            )
        await outcomes.record(conn, self.queries, self.namespace, result, fence)
        return result

    async def _take_turn(
        self, conn: asyncpg.Connection, turn: lanes.Turn, idle_timeout: float | None
    ) -> None:
        """Wait for the consumer's turn, then the group's (:mod:`dedup._lanes`)."""

        async def drop_snapshot() -> str:
            return await self.queries.drop_snapshot.execute(conn)

        await drop_snapshot()
        await turn.wait(drop_snapshot, None if idle_timeout is None else idle_timeout / 3)
        await self.queries.serialize_group.execute(conn, group_id=turn.group_id)

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
            rows = await self.queries.fence_and_claim.fetch(  # without a fence
                conn,
                **_NO_FENCE,
                namespace=self.namespace,
                keys=keys,
                offsets=[m.offset for m in found],
                hashes=[first[k][1] for k in keys],
                topics=[m.topic for m in found],
                partitions=[m.partition for m in found],
            )
            await self._sort_claimed(conn, result, rows, first, copies)
        await outcomes.record(conn, self.queries, self.namespace, result, None)
        return result

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
        await self.queries.count_copies.execute(
            conn,
            namespace=self.namespace,
            keys=keys,
            duplicates=[counts[k][0] for k in keys],
            conflicts=[counts[k][1] for k in keys],
        )

    def _conflict(self, result: BatchResult, msg: message_.Message, original: str) -> None:
        result.conflicts.append(msg)
        if self.on_conflict is message_.OnConflict.DEAD_LETTER:
            result.dead_letters.append(
                DeadLetter(
                    msg,
                    f"conflict: key {msg.idempotency_key!r} was applied from {original} "
                    "with a different payload",
                )
            )


# fence_and_claim for keys of any partitions, in the caller's transaction.
_NO_FENCE: dict[str, Any] = dict.fromkeys(
    (
        "group_id",
        "topic",
        "partition",
        "next_offset",
        "token",
        "expected",
        "idle_timeout_ms",
        "lock_timeout_ms",
    ),
)


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


def _milliseconds(seconds: float | None) -> str | None:
    """A setting's value in ms, as text (None stays None: the session's own value)."""
    return None if seconds is None else str(round(seconds * 1000))
