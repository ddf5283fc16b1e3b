-- Named queries of dedup.  Each starts with a `-- name: NAME` line and is
-- loaded by dedup.schema.Queries; `{schema}` becomes the quoted schema name.

-- name: applied_migrations
SELECT component, version, name, applied_at FROM {schema}.migrations ORDER BY component, version
