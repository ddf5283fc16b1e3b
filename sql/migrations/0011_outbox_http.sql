-- The outbox's HTTP sink for any number of dispatchers (dedup.Dispatcher): a
-- handler's `tx.post(destination, payload)` writes a row in the transaction
-- that applies its source; a dispatcher serving that destination claims due
-- rows with FOR UPDATE SKIP LOCKED, each claim taking the next `claim_token`
-- and lasting until `claimed_until` (database clock), commits the claim, POSTs
-- the payload with the row key as its Idempotency-Key and the claim token as
-- X-Fencing-Token, and marks the row only while it still carries that token.
-- A failed send is due again at `next_attempt_at`; `response_status` is the
-- last answer.
ALTER TABLE {schema}.outbox
    ADD COLUMN IF NOT EXISTS claim_token     bigint      NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS claimed_by      text,
    ADD COLUMN IF NOT EXISTS claimed_until   timestamptz,
    ADD COLUMN IF NOT EXISTS next_attempt_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS response_status integer;

-- What dispatchers look for: pending HTTP rows of their destinations that are due.
CREATE INDEX IF NOT EXISTS outbox_due_http ON {schema}.outbox (destination, next_attempt_at, id)
    WHERE status = 'pending' AND sink = 'http';
