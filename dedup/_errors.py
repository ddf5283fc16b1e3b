"""Errors raised by dedup.

    DedupError
    ├── ConfigurationError     a setting is wrong; names the setting
    ├── ServiceUnavailableError  Kafka or Postgres can't be reached (retriable)
    ├── StaleTokenError        a newer fencing token exists: stop writing
    ├── KeyExtractionError     no idempotency key could be taken from a message
    ├── HandlerError           a handler broke the rules of its batch: ran past
    │                          handler_timeout, was cancelled, or tried to end
    │                          dedup's transaction
    ├── MigrationError         the schema could not be brought up to date
    └── UndecodableBatchError  a record batch from Kafka cannot be read; names where

Every error keeps the original exception on ``__cause__``.  ``retriable`` says
whether trying the same thing again later can succeed.
"""

from __future__ import annotations


class DedupError(Exception):
    """Root of every error dedup raises."""

    retriable: bool = False


class ConfigurationError(DedupError):
    """A setting is missing or invalid; the message names the setting."""


class ServiceUnavailableError(DedupError):
    """Kafka or Postgres did not answer; trying again later may succeed."""

    retriable = True


class StaleTokenError(DedupError):
    """A newer holder owns the resource: this holder's writes are refused.

    Raised inside the caller's transaction, which must then roll back.
    """

    def __init__(self, resource: str, token: int, message: str | None = None) -> None:
        self.resource = resource
        self.token = token
        super().__init__(
            message
            or f"fencing token {token} for {resource} is stale: a newer holder took over; "
            "roll back and stop writing"
        )


class KeyExtractionError(DedupError):
    """No idempotency key could be taken from a message."""


class HandlerError(DedupError):
    """A handler failed in a way dedup caught: a timeout, a cancellation, a transaction it ended.

    It counts like any exception the handler raises: the batch rolls back, the
    message is tried again and dead-lettered after ``max_attempts``.
    """


class MigrationError(DedupError):
    """The schema could not be brought up to date."""


class UndecodableBatchError(DedupError):
    """A record batch fetched from Kafka cannot be decoded (a codec missing, corrupt bytes).

    The consumer stops rather than skip records it cannot read.  ``topic`` and
    ``partition`` name the partition (None when aiokafka did not say which);
    ``offset`` is the partition's stored offset once the readable records before the batch
    were applied (where consumption stands);
    ``batch`` is the undecodable batch's ``(first offset, next offset)`` when known.
    """

    def __init__(
        self,
        message: str,
        *,
        topic: str | None = None,
        partition: int | None = None,
        offset: int | None = None,
        batch: tuple[int, int] | None = None,
    ) -> None:
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.batch = batch
        super().__init__(message)
