-- Named queries of dedup: leases.  Loaded by dedup/_sql.py: each starts with a
-- `-- name: NAME` line; `{schema}` becomes the quoted schema name and
-- `:name` parameters are bound by keyword.

-- name: lease_acquire
-- Take the resource when it is free or its lease expired; the token grows by
-- one on every acquisition.  $1 resource, $2 holder, $3 ttl in seconds.
INSERT INTO {schema}.leases AS l
    (resource, holder, token, ttl, acquired_at, renewed_at, expires_at)
SELECT $1, $2, 1, make_interval(secs => $3), n.t, n.t, n.t + make_interval(secs => $3)
  FROM (SELECT clock_timestamp() AS t) AS n
ON CONFLICT (resource) DO UPDATE
   SET holder = EXCLUDED.holder, token = l.token + 1, ttl = EXCLUDED.ttl,
       acquired_at = EXCLUDED.acquired_at, renewed_at = EXCLUDED.renewed_at,
       expires_at = EXCLUDED.expires_at, released_at = NULL
 WHERE l.expires_at <= clock_timestamp()
RETURNING resource, holder, token, ttl, acquired_at, renewed_at, expires_at

-- name: lease_renew
-- Extend a live lease by its ttl ($3 seconds, or NULL to keep the stored one),
-- only while $2 is still its token.
UPDATE {schema}.leases AS l
   SET renewed_at = n.t,
       ttl = coalesce(make_interval(secs => $3), l.ttl),
       expires_at = n.t + coalesce(make_interval(secs => $3), l.ttl)
  FROM (SELECT clock_timestamp() AS t) AS n
 WHERE l.resource = $1 AND l.token = $2 AND l.expires_at > n.t
RETURNING l.resource, l.holder, l.token, l.ttl, l.acquired_at, l.renewed_at, l.expires_at

-- name: lease_release
-- Expire a live lease now; the row and its token stay for the next holder.
UPDATE {schema}.leases AS l
   SET expires_at = n.t, released_at = n.t
  FROM (SELECT clock_timestamp() AS t) AS n
 WHERE l.resource = $1 AND l.token = $2 AND l.expires_at > n.t
RETURNING l.released_at

-- name: lease_fence
-- The fence: a conditional UPDATE in the caller's transaction.  A row comes
-- back only while $2 is the token and the lease is live; the row lock it takes
-- makes a takeover wait until that transaction ends.
UPDATE {schema}.leases
   SET token = token
 WHERE resource = $1 AND token = $2 AND expires_at > clock_timestamp()
RETURNING expires_at

-- name: lease_get
SELECT resource, holder, token, ttl, acquired_at, renewed_at, expires_at, released_at,
       expires_at > clock_timestamp() AS live
  FROM {schema}.leases
 WHERE resource = $1
