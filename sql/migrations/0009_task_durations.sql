-- What `dedup task stats`, a run's start and a scheduler's round read: the
-- latest successful runs of one task, newest first, each event's `duration`.
CREATE INDEX IF NOT EXISTS events_task_succeeded ON {schema}.events (namespace, id)
    WHERE subject = 'task' AND kind = 'task_succeeded';
