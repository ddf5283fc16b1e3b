-- Named queries of dedup: schedules (dedup/tasks/_scheduler.py).  Loaded by
-- dedup/data/_sql.py: each starts with a `-- name: NAME` line; `{schema}`
-- becomes the quoted schema name and `:name` parameters are bound by keyword.

-- name: schedule_upsert
-- A new schedule is decided up to :decided_until (now, or just before its start);
-- a changed one keeps its place unless its cron or time zone changed.
INSERT INTO {schema}.schedules AS s
       (name, task, job, cron, timezone, key_format, catch_up, catch_up_window, overlap,
        lease_ttl, platform_timeout, decided_until)
VALUES (:name, :task, :job, :cron, :timezone, :key_format, :catch_up,
        make_interval(secs => :catch_up_window), :overlap, :lease_ttl, :platform_timeout,
        coalesce(:decided_until, clock_timestamp()))
ON CONFLICT (name) DO UPDATE
   SET task = EXCLUDED.task, job = EXCLUDED.job, cron = EXCLUDED.cron,
       timezone = EXCLUDED.timezone, key_format = EXCLUDED.key_format,
       catch_up = EXCLUDED.catch_up, catch_up_window = EXCLUDED.catch_up_window,
       overlap = EXCLUDED.overlap, lease_ttl = EXCLUDED.lease_ttl,
       platform_timeout = EXCLUDED.platform_timeout,
       decided_until = CASE
           WHEN :decided_until IS NOT NULL THEN EXCLUDED.decided_until
           WHEN (s.cron, s.timezone) IS DISTINCT FROM (EXCLUDED.cron, EXCLUDED.timezone)
           THEN clock_timestamp()
           ELSE s.decided_until END,
       updated_at = clock_timestamp()
 WHERE (s.task, s.job, s.cron, s.timezone, s.key_format, s.catch_up, s.catch_up_window,
        s.overlap, s.lease_ttl, s.platform_timeout)
       IS DISTINCT FROM
       (EXCLUDED.task, EXCLUDED.job, EXCLUDED.cron, EXCLUDED.timezone, EXCLUDED.key_format,
        EXCLUDED.catch_up, EXCLUDED.catch_up_window, EXCLUDED.overlap, EXCLUDED.lease_ttl,
        EXCLUDED.platform_timeout)
    OR :decided_until IS NOT NULL
RETURNING (xmax = 0) AS created

-- name: schedule_list
SELECT name, task, job, cron, timezone, key_format, catch_up,
       extract(epoch FROM catch_up_window)::float8 AS catch_up_window, overlap, lease_ttl,
       platform_timeout, paused, decided_until, buffered
  FROM {schema}.schedules
 ORDER BY name

-- name: schedule_get
SELECT name, task, job, cron, timezone, key_format, catch_up,
       extract(epoch FROM catch_up_window)::float8 AS catch_up_window, overlap, lease_ttl,
       platform_timeout, paused, decided_until, buffered
  FROM {schema}.schedules
 WHERE name = :name

-- name: schedule_lock_active
-- The schedules this scheduler decides now: another scheduler's are skipped,
-- it decides them.  clock_timestamp() is the database's "now" of the decision.
SELECT name, task, job, cron, timezone, key_format, catch_up,
       extract(epoch FROM catch_up_window)::float8 AS catch_up_window, overlap, lease_ttl,
       platform_timeout, paused, decided_until, buffered, clock_timestamp() AS now
  FROM {schema}.schedules
 WHERE NOT paused
 ORDER BY name
   FOR UPDATE SKIP LOCKED

-- name: schedule_decided
UPDATE {schema}.schedules
   SET decided_until = :decided_until, buffered = :buffered, updated_at = clock_timestamp()
 WHERE name = :name

-- name: schedule_set_paused
UPDATE {schema}.schedules
   SET paused = :paused, updated_at = clock_timestamp()
 WHERE name = :name
RETURNING paused

-- name: schedule_remove
DELETE FROM {schema}.schedules WHERE name = :name RETURNING name

-- name: schedule_running
-- Is a run of this task live right now (a holder whose lease has not run out)?
SELECT EXISTS (
    SELECT 1
      FROM {schema}.tasks t
      JOIN {schema}.leases l ON l.resource = 'task:' || t.task || ':' || t.business_key
     WHERE t.task = :task AND t.state = 'running' AND l.expires_at > clock_timestamp()
)

-- name: schedule_abandoned
-- Periods decided but never started (pending for longer than :grace seconds), or
-- started by a holder that stopped renewing: the scheduler runs them again.
SELECT t.business_key
  FROM {schema}.tasks t
  LEFT JOIN {schema}.leases l ON l.resource = 'task:' || t.task || ':' || t.business_key
 WHERE t.task = :task
   AND ((t.state = 'pending' AND t.created_at < clock_timestamp() - make_interval(secs => :grace))
        OR (t.state = 'running' AND (l.expires_at IS NULL OR l.expires_at <= clock_timestamp())))
 ORDER BY t.business_key
 LIMIT :limit
