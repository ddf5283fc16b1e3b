"""The benchmark harness: exactly-once consumption side by side with the alternatives.

Run it with ``make bench`` (or ``python -m bench --help``); it is not part of
the test run.  ``bench.stats`` holds the pure arithmetic (medians, percentiles,
round-by-round ratios, targets) and is unit-tested; everything else talks to the
real Kafka and Postgres.
"""
