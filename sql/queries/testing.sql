-- Named queries of dedup: the test helpers (dedup/testing/).  Loaded by dedup/_sql.py:
-- each starts with a `-- name: NAME` line; `{schema}` becomes the quoted schema name.

-- name: testing_drop_schema
-- The end of a schema dedup.testing.Schema.create made for one test: the schema
-- with everything in it, then its runtime and audit roles, named in its roles
-- table (made for it alone, they hold privileges on nothing else once the schema
-- is gone; a role the test granted more keeps it, and DROP ROLE says so).  A
-- schema the test dropped itself leaves nothing to do.
DO $drop$
DECLARE
    made text[];
    found text;
BEGIN
    IF to_regnamespace('{schema}') IS NULL THEN
        RETURN;
    END IF;
    made := ARRAY(SELECT r.role_name FROM {schema}.roles AS r ORDER BY r.purpose);
    DROP SCHEMA {schema} CASCADE;
    FOREACH found IN ARRAY made LOOP
        EXECUTE format('DROP ROLE %I', found);
    END LOOP;
END $drop$
