"""Idempotency key strategies: how to take a message's key, and the form it is stored in.

A strategy is any callable ``(Message) -> str | None``.  Returning ``None`` or
raising :class:`dedup.KeyExtractionError` means "no key"; the consumer then
dead-letters the message with the reason (or falls back, if configured).

What a strategy gives is the key a user knows.  :func:`extract` turns it into
the key that is stored (:func:`stored`): the same text, or a SHA-256 digest when
the text is too long to index or could be mistaken for a digest.

The format is a contract (docs/concepts/guarantees.md, "Key format", pinned by
golden values in tests/unit/test_keys.py): a key taken in one format from a
message stored under another would be fresh again, and the message applied twice.

- ``json_field("id")``: a string is itself (``"pay-1"`` → ``pay-1``), but one
  that starts with ``#`` gets another ``#`` in front; a number is ``#`` and its
  exact decimal value (``42`` → ``#42``, ``1.50`` and ``1.5e0`` → ``#1.5``).
- ``json_field("a", "b")``: each part as above with ``\\`` and ``:`` escaped by
  a ``\\``, joined with ``:``.
- ``header``, ``kafka_key``, ``offset``: the text as it came.
"""

from __future__ import annotations

import decimal
import hashlib
import json
from collections.abc import Callable
from typing import Any

import orjson

from dedup import _errors as errors
from dedup import _message as message_

Strategy = Callable[[message_.Message], "str | None"]

SEPARATOR = ":"
"""Joins the parts of a key made of several fields."""

ESCAPE = "\\"
"""Escapes :data:`SEPARATOR` and itself inside each part of a key made of several fields."""

NUMBER_MARK = "#"
"""Starts a key taken from a JSON number; a JSON string starting with it gets a second one."""

MAX_KEY_BYTES = 256
"""Longest key, in UTF-8 bytes, stored as it is; a longer one is stored as its digest."""

DIGEST_PREFIX = "sha256:"
"""Starts a stored digest; a key that starts with it is stored as its digest too."""

MAX_NUMBER_CHARS = 4300
"""Longest decimal text of a JSON number taken as a key (Python's own limit for
printing an int), so ``1e-999999999`` can't make a billion-digit key."""

MAX_REASON_CHARS = 300
"""Longest reason for a missing key: a reason never carries a huge key along."""

# Keys this short are under MAX_KEY_BYTES whatever their characters (4 bytes at most each).
_SURELY_SHORT = MAX_KEY_BYTES // 4
_DIGEST_START = DIGEST_PREFIX[0]


def header(name: str) -> Strategy:
    """The value of header ``name``, as UTF-8 text."""

    def from_header(msg: message_.Message) -> str | None:
        raw = msg.headers.get(name)
        if raw is None:
            raise errors.KeyExtractionError(f"missing header {name!r}")
        return _text(raw, f"header {name!r}")

    return from_header


def json_field(*paths: str) -> Strategy:
    """The value at each dotted path of the JSON value; several are joined with ``:``.

    A string is itself (one starting with ``#`` gets a second ``#``), a number
    is ``#`` and its exact decimal value; with several paths each part has
    ``\\`` and ``:`` escaped with a ``\\``.  ``json_field("task", "date",
    "doc.number")`` makes ``close:2026-11-30:#17``.  Anything else (null, a
    boolean, an object, an array, a missing field) is no key.
    """
    if not paths:
        raise errors.ConfigurationError("json_field needs at least one dotted path")
    if len(paths) == 1 and "." not in paths[0]:
        return _top_level_field(paths[0])
    split = [(path, path.split(".")) for path in paths]

    def from_json(msg: message_.Message) -> str | None:
        doc = _decode(msg)
        found = [_part(msg, _lookup(doc, parts, path), parts, path) for path, parts in split]
        if len(found) == 1:
            return found[0]
        return SEPARATOR.join(_escape(part) for part in found)

    return from_json


