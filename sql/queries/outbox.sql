-- Named queries of dedup: the outbox (dedup/_outbox.py).  Loaded by
-- dedup/data/_sql.py: each starts with a `-- name: NAME` line; `{schema}`
-- becomes the quoted schema name and `:name` parameters are bound by keyword.

-- name: outbox_add
-- A message to send once: nothing when its key is already in the outbox.
INSERT INTO {schema}.outbox (key, sink, destination, payload)
VALUES (:key, :sink, :destination, :payload::text::jsonb)
ON CONFLICT (key) DO NOTHING
RETURNING id

-- name: outbox_due
-- The pending HTTP messages to :destinations (URLs) no other sender holds (nor a
-- dispatcher's claim), oldest first; locked until the sender's transaction marks them.
SELECT id, key, sink, destination, payload::text AS payload, attempts
  FROM {schema}.outbox
 WHERE status = 'pending' AND sink = 'http' AND destination = ANY(:destinations::text[])
   AND (claimed_until IS NULL OR claimed_until < now())
 ORDER BY id
 LIMIT :limit
   FOR UPDATE SKIP LOCKED

-- name: outbox_mark
-- One attempt's outcome: `sent`, `failed` (never accepted), or still `pending`.
UPDATE {schema}.outbox
   SET status = :status, attempts = attempts + 1, last_error = :error,
       sent_at = CASE WHEN :status = 'sent' THEN clock_timestamp() END
 WHERE id = :id

-- name: outbox_publish
-- A record for the relay to publish, in the transaction that applied its
-- source; nothing when a row of that key is there already (a replay of a
-- source whose key was purged, say).
INSERT INTO {schema}.outbox
       (key, sink, destination, message_key, value, header_names, header_values,
        source, token)
VALUES (:key, 'kafka', :topic, :message_key, :value, :header_names, :header_values,
        :source, :token)
ON CONFLICT (key) DO NOTHING
RETURNING id

-- name: outbox_kafka_due
-- The relay's next pending records, in the order they were written.  No lock:
-- one relay at a time holds the relay's lease and publishes.
SELECT id, key, destination AS topic, message_key, value, header_names, header_values,
       source, token
  FROM {schema}.outbox
 WHERE status = 'pending' AND sink = 'kafka'
 ORDER BY id
 LIMIT :limit

-- name: outbox_kafka_mark
-- Records the broker acknowledged (or, with :status = 'failed', refused for
-- good, with :error); pending ones only, so a row is marked once.
WITH marked AS (
    UPDATE {schema}.outbox
       SET status = :status, attempts = attempts + 1, last_error = :error,
           sent_at = CASE WHEN :status = 'sent' THEN clock_timestamp() END
     WHERE id = ANY(:ids::bigint[]) AND status = 'pending'
    RETURNING 1
)
SELECT count(*) FROM marked

-- name: outbox_backlog
-- The relay's backlog: pending Kafka records and the age of the oldest (seconds).
SELECT count(*) AS pending,
       coalesce(extract(epoch FROM clock_timestamp() - min(created_at)), 0)::float8 AS oldest
  FROM {schema}.outbox
 WHERE status = 'pending' AND sink = 'kafka'

-- name: relay_database
-- The database a relay publishes from: part of its transactional id.
SELECT current_database()

-- name: outbox_post
-- An HTTP message for the dispatchers of :destination, in the transaction that
-- applied its source; nothing when a row of that key is there already.
INSERT INTO {schema}.outbox (key, sink, destination, payload, source, token)
VALUES (:key, 'http', :destination, :payload::text::jsonb, :source, :token)
ON CONFLICT (key) DO NOTHING
RETURNING id

-- name: outbox_http_claim
-- Up to :limit due rows of :destinations no live claim holds, each claimed for
-- :ttl seconds under its next claim token.  Commits on its own: no transaction
-- stays open while the POSTs are in flight.
WITH due AS (
    SELECT id FROM {schema}.outbox
     WHERE status = 'pending' AND sink = 'http' AND destination = ANY(:destinations::text[])
       AND next_attempt_at <= now()
       AND (claimed_until IS NULL OR claimed_until < now())
     ORDER BY next_attempt_at, id
     LIMIT :limit
       FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.outbox AS o
   SET claim_token = o.claim_token + 1, claimed_by = :holder, attempts = o.attempts + 1,
       claimed_until = now() + make_interval(secs => :ttl)
  FROM due
 WHERE o.id = due.id
RETURNING o.id, o.key, o.destination, o.payload::text AS payload, o.claim_token, o.attempts

-- name: outbox_http_sent
-- A 2xx answer, while the row still carries this claim's token.
UPDATE {schema}.outbox
   SET status = 'sent', sent_at = clock_timestamp(), response_status = :status,
       last_error = NULL, claimed_by = NULL, claimed_until = NULL
 WHERE id = :id AND claim_token = :token AND status = 'pending'

-- name: outbox_http_retry
-- An answer worth trying again (or none): due again after :delay seconds, or
-- failed once :max_attempts claims are spent; the row's status after it.
UPDATE {schema}.outbox
   SET status = CASE WHEN attempts >= :max_attempts THEN 'failed' ELSE 'pending' END,
       next_attempt_at = now() + make_interval(secs => :delay),
       response_status = :status, last_error = :error, claimed_by = NULL, claimed_until = NULL
 WHERE id = :id AND claim_token = :token AND status = 'pending'
RETURNING status

-- name: outbox_http_fail
-- An answer that says never (another 4xx): failed, with it.
UPDATE {schema}.outbox
   SET status = 'failed', response_status = :status, last_error = :error,
       claimed_by = NULL, claimed_until = NULL
 WHERE id = :id AND claim_token = :token AND status = 'pending'
