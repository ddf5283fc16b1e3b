"""``dedup purge``: forget idempotency keys older than the retention window, cheaply.

Designed for a ``processed`` table of 100 million rows that a consumer keeps
inserting into while the purge runs:

1. The cutoff is fixed once, from the database clock, before anything is
   deleted.  A key goes only when ``first_seen``, ``processed_at`` and
   ``last_duplicate_at`` are all older than the cutoff, and every DELETE
   checks that again row by row: a key inside the window is never removed,
   and a key that is still being redelivered (a recent duplicate) stays.
2. One read of the old part of the table through the BRIN index on
   ``first_seen`` finds which BRIN ranges (``pages_per_range`` blocks, 128
   by default) hold old rows, and how many.  No B-tree is added to the hot
   table for this.
3. Each batch is one short transaction of its own: a TID range scan over a
   few contiguous blocks holding about ``batch_size`` old rows (5,000 by
   default), with a pause between batches.  No long transaction holds back
   vacuum, no lock is held for more than one batch, and ``lock_timeout``
   (``SET LOCAL`` in each batch's transaction, so it holds through a pooler
   in transaction mode too) keeps a batch from queueing behind a consumer's
   transaction for long.
4. Once a range is done it is summarized afresh
   (``brin_desummarize_range`` + ``brin_summarize_range``), because BRIN
   summaries only ever widen: without it every purged range would stay a
   candidate forever.  That is done at the end, once no transaction older
   than the deletes is open in the database (else the deleted rows, still
   visible to it, would go into the summary again; the wait is bounded).  It
   needs the table's owner; it is skipped (and counted) otherwise, or when
   autovacuum holds the table (a 100 ms lock_timeout, shorter than
   ``deadlock_timeout``, so it never cancels an autovacuum).
5. Autovacuum (``autovacuum_vacuum_scale_factor = 0.02`` on ``processed``)
   makes the freed space reusable by new inserts, so the table does not grow.

Dead letters that were replayed before the cutoff go too (unreplayed ones never
do).  Events are kept unless ``events_older_than`` is given: they are the audit
trail, and the runtime role may not delete them.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from dedup import _errors as errors
from dedup import _report as report
from dedup import _timespec as timespec
from dedup.data import _db as db
from dedup.data import _sql as sql

log = logging.getLogger("dedup.retention")

DEFAULT_BATCH_SIZE = 5000
MAX_BATCH_SIZE = 1_000_000
"""The largest ``batch_size``: a batch is one transaction holding its rows' locks,
meant to be short; a million rows is already seconds of locks."""
DEFAULT_PAUSE = 0.05
MAX_PAUSE = 3600.0
"""The longest ``pause`` in seconds: an hour between batches is already a purge
that takes days; longer is a typo."""
BATCH_LOCK_TIMEOUT = "2s"
BATCH_SETTINGS = {"lock_timeout": BATCH_LOCK_TIMEOUT}
"""Each DELETE batch is a transaction of its own with these settings (``SET LOCAL``)."""
RESUMMARIZE_LOCK_TIMEOUT = "100ms"
# Waits between tries when rows or the table are locked (whatever --pause is):
# a consumer's transaction ends in milliseconds, an autovacuum of a small table
# in a second or two; a long autovacuum is not waited for.
BATCH_BACKOFF = (0.1, 0.5, 2.0)
RESUMMARIZE_BACKOFF = (0.5, 1.0, 2.0, 4.0)
# How long purge waits for transactions older than its deletes before summarizing.
SNAPSHOT_WAIT = 10.0


@dataclass(frozen=True)
class Batch:
    """One DELETE: blocks ``lo <= block < hi``, and the BRIN ranges it finishes."""

    lo: int
    """First block."""
    hi: int
    """Block after the last."""
    rows: int
    """Old rows expected in it (from the candidate scan)."""
    finishes: tuple[int, ...] = ()
    """BRIN ranges with no old rows left once this batch is done."""


def plan_batches(
    candidates: Iterable[tuple[int, int]], pages_per_range: int, batch_size: int
) -> list[Batch]:
    """Batches of about ``batch_size`` rows from ``(brin_range, old_rows)`` pairs, in order.

    Small neighbouring ranges share a batch; a range with more than about
    1.5 x ``batch_size`` old rows is split into equal block slices.
    """
    batches: list[Batch] = []
    current: Batch | None = None
    for brin_range, rows in candidates:
        lo, hi = brin_range * pages_per_range, (brin_range + 1) * pages_per_range
        if current and current.hi == lo and current.rows + rows <= batch_size:
            current = Batch(current.lo, hi, current.rows + rows, (*current.finishes, brin_range))
            continue
        if current:
            batches.append(current)
            current = None
        slices = round(rows / batch_size)
        if slices <= 1:
            current = Batch(lo, hi, rows, (brin_range,))
            continue
        step = math.ceil(pages_per_range / slices)
        for start in range(lo, hi, step):
            end = min(start + step, hi)
            share = math.ceil(rows * (end - start) / pages_per_range)
            batches.append(Batch(start, end, share, (brin_range,) if end == hi else ()))
    if current:
        batches.append(current)
    return batches


@dataclass
class PurgeResult:
    """What a purge did (or, with ``dry_run``, would do)."""

    cutoff: datetime.datetime
    """Keys, replayed dead letters and sent outbox rows older than this went."""
    events_cutoff: datetime.datetime | None
    """Events older than this went (None: events kept)."""
    dry_run: bool
    """Nothing was deleted: the counts are what would be."""
    forced: bool = False
    """The cutoff was not before the database's ``now()`` and ``force`` let it run."""
    processed: int = 0
    """Keys deleted."""
    dead_letters: int = 0
    """Replayed dead letters deleted."""
    outbox: int = 0
    """Outbox rows sent before the cutoff, deleted."""
    events: int | None = None
    """Events deleted (None: events kept)."""
    batches: int = 0
    """The DELETE transactions on ``processed``."""
    batches_skipped: int = 0
    """Batches given up after lock timeouts (their keys stay for the next purge)."""
    ranges_resummarized: int = 0
    """BRIN ranges summarized afresh."""
    ranges_not_resummarized: int = 0
    """BRIN ranges left with their old summary (not the owner, or autovacuum held the lock)."""
    seconds: float = 0.0
    """Wall time."""
    query: dict[str, Any] = field(default_factory=dict)
    """The settings, as the report shows them."""

    def as_report(self) -> report.Report:
        """What ``dedup purge`` prints: ``field  value`` lines, or the documented JSON."""
        verb = "to purge" if self.dry_run else "purged"
        events = "kept" if self.events is None else str(self.events)
        lines: dict[str, Any] = {
            "cutoff": report.utc(self.cutoff),
            f"keys {verb}": self.processed,
            f"dead letters {verb}": self.dead_letters,
            f"outbox rows {verb}": self.outbox,
            "events cutoff": report.utc(self.events_cutoff),
            f"events {verb}": events,
        }
        if not self.dry_run:
            lines["batches"] = f"{self.batches} ({self.batches_skipped} skipped: locked, rerun)"
            lines["brin ranges"] = (
                f"{self.ranges_resummarized} summarized afresh, "
                f"{self.ranges_not_resummarized} left as they were"
            )
        if self.forced:
            lines["forced"] = "yes: the cutoff is not in the past"
        lines["seconds"] = round(self.seconds, 3)
        return report.Report(
            query=self.query,
            sections=[report.Section("summary", "", (), table_rows=[lines], in_json=False)],
            fields={
                "cutoff": report.utc(self.cutoff),
                "events_cutoff": report.utc(self.events_cutoff),
                "dry_run": self.dry_run,
                "forced": self.forced,
                "purged": {
                    "processed": self.processed,
                    "dead_letters": self.dead_letters,
                    "outbox": self.outbox,
                    "events": self.events,
                },
                "batches": self.batches,
                "batches_skipped": self.batches_skipped,
                "brin_ranges_resummarized": self.ranges_resummarized,
                "brin_ranges_not_resummarized": self.ranges_not_resummarized,
                "seconds": round(self.seconds, 3),
            },
            vertical=True,
        )


