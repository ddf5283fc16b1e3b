-- Named queries of dedup: offsets.  Loaded by dedup/_sql.py: each starts with a
-- `-- name: NAME` line; `{schema}` becomes the quoted schema name and
-- `:name` parameters are bound by keyword.

-- name: offsets_list
-- `dedup offsets show`: $1 group, $2 topic (NULL: all), $3 limit.
SELECT group_id, topic, "partition", holder, token, next_offset, acquired_at, updated_at
  FROM {schema}.partitions
 WHERE ($1::text IS NULL OR group_id = $1) AND ($2::text IS NULL OR topic = $2)
 ORDER BY group_id, topic, "partition"
 LIMIT $3

-- name: offsets_lock
-- `dedup offsets rewind|skip`: the rows to move, locked until the move commits,
-- so a batch in flight on one of them commits first and is counted in the old
-- offset.  $1 group, $2 topic, $3 partitions.
SELECT "partition", holder, token, next_offset FROM {schema}.partitions
 WHERE group_id = $1 AND topic = $2 AND "partition" = ANY($3::int[])
 ORDER BY "partition"
   FOR UPDATE

-- name: offsets_move
-- The operator's offset under a new token, which fences out the running owner;
-- a partition the group never consumed gets its row.  $1 group, $2 topic,
-- $3 holder (the command), $4 partitions, $5 new next offsets.
INSERT INTO {schema}.partitions AS p (group_id, topic, "partition", holder, token, next_offset)
SELECT $1, $2, x.part, $3, 1, x.next_offset
  FROM unnest($4::int[], $5::bigint[]) AS x(part, next_offset)
ON CONFLICT (group_id, topic, "partition") DO UPDATE
   SET token = p.token + 1, holder = EXCLUDED.holder, next_offset = EXCLUDED.next_offset,
       acquired_at = now(), updated_at = now()
RETURNING "partition", token
