"""Numbered, re-runnable migrations applied under an advisory lock.

Each file ``NNNN_name.sql`` of a migrations folder is applied once, in order, in
one transaction per ``migrate`` call, and recorded in ``{schema}.migrations``
under its component name (``dedup`` for the library, a service's own name for
its tables).  Two processes migrating at once serialize on the lock; the second
finds nothing left to do, and changes nothing (no DDL runs when nothing is
pending, so a role without DDL rights may run it on an up-to-date schema).

For other migration tools (alembic, flyway) :func:`script` renders the same
statements as one SQL text, bookkeeping included; :func:`status` tells what is
applied; :func:`check` is what the library runs at start: it refuses a schema
that lacks a migration it needs, and accepts one with migrations it does not
know (a newer dedup's, which only add).
"""

from __future__ import annotations

import datetime
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from dedup import _db as db
from dedup import _errors as errors
from dedup import _sql as sql

log = logging.getLogger("dedup.migrations")

_FILE = re.compile(r"(\d{4})_(\w+)\.sql")

_LOCK = "SELECT pg_advisory_xact_lock(hashtext($1))"
# Not CREATE SCHEMA IF NOT EXISTS: that needs CREATE on the database even when
# the schema exists, which the owner of a schema a DBA made for it may lack.
_CREATE_SCHEMA = """DO $schema$ BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_namespace WHERE nspname = {name}) THEN
        CREATE SCHEMA {schema};
    END IF;
END $schema$"""
_CREATE_TABLE = """CREATE TABLE IF NOT EXISTS {schema}.migrations (
    component  text        NOT NULL,
    version    integer     NOT NULL,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (component, version)
)"""
_RECORD = "INSERT INTO {schema}.migrations (component, version, name) VALUES ($1, $2, $3)"
_APPLIED = "SELECT component, version, name, applied_at FROM {schema}.migrations"
_PRIVILEGES = """
SELECT current_user AS role,
       current_database() AS database,
       n.oid IS NOT NULL AS schema_exists,
       pg_get_userbyid(n.nspowner) AS owner,
       coalesce(pg_has_role(n.nspowner, 'USAGE'), false) AS owns
  FROM (SELECT 1) AS one
  LEFT JOIN pg_catalog.pg_namespace n ON n.nspname = $1
"""

APPLIED = "applied"
"""Status of a migration recorded in the schema."""
PENDING = "pending"
"""Status of a migration this dedup ships that the schema lacks."""
NEWER = "newer"
"""Status of a recorded dedup migration this dedup does not ship (a newer release applied it)."""


@dataclass(frozen=True)
class Migration:
    """One migration file."""

    version: int
    """The number the file name starts with; applied in increasing order."""
    name: str
    """The rest of the file name, without ``.sql``."""
    path: Path
    """Where the SQL is."""

    def sql(self, schema_name: str) -> str:
        """The file's SQL for ``schema_name``."""
        return sql.render(self.path.read_text(encoding="utf-8"), schema_name)


@dataclass(frozen=True)
class Status:
    """Where one migration stands in a schema."""

    component: str
    """``dedup``, or a bundled service's name."""
    version: int
    """Its number."""
    name: str
    """Its name (the file name without number and ``.sql``)."""
    status: str
    """:data:`APPLIED`, :data:`PENDING` or :data:`NEWER`."""
    applied_at: datetime.datetime | None
    """When it was applied (database time); None when pending."""


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
    schema_name: str = sql.DEFAULT_SCHEMA,
    directory: Path | None = None,
    component: str = "dedup",
) -> list[str]:
    """Bring the schema up to date; return the names of the migrations applied now.

    ``dsn_or_pool`` is a DSN string, an asyncpg pool or an asyncpg connection.
    A DSN gets a connection without a statement cache (each statement runs
    once anyway), so it works through a pooler in transaction mode too.
    A role that may not make the changes gets a ConfigurationError naming the
    role and what it needs.
    """
    sql.quote(schema_name)  # fail fast, before connecting, on a bad name
    shipped = discover(directory or sql.migrations_dir())
    async with db.connection(dsn_or_pool) as conn:
        try:
            return await _apply(conn, schema_name, shipped, component)
        except asyncpg.InsufficientPrivilegeError as exc:
            raise await _privilege_error(conn, schema_name, exc) from exc


