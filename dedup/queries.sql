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

-- name: fence_and_claim
-- One round trip for steps 1 and 2 of a batch.  The fence moves the partition's
-- offset only while this token is current and the offset is where this holder
-- left it; the claim runs only if the fence held.  A key seen before gets its
-- duplicate (same payload hash) or conflict (different hash) counted instead.
-- $1 group, $2 topic, $3 partition, $4 new next_offset, $5 token (NULL: no fence,
-- for wrap()), $6 expected next_offset, $7 namespace, $8 keys, $9 offsets,
-- $10 payload hashes, $11 copies seen in this batch, $12 conflicting copies.
WITH fence AS (
    UPDATE {schema}.partitions
       SET next_offset = $4, updated_at = now()
     WHERE group_id = $1 AND topic = $2 AND "partition" = $3
       AND token = $5 AND next_offset IS NOT DISTINCT FROM $6
    RETURNING 1
), claim AS (
    INSERT INTO {schema}.processed AS p
        (namespace, idempotency_key, topic, "partition", "offset", token, payload_hash,
         duplicates, conflicts, last_duplicate_at)
    SELECT $7, k, $2, $3, o, $5, h, d, c, CASE WHEN d + c > 0 THEN now() END
      FROM unnest($8::text[], $9::bigint[], $10::bytea[], $11::int[], $12::int[])
           AS x(k, o, h, d, c)
     WHERE $5::bigint IS NULL OR EXISTS (SELECT FROM fence)
    ON CONFLICT (namespace, idempotency_key) DO UPDATE
       SET duplicates = p.duplicates + EXCLUDED.duplicates
                        + (p.payload_hash = EXCLUDED.payload_hash)::int,
           conflicts = p.conflicts + EXCLUDED.conflicts
                       + (p.payload_hash <> EXCLUDED.payload_hash)::int,
           last_duplicate_at = now()
    RETURNING p.idempotency_key, p.xmax = 0 AS fresh, p.payload_hash,
              p.topic, p."partition", p."offset"
)
SELECT (SELECT count(*) FROM fence) AS fenced, claim.*
  FROM (SELECT) AS one LEFT JOIN claim ON true

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
-- Only the current run may finish the task: $3 is its token.
UPDATE {schema}.tasks
   SET state = $4, result = $5, last_error = $6,
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
SELECT task, business_key, state, attempts, holder, token, forced, started_at, finished_at,
       last_error, result
  FROM {schema}.tasks
 WHERE task = $1 AND business_key = $2
