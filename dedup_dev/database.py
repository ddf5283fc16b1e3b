"""Databases made and dropped on the development server, one per test, run or arm.

Names are made here or by the caller, never taken from input: they are quoted
into the statements as they are.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

import asyncpg

from dedup.data import _conninfo as conninfo
from dedup_dev import services

NewDatabase = Callable[[], Awaitable[str]]
"""The ``new_database`` fixture: ``await new_database()`` -> the DSN of a new, empty database."""
LoginAs = Callable[..., Awaitable[str]]
"""The ``login_as`` fixture: ``await login_as(group)`` -> a DSN for a new LOGIN role in it."""


def unique_name(prefix: str) -> str:
    """``prefix`` and 12 random hex digits: a database name no other run takes."""
    return f"{prefix}{uuid.uuid4().hex[:12]}"


async def execute(admin_dsn: str, *statements: str) -> None:
    """Run ``statements`` in turn on one connection of ``admin_dsn``."""
    try:
        conn = await asyncpg.connect(admin_dsn, timeout=30)
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        raise services.Unreachable(
            f"cannot reach Postgres at {conninfo.redact(admin_dsn)}: {exc}; {services.HOW_TO_START}"
        ) from exc
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


async def create(admin_dsn: str, name: str, *, template: str | None = None) -> str:
    """A new database ``name`` (a copy of ``template`` if given); returns its DSN."""
    copy = f' TEMPLATE "{template}"' if template else ""
    await execute(admin_dsn, f'CREATE DATABASE "{name}"{copy}')
    return services.with_database(admin_dsn, name)


# The roles `dedup migrate` named after a database (<database>_<schema>_runtime, _audit)
# belong to the cluster: they outlive it unless dropped with it.  One still granted in
# another database (a clone's) stays, and goes with the last of them.
_DROP_DERIVED_ROLES = """
DO $drop$ DECLARE found text; BEGIN
    FOR found IN SELECT rolname FROM pg_roles WHERE NOT rolcanlogin
        AND starts_with(rolname, '{name}_') AND rolname ~ '_(runtime|audit)$' LOOP
        BEGIN
            EXECUTE format('DROP ROLE %I', found);
        EXCEPTION WHEN dependent_objects_still_exist THEN
            NULL;
        END;
    END LOOP;
END $drop$"""


async def drop(admin_dsn: str, *names: str) -> None:
    """Drop the databases ``names`` (closing any session still on them), and their roles."""
    await execute(
        admin_dsn,
        *(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)' for name in names),
        *(_DROP_DERIVED_ROLES.format(name=name) for name in names),
    )
