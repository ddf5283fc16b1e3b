-- The payments service (consumers/payments.py).  Amounts are integers in minor
-- units (cents).  Its own schema, so its names never meet the application's.
CREATE SCHEMA IF NOT EXISTS payments;

-- Balances.  fence_resource and fence_token: the partition lease
-- (group:topic:partition) and fencing token of the last deduction.  A
-- deduction under an older token of the same lease is refused; tokens of
-- different leases are not comparable, and there the lease's own fence guards.
CREATE TABLE IF NOT EXISTS payments.accounts (
    account        text        PRIMARY KEY,
    balance        bigint      NOT NULL CHECK (balance >= 0),
    fence_resource text,
    fence_token    bigint      NOT NULL DEFAULT 0,
    updated_at     timestamptz NOT NULL DEFAULT now()
);

-- One decision per payment: applied, or rejected with the reason (insufficient
-- funds, unknown account, a non-positive amount).  A rejection is a business
-- outcome, stored like an application; it is not retried.
CREATE TABLE IF NOT EXISTS payments.payments (
    payment_id    text        PRIMARY KEY,
    account       text        NOT NULL,
    amount        bigint      NOT NULL,
    business_date date        NOT NULL,
    status        text        NOT NULL CHECK (status IN ('applied', 'rejected')),
    reason        text,
    balance_after bigint,
    token         bigint      NOT NULL,
    topic         text,
    "partition"   integer,
    "offset"      bigint,
    decided_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS payments_business_date ON payments.payments (business_date, account);

-- One row per balance change, written with the deduction.  `dedup reconcile
-- --task payments` compares these with the applied payments of the day.
CREATE TABLE IF NOT EXISTS payments.postings (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    payment_id    text        NOT NULL,
    account       text        NOT NULL,
    amount        bigint      NOT NULL,
    balance_after bigint      NOT NULL,
    business_date date        NOT NULL,
    token         bigint      NOT NULL,
    posted_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS postings_business_date ON payments.postings (business_date);
