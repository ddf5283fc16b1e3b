-- Named queries of dedup: consumer.  Loaded by dedup/_sql.py: each starts with a
-- `-- name: NAME` line; `{schema}` becomes the quoted schema name and
-- `:name` parameters are bound by keyword.

-- name: take_partitions
-- Take the given partitions for this holder: a new token for each, bumped past
-- every earlier owner's; returns the offset to resume from (NULL: never applied).
INSERT INTO {schema}.partitions AS p (group_id, topic, "partition", holder, token)
SELECT :group_id, t, part, :holder, 1 FROM unnest(:topics::text[], :partitions::int[]) AS x(t, part)
ON CONFLICT (group_id, topic, "partition") DO UPDATE
   SET token = p.token + 1, holder = EXCLUDED.holder, acquired_at = now(), updated_at = now()
RETURNING topic, "partition", token, next_offset

-- name: mark_start
-- Before a holder's first batch on a partition, and before each message of a
-- stretch where an earlier holder died (0005_partition_starts.sql): a batch
-- starts at :offset.  `starts` counts the attempts at that message: +1 when the
-- last mark was there too (the holder that made it died), else the deaths its
-- stretch shared + 1 inside a stretch, else 1.  The first death found outside a
-- stretch opens one of :stretch offsets.  Every expression reads the row as it
-- was.  Under this holder's token only; no row returned: stale.
UPDATE {schema}.partitions AS p
   SET started_offset = :offset,
       starts = CASE WHEN p.started_offset = :offset THEN p.starts + 1
                     WHEN :offset < p.suspect_until THEN p.suspect_deaths + 1
                     ELSE 1 END,
       suspect_until = CASE WHEN p.started_offset = :offset
                             AND :offset >= coalesce(p.suspect_until, -1)
                            THEN :offset + :stretch ELSE p.suspect_until END,
       suspect_deaths = CASE WHEN p.started_offset = :offset
                              AND :offset >= coalesce(p.suspect_until, -1)
                             THEN p.starts ELSE p.suspect_deaths END
 WHERE group_id = :group_id AND topic = :topic AND "partition" = :partition AND token = :token
RETURNING starts, :offset < coalesce(suspect_until, -1) AS single

-- name: unmark_start
-- A clean stop or a revoke cut the batch marked at :offset (mark_start): that
-- was no death, so the attempt is taken back.
UPDATE {schema}.partitions
   SET starts = greatest(starts - 1, 0)
 WHERE group_id = :group_id AND topic = :topic AND "partition" = :partition AND token = :token
   AND started_offset = :offset

-- name: partition_position
-- Who holds a partition and where its offset stands: after a COMMIT whose answer
-- was lost, this tells whether the batch landed; after a refused fence, who
-- took the partition (another consumer, or `dedup offsets`).
SELECT holder, token, next_offset FROM {schema}.partitions
 WHERE group_id = :group_id AND topic = :topic AND "partition" = :partition

-- name: partition_positions
-- The same for every partition a consumer holds, in one statement: an idle
-- consumer looks every kafka_commit_interval.
SELECT p.topic, p."partition", p.holder, p.token, p.next_offset
  FROM {schema}.partitions AS p
  JOIN unnest(:topics::text[], :partitions::int[]) AS x(t, part)
    ON p.topic = x.t AND p."partition" = x.part
 WHERE p.group_id = :group_id

