"""The values a handler sees: the message, the transaction it runs in, and outcomes."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import asyncpg
import orjson

from dedup import _errors as errors
from dedup import _outbox as outbox
from dedup.data import _drivers as drivers
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
        """Build a message from an ``aiokafka.ConsumerRecord`` (see :func:`of` for others)."""
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

    @classmethod
    def from_confluent(cls, record: Any) -> Message:
        """Build a message from a ``confluent_kafka.Message``, whose fields are methods.

        Raises :class:`dedup.ConfigurationError` for one whose ``error()`` is set
        (an end of partition, a broker error): it is an event, not a record.
        """
        error = record.error()
        if error is not None:
            where = ":".join(str(part) for part in (record.topic(), record.partition()))
            raise errors.ConfigurationError(
                f"a confluent_kafka.Message with an error is no record to claim: {error} "
                f"(at {where}); skip such messages (`if msg.error(): ...`) before handing "
                "the rest to dedup"
            )
        raw = tuple(record.headers() or ())
        headers = {name: b"" if v is None else v for name, v in raw} if raw else {}
        value = record.value()
        return cls(
            record.topic(),
            record.partition(),
            record.offset(),
            record.key(),
            b"" if value is None else value,
            headers,
            record.timestamp()[1],  # (type, milliseconds)
            "",
            raw,
            value is None,
        )


class Record(NamedTuple):
    """A record in the shape of aiokafka's ``ConsumerRecord``, for :meth:`Message.from_record`
    (``dedup.testing``'s records)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...]
    timestamp: int


def of(record: Any) -> Message:
    """``record`` as a :class:`Message`: a ``dedup.Message`` as it is, an aiokafka
    ``ConsumerRecord`` or a ``confluent_kafka.Message`` built into one.

    Raises :class:`dedup.ConfigurationError` for anything else, and for a
    confluent message whose ``error()`` is set.
    """
    if isinstance(record, Message):
        return record
    if callable(getattr(record, "topic", None)):  # confluent_kafka's fields are methods
        return Message.from_confluent(record)
    try:
        return Message.from_record(record)
    except AttributeError:
        raise errors.ConfigurationError(
            f"a record is a {type(record).__module__}.{type(record).__qualname__}; expected an "
            "aiokafka ConsumerRecord, a confluent_kafka.Message or a dedup.Message"
        ) from None


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
    schema: str = sql.DEFAULT_SCHEMA
    """dedup's schema: where :meth:`publish` writes."""
    source: Message | None = None
    """The message a per-message handler was called with (None for a batch handler)."""
    _published: list[int] = field(default_factory=lambda: [0], init=False, repr=False)

    async def publish(
        self,
        topic: str,
        value: Any,
        *,
        key: bytes | str | None = None,
        headers: outbox.Headers | None = None,
        source: Message | None = None,
    ) -> str:
        """Publish a record to ``topic`` once: it is written in this transaction, sent by the relay.

        The record exists if and only if this transaction commits, so a
        message's effects and what it tells other services happen together,
        once; ``dedup relay`` publishes it (:class:`dedup.Relay`).  ``value``
        is bytes, text or JSON (a dict, a list), None for a tombstone;
        ``headers`` a mapping or pairs.  A batch handler names the message a
        record comes from (``source=msg``).  Returns the record's row key,
        ``NAMESPACE:KEY:N`` (the Nth record of the message), which the relay
        sends as the ``dedup-key`` header.
        """
        row_key, origin = self._next_row("tx.publish(topic, value, source=msg)", source)
        return await outbox.publish(
            self.conn, self.schema, row_key=row_key, source=origin, token=self.token,
            topic=topic, value=value, key=key, headers=headers,
        )  # fmt: skip

    async def post(self, destination: str, payload: Any, *, source: Message | None = None) -> str:
        """An HTTP message to ``destination``, once: written in this transaction, POSTed by a
        :class:`dedup.Dispatcher` serving that destination name.

        As :meth:`publish`: it exists if and only if this transaction commits;
        ``payload`` is JSON (a dict, a list, or JSON text); a batch handler
        names the message it comes from (``source=msg``).  Returns the row key
        ``NAMESPACE:KEY:N``, sent as the ``Idempotency-Key`` header.
        """
        row_key, origin = self._next_row("tx.post(destination, payload, source=msg)", source)
        return await outbox.post(
            self.conn, self.schema, row_key=row_key, source=origin, token=self.token,
            destination=destination, payload=payload,
        )  # fmt: skip

    def _next_row(self, call: str, source: Message | None) -> tuple[str, str]:
        """The next outbox row key of this transaction, for ``source`` or the handler's message;
        and the source's key.  A batch handler must name it (``call`` says how)."""
        origin = source or self.source
        if origin is None:
            raise errors.ConfigurationError(
                f"{call.partition('(')[0]} in a batch handler: name the message it comes "
                f"from, {call}"
            )
        return _next_row(self.namespace, origin, self._published)

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
        await sql.Queries(self.schema).lock_keys.execute(
            self.conn, namespace=self.namespace, keys=list(keys)
        )


def _next_row(namespace: str, origin: Message, published: list[int]) -> tuple[str, str]:
    """``NAMESPACE:KEY:N``, the ``published[0]``-th outbox row of its transaction (counted);
    and ``NAMESPACE:KEY``, its source."""
    n = published[0]
    published[0] += 1
    source = f"{namespace}:{origin.idempotency_key}"
    return f"{source}:{n}", source


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
    namespace: str = ""
    """The namespace the keys were claimed in."""
    schema: str = sql.DEFAULT_SCHEMA
    """dedup's schema."""
    _published: list[int] = field(default_factory=lambda: [0], init=False, repr=False)

    async def publish(
        self,
        conn: asyncpg.Connection,
        topic: str,
        value: Any,
        *,
        source: Message,
        key: bytes | str | None = None,
        headers: outbox.Headers | None = None,
    ) -> str:
        """:meth:`Tx.publish` for a fresh message ``source``, in the claim's transaction ``conn``
        (the connection or session :func:`dedup.claim` was given; after
        :func:`dedup.sync.claim`, :func:`dedup.sync.publish`)."""
        driver = await drivers.in_transaction(
            conn, "ClaimResult.publish", twin="dedup.sync.publish(result, conn, ...)"
        )
        row_key, origin = _next_row(self.namespace, source, self._published)
        return await outbox.publish(
            driver, self.schema, row_key=row_key, source=origin, token=0,
            topic=topic, value=value, key=key, headers=headers,
        )  # fmt: skip
