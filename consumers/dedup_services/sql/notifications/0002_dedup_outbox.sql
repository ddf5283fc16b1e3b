-- The notifications service moves onto dedup's outbox: the consumer writes each
-- notification with tx.post('notifications', ...) into dedup's outbox table
-- ({schema}.outbox, sink 'http'), which dedup.Dispatcher sends; this service
-- keeps, per notification, its business date and the key of its outbox row,
-- for `dedup reconcile --task notifications`.
CREATE TABLE IF NOT EXISTS notifications.written (
    idempotency_key text        PRIMARY KEY,
    recipient       text        NOT NULL,
    business_date   date        NOT NULL,
    outbox_key      text        NOT NULL,
    source_token    bigint      NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS written_business_date ON notifications.written (business_date);

-- The notifications of the service's own outbox move into dedup's, as they
-- were: their keys (the receiver has seen them), statuses, claims and attempts.
INSERT INTO {schema}.outbox
       (key, sink, destination, payload, source, token, status, attempts, claim_token,
        next_attempt_at, response_status, last_error, created_at, sent_at)
SELECT idempotency_key, 'http', 'notifications', payload, 'notifications:' || idempotency_key,
       source_token, status, attempts, claim_token, next_attempt_at, response_status,
       last_error, created_at, sent_at
  FROM notifications.outbox
ON CONFLICT (key) DO NOTHING;
INSERT INTO notifications.written
       (idempotency_key, recipient, business_date, outbox_key, source_token, created_at)
SELECT idempotency_key, recipient, business_date, idempotency_key, source_token, created_at
  FROM notifications.outbox
ON CONFLICT (idempotency_key) DO NOTHING;
DROP TABLE notifications.outbox;
