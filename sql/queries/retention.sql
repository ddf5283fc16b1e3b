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
-- before the :cutoff.
SELECT (ctid::text::point)[0]::bigint / :pages_per_range AS brin_range, count(*) AS n
  FROM {schema}.processed
 WHERE first_seen < :cutoff AND processed_at < :cutoff
   AND (last_duplicate_at IS NULL OR last_duplicate_at < :cutoff)
 GROUP BY 1
 ORDER BY 1

-- name: purge_processed_batch
-- One short transaction: a TID range scan of a few blocks (:lo <= ctid < :hi),
-- rechecking the cutoff (:cutoff) on every row.
DELETE FROM {schema}.processed
 WHERE ctid >= :lo::tid AND ctid < :hi::tid
   AND first_seen < :cutoff AND processed_at < :cutoff
   AND (last_duplicate_at IS NULL OR last_duplicate_at < :cutoff)

-- name: purge_resummarize
-- Purged ranges keep their old BRIN summary (summaries only ever widen), so the
-- next purge would read them again forever; summarize them afresh.  Needs the
-- table's owner and a SHARE UPDATE EXCLUSIVE lock (taken with a short lock_timeout).
-- :block is the first block of the range.
SELECT brin_desummarize_range(to_regclass('{schema}.processed_first_seen_brin'), :block),
       brin_summarize_range(to_regclass('{schema}.processed_first_seen_brin'), :block)

-- name: purge_marker_xid
-- A transaction id newer than every purge DELETE so far.
SELECT pg_current_xact_id()::xid

-- name: purge_older_snapshots
-- Sessions of this database whose snapshot may predate the :marker (their
-- xmin is not newer), so the deleted rows are not yet dead to everyone.
SELECT count(*) FROM pg_stat_activity
 WHERE datname = current_database() AND pid <> pg_backend_pid()
   AND backend_xmin IS NOT NULL AND age(backend_xmin) >= age(:marker::xid)

-- name: purge_dead_letters_batch
-- Dead letters that were replayed before the cutoff (:cutoff); never unreplayed ones.
WITH gone AS (
    DELETE FROM {schema}.dead_letters
     WHERE id IN (SELECT id FROM {schema}.dead_letters
                   WHERE replayed_at < :cutoff ORDER BY id LIMIT :limit)
    RETURNING id
)
SELECT count(*) FROM gone

-- name: purge_outbox_batch
-- Outbox rows sent before the cutoff (:cutoff); pending and failed ones stay.
WITH gone AS (
    DELETE FROM {schema}.outbox
     WHERE id IN (SELECT id FROM {schema}.outbox
                   WHERE status = 'sent' AND sent_at < :cutoff ORDER BY sent_at LIMIT :limit)
    RETURNING id
)
SELECT count(*) FROM gone

-- name: purge_events_bound
-- The newest event before the cutoff (:cutoff), through the BRIN index on at.
SELECT max(id) FROM {schema}.events WHERE at < :cutoff

-- name: purge_events_batch
-- Oldest first along the primary key, after the last id done, up to the :bound.
WITH gone AS (
    DELETE FROM {schema}.events
     WHERE id IN (SELECT id FROM {schema}.events
                   WHERE id > :after AND id <= :bound AND at < :cutoff ORDER BY id LIMIT :limit)
    RETURNING id
)
SELECT count(*) AS n, max(id) AS last_id FROM gone

-- name: purge_counts
-- For --dry-run: what would go.  :cutoff for keys, dead letters and sent outbox rows,
-- :events_cutoff for events.
SELECT (SELECT count(*) FROM {schema}.processed
         WHERE first_seen < :cutoff AND processed_at < :cutoff
           AND (last_duplicate_at IS NULL OR last_duplicate_at < :cutoff)) AS processed,
       (SELECT count(*) FROM {schema}.dead_letters WHERE replayed_at < :cutoff) AS dead_letters,
       (SELECT count(*) FROM {schema}.outbox
         WHERE status = 'sent' AND sent_at < :cutoff) AS outbox,
       (SELECT count(*) FROM {schema}.events WHERE at < :events_cutoff) AS events

-- name: purge_privileges
-- Checked before purging anything, so a role that may not finish does not start.
SELECT has_table_privilege(to_regclass('{schema}.processed'), 'DELETE') AS processed,
       has_table_privilege(to_regclass('{schema}.dead_letters'), 'DELETE') AS dead_letters,
       has_table_privilege(to_regclass('{schema}.outbox'), 'DELETE') AS outbox,
       has_table_privilege(to_regclass('{schema}.events'), 'DELETE') AS events
