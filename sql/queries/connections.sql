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

-- name: reset_session
-- Undo what a handler set on a consumer lane's session, before the lane's next
-- transaction (dedup/_lanes.py): what asyncpg's pool runs when a connection is
-- given back (Connection.get_reset_query), and RESET ROLE, which RESET ALL
-- leaves alone.  Settings given at connect time (server_settings, the DSN's
-- options) are the session's defaults and stay.  No parameters: one round trip
-- of the simple protocol.
SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL; RESET ROLE

-- name: begin
-- A consumer lane's transaction (dedup/_turn.py) begins with the server's defaults.
BEGIN

-- name: commit
-- The end of a transaction dedup began around a handler (dedup/_wrap.py,
-- dedup/_faststream.py): the server answers ROLLBACK, not COMMIT, when a
-- statement of the handler's failed and the handler went on.
COMMIT

-- name: rollback
-- That transaction failed.
ROLLBACK

-- name: commit_and_reset
-- The end of a consumer lane's transaction: undo what the handler set on the
-- session (as reset_session does), then COMMIT, in one round trip.  The reset
-- runs inside the transaction, so it commits with it; a transaction the
-- handler left aborted fails at its first statement and commits nothing.
SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL; RESET ROLE; COMMIT

-- name: rollback_and_reset
-- A consumer lane's transaction failed: ROLLBACK, then reset the session (as
-- reset_session does), in one round trip.
ROLLBACK; SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL; RESET ROLE

-- name: savepoint
-- tx.conn.transaction() inside a consumer's handler (dedup/_guard.py): a
-- savepoint.  One name serves every level: Postgres releases (or rolls back
-- to) the latest savepoint of a name, so nested blocks unwind in order.
SAVEPOINT dedup_savepoint

-- name: release_savepoint
RELEASE SAVEPOINT dedup_savepoint

-- name: rollback_to_savepoint
ROLLBACK TO SAVEPOINT dedup_savepoint

-- name: lock_keys
-- tx.lock(*keys) (dedup/_message.py): a transaction-scoped advisory lock on a
-- 64-bit hash of :namespace and each of :keys, in the hashes' order (the
-- subquery's ORDER BY), so any two transactions take any two of them in the
-- same order and can't deadlock on them.
SELECT pg_advisory_xact_lock(h)
  FROM (SELECT DISTINCT hashtextextended(:namespace::text || chr(31) || k, 0) AS h
          FROM unnest(:keys::text[]) AS k ORDER BY h) AS sorted
