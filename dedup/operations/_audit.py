"""Read-only answers from the database: ``dedup audit`` and ``dedup events``.

``audit`` says what happened to messages: the claimed key (``processed``:
where it came from, under which token, how many duplicates and conflicts were
suppressed) and any dead letter.  ``events`` tells the story of a key, a lease
or partition (resource), or a task, from the append-only ``events`` table.

Everything here is a plain SELECT, so it runs under the schema's read-only
audit role (sql/migrations/0004_schema_roles.sql).  The output format is documented in
docs/reference/cli.md; the field names are a contract.
"""

from __future__ import annotations

import datetime
import getpass
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import asyncpg
import orjson

from dedup import _errors as errors
from dedup import _report as report
from dedup import _timespec as timespec
from dedup import keys
from dedup.data import _sql as sql

STATUSES = ("processed", "duplicate", "conflict", "dead_lettered")
"""What ``audit --status`` selects: claimed keys, keys that had duplicates or
conflicts suppressed, dead letters."""

PROCESSED_COLUMNS = report.columns(
    "namespace, idempotency_key:key, topic, partition:part, offset, token, status, "
    "first_seen, duplicates:dups, conflicts, last_duplicate_at:last duplicate"
)
ERROR_CELL = 100
"""Most characters of a dead letter's ``error`` in a table: an exception's type and a sentence
of its message (``dead-letters show`` and JSON have it whole)."""
DEAD_LETTER_COLUMNS = (
    *report.columns(
        "id, namespace, topic, partition:part, offset, idempotency_key:key, reason, "
        "attempts, created_at, replayed_at"
    ),
    # Last, as it is the longest: the cause a handler raised.
    report.Column("error", width=ERROR_CELL),
)
EVENT_COLUMNS = report.columns(
    "id, at, subject, kind, namespace, key, resource, holder, token, "
    "from_state:from, to_state:to, trace_id, detail"
)


def operator() -> str:
    """Who runs an operator command, for the events it records: ``user@host``."""
    return f"{getpass.getuser()}@{socket.gethostname()}"


def parse_statuses(text: str) -> list[str]:
    """``duplicate,conflict`` -> the statuses, each one of :data:`STATUSES`."""
    found = [s.strip() for s in text.split(",") if s.strip()]
    for status in found:
        if status not in STATUSES:
            raise ValueError(f"invalid status {status!r}: expected one of {', '.join(STATUSES)}")
    if not found:
        raise ValueError(f"invalid status {text!r}: expected one of {', '.join(STATUSES)}")
    return found


def check_window(since: timespec.TimeSpec | None, until: timespec.TimeSpec | None) -> None:
    """Refuse an empty window (durations are checked once resolved, see :class:`Window`)."""
    if isinstance(since, datetime.datetime) and isinstance(until, datetime.datetime):
        Window(since, until).check()


@dataclass(frozen=True)
class Window:
    """A time window, resolved against the database clock."""

    since: datetime.datetime | None = None
    """From (inclusive)."""
    until: datetime.datetime | None = None
    """To (exclusive)."""

    @classmethod
    async def resolve(
        cls,
        conn: asyncpg.Connection,
        queries: sql.Queries,
        since: timespec.TimeSpec | None,
        until: timespec.TimeSpec | None,
    ) -> Window:
        """Durations count back from the database's ``now()``."""
        if since is None and until is None:
            return cls()
        now = await queries.database_now.fetchval(conn)
        window = cls(timespec.resolve(since, now), timespec.resolve(until, now))
        window.check()
        return window

    def check(self) -> None:
        """Refuse a window that ends before it starts."""
        if self.since and self.until and self.since >= self.until:
            shown = self.as_query()
            raise errors.ConfigurationError(
                f"--since {shown['since']} is not before --until {shown['until']}"
            )

    def as_query(self) -> dict[str, str | None]:
        """For the report's ``query``."""
        return {"since": report.utc(self.since), "until": report.utc(self.until)}


def nothing_matches(what: str, asked: Mapping[str, Any]) -> str:
    """``no events match key=k1, namespace=pay``: what a table says when nothing was found."""
    given = [
        keys.shorten(f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}", 80)
        for k, v in asked.items()
        if v not in (None, False) and k != "limit"
    ]
    return f"no {what} match {', '.join(given)}" if given else f"no {what}"


async def _namespaces(
    conn: asyncpg.Connection, query: sql.Query, key: str | None, namespace: str | None
) -> list[str] | None:
    # A key alone would scan the table: the index leads with the namespace.
    # Enumerating the few namespaces lets Postgres probe (namespace, key) instead.
    if namespace is not None:
        return [namespace]
    if key is None:
        return None
    return [r["namespace"] for r in await query.fetch(conn)]


async def limited(
    conn: asyncpg.Connection, query: sql.Query, limit: int, **values: Any
) -> tuple[list[dict[str, Any]], bool]:
    """Up to ``limit`` rows of ``query`` as JSON-ready rows, and whether there were more."""
    records = await query.fetch(conn, **values, limit=limit + 1)
    return [report.json_row(r) for r in records[:limit]], len(records) > limit


