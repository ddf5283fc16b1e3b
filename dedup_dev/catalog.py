"""What Postgres' catalogs say of a schema, to compare two migrated databases."""

from __future__ import annotations

from urllib.parse import urlsplit

import asyncpg

CATALOG = {
    "relations": """
        SELECT c.relname, c.relkind::text, pg_get_userbyid(c.relowner),
               coalesce(c.reloptions::text, ''), coalesce(c.relacl::text, '')
          FROM pg_class c WHERE c.relnamespace = $1::regnamespace""",
    "columns": """
        SELECT table_name, column_name, ordinal_position::text, data_type, is_nullable,
               coalesce(column_default, ''), is_identity, coalesce(identity_generation, '')
          FROM information_schema.columns WHERE table_schema = $1""",
    "indexes": "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = $1",
    "constraints": """
        SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid)
          FROM pg_constraint WHERE connamespace = $1::regnamespace""",
    "grants": """
        SELECT grantor, grantee, table_name, privilege_type, is_grantable
          FROM information_schema.role_table_grants WHERE table_schema = $1""",
    "schema": """
        SELECT pg_get_userbyid(nspowner), coalesce(nspacl::text, '')
          FROM pg_namespace WHERE nspname = $1""",
    "default_privileges": """
        SELECT pg_get_userbyid(defaclrole), defaclobjtype::text, defaclacl::text
          FROM pg_default_acl WHERE defaclnamespace = $1::regnamespace""",
}


async def catalog(dsn: str, schema_name: str) -> dict[str, list[tuple[str, ...]]]:
    """What Postgres' catalogs say of the schema: tables, columns, indexes, grants...

    The database's name, which the default role names carry, reads ``<database>``.
    """
    database = urlsplit(dsn).path[1:]
    conn = await asyncpg.connect(dsn)
    try:
        found = {
            what: sorted(
                tuple(value.replace(database, "<database>") for value in row)
                for row in await conn.fetch(query, schema_name)
            )
            for what, query in CATALOG.items()
        }
        found["migrations"] = [
            tuple(map(str, row))
            for row in await conn.fetch(
                f'SELECT component, version, name FROM "{schema_name}".migrations ORDER BY 1, 2'
            )
        ]
    finally:
        await conn.close()
    return found
