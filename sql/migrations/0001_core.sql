-- Core tables of dedup.  The schema name comes from configuration,
-- validated and quoted; nothing else is ever formatted into SQL.

-- One row per (namespace, idempotency key): the key was claimed in the same
-- transaction as the business write it guards.
CREATE TABLE IF NOT EXISTS {schema}.processed (
    namespace         text        NOT NULL,
    idempotency_key   text        NOT NULL,
    topic             text,
    "partition"       integer,
    "offset"          bigint,
    token             bigint,
    payload_hash      bytea       NOT NULL,
    status            text        NOT NULL DEFAULT 'processed',
    first_seen        timestamptz NOT NULL DEFAULT now(),
    processed_at      timestamptz NOT NULL DEFAULT now(),
    duplicates        integer     NOT NULL DEFAULT 0,
    conflicts         integer     NOT NULL DEFAULT 0,
    last_duplicate_at timestamptz,
    PRIMARY KEY (namespace, idempotency_key)
) WITH (
    -- room on each page for the in-place (HOT) duplicate-counter updates
    fillfactor = 90,
    -- purge deletes in small batches; vacuum soon after so space is reused
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.05
);
-- BRIN: near-free to maintain on an append-mostly table, enough for purge to
-- find old rows without a B-tree on the hot insert path.
CREATE INDEX IF NOT EXISTS processed_first_seen_brin
    ON {schema}.processed USING brin (first_seen);

-- The consumer's row per (group, topic, partition): who owns it (fencing
-- token, bumped on every assignment) and the next offset to apply.  Postgres,
-- not Kafka, holds the authoritative offset.
CREATE TABLE IF NOT EXISTS {schema}.partitions (
    group_id    text        NOT NULL,
    topic       text        NOT NULL,
    "partition" integer     NOT NULL,
    holder      text        NOT NULL,
    token       bigint      NOT NULL,
    next_offset bigint,
    acquired_at timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (group_id, topic, "partition")
);

-- Append-only audit of every state transition.  `subject` says what the row is
-- about (message, partition, lease, task, reconcile); namespace/key name it
-- (consumer namespace + idempotency key, or task code + business key).
CREATE TABLE IF NOT EXISTS {schema}.events (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT now(),
    subject     text        NOT NULL,
    kind        text        NOT NULL,
    namespace   text,
    key         text,
    resource    text,
    holder      text,
    token       bigint,
    from_state  text,
    to_state    text,
    trace_id    text,
    detail      jsonb       NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX IF NOT EXISTS events_namespace_key ON {schema}.events (namespace, key);
CREATE INDEX IF NOT EXISTS events_resource ON {schema}.events (resource);
CREATE INDEX IF NOT EXISTS events_at_brin ON {schema}.events USING brin (at);

-- Messages that could not be applied, whole, with the reason.  One row per
-- (namespace, topic, partition, offset), so a redelivered poison message is not
-- dead-lettered twice.
CREATE TABLE IF NOT EXISTS {schema}.dead_letters (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    namespace       text        NOT NULL,
    group_id        text,
    topic           text        NOT NULL,
    "partition"     integer     NOT NULL,
    "offset"        bigint      NOT NULL,
    timestamp_ms    bigint,
    key             bytea,
    value           bytea,
    header_names    text[]      NOT NULL DEFAULT '{}',
    header_values   bytea[]     NOT NULL DEFAULT '{}',
    idempotency_key text,
    reason          text        NOT NULL,
    error           text,
    attempts        integer     NOT NULL DEFAULT 1,
    token           bigint,
    created_at      timestamptz NOT NULL DEFAULT now(),
    replayed_at     timestamptz,
    UNIQUE (namespace, topic, "partition", "offset")
);
