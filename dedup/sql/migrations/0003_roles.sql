-- Least privilege: two group roles (NOLOGIN) that people and services are
-- granted, never logged in as.
--
--   dedup_runtime  consumers, task runners, replay and purge: read and write the
--                  rows of dedup's tables; no DDL (it owns nothing, has no CREATE
--                  on the schema, no TRUNCATE); events are append-only to it
--                  (INSERT, no UPDATE/DELETE); migrations are read-only to it.
--   dedup_audit    `dedup audit`, `dedup events`, `dedup dead-letters list|show`:
--                  SELECT only.
--
-- Roles belong to the cluster, not to a database: they are created once, if
-- missing (two databases migrating at once may race to create them, hence the
-- exception handlers), and granted again in every database and schema this
-- migration runs in.  A migrating user that may not create roles gets a
-- warning and the grants are left out; a DBA can create the roles and rerun
-- the GRANTs below.
--
-- Tables added by later migrations are covered by the default privileges set
-- here (for tables the migrating role creates).  A later append-only table must
-- REVOKE UPDATE, DELETE from dedup_runtime itself, like events below.
-- tests/integration/test_roles.py checks every table of the schema.

DO $roles$
DECLARE
    wanted text;
BEGIN
    FOREACH wanted IN ARRAY ARRAY['dedup_runtime', 'dedup_audit'] LOOP
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = wanted) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', wanted);
            EXCEPTION
                WHEN duplicate_object OR unique_violation THEN
                    NULL;  -- created meanwhile by a migration of another database
                WHEN insufficient_privilege THEN
                    RAISE WARNING 'dedup: cannot create role %: %; ask a DBA to run '
                        'CREATE ROLE % NOLOGIN and then `dedup migrate` again', wanted, SQLERRM, wanted;
            END;
        END IF;
    END LOOP;
END
$roles$;

DO $grants$
BEGIN
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'dedup_runtime') THEN
        GRANT USAGE ON SCHEMA {schema} TO dedup_runtime;
        GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO dedup_runtime;
        GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {schema} TO dedup_runtime;
        REVOKE UPDATE, DELETE ON {schema}.events FROM dedup_runtime;
        REVOKE INSERT, UPDATE, DELETE ON {schema}.migrations FROM dedup_runtime;
        ALTER DEFAULT PRIVILEGES IN SCHEMA {schema}
            GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO dedup_runtime;
        ALTER DEFAULT PRIVILEGES IN SCHEMA {schema}
            GRANT USAGE, SELECT ON SEQUENCES TO dedup_runtime;
    END IF;
    IF EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'dedup_audit') THEN
        GRANT USAGE ON SCHEMA {schema} TO dedup_audit;
        GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO dedup_audit;
        ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} GRANT SELECT ON TABLES TO dedup_audit;
    END IF;
END
$grants$;
