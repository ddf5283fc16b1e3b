-- Named queries of dedup: tasks.  Loaded by dedup/_sql.py: each starts with a
-- `-- name: NAME` line; `{schema}` becomes the quoted schema name and
-- `:name` parameters are bound by keyword.

-- name: task_ensure
INSERT INTO {schema}.tasks (task, business_key) VALUES (:task, :business_key)
ON CONFLICT (task, business_key) DO NOTHING

-- name: task_start
UPDATE {schema}.tasks
   SET state = 'running', attempts = attempts + 1, holder = :holder, token = :token,
       forced = :forced,
       started_at = clock_timestamp(), finished_at = NULL, updated_at = clock_timestamp()
 WHERE task = :task AND business_key = :business_key
RETURNING attempts

-- name: task_finish
-- Only the current run may finish the task: :token is its token.  :result is
-- JSON text (never a jsonb parameter: the pool's codecs are its owner's).
UPDATE {schema}.tasks
   SET state = :state, result = :result::text::jsonb, last_error = :error,
       finished_at = clock_timestamp(), updated_at = clock_timestamp()
 WHERE task = :task AND business_key = :business_key AND token = :token
   AND state = 'running'
RETURNING attempts, extract(epoch FROM finished_at - started_at)::float8 AS duration

-- name: task_give_up
-- A running task whose holder vanished and which has no attempts left.
UPDATE {schema}.tasks
   SET state = 'failed', last_error = :error,
       finished_at = clock_timestamp(), updated_at = clock_timestamp()
 WHERE task = :task AND business_key = :business_key AND state = 'running'

-- name: task_get
-- The result comes back as JSON text, parsed by dedup whatever codecs the pool has.
SELECT task, business_key, state, attempts, holder, token, forced, started_at, finished_at,
       last_error, result::text AS result
  FROM {schema}.tasks
 WHERE task = :task AND business_key = :business_key

-- name: task_lock
-- task_get, locked: runners of one (task, key) queue here one claim at a time.
SELECT task, business_key, state, attempts, holder, token, forced, started_at, finished_at,
       last_error, result::text AS result
  FROM {schema}.tasks
 WHERE task = :task AND business_key = :business_key
   FOR UPDATE

-- name: step_get
-- A step completed by an earlier run of the task (TaskRun.step).
SELECT holder, token, attempt, completed_at
  FROM {schema}.task_steps
 WHERE task = :task AND business_key = :business_key AND step = :step

-- name: step_complete
-- In the step's own transaction, with its writes; nothing when it completed already.
INSERT INTO {schema}.task_steps (task, business_key, step, holder, token, attempt)
VALUES (:task, :business_key, :step, :holder, :token, :attempt)
ON CONFLICT (task, business_key, step) DO NOTHING
RETURNING completed_at

-- name: task_durations
-- How long the task's latest :runs successful runs since :since seconds ago
-- took (seconds, database time): the `duration` of its task_succeeded events,
-- newest first through the index events_task_succeeded.
SELECT count(*) AS runs,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY duration) AS p50,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY duration) AS p95,
       max(duration) AS max
  FROM (SELECT (detail->>'duration')::float8 AS duration
          FROM {schema}.events
         WHERE subject = 'task' AND namespace = :task AND kind = 'task_succeeded'
           AND detail ? 'duration'
           AND at >= clock_timestamp() - make_interval(secs => :since)
         ORDER BY id DESC
         LIMIT :runs) AS latest

-- name: task_last_lease
-- The lease ttl of the task's latest run, and how often it was renewed (seconds).
SELECT (detail->>'lease_ttl')::float8 AS lease_ttl, (detail->>'renew_every')::float8 AS renew_every
  FROM {schema}.events
 WHERE subject = 'task' AND namespace = :task
   AND kind IN ('task_started', 'task_taken_over') AND detail ? 'lease_ttl'
 ORDER BY id DESC
 LIMIT 1

-- name: task_platform_timeouts
-- The platform timeouts declared by the schedules that run the task.
SELECT name, platform_timeout
  FROM {schema}.schedules
 WHERE task = :task AND platform_timeout IS NOT NULL
 ORDER BY name

-- name: diagnose_events
-- One task and business key's story: its runs' events and its lease's.
SELECT id, at, kind, holder, token, detail::text AS detail
  FROM {schema}.events
 WHERE (subject = 'task' AND namespace = :task AND key = :business_key)
    OR (subject = 'lease' AND resource = :resource)
 ORDER BY id
