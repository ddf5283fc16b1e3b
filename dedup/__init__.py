"""dedup: each Kafka message and each scheduled job takes effect exactly once.

Delivery from Kafka stays at-least-once; the effect inside Postgres becomes
exactly once because the idempotency key is claimed in the same transaction as
the business write, under a fencing token that a newer owner invalidates.
"""

from __future__ import annotations

import importlib.metadata

from dedup import keys, sync
from dedup._dispatcher import Dispatcher
from dedup._errors import (
    ConfigurationError,
    DedupError,
    HandlerError,
    KeyExtractionError,
    MigrationError,
    ServiceUnavailableError,
    StaleTokenError,
    UndecodableBatchError,
)
from dedup._faststream import FastStreamDedup
from dedup._kafka_client import add_kafka_options, kafka_options
from dedup._leases import Lease, Leases, default_holder, fenced_upsert
from dedup._message import ClaimResult, Message, OnConflict, OnMissingKey, Outcome, Tx
from dedup._relay import Relay
from dedup._wrap import claim, wrap
from dedup.consumer._consumer import IdempotentConsumer
from dedup.data._db import create_pool
from dedup.data._migrations import migrate
from dedup.operations._reconciliation import Check as ReconcileCheck
from dedup.operations._reconciliation import ReconcileReport, reconcile, sweep_job
from dedup.tasks._command import run_task
from dedup.tasks._run import TaskOutcome, TaskRun, TaskState
from dedup.tasks._runner import TaskRunner
from dedup.tasks._scheduler import Schedule, Scheduler

# Installed as dedup-kafka (`dedup` on PyPI is another project), imported as dedup.
_DISTRIBUTION = "dedup-kafka"

try:
    __version__: str = importlib.metadata.version(_DISTRIBUTION)
    """The installed version of dedup-kafka, e.g. ``"0.2.0"``."""
except importlib.metadata.PackageNotFoundError:
    # Imported from a source tree that was never installed: no metadata to read.
    __version__ = "0+unknown"

__all__ = [
    "ClaimResult",
    "ConfigurationError",
    "DedupError",
    "Dispatcher",
    "FastStreamDedup",
    "HandlerError",
    "IdempotentConsumer",
    "KeyExtractionError",
    "Lease",
    "Leases",
    "Message",
    "MigrationError",
    "OnConflict",
    "OnMissingKey",
    "Outcome",
    "ReconcileCheck",
    "ReconcileReport",
    "Relay",
    "Schedule",
    "Scheduler",
    "ServiceUnavailableError",
    "StaleTokenError",
    "TaskOutcome",
    "TaskRun",
    "TaskRunner",
    "TaskState",
    "Tx",
    "UndecodableBatchError",
    "add_kafka_options",
    "claim",
    "create_pool",
    "default_holder",
    "fenced_upsert",
    "kafka_options",
    "keys",
    "migrate",
    "reconcile",
    "run_task",
    "sweep_job",
    "sync",
    "wrap",
]

# Public names show as dedup.X in reprs and tracebacks (httpx does the same),
# never as the private module they happen to live in.
for _name in __all__:
    _value = globals()[_name]
    if _value is not keys and _value is not sync:  # the modules keep their names
        _value.__module__ = "dedup"
del _name, _value
