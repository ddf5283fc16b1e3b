-- The statements job (consumers/statements.py): one statement per account and
-- business date, summing the month to date of the payments service's ledger.
CREATE SCHEMA IF NOT EXISTS statements;

-- fence_token: the fencing token of the run that wrote the row.  A run whose
-- token is older (one that was paused and superseded) cannot overwrite it.
CREATE TABLE IF NOT EXISTS statements.statements (
    business_date date        NOT NULL,
    account       text        NOT NULL,
    period_start  date        NOT NULL,
    payments      integer     NOT NULL,  -- applied payments in the period
    rejected      integer     NOT NULL,  -- rejected payments in the period
    total         bigint      NOT NULL,  -- sum of the applied payments
    fence_token   bigint      NOT NULL,
    written_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (business_date, account)
);
