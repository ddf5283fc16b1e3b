-- Named queries of dedup: offsets.  Loaded by dedup/_sql.py: each starts with a
-- `-- name: NAME` line; `{schema}` becomes the quoted schema name and
-- `:name` parameters are bound by keyword.

-- name: offsets_list
-- `dedup offsets show`: a NULL group or topic means all.
SELECT group_id, topic, "partition", holder, token, next_offset, acquired_at, updated_at
  FROM {schema}.partitions
 WHERE (:group_id::text IS NULL OR group_id = :group_id) AND (:topic::text IS NULL OR topic = :topic)
 ORDER BY group_id, topic, "partition"
 LIMIT :limit

-- name: offsets_lock
-- `dedup offsets rewind|skip`: the rows to move, locked until the move commits,
-- so a batch in flight on one of them commits first and is counted in the old
-- offset.
SELECT "partition", holder, token, next_offset FROM {schema}.partitions
 WHERE group_id = :group_id AND topic = :topic AND "partition" = ANY(:partitions::int[])
 ORDER BY "partition"
   FOR UPDATE

-- name: offsets_move
-- The operator's offset under a new token, which fences out the running owner;
-- a partition the group never consumed gets its row.  :holder is the
-- command; :next_offsets go with :partitions, in order.
INSERT INTO {schema}.partitions AS p (group_id, topic, "partition", holder, token, next_offset)
SELECT :group_id, :topic, x.part, :holder, 1, x.next_offset
  FROM unnest(:partitions::int[], :next_offsets::bigint[]) AS x(part, next_offset)
ON CONFLICT (group_id, topic, "partition") DO UPDATE
   SET token = p.token + 1, holder = EXCLUDED.holder, next_offset = EXCLUDED.next_offset,
       acquired_at = now(), updated_at = now()
RETURNING "partition", token

-- name: offsets_delete_group
-- `dedup offsets delete-group`: every stored offset of the group goes, once a
-- batch in flight on one of them has committed (the row locks); what each
-- partition held comes back, for the events.
DELETE FROM {schema}.partitions
 WHERE group_id = :group_id
RETURNING topic, "partition", holder, token, next_offset
