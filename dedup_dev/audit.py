"""Rows that look like what the consumer and the task runner write, and the CLI as a user runs it.

Seeding with plain INSERTs keeps the audit tests independent of the consumer:
they check what an operator reads, given what the writers leave behind.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import os
import subprocess
import sys
from typing import Any

import orjson

from dedup_dev import effects

UTC = datetime.UTC


def _cli(
    args: tuple[str, ...], dsn: str | None, env: dict[str, str] | None
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of ``python -m dedup.cli ARGS``."""
    full_env = {k: v for k, v in os.environ.items() if k != "DEDUP_DSN"}
    full_env.update(env or {})
    argv = [sys.executable, "-m", "dedup", *args]
    if dsn is not None:
        argv += ["--dsn", dsn]
    return argv, full_env


def run_cli(*args: str, dsn: str | None = None, env: dict[str, str] | None = None) -> Any:
    """``python -m dedup.cli ARGS`` in a subprocess; ``--dsn`` added when given."""
    argv, full_env = _cli(args, dsn, env)
    return subprocess.run(argv, capture_output=True, text=True, check=False, env=full_env)


async def run_cli_async(
    *args: str, dsn: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """:func:`run_cli` without blocking the event loop (a consumer may run in this process)."""
    argv, full_env = _cli(args, dsn, env)
    child = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=full_env
    )
    out, err = await asyncio.wait_for(child.communicate(), 120)
    assert child.returncode is not None
    return subprocess.CompletedProcess(argv, child.returncode, out.decode(), err.decode())


def json_out(done: Any) -> Any:
    """The JSON document a ``--format json`` command printed."""
    assert done.returncode in (0, 1), done.stderr
    return orjson.loads(done.stdout)


def payload_hash(value: bytes) -> bytes:
    """The hash the consumer stores (16-byte BLAKE2b)."""
    return hashlib.blake2b(value, digest_size=16).digest()


async def add_key(
    pool: Any,
    key: str,
    *,
    namespace: str = "payments",
    topic: str = "payments",
    partition: int = 0,
    offset: int = 0,
    token: int = 1,
    value: bytes = b"{}",
    first_seen: datetime.datetime | None = None,
    duplicates: int = 0,
    conflicts: int = 0,
    last_duplicate_at: datetime.datetime | None = None,
) -> None:
    """A claimed key, as the consumer's claim leaves it."""
    await pool.execute(
        """INSERT INTO dedup.processed
               (namespace, idempotency_key, topic, "partition", "offset", token, payload_hash,
                first_seen, processed_at, duplicates, conflicts, last_duplicate_at)
           VALUES ($1, $2, $3, $4, $5, $6, $7, coalesce($8, now()), coalesce($8, now()),
                   $9, $10, $11)""",
        namespace,
        key,
        topic,
        partition,
        offset,
        token,
        payload_hash(value),
        first_seen,
        duplicates,
        conflicts,
        last_duplicate_at,
    )


async def add_dead_letter(
    pool: Any,
    *,
    namespace: str = "payments",
    topic: str = "payments",
    partition: int = 0,
    offset: int = 0,
    key: bytes | None = b"k",
    value: bytes = b"{}",
    headers: list[tuple[str, bytes]] | None = None,
    idempotency_key: str | None = None,
    reason: str = "handler failed",
    created_at: datetime.datetime | None = None,
    replayed_at: datetime.datetime | None = None,
) -> int:
    """A dead letter, as the consumer writes it; returns its id."""
    headers = headers or []
    dead_letter_id: int = await pool.fetchval(
        """INSERT INTO dedup.dead_letters
               (namespace, group_id, topic, "partition", "offset", timestamp_ms, key, value,
                header_names, header_values, idempotency_key, reason, error, attempts, token,
                created_at, replayed_at)
           VALUES ($1, $1, $2, $3, $4, 1764500000000, $5, $6, $7, $8, $9, $10,
                   'RuntimeError: boom', 3, 1, coalesce($11, now()), $12)
           RETURNING id""",
        namespace,
        topic,
        partition,
        offset,
        key,
        value,
        [n for n, _ in headers],
        [v for _, v in headers],
        idempotency_key,
        reason,
        created_at,
        replayed_at,
    )
    return dead_letter_id


async def add_event(
    pool: Any,
    subject: str,
    kind: str,
    *,
    namespace: str | None = None,
    key: str | None = None,
    resource: str | None = None,
    holder: str | None = None,
    token: int | None = None,
    from_state: str | None = None,
    to_state: str | None = None,
    trace_id: str | None = None,
    detail: dict[str, Any] | None = None,
    at: datetime.datetime | None = None,
) -> None:
    """An events row, as dedup.events.record writes it."""
    await pool.execute(
        """INSERT INTO dedup.events
               (at, subject, kind, namespace, key, resource, holder, token, from_state,
                to_state, trace_id, detail)
           VALUES (coalesce($1, now()), $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)""",
        at,
        subject,
        kind,
        namespace,
        key,
        resource,
        holder,
        token,
        from_state,
        to_state,
        trace_id,
        detail or {},
    )


def consumer(handler: Any, topic: str, bootstrap_servers: str, pool: Any, **kw: Any) -> Any:
    """An IdempotentConsumer of ``topic`` keyed by ``payment_id``, reading from the start."""
    return effects.consumer(handler, topic, bootstrap_servers, pool, key_field="payment_id", **kw)
