-- Named queries of dedup: the outbox (dedup/_outbox.py).  Loaded by
-- dedup/data/_sql.py: each starts with a `-- name: NAME` line; `{schema}`
-- becomes the quoted schema name and `:name` parameters are bound by keyword.

-- name: outbox_add
-- A message to send once: nothing when its key is already in the outbox.
INSERT INTO {schema}.outbox (key, sink, destination, payload)
VALUES (:key, :sink, :destination, :payload::jsonb)
ON CONFLICT (key) DO NOTHING
RETURNING id

-- name: outbox_due
-- The pending messages no other sender holds, oldest first; locked until the
-- sender's transaction marks them.
SELECT id, key, sink, destination, payload::text AS payload, attempts
  FROM {schema}.outbox
 WHERE status = 'pending'
 ORDER BY id
 LIMIT :limit
   FOR UPDATE SKIP LOCKED

-- name: outbox_mark
-- One attempt's outcome: `sent`, `failed` (never accepted), or still `pending`.
UPDATE {schema}.outbox
   SET status = :status, attempts = attempts + 1, last_error = :error,
       sent_at = CASE WHEN :status = 'sent' THEN clock_timestamp() END
 WHERE id = :id