async def _apply(
    conn: asyncpg.Connection,
    schema_name: str,
    shipped: list[Migration],
    component: str,
) -> list[str]:
    applied_now = []
    async with conn.transaction():
        # The lock comes first: even creating the schema races otherwise.
        await conn.execute(_LOCK, lock_key(schema_name))
        rows = await _applied(conn, schema_name)
        done = {row["version"] for row in rows if row["component"] == component}
        pending = [m for m in shipped if m.version not in done]
        if not pending:
            return []
        await conn.execute(_create_schema(schema_name))
        await conn.execute(sql.render(_CREATE_TABLE, schema_name))
        for migration in pending:
            try:
                await conn.execute(migration.sql(schema_name))
            except asyncpg.InsufficientPrivilegeError:
                raise
            except asyncpg.PostgresError as exc:
                raise errors.MigrationError(
                    f"migration {migration.path.name} ({component}) failed: {exc}"
                ) from exc
            await conn.execute(
                sql.render(_RECORD, schema_name),
                component,
                migration.version,
                migration.name,
            )
            log.info("applied migration %s/%s", component, migration.path.name)
            applied_now.append(f"{component}/{migration.path.name}")
    return applied_now


def lock_key(schema_name: str) -> str:
    """The advisory lock migrations of ``schema_name`` take (hashed with ``hashtext``)."""
    return "dedup.migrate:" + schema_name


async def _applied(conn: Any, schema_name: str) -> list[asyncpg.Record]:
    """The rows of ``{schema}.migrations``; none when the table does not exist."""
    table = f"{sql.quote(schema_name)}.migrations"
    if await conn.fetchval("SELECT to_regclass($1)", table) is None:
        return []
    rows: list[asyncpg.Record] = await conn.fetch(sql.render(_APPLIED, schema_name))
    return rows


async def status(
    dsn_or_pool: Any,
    *,
    schema_name: str = sql.DEFAULT_SCHEMA,
    directory: Path | None = None,
    component: str = "dedup",
) -> list[Status]:
    """Every migration of the schema and every one this dedup ships, applied or not.

    Read-only: a role granted ``dedup_audit`` may ask.  Rows of other
    components (the bundled services) are listed as applied; ``component``'s
    migrations are applied, pending or newer (applied, not shipped here).
    """
    sql.quote(schema_name)
    shipped = discover(directory or sql.migrations_dir())
    async with db.connection(dsn_or_pool) as conn:
        try:
            rows = await _applied(conn, schema_name)
        except asyncpg.InsufficientPrivilegeError as exc:
            raise errors.ConfigurationError(
                f"{await _role(conn)} may not read {sql.quote(schema_name)}.migrations ({exc}): "
                "connect as a role granted dedup_runtime or dedup_audit "
                "(docs/howto/audit-and-purge.md), or as the schema's owner"
            ) from exc
    known = {m.version for m in shipped}
    found = [
        Status(
            row["component"],
            row["version"],
            row["name"],
            NEWER if row["component"] == component and row["version"] not in known else APPLIED,
            row["applied_at"],
        )
        for row in rows
    ]
    done = {s.version for s in found if s.component == component}
    found += [
        Status(component, m.version, m.name, PENDING, None)
        for m in shipped
        if m.version not in done
    ]
    found.sort(key=lambda s: (s.component != component, s.component, s.version))
    return found


async def pending(
    dsn_or_pool: Any, *, schema_name: str = sql.DEFAULT_SCHEMA, directory: Path | None = None
) -> list[Migration]:
    """The migrations this dedup ships that the schema lacks."""
    shipped = discover(directory or sql.migrations_dir())
    missing = {
        s.version
        for s in await status(dsn_or_pool, schema_name=schema_name, directory=directory)
        if s.status == PENDING
    }
    return [m for m in shipped if m.version in missing]


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _create_schema(schema_name: str) -> str:
    return sql.render(_CREATE_SCHEMA, schema_name).replace("{name}", _literal(schema_name))


