-- The notifications service (consumers/notifications.py, consumers/outbox.py):
-- the transactional outbox.  The consumer writes a row in the transaction that
-- claims the message's key; a dispatcher sends it to the receiver afterwards.
CREATE SCHEMA IF NOT EXISTS notifications;

CREATE TABLE IF NOT EXISTS notifications.outbox (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- Sent to the receiver as the Idempotency-Key header: it handles a key once.
    idempotency_key text        NOT NULL UNIQUE,
    recipient       text        NOT NULL,
    payload         jsonb       NOT NULL,
    business_date   date        NOT NULL,
    -- The consumer's fencing token when the row was written.
    source_token    bigint      NOT NULL,
    status          text        NOT NULL DEFAULT 'pending'
                                CHECK (status IN ('pending', 'sent', 'failed')),
    -- Claims, one per send attempt (a dispatcher that died counts too).
    attempts        integer     NOT NULL DEFAULT 0,
    -- The fencing token of the latest claim, sent as X-Fencing-Token: the
    -- receiver refuses a lower one than it has seen for the key.
    claim_token     bigint      NOT NULL DEFAULT 0,
    claimed_by      text,
    -- A claim is the dispatcher's until then (database clock); after that,
    -- another dispatcher may claim the row again with the next token.
    claimed_until   timestamptz,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    response_status integer,
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    sent_at         timestamptz
);
-- What dispatchers look for: pending rows that are due.
CREATE INDEX IF NOT EXISTS outbox_due
    ON notifications.outbox (next_attempt_at, id) WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS outbox_business_date ON notifications.outbox (business_date);