-- name: fence_and_claim
-- The first statement of a consumer transaction, one round trip for all the
-- partitions of a lane's turn (dedup/_turn.py).  The fence moves each
-- partition's offset (:topics[i], :partitions[i]) to :next_offsets[i] only
-- while :tokens[i] is current and the offset is where this holder left it
-- (:expected[i]); the claim inserts the keys of the fenced partitions only
-- (:parts[j] is the 1-based partition of :keys[j]; :hashes, their 16-byte
-- payload hashes one after another, in one bytea: an array of them costs the
-- client several times as much to send), in the order given (key
-- order, so transactions that share keys can't deadlock on them).  A key seen
-- before gets its duplicate (same payload hash) or conflict (different hash)
-- counted instead.  The answer: `fenced`, the partitions whose fence held
-- (1-based), and a row for each key seen before (fresh keys come back as
-- nothing: the happy path reads one row).  :idle_timeout_ms is the
-- transaction's idle_in_transaction_session_timeout, as text: set by this,
-- its first statement, for the transaction only, so it holds through a
-- pooler in transaction mode and costs no round trip.  dedup sets nothing else.
WITH fence AS (
    UPDATE {schema}.partitions AS p
       SET next_offset = f.next_offset, updated_at = now()
      FROM unnest(:topics::text[], :partitions::int[], :tokens::bigint[],
                  :expected::bigint[], :next_offsets::bigint[])
           WITH ORDINALITY AS f(topic, part, token, expected, next_offset, i)
     WHERE p.group_id = :group_id AND p.topic = f.topic AND p."partition" = f.part
       AND p.token = f.token AND p.next_offset IS NOT DISTINCT FROM f.expected
    RETURNING f.i
), claim AS (
    INSERT INTO {schema}.processed AS p
        (namespace, idempotency_key, topic, "partition", "offset", token, payload_hash)
    SELECT :namespace, x.k, (:topics::text[])[x.i], (:partitions::int[])[x.i], x.o,
           (:tokens::bigint[])[x.i], substring(:hashes::bytea FROM x.n::int * 16 - 15 FOR 16)
      FROM unnest(:keys::text[], :offsets::bigint[], :parts::int[])
           WITH ORDINALITY AS x(k, o, i, n)
     WHERE x.i IN (SELECT i FROM fence)
    ON CONFLICT (namespace, idempotency_key) DO UPDATE
       SET duplicates = p.duplicates + (p.payload_hash = EXCLUDED.payload_hash)::int,
           conflicts = p.conflicts + (p.payload_hash <> EXCLUDED.payload_hash)::int,
           last_duplicate_at = now()
    RETURNING p.idempotency_key, p.xmax = 0 AS fresh, p.payload_hash,
              p.topic, p."partition", p."offset"
)
SELECT (SELECT array_agg(i::int) FROM fence) AS fenced, c.idempotency_key, c.payload_hash,
       c.topic, c."partition", c."offset"
  FROM (SELECT set_config('idle_in_transaction_session_timeout', :idle_timeout_ms, true))
       AS settings
  LEFT JOIN claim AS c ON NOT c.fresh

-- name: claim_keys
-- dedup.claim() and wrap(): keys of any partitions, in the caller's transaction,
-- without a fence; the same claim as fence_and_claim's.  Returns a row for each
-- key seen before only.
WITH claim AS (
    INSERT INTO {schema}.processed AS p
        (namespace, idempotency_key, topic, "partition", "offset", token, payload_hash)
    SELECT :namespace, k, t, part, o, NULL, substring(:hashes::bytea FROM n::int * 16 - 15 FOR 16)
      FROM unnest(:keys::text[], :offsets::bigint[], :topics::text[], :partitions::int[])
           WITH ORDINALITY AS x(k, o, t, part, n)
    ON CONFLICT (namespace, idempotency_key) DO UPDATE
       SET duplicates = p.duplicates + (p.payload_hash = EXCLUDED.payload_hash)::int,
           conflicts = p.conflicts + (p.payload_hash <> EXCLUDED.payload_hash)::int,
           last_duplicate_at = now()
    RETURNING p.idempotency_key, p.xmax = 0 AS fresh, p.payload_hash,
              p.topic, p."partition", p."offset"
)
SELECT idempotency_key, payload_hash, topic, "partition", "offset" FROM claim WHERE NOT fresh

-- name: count_copies
-- Further copies of a key inside one batch, once each was classified against
-- the stored payload hash: :duplicates and :conflicts per key.
UPDATE {schema}.processed AS p
   SET duplicates = p.duplicates + x.d, conflicts = p.conflicts + x.c,
       last_duplicate_at = now()
  FROM unnest(:keys::text[], :duplicates::int[], :conflicts::int[]) AS x(k, d, c)
 WHERE p.namespace = :namespace AND p.idempotency_key = x.k

-- name: dead_letter
-- Rare, so one row per statement (sent pipelined with executemany).
INSERT INTO {schema}.dead_letters
    (namespace, group_id, topic, "partition", "offset", timestamp_ms, key, value,
     header_names, header_values, idempotency_key, reason, error, attempts, token)
VALUES (:namespace, :group_id, :topic, :partition, :offset, :timestamp_ms, :kafka_key, :value,
        :header_names, :header_values, :idempotency_key, :reason, :error, :attempts, :token)
ON CONFLICT (namespace, topic, "partition", "offset") DO NOTHING

-- name: current_database
-- The database the consumer writes to, named on its database spans (db.namespace).
SELECT current_database()