@dataclass(frozen=True, kw_only=True)
class Lookup:
    """What ``dedup audit`` and ``dedup events`` both filter by; ``None`` means no filter."""

    key: str | None = None
    """The idempotency key, as the user knows it or as stored (see :func:`keys.lookup_forms`);
    for a task's events, its business key."""
    namespace: str | None = None
    """The consumer namespace (for events, a task code is one too)."""
    since: timespec.TimeSpec | None = None
    """At or after (audit: first seen; dead letters: created)."""
    until: timespec.TimeSpec | None = None
    """Before."""
    limit: int = report.DEFAULT_LIMIT
    """Most rows per section."""

    ASK: ClassVar[str] = "say what to look up"
    """What to say when the query names nothing: the options that would."""

    def naming(self) -> tuple[object, ...]:
        """The filters of which at least one must be given."""
        return (self.key,)

    def check(self) -> None:
        """Refuse an empty window (durations are checked once resolved, see :class:`Window`),
        or a query that names nothing (:attr:`ASK` says what to give)."""
        check_window(self.since, self.until)
        if all(v is None for v in self.naming()):
            raise errors.ConfigurationError(self.ASK)

    async def window(self, conn: asyncpg.Connection, queries: sql.Queries) -> Window:
        """Check the query, then resolve its window against the database clock."""
        self.check()
        return await Window.resolve(conn, queries, self.since, self.until)


@dataclass(frozen=True, kw_only=True)
class AuditQuery(Lookup):
    """What ``dedup audit`` was asked; ``None`` means no filter."""

    topic: str | None = None
    """Where the message came from: topic, partition and offset together."""
    partition: int | None = None
    """See ``topic``."""
    offset: int | None = None
    """See ``topic``."""
    statuses: Sequence[str] | None = None
    """Any of :data:`STATUSES`."""

    ASK = (
        "say what to audit: --key KEY, --topic T --partition P --offset O, "
        "or --since TIME (with --until, --status)"
    )

    def naming(self) -> tuple[object, ...]:
        return (self.key, self.topic, self.since)

    def check(self) -> None:
        """Refuse a query that names no message, naming the options to use."""
        where = (self.topic, self.partition, self.offset)
        if any(v is not None for v in where) and any(v is None for v in where):
            raise errors.ConfigurationError(
                "--topic, --partition and --offset go together: give all three"
            )
        super().check()


async def audit(conn: asyncpg.Connection, schema: str, q: AuditQuery) -> report.Report:
    """The claimed keys and dead letters matching ``q``."""
    queries = sql.Queries(schema)
    window = await q.window(conn, queries)
    statuses = set(q.statuses or STATUSES)
    where = {
        "keys": keys.lookup_forms(q.key) if q.key is not None else None,
        "topic": q.topic,
        "partition": q.partition,
        "offset": q.offset,
        "since": window.since,
        "until": window.until,
    }

    processed: list[dict[str, Any]] = []
    dead: list[dict[str, Any]] = []
    cut_processed = cut_dead = False
    processed_statuses = sorted(statuses - {"dead_lettered"})
    if processed_statuses:
        namespaces = await _namespaces(conn, queries.processed_namespaces, q.key, q.namespace)
        wanted = {**where, "namespaces": namespaces, "statuses": processed_statuses}
        processed, cut_processed = await limited(conn, queries.audit_processed, q.limit, **wanted)
    if "dead_lettered" in statuses:
        namespaces = [q.namespace] if q.namespace is not None else None
        dead, cut_dead = await limited(
            conn, queries.audit_dead_letters, q.limit, **where, namespaces=namespaces, pending=False
        )

    asked = {
        "key": q.key,
        "namespace": q.namespace,
        "topic": q.topic,
        "partition": q.partition,
        "offset": q.offset,
        **window.as_query(),
        "status": sorted(statuses) if q.statuses else None,
        "limit": q.limit,
    }
    return report.Report(
        query=asked,
        sections=[
            report.Section("processed", "processed keys", PROCESSED_COLUMNS, processed),
            report.Section("dead_letters", "dead letters", DEAD_LETTER_COLUMNS, dead),
        ],
        truncated=cut_processed or cut_dead,
        nothing=nothing_matches("processed keys or dead letters", asked),
    )


@dataclass(frozen=True, kw_only=True)
class EventsQuery(Lookup):
    """What ``dedup events`` was asked; ``None`` means no filter."""

    resource: str | None = None
    """A lease resource, or ``topic:partition`` / ``group:topic:partition``."""
    task: str | None = None
    """A task code (events with subject ``task``, and ``lease`` for its lease); it is the
    namespace, so ``namespace`` is not given with it."""
    kind: str | None = None
    """One transition, e.g. ``task_taken_over``."""

    ASK = (
        "say whose events: --key KEY [--namespace NS], --resource R, "
        "or --task CODE [--business-key KEY]"
    )

    def naming(self) -> tuple[object, ...]:
        return (self.key, self.resource, self.task)


async def events(conn: asyncpg.Connection, schema: str, q: EventsQuery) -> report.Report:
    """The events matching ``q``, oldest first."""
    queries = sql.Queries(schema)
    window = await q.window(conn, queries)
    namespace = q.task if q.task is not None else q.namespace
    namespaces = await _namespaces(conn, queries.events_namespaces, q.key, namespace)
    # A task's story includes the lease it ran under (same namespace and key).
    subjects = ["task", "lease"] if q.task is not None else None
    # A task's business key is stored as given; a message's key may be a digest.
    stored_keys = keys.lookup_forms(q.key) if q.key is not None else None
    rows, cut = await limited(
        conn,
        queries.audit_events,
        q.limit,
        keys=stored_keys,
        namespaces=namespaces,
        resource=q.resource,
        subjects=subjects,
        kind=q.kind,
        since=window.since,
        until=window.until,
    )
    for row in rows:  # JSON text (see queries/audit.sql), whatever codecs the connection has
        row["detail"] = orjson.loads(row["detail"])
    if q.task is not None:
        asked: dict[str, Any] = {"task": q.task, "business_key": q.key}
    else:
        asked = {"key": q.key, "namespace": q.namespace, "resource": q.resource}
    asked.update(kind=q.kind, **window.as_query(), limit=q.limit)
    return report.Report(
        query=asked,
        sections=[report.Section("events", "events", EVENT_COLUMNS, rows)],
        truncated=cut,
        nothing=nothing_matches("events", asked),
    )