def script(
    migrations: list[Migration],
    *,
    schema_name: str = sql.DEFAULT_SCHEMA,
    component: str = "dedup",
) -> str:
    """The SQL that applies ``migrations`` to ``schema_name`` the way :func:`migrate` does.

    The same statements in the same order, each migration recorded in
    ``{schema}.migrations``, under the same advisory lock; meant to run in one
    transaction (``psql -1``, or a migration of alembic or flyway).
    """
    quoted = sql.quote(schema_name)
    if not migrations:
        return f"-- {component} migrations for schema {quoted}: none pending\n"
    names = ", ".join(f"{m.version:04d}_{m.name}" for m in migrations)
    head = [
        f"-- {component} migrations for schema {quoted}: {names}.",
        "-- Run in one transaction: psql -1 -v ON_ERROR_STOP=1 -f FILE (alembic and flyway",
        "-- run each migration in one). Each is recorded in the migrations table, as",
        "-- `dedup migrate` records it; rerunning the whole text changes nothing.",
    ]
    parts = [
        "\n".join(head),
        f"DO $lock$ BEGIN PERFORM pg_advisory_xact_lock(hashtext("
        f"{_literal(lock_key(schema_name))})); END $lock$;",
        _create_schema(schema_name) + ";",
        sql.render(_CREATE_TABLE, schema_name) + ";",
    ]
    for m in migrations:
        # Text for a person or a tool to run, not a query of ours: the values are
        # literals, quoted (the name is \w+, the schema a checked identifier).
        record = (
            f"INSERT INTO {quoted}.migrations (component, version, name)\n"  # noqa: S608
            f"    VALUES ({_literal(component)}, {m.version}, {_literal(m.name)})\n"
            "    ON CONFLICT (component, version) DO NOTHING;"
        )
        parts.append(f"-- {component}/{m.path.name}\n{m.sql(schema_name).strip()}\n\n{record}")
    return "\n\n".join(parts) + "\n"


async def check(
    dsn_or_pool: Any,
    *,
    schema_name: str = sql.DEFAULT_SCHEMA,
    directory: Path | None = None,
) -> None:
    """Raise ConfigurationError unless every migration this dedup ships is applied.

    Migrations it does not know (applied by a newer dedup) are fine: a
    migration only adds (see docs/operations.md, "Upgrading").
    """
    found = await status(dsn_or_pool, schema_name=schema_name, directory=directory)
    if not any(s.component == "dedup" and s.status != PENDING for s in found):
        raise errors.ConfigurationError(
            f"no dedup tables in schema {schema_name!r}: check the schema setting, or run "
            "`dedup migrate` first"
        )
    missing = [f"{s.version:04d}_{s.name}" for s in found if s.status == PENDING]
    if missing:
        raise errors.ConfigurationError(
            f"schema {schema_name!r} lacks migration {', '.join(missing)}, which this "
            "version of dedup needs: run `dedup migrate` (or apply `dedup migrate --sql`) "
            "before deploying it; see docs/operations.md#upgrading"
        )


async def _role(conn: asyncpg.Connection) -> str:
    """``role "name"``, or ``this role`` when the connection cannot say (a failed transaction)."""
    try:
        return f'role "{await conn.fetchval("SELECT current_user")}"'
    except asyncpg.PostgresError:
        return "this role"


async def _privilege_error(
    conn: asyncpg.Connection, schema_name: str, exc: asyncpg.PostgresError
) -> errors.ConfigurationError:
    """What the role lacks, in words, after a migration was refused for want of a privilege."""
    facts = await conn.fetchrow(_PRIVILEGES, schema_name)
    role, database = facts["role"], facts["database"]
    quoted = sql.quote(schema_name)
    if not facts["schema_exists"]:
        needs = (
            f'creating the schema needs CREATE on database "{database}" '
            f'(GRANT CREATE ON DATABASE "{database}" TO "{role}"), or a DBA makes it for the '
            f'role: CREATE SCHEMA {quoted} AUTHORIZATION "{role}"'
        )
    elif not facts["owns"]:
        needs = (
            f'migrating needs the owner of schema {quoted} and its tables: run it as "'
            f'{facts["owner"]}" or a role granted it'
        )
    else:
        needs = f"migrating needs the owner of schema {quoted}'s tables and of its migrations table"
    return errors.ConfigurationError(
        f'role "{role}" may not migrate schema {quoted} in database "{database}": {exc}; '
        f"{needs}; or give a DBA the SQL: dedup migrate --sql --schema {schema_name}"
    )
