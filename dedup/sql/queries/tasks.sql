-- Named queries of dedup: tasks.  Loaded by dedup/_sql.py: each starts with a
-- `-- name: NAME` line; `{schema}` becomes the quoted schema name and
-- `:name` parameters are bound by keyword.

-- name: task_ensure
INSERT INTO {schema}.tasks (task, business_key) VALUES ($1, $2)
ON CONFLICT (task, business_key) DO NOTHING

-- name: task_start
UPDATE {schema}.tasks
   SET state = 'running', attempts = attempts + 1, holder = $3, token = $4, forced = $5,
       started_at = clock_timestamp(), finished_at = NULL, updated_at = clock_timestamp()
 WHERE task = $1 AND business_key = $2
RETURNING attempts

-- name: task_finish
-- Only the current run may finish the task: $3 is its token.  $5 is the result
-- as JSON text (never a jsonb parameter: the pool's codecs are its owner's).
UPDATE {schema}.tasks
   SET state = $4, result = $5::text::jsonb, last_error = $6,
       finished_at = clock_timestamp(), updated_at = clock_timestamp()
 WHERE task = $1 AND business_key = $2 AND token = $3 AND state = 'running'
RETURNING attempts

-- name: task_give_up
-- A running task whose holder vanished and which has no attempts left.
UPDATE {schema}.tasks
   SET state = 'failed', last_error = $3,
       finished_at = clock_timestamp(), updated_at = clock_timestamp()
 WHERE task = $1 AND business_key = $2 AND state = 'running'

-- name: task_get
-- With FOR UPDATE appended, runners of one (task, key) queue here one claim at a time.
-- The result comes back as JSON text, parsed by dedup whatever codecs the pool has.
SELECT task, business_key, state, attempts, holder, token, forced, started_at, finished_at,
       last_error, result::text AS result
  FROM {schema}.tasks
 WHERE task = $1 AND business_key = $2
