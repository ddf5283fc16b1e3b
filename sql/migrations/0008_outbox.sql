-- The outbox: a message written in the transaction that decides it, sent after
-- the COMMIT, once per key.  `key` names what the message is once (a sweep's
-- alert: reconcile:TASK:DATE), so a second writer of the same message adds
-- nothing; a sender takes pending rows FOR UPDATE SKIP LOCKED, sends each with
-- `key` as its Idempotency-Key and marks it in the same transaction.  Sinks:
-- `http` (a POST of `payload` to the URL in `destination`).
CREATE TABLE IF NOT EXISTS {schema}.outbox (
    id          bigserial   PRIMARY KEY,
    key         text        NOT NULL UNIQUE,
    sink        text        NOT NULL CHECK (sink IN ('http')),
    destination text        NOT NULL,
    payload     jsonb       NOT NULL,
    status      text        NOT NULL DEFAULT 'pending'
                            CHECK (status IN ('pending', 'sent', 'failed')),
    attempts    integer     NOT NULL DEFAULT 0,
    last_error  text,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    sent_at     timestamptz
);

CREATE INDEX IF NOT EXISTS outbox_pending ON {schema}.outbox (id) WHERE status = 'pending';
