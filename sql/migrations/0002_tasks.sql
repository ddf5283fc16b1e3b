-- Leases with fencing tokens, and run-once tasks (dedup.leases, dedup.tasks).
-- Every time in these tables comes from the database clock, never a worker's.

-- One row per resource, kept for good: releasing a lease expires it but keeps
-- the row, so the next token is always larger than every token issued for the
-- resource before.  A lease is live while expires_at > clock_timestamp().
CREATE TABLE IF NOT EXISTS {schema}.leases (
    resource    text        PRIMARY KEY,
    holder      text        NOT NULL,
    token       bigint      NOT NULL CHECK (token > 0),
    ttl         interval    NOT NULL,
    acquired_at timestamptz NOT NULL,
    renewed_at  timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    released_at timestamptz
) WITH (
    -- renewals rewrite the row every fraction of a TTL: leave room for HOT updates
    fillfactor = 70
);

-- One row per (task code, business key): the run-once state machine
-- pending -> running -> succeeded | failed.  A failed task may run again
-- (attempts + 1, up to a limit); a running one whose lease expired is taken
-- over; a succeeded one runs again only when forced.  `token` is the fencing
-- token of the latest run (the lease of resource task:<task>:<business_key>).
CREATE TABLE IF NOT EXISTS {schema}.tasks (
    task         text        NOT NULL,
    business_key text        NOT NULL,
    state        text        NOT NULL DEFAULT 'pending'
                             CHECK (state IN ('pending', 'running', 'succeeded', 'failed')),
    attempts     integer     NOT NULL DEFAULT 0,
    holder       text,
    token        bigint,
    forced       boolean     NOT NULL DEFAULT false,
    created_at   timestamptz NOT NULL DEFAULT now(),
    started_at   timestamptz,
    finished_at  timestamptz,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    last_error   text,
    result       jsonb,
    PRIMARY KEY (task, business_key)
);
-- What an operator looks for: tasks that are running or failed right now.
CREATE INDEX IF NOT EXISTS tasks_unfinished
    ON {schema}.tasks (task, state) WHERE state IN ('running', 'failed');
