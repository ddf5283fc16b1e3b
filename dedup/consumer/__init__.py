"""The idempotent Kafka consumer: fetching, the partitions it holds, lanes and their turns.

``_consumer`` holds ``IdempotentConsumer`` (its lifecycle and fetch loop);
``_partitions`` the partitions it holds (taken in Postgres, placed on lanes,
reported to Kafka) and ``_rebalance`` aiokafka's rebalance calls; ``_lanes``
the lanes (a connection, a task and pinned partitions each) and ``_turn`` one
turn's transaction; ``_retry`` the one table that says what a failed turn
means, ``_refusal`` what a refused fence found; ``_out_of_range`` and
``_decoding`` the fetch errors (a position outside the log, a batch that
cannot be decoded).

They may import the layers below them (dedup's statements, what a handler
sees, Postgres, Kafka, the basics); only the package's face imports them.
"""