class _Purge:
    def __init__(
        self,
        conn: asyncpg.Connection,
        queries: sql.Queries,
        result: PurgeResult,
        batch_size: int,
        pause: float,
    ) -> None:
        self.conn = conn
        self.queries = queries
        self.result = result
        self.batch_size = batch_size
        self.pause = pause
        self.pages_per_range = 128

    async def processed(self) -> None:
        layout = await self.queries.purge_layout.fetchrow(self.conn)
        if layout is None:
            raise errors.ConfigurationError(
                "no processed table or BRIN index in this schema: run `dedup migrate` first"
            )
        ppr = self.pages_per_range = layout["pages_per_range"]
        candidates = await self.queries.purge_candidate_ranges.fetch(
            self.conn, cutoff=self.result.cutoff, pages_per_range=ppr
        )
        batches = plan_batches(
            ((r["brin_range"], r["n"]) for r in candidates), ppr, self.batch_size
        )
        log.info(
            "purge: %d old keys in %d BRIN ranges", sum(b.rows for b in batches), len(candidates)
        )
        finished: list[int] = []
        for number, batch in enumerate(batches):
            if number:
                await asyncio.sleep(self.pause)
            if await self._delete(batch):
                finished += batch.finishes
        if finished:
            await self._resummarize(finished, owner=layout["owner"])

    async def _delete(self, batch: Batch) -> bool:
        for attempt, backoff in enumerate(BATCH_BACKOFF, start=1):
            try:
                async with db.transaction(self.conn, BATCH_SETTINGS):
                    status = await self.queries.purge_processed_batch.execute(
                        self.conn, lo=(batch.lo, 0), hi=(batch.hi, 0), cutoff=self.result.cutoff
                    )
            except asyncpg.LockNotAvailableError:
                log.info("purge: blocks %d-%d busy (try %d)", batch.lo, batch.hi, attempt)
                await asyncio.sleep(backoff)
                continue
            self.result.processed += int(status.split()[-1])
            self.result.batches += 1
            return True
        self.result.batches_skipped += 1
        return False

    async def _resummarize(self, ranges: Sequence[int], *, owner: bool) -> None:
        """Summarize ``ranges`` afresh, once no older snapshot can see the deleted rows."""
        if not owner:
            log.warning(
                "purge: not the owner of the processed table, so %d purged BRIN ranges keep "
                "their old summaries; run purge as the owner now and then "
                "(docs/howto/audit-and-purge.md)",
                len(ranges),
            )
            self.result.ranges_not_resummarized += len(ranges)
            return
        # Rows deleted under an older snapshot are still "recently dead" and would
        # go into the new summary, keeping it as wide as before.
        await self._wait_for_older_snapshots()
        for backoff in (0.0, *RESUMMARIZE_BACKOFF):
            if not ranges:
                break
            await asyncio.sleep(backoff)
            locked: Sequence[int] = ()
            for done, brin_range in enumerate(ranges):
                try:
                    async with db.transaction(
                        self.conn, {"lock_timeout": RESUMMARIZE_LOCK_TIMEOUT}
                    ):
                        await self.queries.purge_resummarize.execute(
                            self.conn, block=brin_range * self.pages_per_range
                        )
                except asyncpg.LockNotAvailableError:
                    # Whoever holds the table (an autovacuum, mostly) holds it for
                    # every range left: trying each would wait out the lock timeout
                    # once per range (minutes for 10 M purged keys).  Back off instead.
                    locked = ranges[done:]
                    break
                self.result.ranges_resummarized += 1
            ranges = locked
        self.result.ranges_not_resummarized += len(ranges)

    async def _wait_for_older_snapshots(self) -> None:
        marker = await self.queries.purge_marker_xid.fetchval(self.conn)
        deadline = time.monotonic() + SNAPSHOT_WAIT
        while await self.queries.purge_older_snapshots.fetchval(self.conn, marker=marker):
            if time.monotonic() > deadline:
                log.info("purge: a transaction older than the purge is still open; going on")
                return
            await asyncio.sleep(0.1)

    async def dead_letters(self) -> None:
        while True:
            async with db.transaction(self.conn, BATCH_SETTINGS):
                n = await self.queries.purge_dead_letters_batch.fetchval(
                    self.conn, cutoff=self.result.cutoff, limit=self.batch_size
                )
            self.result.dead_letters += n
            if n < self.batch_size:
                return
            await asyncio.sleep(self.pause)

    async def outbox(self) -> None:
        while True:
            async with db.transaction(self.conn, BATCH_SETTINGS):
                n = await self.queries.purge_outbox_batch.fetchval(
                    self.conn, cutoff=self.result.cutoff, limit=self.batch_size
                )
            self.result.outbox += n
            if n < self.batch_size:
                return
            await asyncio.sleep(self.pause)

    async def events(self, cutoff: datetime.datetime) -> None:
        self.result.events = 0
        bound = await self.queries.purge_events_bound.fetchval(self.conn, cutoff=cutoff)
        last = 0
        while bound is not None:
            async with db.transaction(self.conn, BATCH_SETTINGS):
                row = await self.queries.purge_events_batch.fetchrow(
                    self.conn, after=last, bound=bound, cutoff=cutoff, limit=self.batch_size
                )
            if not row["n"]:
                return
            self.result.events += row["n"]
            last = row["last_id"]
            await asyncio.sleep(self.pause)


