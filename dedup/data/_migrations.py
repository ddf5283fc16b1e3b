"""Numbered, re-runnable migrations applied under an advisory lock.

Each file ``NNNN_name.sql`` of a migrations folder is applied once, in order, in
one transaction per ``migrate`` call, and recorded in ``{schema}.migrations``
under its component name (``dedup`` for the library, a service's own name for
its tables).  Two processes migrating at once serialize on the lock; the second
finds nothing left to do, and changes nothing (no DDL runs when nothing is
pending, so a role without DDL rights may run it on an up-to-date schema).

Migration 0004 grants dedup's tables to a runtime and an audit group role of
the schema's own (:class:`Roles`: named by the operator, or derived from the
database and schema names), recorded in ``{schema}.roles``.

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

from dedup import _errors as errors
from dedup.data import _db as db
from dedup.data import _sql as sql

log = logging.getLogger("dedup.migrations")

_FILE = re.compile(r"(\d{4})_(\w+)\.sql")

APPLIED = "applied"
"""Status of a migration recorded in the schema."""
PENDING = "pending"
"""Status of a migration this dedup ships that the schema lacks."""
NEWER = "newer"
"""Status of a recorded dedup migration this dedup does not ship (a newer release applied it)."""

ROLE_REFUSED: str = "DD001"  # a SQLSTATE, not an environment variable
"""SQLSTATE the roles migration raises for a role it will not grant (0004_schema_roles.sql)."""
_ROLE_NAME_BYTES = 63
"""Postgres' longest role name (NAMEDATALEN - 1); it cuts longer ones without a word."""


@dataclass(frozen=True)
class Roles:
    """The group roles a schema's tables are granted to (migration 0004).

    None is the default, ``<database>_<schema>_runtime`` and
    ``<database>_<schema>_audit``, which the SQL derives where it runs, so
    ``dedup migrate --sql`` prints one text for every database.
    """

    runtime: str | None = None
    """Consumers, task runners, replay and purge: rows of every table, no DDL."""
    audit: str | None = None
    """``dedup audit``, ``events``, ``dead-letters list|show``: SELECT only."""

    def __post_init__(self) -> None:
        for purpose, name in (("runtime", self.runtime), ("audit", self.audit)):
            if name is not None:
                _check_role_name(purpose, name)
        if self.runtime is not None and self.runtime == self.audit:
            raise errors.ConfigurationError(
                f"runtime_role and audit_role are both {self.runtime!r}: give them two names"
            )

    def render(self, text: str) -> str:
        """``text`` with ``{runtime_role}`` and ``{audit_role}`` as string literals (or NULL)."""
        for placeholder, name in (("{runtime_role}", self.runtime), ("{audit_role}", self.audit)):
            text = text.replace(placeholder, "NULL" if name is None else _literal(name))
        return text


def _check_role_name(purpose: str, name: str) -> None:
    """A plain identifier of at most 63 bytes, as for the schema: no quoting surprises."""
    if not sql.plain_identifier(name):
        raise errors.ConfigurationError(
            f"invalid {purpose} role name {name!r}: use lowercase letters, digits and '_' "
            f"(at most {_ROLE_NAME_BYTES}, not starting with a digit)"
        )


@dataclass(frozen=True)
class Migration:
    """One migration file."""

    version: int
    """The number the file name starts with; applied in increasing order."""
    name: str
    """The rest of the file name, without ``.sql``."""
    path: Path
    """Where the SQL is."""

    def sql(self, schema: str, roles: Roles | None = None) -> str:
        """The file's SQL for ``schema``, granting to ``roles`` (default: the derived names)."""
        return (roles or Roles()).render(sql.render(self.path.read_text(encoding="utf-8"), schema))


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
    schema: str = sql.DEFAULT_SCHEMA,
    directory: Path | None = None,
    component: str = "dedup",
    runtime_role: str | None = None,
    audit_role: str | None = None,
) -> list[str]:
    """Bring the schema up to date; return the names of the migrations applied now.

    ``dsn_or_pool`` is a DSN string, an asyncpg pool or an asyncpg connection.
    ``runtime_role`` and ``audit_role`` name the group roles the schema's
    tables are granted to (created if missing; default
    ``<database>_<schema>_runtime`` and ``<database>_<schema>_audit``); a
    schema keeps the roles it was first migrated with, and naming others
    later is a ConfigurationError.  So is a role that already has privileges
    in another database or on another dedup schema, and a role that may not
    make the changes (the message names the role and what it needs).
    """
    queries = sql.Queries(schema)  # fails fast, before connecting, on a bad name
    roles = Roles(runtime_role, audit_role)
    shipped = discover(directory or sql.migrations_dir())
    async with db.connection(dsn_or_pool) as conn:
        try:
            return await _apply(conn, queries, shipped, component, roles)
        except asyncpg.InsufficientPrivilegeError as exc:
            raise await _privilege_error(conn, queries, exc) from exc