def _top_level_field(name: str) -> Strategy:
    """``json_field(name)`` for one top-level field: the common case, on the hot path."""

    def from_json(msg: message_.Message) -> str | None:
        try:
            doc = message_.decoded(msg)
        except orjson.JSONDecodeError as exc:
            raise errors.KeyExtractionError(f"invalid JSON: {exc}") from exc
        value = doc.get(name) if type(doc) is dict else None
        if type(value) is str and value and value[0] != NUMBER_MARK:
            return value
        return _part(msg, _lookup(doc, [name], name), [name], name)

    return from_json


def kafka_key() -> Strategy:
    """The Kafka record key, as UTF-8 text."""

    def from_kafka_key(msg: message_.Message) -> str | None:
        if msg.key is None:
            raise errors.KeyExtractionError("the record has no Kafka key")
        return _text(msg.key, "Kafka key")

    return from_kafka_key


def offset() -> Strategy:
    """``topic:partition:offset``: unique per record, so only redelivery is deduplicated."""

    def from_offset(msg: message_.Message) -> str | None:
        return msg.where

    return from_offset


def first(*strategies: Strategy) -> Strategy:
    """The key of the first strategy that gives one."""
    if not strategies:
        raise errors.ConfigurationError("first() needs at least one strategy")

    def from_first(msg: message_.Message) -> str | None:
        reasons = []
        for strategy in strategies:
            try:
                key = strategy(msg)
            except errors.KeyExtractionError as exc:
                reasons.append(str(exc))
                continue
            if key:
                return key
            reasons.append(f"{_name(strategy)} gave no key")
        raise errors.KeyExtractionError("; ".join(reasons))

    return from_first


def extract(strategy: Strategy, msg: message_.Message) -> str:
    """Apply ``strategy`` and return the key as stored (:func:`stored`).

    Raise KeyExtractionError with the reason (at most :data:`MAX_REASON_CHARS`
    long, :func:`storable`) when there is no key.
    """
    try:
        key = strategy(msg)
    except errors.KeyExtractionError as exc:
        # The reason is stored with the dead letter: a NUL or a lone surrogate in it (from
        # a strategy quoting the message) would fail the write and stall the partition.
        reason = shorten(storable(str(exc)))
        if reason != str(exc):
            raise errors.KeyExtractionError(reason) from exc
        raise
    except Exception as exc:
        raise errors.KeyExtractionError(
            shorten(f"key strategy {_name(strategy)} failed: {exc!r}")
        ) from exc
    if (
        type(key) is str
        and 0 < len(key) <= _SURELY_SHORT
        and key.isascii()
        and "\x00" not in key
        and (key[0] != _DIGEST_START or not key.startswith(DIGEST_PREFIX))
    ):
        return key  # stored as it is: the common case, tested inline to keep it quick
    if key is not None and not isinstance(key, str):
        raise errors.KeyExtractionError(
            f"key strategy {_name(strategy)} gave a {type(key).__name__}, not a str"
        )
    if not key:
        raise errors.KeyExtractionError(f"key strategy {_name(strategy)} gave no key")
    return stored(key)


def stored(key: str) -> str:
    """The form ``key`` is stored in: itself, or ``sha256:`` and the hex digest of its UTF-8.

    The digest stands in for a key longer than :data:`MAX_KEY_BYTES` (a B-tree
    entry can't hold a few kilobytes), one that Postgres text can't hold (a NUL,
    a lone surrogate) and one that already starts with ``sha256:``, so no key
    kept as it is can equal another key's digest.
    """
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError:
        # Lone surrogates: still one byte string per key, so the digest stays unique.
        raw = key.encode("utf-8", "surrogatepass")
    else:
        if len(raw) <= MAX_KEY_BYTES and b"\x00" not in raw and not key.startswith(DIGEST_PREFIX):
            return str(key)
    return DIGEST_PREFIX + hashlib.sha256(raw).hexdigest()


def lookup_forms(key: str) -> list[str]:
    """The stored keys that a key typed by an operator may mean.

    The stored form of ``key`` and, when that differs, ``key`` itself, so
    ``dedup audit --key`` finds a message by the key a user knows as well as
    by a ``sha256:...`` digest copied from a listing.
    """
    as_stored = stored(key)
    return [as_stored] if as_stored == key else [as_stored, key]


