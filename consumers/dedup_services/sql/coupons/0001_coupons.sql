-- The coupons service (consumers/coupons.py): at most one coupon per (user, campaign).
CREATE SCHEMA IF NOT EXISTS coupons;

-- The business rule as a constraint: the primary key (user_id, campaign).  The
-- idempotency key stops a redelivered request; this stops a second request
-- for the same coupon (a double click, a retrying client with a new id).
CREATE TABLE IF NOT EXISTS coupons.coupons (
    user_id       text        NOT NULL,
    campaign      text        NOT NULL,
    code          text        NOT NULL UNIQUE,
    value         bigint      NOT NULL DEFAULT 0,
    request_key   text        NOT NULL,
    business_date date        NOT NULL,
    token         bigint      NOT NULL,
    issued_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (user_id, campaign)
);
CREATE INDEX IF NOT EXISTS coupons_business_date ON coupons.coupons (business_date);

-- Every request applied (one per idempotency key), and what it got: a new
-- coupon (issued) or the one the user already had (already_issued).
CREATE TABLE IF NOT EXISTS coupons.requests (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    request_key   text        NOT NULL UNIQUE,
    user_id       text        NOT NULL,
    campaign      text        NOT NULL,
    value         bigint      NOT NULL DEFAULT 0,
    business_date date        NOT NULL,
    outcome       text        NOT NULL CHECK (outcome IN ('issued', 'already_issued')),
    coupon_code   text        NOT NULL,
    token         bigint      NOT NULL,
    received_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS requests_user_campaign ON coupons.requests (user_id, campaign, id);
CREATE INDEX IF NOT EXISTS requests_business_date ON coupons.requests (business_date);
