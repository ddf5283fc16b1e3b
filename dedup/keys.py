"""Idempotency key strategies: how to take a message's key.

A strategy is any callable ``(Message) -> str | None``.  Returning ``None`` or
raising :class:`dedup.KeyExtractionError` means "no key"; the consumer then
dead-letters the message with the reason (or falls back, if configured).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from dedup import errors
from dedup import message as message_

Strategy = Callable[[message_.Message], "str | None"]

SEPARATOR = ":"
"""Joins the parts of a key made of several fields."""


def header(name: str) -> Strategy:
    """The value of header ``name``, as UTF-8 text."""

    def from_header(msg: message_.Message) -> str | None:
        raw = msg.headers.get(name)
        if raw is None:
            raise errors.KeyExtractionError(f"missing header {name!r}")
        return _text(raw, f"header {name!r}")

    return from_header


def json_field(*paths: str) -> Strategy:
    """The value at each dotted path of the JSON value, joined with ``:``.

    ``json_field("task", "date", "doc.number")`` makes ``"close:2026-11-30:17"``.
    """
    if not paths:
        raise errors.ConfigurationError("json_field needs at least one dotted path")
    split = [(path, path.split(".")) for path in paths]
    if len(paths) == 1 and "." not in paths[0]:
        return _top_level_field(paths[0])

    def from_json(msg: message_.Message) -> str | None:
        try:
            doc = msg.json()
        except orjson.JSONDecodeError as exc:
            raise errors.KeyExtractionError(f"invalid JSON: {exc}") from exc
        return SEPARATOR.join(_scalar(_lookup(doc, path, parts), path) for path, parts in split)

    return from_json


def _top_level_field(name: str) -> Strategy:
    """``json_field(name)`` for one top-level field: the common case, on the hot path."""

    def from_json(msg: message_.Message) -> str | None:
        try:
            doc = msg.json()
        except orjson.JSONDecodeError as exc:
            raise errors.KeyExtractionError(f"invalid JSON: {exc}") from exc
        value = doc.get(name) if type(doc) is dict else None
        if type(value) is str:
            return value
        return _scalar(_lookup(doc, name, [name]), name)

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
    """Apply ``strategy``; raise KeyExtractionError with the reason when there is no key."""
    try:
        key = strategy(msg)
    except errors.KeyExtractionError:
        raise
    except Exception as exc:
        raise errors.KeyExtractionError(f"key strategy {_name(strategy)} failed: {exc!r}") from exc
    if not key:
        raise errors.KeyExtractionError(f"key strategy {_name(strategy)} gave no key")
    if "\x00" in key:
        raise errors.KeyExtractionError("the key contains a NUL character")
    return key


def _lookup(doc: Any, path: str, parts: list[str]) -> Any:
    node = doc
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            raise errors.KeyExtractionError(f"missing key field {path!r}")
        node = node[part]
    return node


def _scalar(value: Any, path: str) -> str:
    if value is None:
        raise errors.KeyExtractionError(f"key field {path!r} is null")
    if isinstance(value, bool | dict | list):
        raise errors.KeyExtractionError(f"key field {path!r} is not a string or number")
    return str(value)


def _text(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise errors.KeyExtractionError(f"{what} is not UTF-8 text") from exc


def _name(strategy: Strategy) -> str:
    return getattr(strategy, "__name__", repr(strategy))
