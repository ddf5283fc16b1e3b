-- Steps of a task's job (TaskRun.step): a step's row is written in the same
-- transaction as the step's own writes, so a rerun of the task (after a
-- failure, or forced) skips exactly the steps whose writes committed.
CREATE TABLE IF NOT EXISTS {schema}.task_steps (
    task         text        NOT NULL,
    business_key text        NOT NULL,
    step         text        NOT NULL,
    holder       text        NOT NULL,
    token        bigint      NOT NULL,
    attempt      integer     NOT NULL,
    completed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (task, business_key, step)
);
