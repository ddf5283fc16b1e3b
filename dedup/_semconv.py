"""What the OpenTelemetry semantic conventions say, as dedup follows them.

The version followed (:data:`SCHEMA_URL`), bucket boundaries fit for
seconds, ``error.type``, the database attributes of a connection, and
``OTEL_SEMCONV_STABILITY_OPT_IN``, read as the OpenTelemetry instrumentations
read it (a comma-separated list): dedup emits the current attribute names in
every mode; ``database/dup`` and ``messaging/dup`` add the names the
conventions used before their renames, for dashboards not yet moved.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

SCHEMA_URL = "https://opentelemetry.io/schemas/1.44.0"
"""The semantic conventions dedup's spans and metrics follow."""
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
"""Advisory bucket boundaries (seconds) of the consumer's duration histograms: 1 ms to 30 s.  The
SDK's defaults (0, 5, 10, ... 10000) are meant for milliseconds and would put every
batch of a healthy consumer into one bucket."""
TASK_DURATION_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400)
"""Advisory bucket boundaries (seconds) of ``dedup.task.duration``: a second to four hours,
the lengths of scheduled jobs."""
SIZE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
"""Advisory bucket boundaries of ``dedup.batch.size`` (messages)."""

DB_METRIC_ATTRIBUTES = (
    "db.system.name",
    "db.namespace",
    "db.operation.name",
    "db.query.summary",
    "server.address",
    "server.port",
)


@functools.lru_cache(maxsize=256)
def server_attributes(
    database: str | None, schema: str | None, host: str | None, port: int | None
) -> Mapping[str, Any]:
    """The ``db.*`` and ``server.*`` attributes of a PostgreSQL connection."""
    attributes: dict[str, Any] = {"db.system.name": "postgresql"}
    if database:
        # The conventions' form for PostgreSQL: {database}|{schema}.
        attributes["db.namespace"] = f"{database}|{schema}" if schema else database
    if host:
        attributes["server.address"] = host
    if port is not None:
        attributes["server.port"] = port
    return attributes


def error_type(exc: BaseException) -> str:
    """``error.type`` of ``exc``: the SQLSTATE of a database error, else the class's full name."""
    sqlstate = getattr(exc, "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate:
        return sqlstate
    cls = type(exc)
    module = cls.__module__
    if module == "builtins":
        return cls.__qualname__
    if module.startswith("dedup."):
        module = "dedup"  # dedup's errors are public under dedup, wherever they live
    return f"{module}.{cls.__qualname__}"


OLD_NAMES: dict[str, dict[str, tuple[str, Callable[[Any], Any]]]] = {
    "database": {
        "db.system.name": ("db.system", str),
        "db.namespace": ("db.name", str),
        "db.operation.name": ("db.operation", str),
        "server.address": ("net.peer.name", str),
        "server.port": ("net.peer.port", int),
    },
    "messaging": {
        "messaging.consumer.group.name": ("messaging.kafka.consumer.group", str),
        "messaging.destination.partition.id": ("messaging.kafka.destination.partition", int),
        "messaging.kafka.offset": ("messaging.kafka.message.offset", int),
        "messaging.operation.type": ("messaging.operation", str),
    },
}
"""Per domain of ``OTEL_SEMCONV_STABILITY_OPT_IN``: the current attribute names the
conventions renamed, with the name (and type) they had before."""


def duplicated_domains(opt_in: str | None) -> frozenset[str]:
    """The domains whose old attribute names are added too: those given as ``<domain>/dup``.

    Read as the OpenTelemetry instrumentations read it: a comma-separated list,
    ``<domain>/dup`` winning over ``<domain>``.  dedup has emitted the current
    names from the start, so ``<domain>`` alone, or nothing, means just those.
    """
    given = {part.strip() for part in (opt_in or "").split(",")}
    return frozenset(domain for domain in OLD_NAMES if f"{domain}/dup" in given)


DUPLICATED = duplicated_domains(os.environ.get("OTEL_SEMCONV_STABILITY_OPT_IN"))


def with_old_names(
    attributes: Mapping[str, Any], domains: Iterable[str] | None = None
) -> dict[str, Any]:
    """``attributes`` with the old names of the renamed ones added (for the ``/dup`` domains)."""
    found = dict(attributes)
    for domain in DUPLICATED if domains is None else domains:
        for current, (old, convert) in OLD_NAMES[domain].items():
            if current in attributes:
                found[old] = convert(attributes[current])
    return found
