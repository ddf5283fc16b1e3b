-- Named queries of dedup: migrations.  Loaded by dedup/_sql.py: each starts with a
-- `-- name: NAME` line; `{schema}` becomes the quoted schema name and
-- `:name` parameters are bound by keyword.

-- name: applied_migrations
SELECT component, version, name, applied_at FROM {schema}.migrations ORDER BY component, version
