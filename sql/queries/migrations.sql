-- Named queries of dedup: migrations.  Loaded by dedup/_sql.py: each starts with a
-- `-- name: NAME` line; `{schema}` becomes the quoted schema name and
-- `:name` parameters are bound by keyword.  `dedup migrate --sql` prints the
-- same statements, so they run in psql, alembic and flyway too.

-- name: migration_lock
-- Migrations of one schema take turns, the lock first: even creating the
-- schema races otherwise.  A DO block, so psql prints nothing for it.
DO $lock$ BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('dedup.migrate:{schema}'));
END $lock$

-- name: migration_create_schema
-- Not CREATE SCHEMA IF NOT EXISTS: that needs CREATE on the database even when
-- the schema exists, which the owner of a schema a DBA made for it may lack.
DO $schema$ BEGIN
    IF to_regnamespace('{schema}') IS NULL THEN
        CREATE SCHEMA {schema};
    END IF;
END $schema$

-- name: migration_create_table
CREATE TABLE IF NOT EXISTS {schema}.migrations (
    component  text        NOT NULL,
    version    integer     NOT NULL,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (component, version)
)

-- name: migration_record
INSERT INTO {schema}.migrations (component, version, name)
VALUES (:component, :version, :name)
ON CONFLICT (component, version) DO NOTHING

-- name: migration_table
-- The migrations table, or NULL before the first migration.
SELECT to_regclass('{schema}.migrations')

-- name: migration_rows
SELECT component, version, name, applied_at FROM {schema}.migrations ORDER BY component, version

-- name: current_role
SELECT current_user

-- name: migration_privileges
-- What a role refused a migration lacks: the schema, or its ownership.
SELECT current_user AS role,
       current_database() AS database,
       n.oid IS NOT NULL AS schema_exists,
       pg_get_userbyid(n.nspowner) AS owner,
       coalesce(pg_has_role(n.nspowner, 'USAGE'), false) AS owns
  FROM (SELECT 1) AS one
  LEFT JOIN pg_catalog.pg_namespace n ON n.nspname = :schema

-- name: migration_roles_table
-- The roles table (migration 0004), or NULL before it.
SELECT to_regclass('{schema}.roles')

-- name: migration_roles
-- The group roles the schema's tables are granted to, by purpose (runtime, audit).
SELECT purpose, role_name FROM {schema}.roles
