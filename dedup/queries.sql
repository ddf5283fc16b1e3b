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
