-- The outbox's Kafka sink.  A handler's `tx.publish(topic, value)` (and a task
-- run's `run.publish`) writes a row in the transaction that claims its source,
-- so the row exists if and only if the source was applied, once; `dedup relay`
-- publishes the pending rows to Kafka in `id` order and marks them `sent`.
-- `key` stays the row's unique name (sent as the record's `dedup-key` header);
-- `destination` is the topic.  A Kafka row keeps the record (`message_key`,
-- `value`, `header_names` / `header_values`), the key of what caused it
-- (`source`) and its fencing token; the headers carry the handler's trace context.
ALTER TABLE {schema}.outbox ALTER COLUMN payload DROP NOT NULL;
ALTER TABLE {schema}.outbox DROP CONSTRAINT IF EXISTS outbox_sink_check;
ALTER TABLE {schema}.outbox ADD CONSTRAINT outbox_sink_check CHECK (sink IN ('http', 'kafka'));
ALTER TABLE {schema}.outbox
    ADD COLUMN IF NOT EXISTS message_key   bytea,
    ADD COLUMN IF NOT EXISTS value         bytea,
    ADD COLUMN IF NOT EXISTS header_names  text[],
    ADD COLUMN IF NOT EXISTS header_values bytea[],
    ADD COLUMN IF NOT EXISTS source        text,
    ADD COLUMN IF NOT EXISTS token         bigint;

-- What the relay reads (pending Kafka rows by id) and what purge deletes (sent
-- rows by age) each get their own partial index, so neither scans the other's.
CREATE INDEX IF NOT EXISTS outbox_pending_kafka ON {schema}.outbox (id)
    WHERE status = 'pending' AND sink = 'kafka';
CREATE INDEX IF NOT EXISTS outbox_sent ON {schema}.outbox (sent_at) WHERE status = 'sent';
