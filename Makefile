# The two commands a newcomer needs are `make demo` and `make test`.
# Both build .venv (the library and the bundled services, both editable, with the
# library's dev extras) and bring up the local Kafka and Postgres when none is
# configured (compose/local/up).  The tests that run through pgbouncer start it
# themselves (compose/local/up pgbouncer).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: venv services down lint unit test demo bench bench-full bench-soak chaos

# The library (dedup-kafka) and the bundled services (dedup-kafka-services, from
# consumers/) are two distributions.  Until 0.2 the library was called `dedup`:
# a venv made then still holds it (and its reconcile entry points), so it goes.
$(STAMP): pyproject.toml consumers/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip uninstall -q -y --disable-pip-version-check dedup 2>/dev/null || true
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]' -e ./consumers
	touch $@

venv: $(STAMP)

# The broker gets the SASL_SSL listener the secured-Kafka tests use (docs/reference/configuration.md).
services:
	DEDUP_KAFKA_SASL_SSL=1 compose/local/up

down:
	compose/local/down

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

unit: venv
	$(BIN)/pytest tests/unit

test: venv services lint
	$(BIN)/pytest

demo: venv services
	$(BIN)/python -m dedup_services.demo

# The chaos suite's full matrix (tests/chaos, docs/reliability.md): 20-25 min on
# its own Kafka and Postgres (.services/chaos; the failover scenarios add a
# standby there), never the shared pair, and about as long again for the
# three-broker cluster's scenarios (.services/chaos-cluster), and 10 min for the
# network partitions (tests/chaos/test_partitions.py); the tables go to
# .services/chaos/results*.md and docs/reliability.md.  `make test` runs
# its short version (one seed per scenario).
chaos: venv
	CHAOS_MATRIX=full CHAOS_UPDATE_DOCS=1 $(BIN)/pytest tests/chaos -m chaos

# The benchmark (bench/, docs/performance.md); not part of `make test`.
# `make bench`: every section small (< 10 minutes), every target printed; `make bench-full`:
# the long run that publishes docs/performance.md.  Shrink with e.g. BENCH_ARGS="--rounds 1".
BENCH_STAMP := $(VENV)/.bench-stamp
$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev,bench]' -e ./consumers
	touch $@

bench: venv services $(BENCH_STAMP)
	$(BIN)/python -m bench quick $(BENCH_ARGS)

bench-full: venv services $(BENCH_STAMP)
	$(BIN)/python -m bench full --publish $(BENCH_ARGS)

bench-soak: venv services $(BENCH_STAMP)
	$(BIN)/python -m bench soak $(BENCH_ARGS)
