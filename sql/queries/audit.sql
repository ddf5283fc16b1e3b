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
-- :keys are dedup.keys.lookup_forms; :statuses any of processed, duplicate, conflict.
SELECT namespace, idempotency_key, topic, "partition", "offset", token, payload_hash,
       status, first_seen, processed_at, duplicates, conflicts, last_duplicate_at
  FROM {schema}.processed
 WHERE (:keys::text[] IS NULL OR idempotency_key = ANY(:keys))
   AND (:namespaces::text[] IS NULL OR namespace = ANY(:namespaces))
   AND (:topic::text IS NULL OR topic = :topic)
   AND (:partition::int IS NULL OR "partition" = :partition)
   AND (:offset::bigint IS NULL OR "offset" = :offset)
   AND first_seen >= coalesce(:since::timestamptz, '-infinity')
   AND first_seen < coalesce(:until::timestamptz, 'infinity')
   AND (:statuses::text[] IS NULL OR 'processed' = ANY(:statuses)
        OR ('duplicate' = ANY(:statuses) AND duplicates > 0)
        OR ('conflict' = ANY(:statuses) AND conflicts > 0))
 ORDER BY first_seen, namespace, idempotency_key
 LIMIT :limit

-- name: audit_dead_letters
-- The window is on created_at; :pending keeps only those not replayed yet.
SELECT id, namespace, group_id, topic, "partition", "offset", timestamp_ms, idempotency_key,
       reason, error, attempts, token, created_at, replayed_at
  FROM {schema}.dead_letters
 WHERE (:keys::text[] IS NULL OR idempotency_key = ANY(:keys))
   AND (:namespaces::text[] IS NULL OR namespace = ANY(:namespaces))
   AND topic = coalesce(:topic::text, topic)
   AND "partition" = coalesce(:partition::int, "partition")
   AND "offset" = coalesce(:offset::bigint, "offset")
   AND created_at >= coalesce(:since::timestamptz, '-infinity')
   AND created_at < coalesce(:until::timestamptz, 'infinity')
   AND (NOT :pending::bool OR replayed_at IS NULL)
 ORDER BY id
 LIMIT :limit

-- name: dead_letter_record
-- One dead letter whole.
SELECT id, namespace, group_id, topic, "partition", "offset", timestamp_ms, idempotency_key,
       reason, error, attempts, token, created_at, replayed_at,
       key, value, header_names, header_values
  FROM {schema}.dead_letters
 WHERE id = :id

-- name: dead_letter_locked
-- The same, locked for a replay, so two replays of one dead letter serialize
-- and the second sees replayed_at.
SELECT * FROM {schema}.dead_letters WHERE id = :id FOR UPDATE

-- name: dead_letter_replayed
UPDATE {schema}.dead_letters SET replayed_at = now() WHERE id = :id RETURNING replayed_at

-- name: audit_events
-- By key: (namespace = ANY, key) on events_namespace_key; by resource:
-- events_resource; by task: subject task or lease, namespace = task code.
SELECT id, at, subject, kind, namespace, key, resource, holder, token, from_state,
       to_state, trace_id, detail::text AS detail
  FROM {schema}.events
 WHERE (:keys::text[] IS NULL OR key = ANY(:keys))
   AND (:namespaces::text[] IS NULL OR namespace = ANY(:namespaces))
   AND (:resource::text IS NULL OR resource = :resource)
   AND (:subjects::text[] IS NULL OR subject = ANY(:subjects))
   AND (:kind::text IS NULL OR kind = :kind)
   AND at >= coalesce(:since::timestamptz, '-infinity')
   AND at < coalesce(:until::timestamptz, 'infinity')
 ORDER BY id
 LIMIT :limit

-- name: database_now
SELECT now()

-- name: database_today
-- The database's date (its TimeZone setting): the last day a sweep `--since` checks.
SELECT current_date
