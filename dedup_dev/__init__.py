"""Development support for the tests, the benchmark and the chaos suite: never shipped.

One place for what they all need (neither wheel includes it):

``services``  where Kafka and Postgres answer (the environment, else ``.services/env``)
``database``  databases made and dropped on the test server
``kafka``     topics made and deleted, records produced, offsets read
``children``  child processes that announce themselves with lines on stdout
``effects``   the ``effects`` business table, its handlers and the consumer builder
``dashboard`` the Grafana dashboard's panels drawn with matplotlib from a Prometheus
"""
