-- Named queries of dedup: retention.  Loaded by dedup/_sql.py: each starts with a
-- `-- name: NAME` line; `{schema}` becomes the quoted schema name and
-- `:name` parameters are bound by keyword.

-- name: purge_layout
-- The BRIN index's pages_per_range (128 unless set), and whether this role owns
-- the table (needed to summarize BRIN ranges afresh).
SELECT coalesce((SELECT split_part(opt, '=', 2)::int FROM unnest(i.reloptions) AS opt
                  WHERE opt LIKE 'pages_per_range=%'), 128) AS pages_per_range,
       pg_has_role(t.relowner, 'USAGE') AS owner
  FROM pg_class AS i, pg_class AS t
 WHERE i.oid = to_regclass('{schema}.processed_first_seen_brin')
   AND t.oid = to_regclass('{schema}.processed')

-- name: purge_candidate_ranges
-- One read of the old part of the table through the BRIN index: the BRIN ranges
-- (pages_per_range blocks each) holding rows to purge, and how many each holds.
-- A key is purged once first_seen, processed_at and last_duplicate_at are all
-- before the cutoff ($1); $2 pages_per_range.
SELECT (ctid::text::point)[0]::bigint / $2 AS brin_range, count(*) AS n
  FROM {schema}.processed
 WHERE first_seen < $1 AND processed_at < $1
   AND (last_duplicate_at IS NULL OR last_duplicate_at < $1)
 GROUP BY 1
 ORDER BY 1

-- name: purge_processed_batch
-- One short transaction: a TID range scan of a few blocks ($1 <= ctid < $2),
-- rechecking the cutoff ($3) on every row.
DELETE FROM {schema}.processed
 WHERE ctid >= $1::tid AND ctid < $2::tid
   AND first_seen < $3 AND processed_at < $3
   AND (last_duplicate_at IS NULL OR last_duplicate_at < $3)

-- name: purge_resummarize
-- Purged ranges keep their old BRIN summary (summaries only ever widen), so the
-- next purge would read them again forever; summarize them afresh.  Needs the
-- table's owner and a SHARE UPDATE EXCLUSIVE lock (taken with a short lock_timeout).
-- $1 is the range's first block.
SELECT brin_desummarize_range(to_regclass('{schema}.processed_first_seen_brin'), $1),
       brin_summarize_range(to_regclass('{schema}.processed_first_seen_brin'), $1)

-- name: purge_marker_xid
-- A transaction id newer than every purge DELETE so far.
SELECT pg_current_xact_id()::xid

-- name: purge_older_snapshots
-- Sessions of this database whose snapshot may predate the marker $1 (their
-- xmin is not newer), so the deleted rows are not yet dead to everyone.
SELECT count(*) FROM pg_stat_activity
 WHERE datname = current_database() AND pid <> pg_backend_pid()
   AND backend_xmin IS NOT NULL AND age(backend_xmin) >= age($1::xid)

-- name: purge_dead_letters_batch
-- Dead letters that were replayed before the cutoff ($1); never unreplayed ones.
WITH gone AS (
    DELETE FROM {schema}.dead_letters
     WHERE id IN (SELECT id FROM {schema}.dead_letters
                   WHERE replayed_at < $1 ORDER BY id LIMIT $2)
    RETURNING id
)
SELECT count(*) FROM gone

-- name: purge_events_bound
-- The newest event before the cutoff ($1), through the BRIN index on at.
SELECT max(id) FROM {schema}.events WHERE at < $1

-- name: purge_events_batch
-- Oldest first along the primary key: $1 last id done, $2 bound, $3 cutoff, $4 limit.
WITH gone AS (
    DELETE FROM {schema}.events
     WHERE id IN (SELECT id FROM {schema}.events
                   WHERE id > $1 AND id <= $2 AND at < $3 ORDER BY id LIMIT $4)
    RETURNING id
)
SELECT count(*) AS n, max(id) AS last_id FROM gone

-- name: purge_counts
-- For --dry-run: what would go.  $1 cutoff for keys and dead letters, $2 for events.
SELECT (SELECT count(*) FROM {schema}.processed
         WHERE first_seen < $1 AND processed_at < $1
           AND (last_duplicate_at IS NULL OR last_duplicate_at < $1)) AS processed,
       (SELECT count(*) FROM {schema}.dead_letters WHERE replayed_at < $1) AS dead_letters,
       (SELECT count(*) FROM {schema}.events WHERE at < $2) AS events

-- name: purge_privileges
-- Checked before purging anything, so a role that may not finish does not start.
SELECT has_table_privilege(to_regclass('{schema}.processed'), 'DELETE') AS processed,
       has_table_privilege(to_regclass('{schema}.dead_letters'), 'DELETE') AS dead_letters,
       has_table_privilege(to_regclass('{schema}.events'), 'DELETE') AS events
