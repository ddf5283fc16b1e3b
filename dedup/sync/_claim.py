"""``dedup.sync.claim`` and ``dedup.sync.publish``: ``dedup.claim`` and ``ClaimResult.publish``
on a blocking psycopg connection, run by :func:`dedup.sync._drive.run`.

Each is the async call itself, handed the connection's
:class:`dedup.data._psycopg.SyncAdapter`: the same statements, rows and
events, nothing written twice.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dedup import _config as config
from dedup import _message as message_
from dedup import _outbox as outbox
from dedup import _wrap as wrap_
from dedup import keys
from dedup.data import _drivers as drivers
from dedup.sync import _drive as drive


def claim(
    conn: Any,
    records: Iterable[Any],
    *,
    namespace: str,
    key: keys.Strategy = config.DEFAULT_KEY,
    schema: str = "dedup",
    on_missing_key: str = message_.OnMissingKey.DEAD_LETTER,
    on_conflict: str = message_.OnConflict.DEAD_LETTER,
) -> message_.ClaimResult:
    """:func:`dedup.claim`, blocking: claim the keys of ``records`` inside your transaction.

    ``conn`` is a ``psycopg.Connection`` inside ``conn.transaction()`` (or
    with autocommit off: psycopg begins the transaction with dedup's first
    statement, and you commit it), or an SQLAlchemy ``Session`` /
    ``Connection`` on the psycopg dialect inside a transaction.  Everything
    else is :func:`dedup.claim`'s: the records (aiokafka ``ConsumerRecord``,
    ``confluent_kafka.Message``, ``dedup.Message``), the settings, the
    result and the rows it leaves.  No event loop is needed or touched.

    Raises :class:`dedup.ConfigurationError` outside a transaction, or for a
    connection that runs on an event loop (``await dedup.claim`` takes those).
    """

    async def claiming() -> message_.ClaimResult:
        driver = await drivers.in_transaction(
            conn, "dedup.sync.claim", blocking=True, twin="await dedup.claim(conn, records, ...)"
        )
        return await wrap_.claim(
            driver,
            records,
            namespace=namespace,
            key=key,
            schema=schema,
            on_missing_key=on_missing_key,
            on_conflict=on_conflict,
        )

    return drive.run(claiming(), "dedup.sync.claim")


def publish(
    result: message_.ClaimResult,
    conn: Any,
    topic: str,
    value: Any,
    *,
    source: message_.Message,
    key: bytes | str | None = None,
    headers: outbox.Headers | None = None,
) -> str:
    """``result.publish(conn, ...)``, blocking: an outbox record for the fresh message ``source``
    of :func:`claim`'s ``result``, in the claim's transaction ``conn``.

    The record exists if and only if the transaction commits; ``dedup relay``
    publishes it.  Returns its row key, ``NAMESPACE:KEY:N``.
    """

    async def publishing() -> str:
        driver = await drivers.in_transaction(
            conn,
            "dedup.sync.publish",
            blocking=True,
            twin="await result.publish(conn, ...)",
        )
        return await result.publish(driver, topic, value, source=source, key=key, headers=headers)

    return drive.run(publishing(), "dedup.sync.publish")
