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

-- name: drop_snapshot
-- A serial batch runs this after its claim, before it waits for its turn
-- (dedup/_lanes.py): a statement of the simple protocol (no parameters) drops
-- the claim's unnamed portal, and with it the snapshot that would keep the
-- hot rows' dead versions from being pruned while it waits.
SELECT 1

-- name: serialize_group
-- After a deadlock the handlers of a consumer group take turns (dedup/_lanes.py):
-- a batch transaction takes the group's transaction-scoped advisory lock after
-- its claim and the consumer's own turn, before its handler, so the next
-- batch's claim overlaps this handler, and consumers of the group that
-- deadlocked on hot rows take turns across processes too.  Whoever holds it
-- has claimed already and waits for no claim, so it can't close a deadlock cycle.
SELECT pg_advisory_xact_lock(hashtext('dedup.serial'), hashtext(:group_id))

-- name: advance_partition
-- Move the offset past records the consumer was never handed (transaction
-- markers, records of aborted transactions, compacted gaps) under the batch's
-- fence: only while this token is current and the offset is where this holder
-- left it (:expected, the next_offset it last stored).  No keys are claimed;
-- returns a row only if the fence held.
UPDATE {schema}.partitions
   SET next_offset = :next_offset, updated_at = now()
 WHERE group_id = :group_id AND topic = :topic AND "partition" = :partition
   AND token = :token AND next_offset IS NOT DISTINCT FROM :expected
RETURNING 1 AS fenced

-- name: fence_and_claim
-- One round trip for steps 1 and 2 of a batch.  The fence moves the partition's
-- offset only while this token is current and the offset is where this holder
-- left it; the claim runs only if the fence held.  A key seen before gets its
-- duplicate (same payload hash) or conflict (different hash) counted instead.
-- :token NULL means no fence (wrap(), claim()); :expected is the next_offset this
-- holder last stored.  :idle_timeout_ms and :lock_timeout_ms are the
-- transaction's idle_in_transaction_session_timeout and lock_timeout, as text
-- (NULL: the session's).  The settings ride on
-- this statement, the batch's first, instead of a SET LOCAL of their own: no
-- round trip more per batch, and nothing per session, so they hold through a
-- pooler in transaction mode.  A batch's keys are of one :topic and
-- :partition; dedup.claim() gives keys of any partitions instead, as :topics
-- and :partitions beside :keys (and no fence).
WITH fence AS (
    UPDATE {schema}.partitions
       SET next_offset = :next_offset, updated_at = now()
     WHERE group_id = :group_id AND topic = :topic AND "partition" = :partition
       AND token = :token AND next_offset IS NOT DISTINCT FROM :expected
    RETURNING 1
), claim AS (
    INSERT INTO {schema}.processed AS p
        (namespace, idempotency_key, topic, "partition", "offset", token, payload_hash)
    SELECT :namespace, k, coalesce(t, :topic), coalesce(part, :partition), o, :token, h
      FROM unnest(:keys::text[], :offsets::bigint[], :hashes::bytea[],
                  :topics::text[], :partitions::int[]) AS x(k, o, h, t, part)
     WHERE :token::bigint IS NULL OR EXISTS (SELECT FROM fence)
    ON CONFLICT (namespace, idempotency_key) DO UPDATE
       SET duplicates = p.duplicates + (p.payload_hash = EXCLUDED.payload_hash)::int,
           conflicts = p.conflicts + (p.payload_hash <> EXCLUDED.payload_hash)::int,
           last_duplicate_at = now()
    RETURNING p.idempotency_key, p.xmax = 0 AS fresh, p.payload_hash,
              p.topic, p."partition", p."offset"
)
SELECT (SELECT count(*) FROM fence) AS fenced, claim.*
  FROM (SELECT set_config('idle_in_transaction_session_timeout',
                          coalesce(:idle_timeout_ms::text,
                                   current_setting('idle_in_transaction_session_timeout')),
                          true),
               set_config('lock_timeout',
                          coalesce(:lock_timeout_ms::text, current_setting('lock_timeout')),
                          true)) AS settings
  LEFT JOIN claim ON true

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
