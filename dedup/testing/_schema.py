"""``Schema``: a fresh dedup schema on a test database, made for one test and dropped after it.

The ``dedup_schema`` fixture (:mod:`dedup.testing._plugin`) is one; outside pytest,
``await Schema.create(dsn)`` and ``await schema.drop()`` do the same.  The schema
gets runtime and audit roles of its own (``<schema>_runtime``, ``<schema>_audit``),
as every migrated dedup schema does, so the test database's login needs
``CREATEROLE`` (or to be a superuser); they are dropped with the schema.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from dedup import _message as message_
from dedup.data import _db as db
from dedup.data import _migrations as migrations
from dedup.data import _sql as sql
from dedup.testing import _deliver as deliver_

PREFIX = "dedup_test_"
"""How the name of each schema :meth:`Schema.create` makes begins."""
RANDOM_HEX_DIGITS = 12
"""The random hex digits after :data:`PREFIX`: no two tests, or runs, take one name."""


@dataclass(frozen=True, slots=True)
class Schema:
    """A migrated dedup schema of its own on a test database (the ``dedup_schema`` fixture)."""

    dsn: str
    """The test database."""
    name: str
    """The schema: ``dedup_test_`` and 12 random hex digits."""

    @classmethod
    async def create(cls, dsn: str) -> Schema:
        """Migrate a new schema on the database of ``dsn``; its roles are made for it."""
        name = PREFIX + uuid.uuid4().hex[:RANDOM_HEX_DIGITS]
        await migrations.migrate(
            dsn, schema=name, runtime_role=f"{name}_runtime", audit_role=f"{name}_audit"
        )
        return cls(dsn, name)

    async def drop(self) -> None:
        """Drop the schema, everything in it and its two roles."""
        async with db.connection(self.dsn) as conn:
            await sql.Queries(self.name).testing_drop_schema.execute(conn)

    async def deliver(
        self,
        handler: Callable[..., Awaitable[object]],
        records: Iterable[message_.Message | deliver_.Record | deliver_.Value],
        *,
        namespace: str,
        **options: Any,
    ) -> deliver_.Delivery:
        """:func:`dedup.testing.deliver` on this schema's database and tables (``options``
        are its keyword arguments but ``dsn``, ``pool`` and ``schema``)."""
        return await deliver_.deliver(
            handler, records, namespace=namespace, dsn=self.dsn, schema=self.name, **options
        )
