-- Named queries of dedup: events.  Loaded by dedup/_sql.py: each starts with a
-- `-- name: NAME` line; `{schema}` becomes the quoted schema name and
-- `:name` parameters are bound by keyword.

-- name: record_events
-- Every transition of a statement's worth of events, in one INSERT (on the hot
-- path: a batch writes its conflicts and dead letters this way).  One array per
-- column; :details are JSON texts, cast here: the json codecs belong to the
-- pool's owner.
INSERT INTO {schema}.events
    (subject, kind, namespace, key, resource, holder, token, from_state, to_state,
     trace_id, detail)
SELECT s, k, n, ik, r, h, t, f, tt, tr, d::jsonb
  FROM unnest(:subjects::text[], :kinds::text[], :namespaces::text[], :keys::text[],
              :resources::text[], :holders::text[], :tokens::bigint[], :from_states::text[],
              :to_states::text[], :trace_ids::text[], :details::text[])
       AS x(s, k, n, ik, r, h, t, f, tt, tr, d)
