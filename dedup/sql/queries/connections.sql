-- Named queries of dedup: connections (dedup/_db.py, dedup/_drivers.py), the
-- same in every schema.  Loaded by dedup/_sql.py: each starts with a
-- `-- name: NAME` line; `:name` parameters are bound by keyword.

-- name: set_local
-- Settings for the rest of the open transaction (SET LOCAL), any number in one
-- statement: :names[i] = :values[i].
SELECT set_config(s.name, s.value, true)
  FROM unnest(:names::text[], :values::text[]) AS s(name, value)

-- name: nothing
-- A statement that does nothing, sent for what sending one does (a driver's BEGIN).
SELECT 1
