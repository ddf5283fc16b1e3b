-- Named queries of dedup.  Each starts with a `-- name: NAME` line and is
-- loaded by dedup.schema.Queries; `{schema}` becomes the quoted schema name.

-- name: applied_migrations
SELECT component, version, name, applied_at FROM {schema}.migrations ORDER BY component, version

-- ---------------------------------------------------------------------------
-- The consumer (dedup/store.py)

-- name: take_partitions
-- Take the given partitions for this holder: a new token for each, bumped past
-- every earlier owner's; returns the offset to resume from (NULL: never applied).
INSERT INTO {schema}.partitions AS p (group_id, topic, "partition", holder, token)
SELECT $1, t, part, $2, 1 FROM unnest($3::text[], $4::int[]) AS x(t, part)
ON CONFLICT (group_id, topic, "partition") DO UPDATE
   SET token = p.token + 1, holder = EXCLUDED.holder, acquired_at = now(), updated_at = now()
RETURNING topic, "partition", token, next_offset

-- name: partition_position
-- Who holds a partition and where its offset stands: after a COMMIT whose answer
-- was lost, this tells whether the batch landed; after a refused fence, who
-- took the partition (another consumer, or `dedup offsets`).
SELECT holder, token, next_offset FROM {schema}.partitions
 WHERE group_id = $1 AND topic = $2 AND "partition" = $3

-- name: partition_positions
-- The same for every partition a consumer holds ($2 topics, $3 partitions), in
-- one statement: an idle consumer looks every kafka_commit_interval.
SELECT p.topic, p."partition", p.holder, p.token, p.next_offset
  FROM {schema}.partitions AS p
  JOIN unnest($2::text[], $3::int[]) AS x(t, part) ON p.topic = x.t AND p."partition" = x.part
 WHERE p.group_id = $1

-- name: serialize_group
-- After a deadlock a consumer runs one batch transaction at a time (dedup/lanes.py).
-- Each such transaction first takes the group's transaction-scoped advisory
-- lock, so the consumers of a group that all deadlocked on hot rows run their
-- batches one at a time across processes too, instead of deadlocking again
-- each time two of them overlap.  Taken before any row lock, it can't be part
-- of a deadlock itself.  $1 group.
SELECT pg_advisory_xact_lock(hashtext('dedup.serial'), hashtext($1))

-- name: advance_partition
-- Move the offset past records the consumer was never handed (transaction
-- markers, records of aborted transactions, compacted gaps) under the batch's
-- fence: only while this token is current and the offset is where this holder
-- left it.  No keys are claimed.  $1 group, $2 topic, $3 partition, $4 new
-- next_offset, $5 token, $6 expected next_offset.
UPDATE {schema}.partitions
   SET next_offset = $4, updated_at = now()
 WHERE group_id = $1 AND topic = $2 AND "partition" = $3
   AND token = $5 AND next_offset IS NOT DISTINCT FROM $6