async def _apply(
    conn: asyncpg.Connection,
    queries: sql.Queries,
    shipped: list[Migration],
    component: str,
    roles: Roles,
) -> list[str]:
    applied_now = []
    async with conn.transaction():
        await queries.migration_lock.execute(conn)
        rows = await _applied(conn, queries)
        done = {row["version"] for row in rows if row["component"] == component}
        pending = [m for m in shipped if m.version not in done]
        if not pending:
            await _check_roles(conn, queries, roles)
            return []
        await queries.migration_create_schema.execute(conn)
        await queries.migration_create_table.execute(conn)
        for migration in pending:
            try:
                await conn.execute(migration.sql(queries.schema, roles))
            except asyncpg.InsufficientPrivilegeError:
                raise
            except asyncpg.PostgresError as exc:
                if exc.sqlstate == ROLE_REFUSED:
                    raise errors.ConfigurationError(
                        f"schema {sql.quote(queries.schema)}: {exc}"
                    ) from exc
                raise errors.MigrationError(
                    f"migration {migration.path.name} ({component}) failed: {exc}"
                ) from exc
            await queries.migration_record.execute(
                conn, component=component, version=migration.version, name=migration.name
            )
            log.info("applied migration %s/%s", component, migration.path.name)
            applied_now.append(f"{component}/{migration.path.name}")
    return applied_now


async def roles(target: Any, *, schema: str = sql.DEFAULT_SCHEMA) -> Roles:
    """The group roles ``schema``'s tables are granted to; ``Roles()`` before migration 0004."""
    queries = sql.Queries(schema)
    async with db.connection(target) as conn:
        if await queries.migration_roles_table.fetchval(conn) is None:
            return Roles()
        found = {r["purpose"]: r["role_name"] for r in await queries.migration_roles.fetch(conn)}
    return Roles(found.get("runtime"), found.get("audit"))


async def _check_roles(conn: asyncpg.Connection, queries: sql.Queries, roles: Roles) -> None:
    """Refuse role names other than those the schema was granted to (nothing would change)."""
    if roles == Roles() or await queries.migration_roles_table.fetchval(conn) is None:
        return
    recorded = {r["purpose"]: r["role_name"] for r in await queries.migration_roles.fetch(conn)}
    for purpose, wanted in (("runtime", roles.runtime), ("audit", roles.audit)):
        if wanted is not None and recorded.get(purpose) not in (None, wanted):
            raise errors.ConfigurationError(
                f"the {purpose} role of schema {sql.quote(queries.schema)} is "
                f'"{recorded[purpose]}" (since it was migrated), not "{wanted}": grant it to '
                f'the login instead (GRANT "{recorded[purpose]}" TO ...)'
            )


async def _applied(conn: Any, queries: sql.Queries) -> list[asyncpg.Record]:
    """The rows of ``{schema}.migrations``; none when the table does not exist."""
    if await queries.migration_table.fetchval(conn) is None:
        return []
    rows: list[asyncpg.Record] = await queries.migration_rows.fetch(conn)
    return rows


