-- The downstream receiver (consumers/receiver.py): a stand-in for a system
-- outside dedup's database that takes notifications over HTTP.
CREATE SCHEMA IF NOT EXISTS receiver;

-- What it delivered: one row per idempotency key, ever.
CREATE TABLE IF NOT EXISTS receiver.notifications (
    idempotency_key text        PRIMARY KEY,
    recipient       text,
    payload         jsonb       NOT NULL,
    first_token     bigint      NOT NULL,   -- the fencing token it was delivered under
    last_token      bigint      NOT NULL,   -- the highest token seen for the key
    repeats         integer     NOT NULL DEFAULT 0,  -- later requests, ignored
    stale           integer     NOT NULL DEFAULT 0,  -- requests refused: token too low
    delivered_at    timestamptz NOT NULL DEFAULT now()
);

-- Every request and the answer it got.
CREATE TABLE IF NOT EXISTS receiver.requests (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    idempotency_key text,
    token           bigint,
    status          integer     NOT NULL,
    outcome         text        NOT NULL,
    at              timestamptz NOT NULL DEFAULT now()
);
