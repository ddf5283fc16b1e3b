-- Exits counted across restarts (dedup/_worker.py, PartitionWorker._starts).
-- A message whose handling ends the process (SystemExit, a signal, an OOM kill)
-- rolls its batch back, and the restart meets it again.  So a holder records,
-- before its first batch on a partition, where that batch starts
-- (`started_offset`) and how many holders in a row started there without
-- committing past it (`starts`).  Finding an earlier holder died there, it
-- applies the stretch up to `suspect_until` one message at a time, marking each,
-- so a death names its message; `suspect_deaths` is how many deaths the whole
-- stretch shared before that (each of its messages was in the batch that died).
-- A message marked more than max_attempts times is dead-lettered unhandled.
-- Nothing on the hot path writes these columns.
ALTER TABLE {schema}.partitions
    ADD COLUMN IF NOT EXISTS started_offset bigint,
    ADD COLUMN IF NOT EXISTS starts integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS suspect_until bigint,
    ADD COLUMN IF NOT EXISTS suspect_deaths integer NOT NULL DEFAULT 0;
