-- Named queries of dedup: audit.  Loaded by dedup/_sql.py: each starts with a
-- `-- name: NAME` line; `{schema}` becomes the quoted schema name and
-- `:name` parameters are bound by keyword.

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

-- name: database_now
SELECT now()
