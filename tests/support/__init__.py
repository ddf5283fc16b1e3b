"""Support for the integration tests that only they use (the shared part is dedup_dev).

``audit``             rows as the writers leave them, and the CLI as a user runs it
``docs``              the pages' snippets, found and run
``rows``              records of every outcome, and the rows dedup must leave for them
``service``           ``dedup ...`` child processes of the bundled-service tests
``kafka_tools``       Kafka's own command-line tools
``task_jobs``         jobs of the task tests (``dedup task run tests.support.task_jobs:NAME``)
``task_worker``       a ``dedup`` CLI process with a wrong wall clock or a start barrier
``consumer_process``  a consumer in its own process, for tests that kill or pause it
"""