def storable(text: str) -> str:
    """``text`` with what Postgres text can't hold escaped: a NUL as ``\\x00``, a lone
    surrogate as ``\\ud800``; any other text is returned as it is."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def shorten(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[: limit - 40]}... ({len(text) - limit + 40} more characters)"


def _decode(msg: message_.Message) -> Any:
    try:
        return message_.decoded(msg)
    except orjson.JSONDecodeError as exc:
        raise errors.KeyExtractionError(f"invalid JSON: {exc}") from exc


def _lookup(doc: Any, parts: list[str], path: str) -> Any:
    node = doc
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            raise errors.KeyExtractionError(f"missing key field {path!r}")
        node = node[part]
    return node


def _part(msg: message_.Message, value: Any, parts: list[str], path: str) -> str:
    """One field's value as a key: a string as itself, a number as ``#`` and its digits."""
    kind = type(value)
    if kind is str:
        text: str = value
        return NUMBER_MARK + text if text.startswith(NUMBER_MARK) else text
    if kind is int:
        return NUMBER_MARK + str(value)
    if kind is float:
        # orjson gives a float for a fraction, an exponent or an integer past 64
        # bits: the binary value is not the one written, so read the literal again.
        return NUMBER_MARK + _number_text(_exact_number(msg, parts, path), path)
    if value is None:
        raise errors.KeyExtractionError(f"key field {path!r} is null")
    raise errors.KeyExtractionError(
        f"key field {path!r} is a {_json_type(value)}, not a string or number"
    )


def _exact_number(msg: message_.Message, parts: list[str], path: str) -> decimal.Decimal:
    """The number at ``parts`` exactly as written, from a second, slower decoding."""
    try:
        doc = json.loads(msg.value, parse_float=decimal.Decimal, parse_int=decimal.Decimal)
    except (ValueError, RecursionError) as exc:
        raise errors.KeyExtractionError(f"key field {path!r}: cannot read the number") from exc
    value = _lookup(doc, parts, path)
    if not isinstance(value, decimal.Decimal):
        raise errors.KeyExtractionError(f"key field {path!r}: cannot read the number")
    return value


def _number_text(value: decimal.Decimal, path: str) -> str:
    """The canonical decimal text: no exponent, no leading or trailing zeros, ``-`` if below 0."""
    sign, digit_tuple, exponent = value.as_tuple()
    if not isinstance(exponent, int):  # NaN or Infinity: JSON has neither
        raise errors.KeyExtractionError(f"key field {path!r}: cannot read the number")
    digits = "".join(map(str, digit_tuple)).lstrip("0")
    if not digits:
        return "0"  # 0, -0, 0.000, 0e5: one value, one key
    significant = digits.rstrip("0")
    exponent += len(digits) - len(significant)
    whole = len(significant) + exponent  # digits before the decimal point
    if exponent >= 0:
        length = whole
    elif whole > 0:
        length = len(significant) + 1
    else:
        length = len(significant) + 2 - whole
    if length > MAX_NUMBER_CHARS:
        # Counted before the text is made: 1e-999999999 is 12 bytes of JSON.
        raise errors.KeyExtractionError(
            f"key field {path!r} is a number of more than {MAX_NUMBER_CHARS} digits: "
            "send such an id as a JSON string"
        )
    if exponent >= 0:
        text = significant + "0" * exponent
    elif whole > 0:
        text = f"{significant[:whole]}.{significant[whole:]}"
    else:
        text = f"0.{'0' * -whole}{significant}"
    return "-" + text if sign else text


def _escape(part: str) -> str:
    if ESCAPE in part:
        part = part.replace(ESCAPE, ESCAPE + ESCAPE)
    if SEPARATOR in part:
        part = part.replace(SEPARATOR, ESCAPE + SEPARATOR)
    return part


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    return "array" if isinstance(value, list) else "object"


def _text(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise errors.KeyExtractionError(f"{what} is not UTF-8 text") from exc


def _name(strategy: Strategy) -> str:
    return getattr(strategy, "__name__", repr(strategy))