async def status(
    target: Any, *, schema: str = sql.DEFAULT_SCHEMA, directory: Path | None = None
) -> list[Status]:
    """Every migration of the schema and every one this dedup ships, applied or not.

    Read-only: a role granted the schema's audit role may ask.  Rows of other
    components (the bundled services) are listed as applied; dedup's own
    are applied, pending or newer (applied, not shipped here).
    """
    queries = sql.Queries(schema)
    shipped = discover(directory or sql.migrations_dir())
    async with db.connection(target) as conn:
        try:
            rows = await _applied(conn, queries)
        except asyncpg.InsufficientPrivilegeError as exc:
            raise errors.ConfigurationError(
                f"{await _role(conn, queries)} may not read {sql.quote(schema)}.migrations "
                f"({exc}): connect as a role granted the schema's runtime or audit role "
                "(docs/howto/audit-and-purge.md#4-least-privilege), or as the schema's owner"
            ) from exc
    component = "dedup"
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
    target: Any, *, schema: str = sql.DEFAULT_SCHEMA, directory: Path | None = None
) -> list[Migration]:
    """The migrations this dedup ships that the schema lacks."""
    shipped = discover(directory or sql.migrations_dir())
    found = await status(target, schema=schema, directory=directory)
    missing = {s.version for s in found if s.component == "dedup" and s.status == PENDING}
    return [m for m in shipped if m.version in missing]


def _literal(value: str | int) -> str:
    return str(value) if isinstance(value, int) else "'" + value.replace("'", "''") + "'"


def _inline(query: sql.Query, **values: str | int) -> str:
    """``query`` with its parameters written as literals, for a script."""
    literals = [_literal(value) for value in query.args(values)]
    return re.sub(r"\$(\d+)", lambda n: literals[int(n[1]) - 1], query.sql)


def script(
    migrations: list[Migration],
    *,
    schema: str = sql.DEFAULT_SCHEMA,
    component: str = "dedup",
    roles: Roles | None = None,
) -> str:
    """The SQL that applies ``migrations`` to ``schema`` the way :func:`migrate` does.

    The same statements in the same order, each migration recorded in
    ``{schema}.migrations``, under the same advisory lock; meant to run in one
    transaction (``psql -1``, or a migration of alembic or flyway).  Default
    role names are derived where the text runs, from its database.
    """
    queries = sql.Queries(schema)
    quoted = sql.quote(schema)
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
        *(
            f"{query.sql};"
            for query in (
                queries.migration_lock,
                queries.migration_create_schema,
                queries.migration_create_table,
            )
        ),
    ]
    record = queries.migration_record
    for m in migrations:
        # Text for a person or a tool to run: the values go in as literals, quoted.
        inserted = _inline(record, component=component, version=m.version, name=m.name)
        text = m.sql(schema, roles).strip()
        parts.append(f"-- {component}/{m.path.name}\n{text}\n\n{inserted};")
    return "\n\n".join(parts) + "\n"


async def check(
    target: Any, *, schema: str = sql.DEFAULT_SCHEMA, directory: Path | None = None
) -> None:
    """Raise ConfigurationError unless every migration this dedup ships is applied.

    Migrations it does not know (applied by a newer dedup) are fine: a
    migration only adds (see docs/operations.md, "Upgrading").
    """
    found = await status(target, schema=schema, directory=directory)
    if not any(s.component == "dedup" and s.status != PENDING for s in found):
        raise errors.ConfigurationError(
            f"no dedup tables in schema {schema!r}: check the schema setting, or run "
            "`dedup migrate` first"
        )
    missing = [f"{s.version:04d}_{s.name}" for s in found if s.status == PENDING]
    if missing:
        raise errors.ConfigurationError(
            f"schema {schema!r} lacks migration {', '.join(missing)}, which this "
            "version of dedup needs: run `dedup migrate` (or apply `dedup migrate --sql`) "
            "before deploying it; see docs/operations.md#upgrading"
        )


async def _role(conn: asyncpg.Connection, queries: sql.Queries) -> str:
    """``role "name"``, or ``this role`` when the connection cannot say (a failed transaction)."""
    try:
        return f'role "{await queries.current_role.fetchval(conn)}"'
    except asyncpg.PostgresError:
        return "this role"


async def _privilege_error(
    conn: asyncpg.Connection, queries: sql.Queries, exc: asyncpg.PostgresError
) -> errors.ConfigurationError:
    """What the role lacks, in words, after a migration was refused for want of a privilege."""
    schema = queries.schema
    facts = await queries.migration_privileges.fetchrow(conn, schema=schema)
    role, database = facts["role"], facts["database"]
    quoted = sql.quote(schema)
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
        f"{needs}; or give a DBA the SQL: dedup migrate --sql --schema {schema}"
    )