-- name: fence_and_claim
-- One round trip for steps 1 and 2 of a batch.  The fence moves the partition's
-- offset only while this token is current and the offset is where this holder
-- left it; the claim runs only if the fence held.  A key seen before gets its
-- duplicate (same payload hash) or conflict (different hash) counted instead.
-- $1 group, $2 topic, $3 partition, $4 new next_offset, $5 token (NULL: no fence,
-- for wrap()), $6 expected next_offset, $7 namespace, $8 keys, $9 offsets,
-- $10 payload hashes, $11 the transaction's idle_in_transaction_session_timeout
-- and $12 its lock_timeout, in ms (NULL: the session's).  The settings ride on
-- this statement, the batch's first, instead of a SET LOCAL of their own: no
-- round trip more per batch, and nothing per session, so they hold through a
-- pooler in transaction mode.
WITH fence AS (
    UPDATE {schema}.partitions
       SET next_offset = $4, updated_at = now()
     WHERE group_id = $1 AND topic = $2 AND "partition" = $3
       AND token = $5 AND next_offset IS NOT DISTINCT FROM $6
    RETURNING 1
), claim AS (
    INSERT INTO {schema}.processed AS p
        (namespace, idempotency_key, topic, "partition", "offset", token, payload_hash)
    SELECT $7, k, $2, $3, o, $5, h
      FROM unnest($8::text[], $9::bigint[], $10::bytea[]) AS x(k, o, h)
     WHERE $5::bigint IS NULL OR EXISTS (SELECT FROM fence)
    ON CONFLICT (namespace, idempotency_key) DO UPDATE
       SET duplicates = p.duplicates + (p.payload_hash = EXCLUDED.payload_hash)::int,
           conflicts = p.conflicts + (p.payload_hash <> EXCLUDED.payload_hash)::int,
           last_duplicate_at = now()
    RETURNING p.idempotency_key, p.xmax = 0 AS fresh, p.payload_hash,
              p.topic, p."partition", p."offset"
)
SELECT (SELECT count(*) FROM fence) AS fenced, claim.*
  FROM (SELECT set_config('idle_in_transaction_session_timeout',
                          coalesce($11::text, current_setting('idle_in_transaction_session_timeout')),
                          true),
               set_config('lock_timeout', coalesce($12::text, current_setting('lock_timeout')),
                          true)) AS settings
  LEFT JOIN claim ON true

-- name: claim_keys
-- dedup.claim(): the claim of fence_and_claim without a fence, inside the
-- caller's own transaction, for keys from any topics and partitions.
-- $1 namespace, $2 keys, $3 topics, $4 partitions, $5 offsets, $6 payload hashes.
INSERT INTO {schema}.processed AS p
    (namespace, idempotency_key, topic, "partition", "offset", token, payload_hash)
SELECT $1, k, t, part, o, NULL, h
  FROM unnest($2::text[], $3::text[], $4::int[], $5::bigint[], $6::bytea[]) AS x(k, t, part, o, h)
ON CONFLICT (namespace, idempotency_key) DO UPDATE
   SET duplicates = p.duplicates + (p.payload_hash = EXCLUDED.payload_hash)::int,
       conflicts = p.conflicts + (p.payload_hash <> EXCLUDED.payload_hash)::int,
       last_duplicate_at = now()
RETURNING p.idempotency_key, p.xmax = 0 AS fresh, p.payload_hash,
          p.topic, p."partition", p."offset"

-- name: count_copies
-- Further copies of a key inside one batch, once each was classified against
-- the stored payload hash.  $1 namespace, $2 keys, $3 duplicates, $4 conflicts.
UPDATE {schema}.processed AS p
   SET duplicates = p.duplicates + x.d, conflicts = p.conflicts + x.c,
       last_duplicate_at = now()
  FROM unnest($2::text[], $3::int[], $4::int[]) AS x(k, d, c)
 WHERE p.namespace = $1 AND p.idempotency_key = x.k

-- name: dead_letter
-- Rare, so one row per statement (sent pipelined with executemany).
INSERT INTO {schema}.dead_letters
    (namespace, group_id, topic, "partition", "offset", timestamp_ms, key, value,
     header_names, header_values, idempotency_key, reason, error, attempts, token)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
ON CONFLICT (namespace, topic, "partition", "offset") DO NOTHING

-- ---------------------------------------------------------------------------
-- Leases and run-once tasks (dedup/leases.py, dedup/tasks.py).  Lease times
-- are the database's clock_timestamp(): the server's clock at the statement,
-- never a worker's, and not frozen at transaction start like now().

-- name: lease_acquire
-- Take the resource when it is free or its lease expired; the token grows by
-- one on every acquisition.  $1 resource, $2 holder, $3 ttl in seconds.
INSERT INTO {schema}.leases AS l
    (resource, holder, token, ttl, acquired_at, renewed_at, expires_at)
SELECT $1, $2, 1, make_interval(secs => $3), n.t, n.t, n.t + make_interval(secs => $3)
  FROM (SELECT clock_timestamp() AS t) AS n
ON CONFLICT (resource) DO UPDATE
   SET holder = EXCLUDED.holder, token = l.token + 1, ttl = EXCLUDED.ttl,
       acquired_at = EXCLUDED.acquired_at, renewed_at = EXCLUDED.renewed_at,
       expires_at = EXCLUDED.expires_at, released_at = NULL
 WHERE l.expires_at <= clock_timestamp()
RETURNING resource, holder, token, ttl, acquired_at, renewed_at, expires_at

-- name: lease_renew
-- Extend a live lease by its ttl ($3 seconds, or NULL to keep the stored one),
-- only while $2 is still its token.
UPDATE {schema}.leases AS l
   SET renewed_at = n.t,
       ttl = coalesce(make_interval(secs => $3), l.ttl),
       expires_at = n.t + coalesce(make_interval(secs => $3), l.ttl)
  FROM (SELECT clock_timestamp() AS t) AS n
 WHERE l.resource = $1 AND l.token = $2 AND l.expires_at > n.t
RETURNING l.resource, l.holder, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at

-- name: lease_release
-- Expire a live lease now; the row and its token stay for the next holder.
UPDATE {schema}.leases AS l
   SET expires_at = n.t, released_at = n.t
  FROM (SELECT clock_timestamp() AS t) AS n
 WHERE l.resource = $1 AND l.token = $2 AND l.expires_at > n.t
RETURNING l.released_at

-- name: lease_fence
-- The fence: a conditional UPDATE in the caller's transaction.  A row comes
-- back only while $2 is the token and the lease is live; the row lock it takes
-- makes a takeover wait until that transaction ends.
UPDATE {schema}.leases
   SET token = token
 WHERE resource = $1 AND token = $2 AND expires_at > clock_timestamp()
RETURNING expires_at

-- name: lease_get
SELECT resource, holder, token, ttl, acquired_at, renewed_at, expires_at, released_at,
       expires_at > clock_timestamp() AS live
  FROM {schema}.leases
 WHERE resource = $1

-- name: task_ensure
INSERT INTO {schema}.tasks (task, business_key) VALUES ($1, $2)
ON CONFLICT (task, business_key) DO NOTHING

-- name: task_start
UPDATE {schema}.tasks
   SET state = 'running', attempts = attempts + 1, holder = $3, token = $4, forced = $5,
       started_at = clock_timestamp(), finished_at = NULL, updated_at = clock_timestamp()
 WHERE task = $1 AND business_key = $2
RETURNING attempts

-- name: task_finish
-- Only the current run may finish the task: $3 is its token.  $5 is the result
-- as JSON text (never a jsonb parameter: the pool's codecs are its owner's).
UPDATE {schema}.tasks
   SET state = $4, result = $5::text::jsonb, last_error = $6,
       finished_at = clock_timestamp(), updated_at = clock_timestamp()
 WHERE task = $1 AND business_key = $2 AND token = $3 AND state = 'running'
RETURNING attempts

-- name: task_give_up
-- A running task whose holder vanished and which has no attempts left.
UPDATE {schema}.tasks
   SET state = 'failed', last_error = $3,
       finished_at = clock_timestamp(), updated_at = clock_timestamp()
 WHERE task = $1 AND business_key = $2 AND state = 'running'

-- name: task_get
-- With FOR UPDATE appended, runners of one (task, key) queue here one claim at a time.
-- The result comes back as JSON text, parsed by dedup whatever codecs the pool has.
SELECT task, business_key, state, attempts, holder, token, forced, started_at, finished_at,
       last_error, result::text AS result
  FROM {schema}.tasks
 WHERE task = $1 AND business_key = $2

-- ---------------------------------------------------------------------------
-- The operator commands: audit, events, dead letters (dedup/audit.py,
-- dedup/dead_letters.py) and purge (dedup/retention.py).  All reads but replay
-- and purge; a NULL parameter means "no filter".

-- name: processed_namespaces
-- The distinct namespaces, found by skipping through the primary key (one index
-- probe per namespace), so a key can be looked up without its namespace.
WITH RECURSIVE ns AS (
    (SELECT namespace FROM {schema}.processed ORDER BY namespace LIMIT 1)
    UNION ALL
    SELECT (SELECT p.namespace FROM {schema}.processed AS p
             WHERE p.namespace > ns.namespace ORDER BY p.namespace LIMIT 1)
      FROM ns WHERE ns.namespace IS NOT NULL
)
SELECT namespace FROM ns WHERE namespace IS NOT NULL

-- name: events_namespaces
WITH RECURSIVE ns AS (
    (SELECT namespace FROM {schema}.events WHERE namespace IS NOT NULL
      ORDER BY namespace LIMIT 1)
    UNION ALL
    SELECT (SELECT e.namespace FROM {schema}.events AS e
             WHERE e.namespace > ns.namespace ORDER BY e.namespace LIMIT 1)
      FROM ns WHERE ns.namespace IS NOT NULL
)
SELECT namespace FROM ns WHERE namespace IS NOT NULL

-- name: audit_processed
-- By key: the primary key (namespace = ANY, key).  By topic/partition/offset:
-- no index on purpose (see docs/reference/cli.md); a --since/--until window
-- narrows the scan through the BRIN index on first_seen.
-- $1 keys (dedup.keys.lookup_forms), $2 namespaces, $3 topic, $4 partition, $5 offset,
-- $6 since, $7 until, $8 statuses (processed, duplicate, conflict), $9 limit.
SELECT namespace, idempotency_key, topic, "partition", "offset", token, payload_hash,
       status, first_seen, processed_at, duplicates, conflicts, last_duplicate_at
  FROM {schema}.processed
 WHERE ($1::text[] IS NULL OR idempotency_key = ANY($1))
   AND ($2::text[] IS NULL OR namespace = ANY($2))
   AND ($3::text IS NULL OR topic = $3)
   AND ($4::int IS NULL OR "partition" = $4)
   AND ($5::bigint IS NULL OR "offset" = $5)
   AND first_seen >= coalesce($6::timestamptz, '-infinity')
   AND first_seen < coalesce($7::timestamptz, 'infinity')
   AND ($8::text[] IS NULL OR 'processed' = ANY($8)
        OR ('duplicate' = ANY($8) AND duplicates > 0)
        OR ('conflict' = ANY($8) AND conflicts > 0))
 ORDER BY first_seen, namespace, idempotency_key
 LIMIT $9

-- name: audit_dead_letters
-- $1 keys, $2 namespaces, $3 topic, $4 partition, $5 offset, $6 since, $7 until
-- (on created_at), $8 only those not replayed yet, $9 limit.
SELECT id, namespace, group_id, topic, "partition", "offset", timestamp_ms, idempotency_key,
       reason, error, attempts, token, created_at, replayed_at
  FROM {schema}.dead_letters
 WHERE ($1::text[] IS NULL OR idempotency_key = ANY($1))
   AND ($2::text[] IS NULL OR namespace = ANY($2))
   AND ($3::text IS NULL OR topic = $3)
   AND ($4::int IS NULL OR "partition" = $4)
   AND ($5::bigint IS NULL OR "offset" = $5)
   AND created_at >= coalesce($6::timestamptz, '-infinity')
   AND created_at < coalesce($7::timestamptz, 'infinity')
   AND (NOT $8::bool OR replayed_at IS NULL)
 ORDER BY id
 LIMIT $9

-- name: dead_letter_record
-- One dead letter whole.  Replay appends FOR UPDATE, so two replays of the same
-- one serialize and the second sees replayed_at.
SELECT id, namespace, group_id, topic, "partition", "offset", timestamp_ms, idempotency_key,
       reason, error, attempts, token, created_at, replayed_at,
       key, value, header_names, header_values
  FROM {schema}.dead_letters
 WHERE id = $1

-- name: dead_letter_replayed
UPDATE {schema}.dead_letters SET replayed_at = now() WHERE id = $1 RETURNING replayed_at

-- name: audit_events
-- By key: (namespace = ANY, key) on events_namespace_key; by resource:
-- events_resource; by task: subject task or lease, namespace = task code.
-- $1 keys, $2 namespaces, $3 resource, $4 subjects, $5 kind, $6 since, $7 until, $8 limit.
SELECT id, at, subject, kind, namespace, key, resource, holder, token, from_state,
       to_state, trace_id, detail::text AS detail
  FROM {schema}.events
 WHERE ($1::text[] IS NULL OR key = ANY($1))
   AND ($2::text[] IS NULL OR namespace = ANY($2))
   AND ($3::text IS NULL OR resource = $3)
   AND ($4::text[] IS NULL OR subject = ANY($4))
   AND ($5::text IS NULL OR kind = $5)
   AND at >= coalesce($6::timestamptz, '-infinity')
   AND at < coalesce($7::timestamptz, 'infinity')
 ORDER BY id
 LIMIT $8

-- name: offsets_list
-- `dedup offsets show`: $1 group, $2 topic (NULL: all), $3 limit.
SELECT group_id, topic, "partition", holder, token, next_offset, acquired_at, updated_at
  FROM {schema}.partitions
 WHERE ($1::text IS NULL OR group_id = $1) AND ($2::text IS NULL OR topic = $2)
 ORDER BY group_id, topic, "partition"
 LIMIT $3

-- name: offsets_lock
-- `dedup offsets rewind|skip`: the rows to move, locked until the move commits,
-- so a batch in flight on one of them commits first and is counted in the old
-- offset.  $1 group, $2 topic, $3 partitions.
SELECT "partition", holder, token, next_offset FROM {schema}.partitions
 WHERE group_id = $1 AND topic = $2 AND "partition" = ANY($3::int[])
 ORDER BY "partition"
   FOR UPDATE

-- name: offsets_move
-- The operator's offset under a new token, which fences out the running owner;
-- a partition the group never consumed gets its row.  $1 group, $2 topic,
-- $3 holder (the command), $4 partitions, $5 new next offsets.
INSERT INTO {schema}.partitions AS p (group_id, topic, "partition", holder, token, next_offset)
SELECT $1, $2, x.part, $3, 1, x.next_offset
  FROM unnest($4::int[], $5::bigint[]) AS x(part, next_offset)
ON CONFLICT (group_id, topic, "partition") DO UPDATE
   SET token = p.token + 1, holder = EXCLUDED.holder, next_offset = EXCLUDED.next_offset,
       acquired_at = now(), updated_at = now()
RETURNING "partition", token

-- name: database_now
SELECT now()

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