async def _check_privileges(
    conn: asyncpg.Connection, queries: sql.Queries, *, events: bool
) -> None:
    may = await queries.purge_privileges.fetchrow(conn)
    if may["processed"] is None:  # to_regclass found no table
        raise errors.ConfigurationError(
            f"no dedup tables in schema {queries.schema!r}: check --schema, or run `dedup migrate`"
        )
    if not (may["processed"] and may["dead_letters"] and may["outbox"]):
        raise errors.ConfigurationError(
            "permission denied: this role may not delete from processed, dead_letters and "
            "outbox; "
            "run purge as a role granted the schema's runtime role, or as the owner"
        )
    if events and not may["events"]:
        raise errors.ConfigurationError(
            "--events-older-than: this role may not delete events (they are append-only for "
            "the schema's runtime role); run the events purge as the schema owner"
        )


async def purge(
    conn: asyncpg.Connection,
    schema: str,
    *,
    older_than: datetime.timedelta | None = None,
    before: datetime.datetime | None = None,
    events_older_than: datetime.timedelta | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    pause: float = DEFAULT_PAUSE,
    dry_run: bool = False,
    force: bool = False,
) -> PurgeResult:
    """Delete keys (and replayed dead letters, sent outbox rows, and events if asked) older
    than the window.

    Give exactly one of ``older_than`` (counted back from the database's
    ``now()``) and ``before`` (an absolute cutoff).  ``conn`` must not be in a
    transaction: each batch commits on its own.

    A ``before`` that is not in the past by the database clock is refused
    unless ``force``: it would forget every key, so any redelivery would be
    applied again.
    """
    if (older_than is None) == (before is None):
        raise errors.ConfigurationError("give one of --older-than DURATION and --before TIME")
    if not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise errors.ConfigurationError(
            f"--batch-size {batch_size}: expected an integer from 1 to {MAX_BATCH_SIZE}"
        )
    if not 0 <= pause <= MAX_PAUSE:
        raise errors.ConfigurationError(
            f"--pause {pause}: expected seconds from 0 to {MAX_PAUSE:g}"
        )
    queries = sql.Queries(schema)
    now = await queries.database_now.fetchval(conn)
    cutoff = before if before is not None else now - older_than
    # Judged by the database clock, as the keys' times are; a machine whose clock
    # runs behind must not make a cutoff look past.
    forced = cutoff >= now
    if forced and not force:
        raise errors.ConfigurationError(
            f"--before {report.utc(cutoff)} is not in the past (the database's now() is "
            f"{report.utc(now)}): it would purge every key, so any redelivery would be "
            "applied again; pass --force to purge anyway"
        )
    events_cutoff = now - events_older_than if events_older_than is not None else None
    result = PurgeResult(cutoff=cutoff, events_cutoff=events_cutoff, dry_run=dry_run, forced=forced)
    result.query = {
        "older_than": timespec.format_duration(older_than),
        "before": report.utc(before),
        "events_older_than": timespec.format_duration(events_older_than),
        "batch_size": batch_size,
        "pause": pause,
        "dry_run": dry_run,
        "force": force,
    }
    await _check_privileges(conn, queries, events=events_cutoff is not None)
    started = time.monotonic()
    if dry_run:
        counts = await queries.purge_counts.fetchrow(
            conn, cutoff=cutoff, events_cutoff=events_cutoff
        )
        result.processed, result.dead_letters = counts["processed"], counts["dead_letters"]
        result.outbox = counts["outbox"]
        result.events = counts["events"] if events_cutoff is not None else None
    else:
        work = _Purge(conn, queries, result, batch_size, pause)
        await work.processed()
        await work.dead_letters()
        await work.outbox()
        if events_cutoff is not None:
            await work.events(events_cutoff)
    result.seconds = time.monotonic() - started
    log.info(
        "purge: %d keys, %d dead letters, %d outbox rows, %s events older than %s in %.1fs",
        result.processed,
        result.dead_letters,
        result.outbox,
        result.events,
        cutoff,
        result.seconds,
    )
    return result
