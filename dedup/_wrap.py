"""``wrap`` and ``claim``: exactly-once effects inside a hand-written aiokafka loop.

Both claim each record's idempotency key in a transaction with the business
writes, as the consumer does, without a partition lease: the caller's loop owns
offsets, and the key claim alone makes redelivery harmless.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from dedup import _config as config
from dedup import _handler as handler_
from dedup import _limits as limits
from dedup import _message as message_
from dedup import _store as store
from dedup import keys
from dedup.data import _db as db
from dedup.data import _drivers as drivers


def wrap(
    handler: Callable[..., Awaitable[object]],
    *,
    pool: Any,
    namespace: str,
    key: keys.Strategy = config.DEFAULT_KEY,
    schema: str = "dedup",
    on_missing_key: str = message_.OnMissingKey.DEAD_LETTER,
    on_conflict: str = message_.OnConflict.DEAD_LETTER,
) -> Callable[[Any], Awaitable[message_.Outcome]]:
    """Make ``handler`` idempotent inside your own aiokafka loop.

    Returns ``async (record: aiokafka.ConsumerRecord) -> Outcome``: claims the
    record's key and runs ``handler(msg, tx)`` in one transaction when the key is
    fresh.  There is no partition lease here (``tx.token`` is 0): your loop owns
    offsets, and the key claim alone makes redelivery harmless.  A handler error
    rolls back and propagates, so your loop decides whether to retry.
    """
    config.check_handler(handler)
    writes, missing_key = _claimer(key, schema, namespace, on_missing_key, on_conflict)

    async def handle(record: Any) -> message_.Outcome:
        msg = message_.Message.from_record(record)
        letter = store.take_key(key, missing_key, msg)
        async with pool.acquire() as conn, db.around_handler(conn):
            result = await writes.claim(
                conn, [msg] if letter is None else [], dead=[letter] if letter else []
            )
            if result.applied:
                await handler_.run(
                    handler,
                    batch_handler=False,
                    msgs=result.applied,
                    conn=conn,
                    token=0,
                    deadline_s=None,
                    namespace=writes.namespace,
                    schema=writes.schema,
                )
        if result.applied:
            return message_.Outcome.PROCESSED
        if result.conflicts:
            return message_.Outcome.CONFLICT
        if result.dead_letters:
            return message_.Outcome.DEAD_LETTERED
        return message_.Outcome.DUPLICATE

    return handle


async def claim(
    conn: Any,
    records: Iterable[Any],
    *,
    namespace: str,
    key: keys.Strategy = config.DEFAULT_KEY,
    schema: str = "dedup",
    on_missing_key: str = message_.OnMissingKey.DEAD_LETTER,
    on_conflict: str = message_.OnConflict.DEAD_LETTER,
) -> message_.ClaimResult:
    """Claim the idempotency keys of ``records`` inside your own open transaction.

    ``conn`` is an asyncpg connection inside a transaction, a
    ``psycopg.AsyncConnection`` inside one (or with autocommit off), or an
    SQLAlchemy ``AsyncConnection`` / ``AsyncSession`` (asyncpg or psycopg
    dialect) inside one; dedup writes on its driver connection, so the claims
    commit or roll back with your writes (:func:`dedup.sync.claim` is the same
    on a blocking psycopg connection).  ``records`` are aiokafka
    ``ConsumerRecord`` objects, ``confluent_kafka.Message`` objects (none with
    ``error()`` set) or :class:`dedup.Message` objects, from any topics and
    partitions.  Apply
    ``result.fresh`` in the same transaction; duplicates and conflicts are
    counted on the key's row and recorded (conflict events) as the consumer
    does, conflicts and keyless records dead-lettered by default.  Offsets stay
    yours: commit them to Kafka after your transaction commits.

    Raises :class:`dedup.ConfigurationError` outside a transaction, and for
    records of no kind above.  Database errors are the driver's own
    (``asyncpg.PostgresError``, ``psycopg.Error``).
    """
    writes, missing_key = _claimer(key, schema, namespace, on_missing_key, on_conflict)
    driver = await drivers.in_transaction(
        conn, "dedup.claim", twin="dedup.sync.claim(conn, records, ...)"
    )
    msgs: list[message_.Message] = []
    dead: list[store.DeadLetter] = []
    for record in records:
        msg = message_.of(record)
        letter = store.take_key(key, missing_key, msg)
        if letter is None:
            msgs.append(msg)
        else:
            dead.append(letter)
    result = await writes.claim(driver, msgs, dead=dead)
    return message_.ClaimResult(
        fresh=result.applied,
        duplicates=result.duplicates,
        conflicts=result.conflicts,
        dead_lettered=[d.msg for d in result.dead_letters],
        namespace=writes.namespace,
        schema=schema,
    )


def _claimer(
    key: keys.Strategy, schema: str, namespace: str, on_missing_key: object, on_conflict: object
) -> tuple[store.Store, message_.OnMissingKey]:
    """The store that claims keys for ``wrap`` and ``claim``, after checking their settings."""
    limits.check_text("namespace", namespace, limits.MAX_NAME_BYTES)
    config.check_key(key)
    missing_key, conflict = config.policies(on_missing_key, on_conflict)
    return store.Store(schema=schema, namespace=namespace, on_conflict=conflict), missing_key
