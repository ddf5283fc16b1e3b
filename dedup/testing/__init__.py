"""Test helpers: a handler run over records through the real claim path, with no Kafka.

``deliver(handler, records, dsn=..., namespace=..., key=...)`` runs ``handler``
over ``records`` as the consumer would (the key claim and the handler in one
transaction, retries, dead letters) and returns each record's outcome;
``record(value, key=..., offset=...)`` makes a record to deliver; ``Schema`` is
a fresh migrated dedup schema on a test database, which the pytest plugin
(``_plugin``, registered by dedup-kafka's ``pytest11`` entry point) gives each
test that asks for the ``dedup_schema`` fixture.

``_deliver`` and ``_schema`` may import the layers below them (the consumer's
transaction and retry table, ``wrap`` and ``claim``, Postgres); ``_plugin``
imports pytest, which ``import dedup`` and ``import dedup.testing`` never do.
"""

from dedup.testing._deliver import (
    DEFAULT_TOPIC,
    Delivered,
    Delivery,
    Record,
    deliver,
    record,
)
from dedup.testing._schema import Schema

__all__ = ["DEFAULT_TOPIC", "Delivered", "Delivery", "Record", "Schema", "deliver", "record"]

# Public names show as dedup.testing.X in reprs and tracebacks, as dedup's own do.
for _name in __all__:
    _value = globals()[_name]
    if callable(_value):
        _value.__module__ = "dedup.testing"
del _name, _value
