"""Numbered, re-runnable migrations applied under an advisory lock.

Each file ``NNNN_name.sql`` of a migrations folder is applied once, in order, in
one transaction per ``migrate`` call, and recorded in ``{schema}.migrations``
under its component name (``dedup`` for the library, a service's own name for
its tables).  Two processes migrating at once serialize on the lock; the second
finds nothing left to do.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from dedup import db, errors, schema

log = logging.getLogger(__name__)

_FILE = re.compile(r"(\d{4})_(\w+)\.sql")

_BOOTSTRAP = """
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {schema}.migrations (
    component  text        NOT NULL,
    version    integer     NOT NULL,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (component, version)
)"""
_APPLIED = "SELECT version FROM {schema}.migrations WHERE component = $1"
_RECORD = "INSERT INTO {schema}.migrations (component, version, name) VALUES ($1, $2, $3)"


@dataclass(frozen=True)
class Migration:
    """One migration file."""

    version: int
    """The number the file name starts with; applied in increasing order."""
    name: str
    """The rest of the file name, without ``.sql``."""
    path: Path
    """Where the SQL is."""


def discover(directory: Path) -> list[Migration]:
    """The migrations of ``directory``, in the order they apply."""
    found = []
    for path in sorted(directory.glob("*.sql")):
        match = _FILE.fullmatch(path.name)
        if not match:
            raise errors.MigrationError(f"{path}: migration files are named NNNN_name.sql")
        found.append(Migration(int(match[1]), match[2], path))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise errors.MigrationError(f"{directory}: two migrations share a number")
    return found


async def migrate(
    dsn_or_pool: Any,
    *,
    schema_name: str = schema.DEFAULT_SCHEMA,
    directory: Path | None = None,
    component: str = "dedup",
) -> list[str]:
    """Bring the schema up to date; return the names of the migrations applied now.

    ``dsn_or_pool`` is a DSN string, an asyncpg pool or an asyncpg connection.
    A DSN gets a connection without a statement cache (each statement runs
    once anyway), so it works through a pooler in transaction mode too.
    """
    schema.quote(schema_name)  # fail fast, before connecting, on a bad name
    pending = discover(directory or schema.migrations_dir())
    if isinstance(dsn_or_pool, str):
        try:
            conn = await asyncpg.connect(dsn_or_pool, statement_cache_size=0)
        except (OSError, asyncpg.PostgresError) as exc:
            raise errors.ServiceUnavailableError(
                f"cannot connect to Postgres at {db.describe_dsn(dsn_or_pool)} to migrate: {exc}"
            ) from exc
        try:
            return await _apply(conn, schema_name, pending, component)
        finally:
            await conn.close()
    if isinstance(dsn_or_pool, asyncpg.Pool):
        async with dsn_or_pool.acquire() as conn:
            return await _apply(conn, schema_name, pending, component)
    return await _apply(dsn_or_pool, schema_name, pending, component)


async def _apply(
    conn: asyncpg.Connection,
    schema_name: str,
    pending: list[Migration],
    component: str,
) -> list[str]:
    applied_now = []
    async with conn.transaction():
        # The lock comes first: even CREATE SCHEMA IF NOT EXISTS races otherwise.
        await conn.execute(
            "SELECT pg_advisory_xact_lock(hashtext($1))", "dedup.migrate:" + schema_name
        )
        await conn.execute(schema.render(_BOOTSTRAP, schema_name))
        done = {
            row["version"]
            for row in await conn.fetch(schema.render(_APPLIED, schema_name), component)
        }
        for migration in pending:
            if migration.version in done:
                continue
            sql = schema.render(migration.path.read_text(encoding="utf-8"), schema_name)
            try:
                await conn.execute(sql)
            except asyncpg.PostgresError as exc:
                raise errors.MigrationError(
                    f"migration {migration.path.name} ({component}) failed: {exc}"
                ) from exc
            await conn.execute(
                schema.render(_RECORD, schema_name),
                component,
                migration.version,
                migration.name,
            )
            log.info("applied migration %s/%s", component, migration.path.name)
            applied_now.append(f"{component}/{migration.path.name}")
    return applied_now
