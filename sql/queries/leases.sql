-- Named queries of dedup: leases.  Loaded by dedup/_sql.py: each starts with a
-- `-- name: NAME` line; `{schema}` becomes the quoted schema name and
-- `:name` parameters are bound by keyword.

-- name: lease_acquire
-- Take the resource when it is free or its lease expired; the token grows by
-- one on every acquisition.  :ttl is in seconds.
INSERT INTO {schema}.leases AS l
    (resource, holder, token, ttl, acquired_at, renewed_at, expires_at)
SELECT :resource, :holder, 1, make_interval(secs => :ttl), n.t, n.t,
       n.t + make_interval(secs => :ttl)
  FROM (SELECT clock_timestamp() AS t) AS n
ON CONFLICT (resource) DO UPDATE
   SET holder = EXCLUDED.holder, token = l.token + 1, ttl = EXCLUDED.ttl,
       acquired_at = EXCLUDED.acquired_at, renewed_at = EXCLUDED.renewed_at,
       expires_at = EXCLUDED.expires_at, released_at = NULL
 WHERE l.expires_at <= clock_timestamp()
RETURNING resource, holder, token, ttl, acquired_at, renewed_at, expires_at

-- name: lease_renew
-- Extend a live lease by its ttl (:ttl seconds, or NULL to keep the stored one),
-- only while :token is still its token.
UPDATE {schema}.leases AS l
   SET renewed_at = n.t,
       ttl = coalesce(make_interval(secs => :ttl), l.ttl),
       expires_at = n.t + coalesce(make_interval(secs => :ttl), l.ttl)
  FROM (SELECT clock_timestamp() AS t) AS n
 WHERE l.resource = :resource AND l.token = :token AND l.expires_at > n.t
RETURNING l.resource, l.holder, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at

-- name: lease_release
-- Expire a live lease now; the row and its token stay for the next holder.
UPDATE {schema}.leases AS l
   SET expires_at = n.t, released_at = n.t
  FROM (SELECT clock_timestamp() AS t) AS n
 WHERE l.resource = :resource AND l.token = :token AND l.expires_at > n.t
RETURNING l.released_at

-- name: lease_fence
-- The fence: a conditional UPDATE in the caller's transaction.  A row comes
-- back only while :token is the token and the lease is live; the row lock it takes
-- makes a takeover wait until that transaction ends.
UPDATE {schema}.leases
   SET token = token
 WHERE resource = :resource AND token = :token AND expires_at > clock_timestamp()
RETURNING expires_at

-- name: lease_get
SELECT resource, holder, token, ttl, acquired_at, renewed_at, expires_at, released_at,
       expires_at > clock_timestamp() AS live
  FROM {schema}.leases
 WHERE resource = :resource

-- name: fenced_upsert
-- A template, completed by dedup/_leases.py for one table (dedup.Leases'
-- fenced_upsert): insert the row, or update it only while the stored token is
-- not newer than this writer's.  {table}, {columns}, {keys}, {updated}, {fence}
-- are quoted identifiers, {excluded} the same columns as EXCLUDED.<column>, and
-- {values} their named parameters (one per column, named after it).  A refused
-- write returns no row.
INSERT INTO {table} AS cur ({columns}) VALUES ({values})
ON CONFLICT ({keys}) DO UPDATE SET ({updated}) = ROW({excluded})
 WHERE cur.{fence} <= EXCLUDED.{fence}
RETURNING 1
