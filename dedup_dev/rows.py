"""Records that make every kind of outcome, and the rows dedup must leave for them.

Shared by the tests that run the same records through the consumer, ``wrap``
and ``dedup.claim`` on different pools and connections: each must leave these
rows, read back as text (no codec) and parsed here.
"""

from __future__ import annotations

from typing import Any

import asyncpg
import orjson
from aiokafka.structs import ConsumerRecord

VALUES = [
    {"id": "a", "n": 1},
    {"id": "a", "n": 1},  # duplicate
    {"id": "a", "n": 2},  # conflict: dead-lettered
    {"no_id": True},  # no key: dead-lettered
    {"id": "b", "n": 3},
]


def record(
    topic: str, offset: int, value: dict[str, Any], partition: int = 0
) -> ConsumerRecord[Any, Any]:
    """An aiokafka record as a consumer hands it out, with ``value`` as its JSON payload."""
    body = orjson.dumps(value)
    return ConsumerRecord(topic, partition, offset, 0, 0, None, body, None, 0, len(body), [])


async def dedup_rows(conn: asyncpg.Connection) -> dict[str, Any]:
    """dedup's rows: keys with their counts, dead letters, events (partition events left out)."""
    processed = await conn.fetch(
        "SELECT namespace, idempotency_key, duplicates, conflicts FROM dedup.processed"
        " ORDER BY 1, 2"
    )
    dead = await conn.fetch(
        "SELECT namespace, \"offset\", split_part(reason, ':', 1) AS why"
        " FROM dedup.dead_letters ORDER BY 1, 2"
    )
    events = await conn.fetch(
        "SELECT subject, kind, namespace, key, detail::text AS d FROM dedup.events"
        " WHERE subject <> 'partition' ORDER BY id"
    )
    return {
        "processed": [tuple(r) for r in processed],
        "dead_letters": [tuple(r) for r in dead],
        # Sorted: how the consumer cut its batches may change the order of ids.
        "events": sorted(((*tuple(r)[:4], clean(orjson.loads(r["d"]))) for r in events), key=repr),
    }


async def snapshot(dsn: str) -> dict[str, Any]:
    """:func:`dedup_rows`, the ``effects`` table and the task's result."""
    conn = await asyncpg.connect(dsn)
    try:
        effects = await conn.fetch("SELECT key, payload::text AS p FROM effects ORDER BY key, p")
        task = await conn.fetchval("SELECT result::text FROM dedup.tasks")
        found = await dedup_rows(conn)
    finally:
        await conn.close()
    return {
        "effects": [(r["key"], orjson.loads(r["p"])) for r in effects],
        **found,
        "task_result": orjson.loads(task),
    }


def clean(detail: dict[str, Any]) -> dict[str, Any]:
    """Event details without what differs from run to run (times, lease expiries, durations)."""
    return {k: v for k, v in detail.items() if k not in ("expires_at", "reason", "duration")}


EXPECTED = {
    "effects": [
        ("a", {"id": "a", "n": 1}),
        ("a", {"id": "a", "n": 1}),  # one for "pay", one for "wrapped"
        ("b", {"id": "b", "n": 3}),
    ],
    "processed": [("pay", "a", 1, 1), ("pay", "b", 0, 0), ("wrapped", "a", 1, 1)],
    "dead_letters": [
        ("pay", 2, "conflict"),
        ("pay", 3, "no idempotency key"),
        ("wrapped", 2, "conflict"),
    ],
    "events": sorted(
        [
            ("message", "conflict", "pay", "a", {"offset": 2}),
            ("message", "dead_lettered", "pay", None, {"attempts": 1, "offset": 3}),
            ("message", "dead_lettered", "pay", "a", {"attempts": 1, "offset": 2}),
            ("message", "conflict", "wrapped", "a", {"offset": 2}),
            ("message", "dead_lettered", "wrapped", "a", {"attempts": 1, "offset": 2}),
            ("lease", "lease_acquired", "report", "2024-01-31", {"ttl": 30.0}),
            (
                "task",
                "task_started",
                "report",
                "2024-01-31",
                {"attempt": 1, "forced": False, "lease_ttl": 30.0, "renew_every": 10.0},
            ),
            ("task", "task_succeeded", "report", "2024-01-31", {"attempt": 1}),
            ("lease", "lease_released", "report", "2024-01-31", {}),
            ("task", "task_skipped", "report", "2024-01-31", {"held_by": "runner"}),
            (
                "reconcile",
                "reconcile_mismatch",
                "report",
                "2024-01-31",
                {
                    "source_rows": 2,
                    "source_total": 10,
                    "result_rows": 2,
                    "result_total": 7,
                    "rows_difference": 0,
                    "total_difference": -3,
                },
            ),
        ],
        key=repr,
    ),
    "task_result": {"rows": 3, "total": "12.50", "names": ["x", "y"]},
}
