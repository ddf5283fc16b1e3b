"""dedup's statements in the consumer's transactions, and in ``wrap`` and ``claim``.

In one consumer transaction (:mod:`dedup.consumer._turn`), :meth:`Store.fence_and_claim`
sends **one** statement for every partition of the turn: each partition's
offset moves only under its current token and from where this holder left it
(the fence), and the keys of the fenced partitions are claimed with one
set-based ``INSERT ... ON CONFLICT``, in key order.  It answers which
partitions were fenced and, of the keys, only those seen before (duplicates
and conflicts): on the happy path nothing comes back but the fence.  After the
handler, :meth:`Store.record_outcomes` writes the dead letters and the events
of conflicts and dead letters (:mod:`dedup._outcomes`).

:meth:`Store.claim` claims keys of any partitions without a fence, in the
caller's transaction (``dedup.claim``, ``wrap``).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from dedup import _errors as errors
from dedup import _faults as faults
from dedup import _message as message_
from dedup import _outcomes as outcomes
from dedup import _results as results
from dedup import _telemetry as telemetry
from dedup import keys
from dedup.data import _events as events
from dedup.data import _sql as sql

log = logging.getLogger("dedup.store")

# The values of a batch, by the names the rest of dedup (and the chaos suite) knows.
DeadLetter = results.DeadLetter
Fence = results.Fence
Position = results.Position
BatchResult = results.BatchResult


HASH_BYTES = 16
"""The size of a payload hash; the claim statements read them from one bytea by it."""


def payload_hash(value: bytes) -> bytes:
    """The 16-byte BLAKE2b digest stored with each key to tell duplicates from conflicts."""
    return hashlib.blake2b(value, digest_size=HASH_BYTES).digest()


def take_key(
    strategy: keys.Strategy, on_missing_key: str, msg: message_.Message
) -> results.DeadLetter | None:
    """Set ``msg.idempotency_key``; return a dead letter when there is none to set."""
    try:
        msg.idempotency_key = keys.extract(strategy, msg)
    except errors.KeyExtractionError as exc:
        if on_missing_key == "offset":
            msg.idempotency_key = msg.where
            return None
        return results.DeadLetter(msg, f"no idempotency key: {exc}")
    return None


@dataclass(slots=True)
class Part:
    """One partition's share of a consumer transaction: its messages under its fence.

    ``msgs`` have their keys set; ``dead`` are to be dead-lettered instead;
    together they are consecutive records of the partition, in offset order.
    With neither, the part only moves the offset to ``next_offset`` (records
    Kafka never hands out: transaction markers, aborted transactions).
    """

    topic: str
    partition: int
    fence: results.Fence
    msgs: list[message_.Message]
    dead: list[results.DeadLetter] = field(default_factory=list)
    next_offset: int = 0
    """Where the partition's offset stands once the part commits."""

    @property
    def size(self) -> int:
        """Messages and dead letters."""
        return len(self.msgs) + len(self.dead)

    def fault_spot(self, conn: Any) -> dict[str, Any]:
        """What the fence's fault points (:mod:`dedup._faults`) are told."""
        return dict(
            conn=conn,
            fence=self.fence,
            topic=self.topic,
            partition=self.partition,
            next_offset=self.next_offset,
        )


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
    ) -> results.Position | None:
        """Who holds the partition and where its offset stands, or None if it has no row."""
        row = await self.queries.partition_position.fetchrow(
            conn, group_id=group_id, topic=topic, partition=partition
        )
        return (
            None
            if row is None
            else results.Position(row["holder"], row["token"], row["next_offset"])
        )

    async def positions(
        self, conn: asyncpg.Connection, group_id: str, partitions: Sequence[tuple[str, int]]
    ) -> dict[tuple[str, int], results.Position]:
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
            (r["topic"], r["partition"]): results.Position(
                r["holder"], r["token"], r["next_offset"]
            )
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
        fence: results.Fence,
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
        self,
        conn: asyncpg.Connection,
        fence: results.Fence,
        topic: str,
        partition: int,
        offset: int,
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

    async def fence_and_claim(
        self, conn: asyncpg.Connection, parts: Sequence[Part], idle_timeout: float
    ) -> tuple[list[Part], list[results.BatchResult]]:
        """Fence every part and claim the keys of those fenced, in one statement.

        Returns the parts the fence refused (none of their keys was claimed:
        the caller rolls back and runs the rest again) and, for each part, what
        its keys turned out to be: fresh (``applied``, in offset order),
        duplicates or conflicts.  ``idle_timeout`` (seconds) is the
        transaction's ``idle_in_transaction_session_timeout`` from this, its
        first statement, on; nothing else is set on the user's transaction.
        """
        for part in parts:
            await faults.point(faults.Point.BEFORE_FENCE, **part.fault_spot(conn))
        first, copies = _first_copies(parts)
        # Claim in key order: two transactions that share keys then lock them in
        # the same order and can't deadlock on the claim.
        claimed = sorted(first)
        rows = await self.queries.fence_and_claim.fetch(
            conn,
            group_id=parts[0].fence.group_id,
            topics=[p.topic for p in parts],
            partitions=[p.partition for p in parts],
            tokens=[p.fence.token for p in parts],
            expected=[p.fence.expected for p in parts],
            next_offsets=[p.next_offset for p in parts],
            namespace=self.namespace,
            keys=claimed,
            offsets=[first[k][0].offset for k in claimed],
            hashes=b"".join(first[k][1] for k in claimed),
            parts=[first[k][2] + 1 for k in claimed],
            idle_timeout_ms=str(round(idle_timeout * 1000)),
        )
        for part in parts:
            await faults.point(faults.Point.AFTER_FENCE, **part.fault_spot(conn))
        fenced = set(rows[0]["fenced"] or ())
        refused = [p for i, p in enumerate(parts) if i + 1 not in fenced]
        found = [
            results.BatchResult(dead_letters=list(p.dead), next_offset=p.next_offset) for p in parts
        ]
        if refused:
            return refused, found
        await self._sort_claimed(conn, found, rows, first, copies)
        return [], found

    async def record_outcomes(
        self, conn: asyncpg.Connection, result: results.BatchResult, fence: results.Fence | None
    ) -> None:
        """Write a batch's dead letters and the events of its conflicts and dead letters."""
        await outcomes.record(conn, self.queries, self.namespace, result, fence)

    async def claim(
        self,
        conn: asyncpg.Connection,
        msgs: Sequence[message_.Message],
        *,
        dead: Sequence[results.DeadLetter] = (),
    ) -> results.BatchResult:
        """Claim the keys of ``msgs`` inside the caller's open transaction; run nothing.

        For :func:`dedup.claim` and ``wrap``: the caller applies ``result.applied``
        itself, in the same transaction.  ``msgs`` have their idempotency keys set
        and may come from any topics and partitions; ``dead`` are dead-lettered.
        Keys are claimed, and duplicates, conflicts and dead letters recorded,
        with the consumer's rules, in one round trip for the claim.
        """
        result = results.BatchResult(dead_letters=list(dead))
        part = Part("", 0, results.Fence("", 0, None), list(msgs))
        first, copies = _first_copies([part])
        if first:
            claimed = sorted(first)  # key order: concurrent claims can't deadlock
            found = [first[k][0] for k in claimed]
            rows = await self.queries.claim_keys.fetch(
                conn,
                namespace=self.namespace,
                keys=claimed,
                offsets=[m.offset for m in found],
                hashes=b"".join(first[k][1] for k in claimed),
                topics=[m.topic for m in found],
                partitions=[m.partition for m in found],
            )
            await self._sort_claimed(conn, [result], rows, first, copies)
            result.applied.sort(key=_where)  # the caller's records came in any order
        await outcomes.record(conn, self.queries, self.namespace, result, None)
        return result

    async def _sort_claimed(
        self,
        conn: asyncpg.Connection,
        found: list[results.BatchResult],
        rows: Sequence[asyncpg.Record],
        first: dict[str, tuple[message_.Message, bytes, int]],
        copies: list[tuple[message_.Message, bytes, int]],
    ) -> None:
        """File each key's first message as fresh, a duplicate or a conflict, then the copies.

        ``rows`` name only the keys seen before this statement, with what they hold.
        """
        # What each key now holds: its payload hash and where that payload came from
        # (a message of this statement, or a row's topic:partition:offset).
        stored: dict[str, tuple[bytes, message_.Message | str]] = {}
        for row in rows:
            key = row["idempotency_key"]
            if key is None:  # no key seen before: the statement's one row
                continue
            stored[key] = (
                row["payload_hash"],
                f"{row['topic']}:{row['partition']}:{row['offset']}",
            )
        # Each part's messages come in offset order, and so go its fresh ones.
        for key, (msg, digest, i) in first.items():
            held = stored.get(key)
            if held is None:
                found[i].applied.append(msg)
                if copies:
                    stored[key] = (digest, msg)
            else:
                self._classify(found[i], msg, digest, held)
        if copies:
            await self._count_copies(conn, found, copies, stored)
        applied = sum(len(r.applied) for r in found)
        # Per statement, not per message: a span event per message would cost more
        # than the rest of the happy path.
        telemetry.transition("claimed", {"namespace": self.namespace, "count": applied})

    def _classify(
        self,
        result: results.BatchResult,
        msg: message_.Message,
        digest: bytes,
        stored: tuple[bytes, message_.Message | str],
    ) -> bool:
        """File a copy of a claimed key as a duplicate or a conflict; True if a duplicate."""
        stored_digest, source = stored
        original = source if isinstance(source, str) else source.where
        if digest == stored_digest:
            result.duplicates.append(msg)
            return True
        result.conflicts.append(msg)
        if self.on_conflict is message_.OnConflict.DEAD_LETTER:
            result.dead_letters.append(
                results.DeadLetter(
                    msg,
                    f"conflict: key {msg.idempotency_key!r} was applied from {original} "
                    "with a different payload",
                )
            )
        return False

    async def _count_copies(
        self,
        conn: asyncpg.Connection,
        found: list[results.BatchResult],
        copies: list[tuple[message_.Message, bytes, int]],
        stored: dict[str, tuple[bytes, message_.Message | str]],
    ) -> None:
        """Classify the statement's further copies of a key and count them on its row."""
        counts: dict[str, list[int]] = {}  # key -> [duplicates, conflicts]
        for msg, digest, i in copies:
            duplicate = self._classify(found[i], msg, digest, stored[msg.idempotency_key])
            counts.setdefault(msg.idempotency_key, [0, 0])[0 if duplicate else 1] += 1
        counted = sorted(counts)
        await self.queries.count_copies.execute(
            conn,
            namespace=self.namespace,
            keys=counted,
            duplicates=[counts[k][0] for k in counted],
            conflicts=[counts[k][1] for k in counted],
        )


def _where(msg: message_.Message) -> tuple[str, int, int]:
    return msg.topic, msg.partition, msg.offset


def _first_copies(
    parts: Sequence[Part],
) -> tuple[
    dict[str, tuple[message_.Message, bytes, int]], list[tuple[message_.Message, bytes, int]]
]:
    """Each key's first message with its payload hash and its part's index; the later copies."""
    first: dict[str, tuple[message_.Message, bytes, int]] = {}
    copies: list[tuple[message_.Message, bytes, int]] = []
    for i, part in enumerate(parts):
        for msg in part.msgs:
            found = (msg, payload_hash(msg.value), i)
            if msg.idempotency_key in first:
                copies.append(found)
            else:
                first[msg.idempotency_key] = found
    return first, copies
