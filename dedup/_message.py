"""The values a handler sees: the message, the transaction it runs in, and outcomes."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, TypeVar

import asyncpg
import orjson

from dedup import _errors as errors
from dedup.data import _sql as sql

_UNDECODED: Any = object()
"""``Message._decoded`` before the value is decoded (a JSON ``null`` decodes to ``None``)."""


@dataclass(slots=True, eq=False)
class Message:
    """One Kafka record, with the idempotency key dedup took from it.

    The value is decoded from JSON at most once for both dedup and the handler:
    a ``json_field`` key strategy decodes it, and :meth:`json` hands the handler
    that same object.  What dedup keeps of a message (``idempotency_key``, the
    payload hash and the dead letter) comes from the key and the raw ``value``,
    never from that object, so a handler that changes it changes only its own
    view (see :meth:`json`).
    """

    topic: str
    """The topic it was read from."""
    partition: int
    """Its partition."""
    offset: int
    """Its offset in the partition."""
    key: bytes | None
    """The Kafka record key, if any (``None`` for a null key)."""
    value: bytes
    """The record value; ``b""`` for a tombstone (a null value: see ``tombstone``)."""
    headers: dict[str, bytes]
    """Record headers by name, for lookups: the last one wins when a name repeats, and a
    header whose value is null shows as ``b""``.  ``raw_headers`` has them as they came."""
    timestamp: int
    """The record timestamp, in milliseconds since the epoch."""
    idempotency_key: str = ""
    """The key that makes the message's effect happen once, as stored (set before the
    handler runs; see :func:`dedup.keys.stored`)."""
    raw_headers: tuple[tuple[str, bytes | None], ...] = ()
    """The headers exactly as they came, in order, repeats included; a null value is ``None``."""
    tombstone: bool = False
    """True when the record's value was null (a tombstone, e.g. a delete on a compacted topic):
    ``value`` is then ``b""``, and a dead letter keeps the null."""
    # Not init fields: dataclasses.replace(msg, value=...) starts undecoded.
    _decoded: Any = field(default=_UNDECODED, init=False, repr=False)
    _handed_out: bool = field(default=False, init=False, repr=False)

    def json(self) -> Any:
        """The value decoded as JSON (orjson): decoded once, the same object on every call.

        It is the handler's to read.  To change it, change a copy
        (``copy.deepcopy(msg.json())``, or ``orjson.loads(msg.value)``): the
        handler runs again on the same message when its transaction is retried,
        and would find its own changes there.  dedup itself never reads it once
        it was handed out (:func:`decoded`).
        """
        if self._decoded is _UNDECODED:
            self._decoded = orjson.loads(self.value)
        self._handed_out = True
        return self._decoded

    @property
    def where(self) -> str:
        """``topic:partition:offset``, for messages and logs."""
        return f"{self.topic}:{self.partition}:{self.offset}"

    @classmethod
    def from_record(cls, record: Any) -> Message:
        """Build a message from an ``aiokafka.ConsumerRecord``."""
        raw = record.headers
        if type(raw) is not tuple:
            raw = tuple(raw or ())
        if raw:
            headers = dict(raw)
            if None in headers.values():  # rare: keep the lookup dict all bytes
                headers = {name: b"" if v is None else v for name, v in headers.items()}
        else:
            headers = {}  # most records have none: no dict() call, no scan
        value = record.value
        # Positional: a call by keyword costs twice as much, once per record.
        return cls(
            record.topic,
            record.partition,
            record.offset,
            record.key,
            b"" if value is None else value,
            headers,
            record.timestamp,
            "",
            raw,
            value is None,
        )


def decoded(msg: Message) -> Any:
    """``msg``'s value decoded as JSON, for dedup's own reading (the key strategies).

    Decoded once and kept for :meth:`Message.json`.  Once the handler (or the
    caller of :func:`dedup.claim`) was given that object it may have changed
    it, so the value is then decoded anew: a key always comes from the bytes
    that were sent, as it will from a redelivery of them.  Raises
    ``orjson.JSONDecodeError``.
    """
    if msg._handed_out:
        return orjson.loads(msg.value)
    if msg._decoded is _UNDECODED:
        msg._decoded = orjson.loads(msg.value)
    return msg._decoded


@dataclass(frozen=True, slots=True)
class Tx:
    """The open transaction a handler writes in."""

    conn: asyncpg.Connection
    """The asyncpg connection, inside the transaction; business writes go here."""
    token: int
    """The fencing token the transaction runs under (0 for ``wrap``, which has no partition
    lease)."""
    namespace: str = ""
    """The namespace the keys are claimed in; :meth:`lock` locks keys of it."""

    async def lock(self, *keys: str) -> None:
        """Lock ``keys`` of the namespace until the transaction ends, in one statement.

        Transaction-scoped advisory locks (``pg_advisory_xact_lock``) on the
        namespace and each key, taken in one sorted order, so handlers that
        update the same hot rows take them one after another instead of
        deadlocking: lock the rows' business keys (an account, a customer)
        before writing them.  A key's lock is held by at most one transaction
        of the namespace at a time, in every consumer and process.
        """
        if not keys:
            return
        await sql.Queries().lock_keys.execute(self.conn, namespace=self.namespace, keys=list(keys))


class Outcome(enum.Enum):
    """What happened to one message."""

    PROCESSED = "processed"
    """Its key was fresh: the handler ran and its writes committed with the key."""
    DUPLICATE = "duplicate"
    """Its key was already applied with the same payload: nothing ran."""
    CONFLICT = "conflict"
    """Its key was already applied with a different payload: nothing ran; recorded."""
    DEAD_LETTERED = "dead_lettered"
    """It could not be handled; the whole record is in ``dead_letters`` with the reason."""


class OnConflict(enum.StrEnum):
    """What happens to a message whose key was already applied with a different payload.

    Either way nothing runs, the key's row counts it and a ``conflict`` event
    records it; plain strings (``on_conflict="record"``) work as well.
    """

    DEAD_LETTER = "dead_letter"
    """Also write the whole record to ``dead_letters`` (the default)."""
    RECORD = "record"
    """Only count and record it."""


class OnMissingKey(enum.StrEnum):
    """What happens to a message the key strategy finds no key in.

    Plain strings (``on_missing_key="offset"``) work as well.
    """

    DEAD_LETTER = "dead_letter"
    """Write the whole record to ``dead_letters`` (the default)."""
    OFFSET = "offset"
    """Key it by ``topic:partition:offset``: applied once per record, not per business key."""


_Policy = TypeVar("_Policy", OnConflict, OnMissingKey)


def policy(kind: type[_Policy], setting: str, value: Any) -> _Policy:
    """``value`` as a member of ``kind``; a ConfigurationError names ``setting`` and the choices."""
    try:
        return kind(value)
    except ValueError:
        choices = " or ".join(repr(member.value) for member in kind)
        raise errors.ConfigurationError(f"{setting}={value!r}: expected {choices}") from None


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """What :func:`dedup.claim` found for a batch of records, in the caller's transaction."""

    fresh: list[Message]
    """Keys claimed now: apply these in the same transaction (in topic, partition, offset
    order).  If the transaction rolls back, so do their claims."""
    duplicates: list[Message]
    """Keys already applied with the same payload: do nothing (counted on the key's row)."""
    conflicts: list[Message]
    """Keys already applied with a different payload: do nothing; recorded as ``conflict``
    events (and dead-lettered under ``on_conflict="dead_letter"``, the default)."""
    dead_lettered: list[Message]
    """Messages written to ``dead_letters`` in the same transaction: those without a key
    (under ``on_missing_key="dead_letter"``) and the conflicts (under
    ``on_conflict="dead_letter"``)."""
