"""Development support for the tests, the benchmark, the chaos suite and the demo.

The one home of what they need; neither wheel includes it.

``services``          where Kafka and Postgres answer (the environment, else ``.services/env``)
``database``          databases made and dropped on the test server
``kafka``             topics made and deleted, records produced, offsets read
``kafka_tools``       Kafka's own command-line tools
``helpers``           waiting for a condition, and producing records, in the tests
``children``          child processes that announce themselves with lines on stdout
``proxy``             a TCP proxy that passes, blackholes or resets: network partitions
``effects``           the ``effects`` business table, its handlers and the consumer builder
``consumer_process``  a consumer in its own process, for tests that kill or pause it
``faststream_member`` a FastStream group member in its own process
``task_jobs``         jobs of the task tests (``dedup task run dedup_dev.task_jobs:NAME``)
``task_worker``       a ``dedup`` CLI process with a wrong wall clock or a start barrier
``service_process``   ``dedup ...`` child processes of the bundled-service tests
``audit``             rows as the writers leave them, and the CLI as a user runs it
``rows``              records of every outcome, and the rows dedup must leave for them
``catalog``           what Postgres' catalogs say of a schema, to compare two databases
``docs``              the pages' snippets, found and run
``dashboard``         the Grafana dashboard's panels drawn with matplotlib from a Prometheus
"""
