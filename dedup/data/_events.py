"""The append-only ``events`` table: every state transition, so the database alone tells the story.

Each :class:`Event` is written in the caller's transaction (it commits or rolls
back with the change it describes) and mirrored as a span event on the current
span (see :mod:`dedup._telemetry`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import orjson

from dedup import _telemetry as telemetry
from dedup.data import _sql as sql


@dataclass(frozen=True)
class Event:
    """One transition."""

    subject: str
    """What the event is about: ``message``, ``partition``, ``lease``, ``task``, ``schedule``,
    ``reconcile``."""
    kind: str
    """The transition: ``duplicate``, ``conflict``, ``task_started``, ... (no ``dedup.`` prefix)."""
    namespace: str | None = None
    """Consumer namespace, or task code."""
    key: str | None = None
    """Idempotency key, or business key."""
    resource: str | None = None
    """Lease resource or ``topic:partition``."""
    holder: str | None = None
    """Who made the transition."""
    token: int | None = None
    """The fencing token it was made under."""
    from_state: str | None = None
    """State before."""
    to_state: str | None = None
    """State after."""
    detail: Mapping[str, Any] = field(default_factory=dict)
    """Anything else worth keeping (offsets, reasons, both tokens of a takeover)."""

    def span_attributes(self) -> dict[str, Any]:
        """The ``dedup.*`` attributes of this event's span event (prefix added later)."""
        attrs: dict[str, Any] = {
            "namespace": self.namespace,
            "key": self.key,
            "resource": self.resource,
            "holder": self.holder,
            "token": self.token,
            "from": self.from_state,
            "to": self.to_state,
        }
        for k, v in self.detail.items():
            if isinstance(v, str | bool | int | float):
                attrs[k] = v
        return attrs


LOST_TO_RETENTION = "offsets_lost_to_retention"
"""A partition's stored offset lay below its log start: retention deleted records never applied."""
BEYOND_LOG_END = "offsets_beyond_log_end"
"""A partition's stored offset lies beyond its log end (the topic was recreated, say): held."""


def lost_to_retention(resource: str, holder: str, token: int, lost: range, namespace: str) -> Event:
    """The event of offsets ``lost`` (``lost.stop`` is the log start the partition resumes at)."""
    return Event(
        "partition",
        LOST_TO_RETENTION,
        namespace=namespace,
        resource=resource,
        holder=holder,
        token=token,
        detail={"lost_from": lost.start, "lost_to": lost.stop, "records": len(lost)},
    )


def beyond_log_end(
    resource: str, holder: str, token: int, offsets: tuple[int, range], command: str, namespace: str
) -> Event:
    """The event of a partition held at ``offsets[0]``, beyond its log ``offsets[1]``; the
    ``command`` moves it back into the log."""
    stored, log = offsets
    return Event(
        "partition",
        BEYOND_LOG_END,
        namespace=namespace,
        resource=resource,
        holder=holder,
        token=token,
        detail={
            "next_offset": stored,
            "log_start": log.start,
            "log_end": log.stop,
            "command": command,
        },
    )


async def record(conn: asyncpg.Connection, schema: str, events: Sequence[Event]) -> None:
    """Write ``events`` in one statement on ``conn`` and add them to the current span."""
    if not events:
        return
    for event in events:
        telemetry.transition(event.kind, event.span_attributes())
    trace_id = telemetry.current_trace_id()
    await sql.Queries(schema).record_events.execute(
        conn,
        subjects=[e.subject for e in events],
        kinds=[e.kind for e in events],
        namespaces=[e.namespace for e in events],
        keys=[e.key for e in events],
        resources=[e.resource for e in events],
        holders=[e.holder for e in events],
        tokens=[e.token for e in events],
        from_states=[e.from_state for e in events],
        to_states=[e.to_state for e in events],
        trace_ids=[trace_id] * len(events),
        # As text, cast in SQL: the json codecs belong to the pool's owner.
        details=[orjson.dumps(dict(e.detail)).decode() for e in events],
    )
