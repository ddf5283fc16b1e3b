-- Schedules (dedup.Scheduler, `dedup schedule`): cron lines that any number of
-- scheduler processes fire, each period once, through the run-once tasks.
-- A scheduler decides a schedule's due periods under the row's lock (FOR
-- UPDATE SKIP LOCKED), moves `decided_until` past them and creates their
-- `tasks` rows in the same transaction; every time here is the database's.
CREATE TABLE IF NOT EXISTS {schema}.schedules (
    name            text             PRIMARY KEY,
    task            text             NOT NULL,
    job             text             NOT NULL,          -- MODULE:FUNCTION
    cron            text             NOT NULL,
    timezone        text             NOT NULL DEFAULT 'UTC',
    key_format      text             NOT NULL DEFAULT '%Y-%m-%d',
    catch_up        text             NOT NULL DEFAULT 'all'
                                     CHECK (catch_up IN ('none', 'latest', 'all')),
    catch_up_window interval         NOT NULL DEFAULT '7 days',
    overlap         text             NOT NULL DEFAULT 'skip'
                                     CHECK (overlap IN ('skip', 'buffer_one', 'allow')),
    lease_ttl       double precision NOT NULL DEFAULT 30,
    platform_timeout double precision,                  -- declared by the user: seconds
    paused          boolean          NOT NULL DEFAULT false,
    -- Every period at or before this time is decided: fired, buffered or skipped.
    decided_until   timestamptz      NOT NULL,
    -- overlap buffer_one: the one period that waits for the running one to end.
    buffered        timestamptz,
    created_at      timestamptz      NOT NULL DEFAULT clock_timestamp(),
    updated_at      timestamptz      NOT NULL DEFAULT clock_timestamp()
);

-- What a scheduler looks for: periods decided but never started (schedule_abandoned).
CREATE INDEX IF NOT EXISTS tasks_pending ON {schema}.tasks (task) WHERE state = 'pending';
