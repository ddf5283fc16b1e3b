"""What operators read and move: the audit, dead letters, offsets, reconciliation, purge, stats.

``_audit`` reads a key's history and the events; ``_dead_letters`` lists,
replays and resolves dead letters; ``_offsets`` moves a group's partitions
(``dedup offsets rewind | skip``) under a new token; ``_reconciliation``
counts source against result per task code and business date; ``_retention``
purges old keys in small batches; ``_task_stats`` reads how long a task's runs take;
``_diagnose`` says which layer failed for a task and business date.

They may import the layers below them (dedup's statements, Postgres, Kafka's
side of offsets, the basics); ``cli`` and the package's face import them, the
consumer reads ``_offsets`` to tell an operator's move from a takeover, and the
task runner and the scheduler ``_task_stats``'s lease and timeout rules.
"""
