-- Least privilege per application: a runtime and an audit group role (NOLOGIN)
-- for this schema alone, so one application's login can touch no other
-- application's dedup tables, in this database or another.
--
--   runtime  consumers, task runners, replay and purge: read and write the rows
--            of dedup's tables; no DDL (it owns nothing, has no CREATE on the
--            schema, no TRUNCATE); events are append-only to it (INSERT, no
--            UPDATE/DELETE); migrations and roles are read-only to it.
--   audit    `dedup audit`, `dedup events`, `dedup dead-letters list|show`:
--            SELECT only.
--
-- The names are the operator's (`dedup migrate --runtime-role R --audit-role
-- A`); by default <database>_<schema>_runtime and <database>_<schema>_audit,
-- because roles belong to the cluster and two databases may each have a
-- schema "dedup".  {runtime_role} and {audit_role} are string literals, or
-- NULL for the default (the recorded role, when the text runs again).  A role
-- is created if missing; one that already holds privileges in another
-- database, or on another dedup schema of this one, is refused: it would
-- reach both applications.  The names chosen are kept in
-- {schema}.roles, where later migrations find them (a later append-only table
-- must REVOKE UPDATE, DELETE from the runtime role named there, like events
-- below).  Tables added later by the migrating role are covered by the default
-- privileges set here.  tests/integration/test_roles.py checks every table.
--
-- A refusal raises SQLSTATE DD001 (dedup's own code; dedup/_migrations.py
-- turns it into a ConfigurationError) and rolls the whole migration back.

CREATE TABLE IF NOT EXISTS {schema}.roles (
    purpose   text PRIMARY KEY CHECK (purpose IN ('runtime', 'audit')),
    role_name text NOT NULL
);

DO $roles$
DECLARE
    -- The schema's name, unquoted (it is a validated plain identifier).
    schema_name text := '{schema}'::regnamespace::text;
    purposes text[] := ARRAY['runtime', 'audit'];
    given text[] := ARRAY[{runtime_role}, {audit_role}];
    wanted text[];
    role_oid oid;
    elsewhere text;
    recorded text[];
BEGIN
    FOR i IN 1 .. 2 LOOP
        recorded[i] := (SELECT role_name FROM {schema}.roles WHERE purpose = purposes[i]);
        wanted[i] := coalesce(given[i], recorded[i],
                              format('%s_%s_%s', current_database(), schema_name, purposes[i]));
    END LOOP;
    IF wanted[1] = wanted[2] THEN
        RAISE EXCEPTION USING ERRCODE = 'DD001', MESSAGE = format(
            'the runtime and the audit role of schema %I are both %I: give them two names',
            schema_name, wanted[1]);
    END IF;
    FOR i IN 1 .. 2 LOOP
        -- Postgres would cut a longer name to 63 bytes without a word.
        IF octet_length(wanted[i]) > 63 THEN
            RAISE EXCEPTION USING ERRCODE = 'DD001', MESSAGE = format(
                '%s role name %s is %s bytes, over Postgres'' limit of 63: name it with '
                '--%s-role (dedup.migrate(%s_role=...))',
                purposes[i], wanted[i], octet_length(wanted[i]), purposes[i], purposes[i]);
        END IF;
        IF recorded[i] <> wanted[i] THEN
            RAISE EXCEPTION USING ERRCODE = 'DD001', MESSAGE = format(
                'the %s role of schema %I is %I, not %I', purposes[i], schema_name, recorded[i],
                wanted[i]);
        END IF;
        -- Run again (the text of `dedup migrate --sql`): the recorded role is this schema's.
        CONTINUE WHEN recorded[i] IS NOT NULL;
        SELECT oid INTO role_oid FROM pg_catalog.pg_roles WHERE rolname = wanted[i];
        IF role_oid IS NULL THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', wanted[i]);
            EXCEPTION
                WHEN insufficient_privilege THEN
                    RAISE EXCEPTION USING ERRCODE = 'DD001', MESSAGE = format(
                        'role %I may not create the %s role %I of schema %I (%s): a DBA '
                        'runs CREATE ROLE %I NOLOGIN, then `dedup migrate` again',
                        current_user, purposes[i], wanted[i], schema_name, SQLERRM, wanted[i]);
            END;
        ELSE
            -- Privileges and ownership in any database are in the shared pg_shdepend.
            SELECT string_agg(DISTINCT quote_ident(d.datname), ', ') INTO elsewhere
              FROM pg_catalog.pg_shdepend s
              JOIN pg_catalog.pg_database d ON d.oid = s.dbid
             WHERE s.refclassid = 'pg_catalog.pg_authid'::regclass AND s.refobjid = role_oid
               AND s.deptype IN ('a', 'o') AND d.datname <> current_database();
            IF elsewhere IS NULL THEN
                SELECT string_agg(quote_ident(n.nspname), ', ') INTO elsewhere
                  FROM pg_catalog.pg_namespace n
                 WHERE n.nspname <> schema_name
                   AND to_regclass(format('%I.migrations', n.nspname)) IS NOT NULL
                   AND has_schema_privilege(role_oid, n.oid, 'USAGE');
                elsewhere := 'schema ' || elsewhere || ' of this database';
            ELSE
                elsewhere := 'database ' || elsewhere;
            END IF;
            IF elsewhere IS NOT NULL THEN
                RAISE EXCEPTION USING ERRCODE = 'DD001', MESSAGE = format(
                    'role %I already has privileges in %s: a %s role serves one '
                    'application''s schema; name another with --%s-role',
                    wanted[i], elsewhere, purposes[i], purposes[i]);
            END IF;
        END IF;
        INSERT INTO {schema}.roles (purpose, role_name) VALUES (purposes[i], wanted[i]);
    END LOOP;

    EXECUTE format('GRANT USAGE ON SCHEMA {schema} TO %I', wanted[1]);
    EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO %I',
                   wanted[1]);
    EXECUTE format('GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {schema} TO %I', wanted[1]);
    EXECUTE format('REVOKE UPDATE, DELETE ON {schema}.events FROM %I', wanted[1]);
    EXECUTE format('REVOKE INSERT, UPDATE, DELETE ON {schema}.migrations, {schema}.roles FROM %I',
                   wanted[1]);
    EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} '
                   'GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO %I', wanted[1]);
    EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} '
                   'GRANT USAGE, SELECT ON SEQUENCES TO %I', wanted[1]);

    EXECUTE format('GRANT USAGE ON SCHEMA {schema} TO %I', wanted[2]);
    EXECUTE format('GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO %I', wanted[2]);
    EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} GRANT SELECT ON TABLES TO %I',
                   wanted[2]);
END
$roles$;
