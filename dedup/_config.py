"""The consumer's settings: their defaults, and the checks that refuse a bad one at construction.

Every check names the setting and the value it got, so a typo fails before
anything connects.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiokafka

from dedup import _errors as errors
from dedup import _kafka_client as kafka_client
from dedup import _limits as limits
from dedup import _message as message_
from dedup import keys

DEFAULT_BATCH_SIZE = 500
DEFAULT_CONCURRENCY = 4
"""Lanes of a consumer with a batch handler, or with ``batch_size=1`` (measured:
docs/performance.md).

A batch handler sees a turn's messages at once and can order its writes (one
``tx.lock``); its lanes ran at 0.94-1.01 x the hand-written loops where one lane
ran at 0.77 x.  A per-message handler at ``batch_size=1`` ran at 1.05-1.14 x the
naive loop on four lanes, 0.62 x on one."""
DEFAULT_PER_MESSAGE_CONCURRENCY = 1
"""Lanes of a consumer with a per-message handler and ``batch_size`` above 1: one.

Called message by message in offset order, such a handler can't take its
locks in one sorted order, so two lanes whose turns update the same rows
deadlock, turn after turn: the README's handler on 100 accounts ran at
0.09 x one lane with four (docs/performance.md).  At ``batch_size=1`` a
transaction holds one message, whose locks are taken in the order the
handler's code takes them, as in any one-transaction-per-message loop: such a
consumer gets :data:`DEFAULT_CONCURRENCY` lanes."""


def default_concurrency(batch_handler: bool, batch_size: int) -> int:
    """The lanes a consumer runs when ``concurrency`` is not given."""
    if batch_handler or batch_size == 1:
        return DEFAULT_CONCURRENCY
    return DEFAULT_PER_MESSAGE_CONCURRENCY


DEFAULT_HANDLER_TIMEOUT = 30.0
DEFAULT_MAX_ATTEMPTS = 3
"""Tries of a message whose handler raises, before it is dead-lettered."""
DEFAULT_ISOLATION_LEVEL = "read_committed"
"""Records of aborted transactions are skipped (aiokafka's own default is read_uncommitted)."""
DEFAULT_AUTO_OFFSET_RESET = "earliest"
"""Where a partition with no stored offset starts: its log start, so nothing is skipped
(aiokafka's own default is latest, which skips what the partition already holds)."""
DEFAULT_KEY = keys.first(keys.header("idempotency-key"), keys.kafka_key())
"""The ``idempotency-key`` header if present, else the Kafka record key."""

_AIOKAFKA_OPTIONS = (
    frozenset(inspect.signature(aiokafka.AIOKafkaConsumer.__init__).parameters) - {"self", "topics"}
) | frozenset(kafka_client.FILE_SETTINGS)
_KEY_FACTORIES = {
    keys.header: "dedup.keys.header('name')",
    keys.json_field: "dedup.keys.json_field('field')",
    keys.kafka_key: "dedup.keys.kafka_key()",
    keys.offset: "dedup.keys.offset()",
    keys.first: "dedup.keys.first(...)",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """One consumer's settings, checked when built (``IdempotentConsumer`` says what each does)."""

    # Kafka
    topics: Sequence[str]
    group_id: str
    """The Kafka consumer group; also the namespace unless one is given."""
    bootstrap_servers: str | Sequence[str]
    kafka_options: Mapping[str, Any] = dataclasses.field(repr=False)
    """aiokafka's consumer options, as checked by :func:`consumer_options` (not in the repr:
    it may hold a password)."""
    # Postgres
    schema: str
    """The schema of dedup's tables."""
    pool_options: Mapping[str, Any]
    """For the pool dedup opens from ``dsn=``."""
    concurrency: int
    """Partitions whose transactions run at the same time, each on its own connection."""
    # Keys
    namespace: str
    key: keys.Strategy
    on_missing_key: message_.OnMissingKey
    on_conflict: message_.OnConflict
    # The handler
    batch_handler: bool
    """The handler takes the fresh messages of a transaction as one list."""
    batch_size: int
    """Most messages of one partition per transaction."""
    max_attempts: int
    handler_timeout: float
    # Running and stopping
    holder: str
    """The name written with tokens and events."""
    install_signal_handlers: bool
    shutdown_timeout: float
    """Seconds the batches in flight get to finish at a stop."""
    kafka_commit_interval: float
    """Seconds between commits to Kafka and between looks for moved partitions."""

    def __post_init__(self) -> None:
        check_group(
            topics=self.topics, group_id=self.group_id, namespace=self.namespace, holder=self.holder
        )
        check_key(self.key)
        check_handling(
            batch_size=self.batch_size,
            max_attempts=self.max_attempts,
            handler_timeout=self.handler_timeout,
        )
        limits.check_number("concurrency", self.concurrency, 1, 64, whole=True)
        limits.check_number("shutdown_timeout", self.shutdown_timeout, 0, 86_400, whole=False)
        check_commit_interval(self.kafka_commit_interval)


def check_group(*, topics: Sequence[str], group_id: str, namespace: str, holder: str) -> None:
    """Refuse topics, a group, a namespace or a holder name that are empty or too long: the
    consumer's, and ``dedup.sync.Consumer``'s."""
    if isinstance(topics, str) or not topics:
        raise errors.ConfigurationError("topics must be a non-empty list of topic names")
    for i, topic in enumerate(topics):
        limits.check_text(f"topics[{i}]", topic, limits.MAX_TOPIC_BYTES)
    if not group_id:
        raise errors.ConfigurationError("group_id must be set")
    limits.check_text("group_id", group_id, limits.MAX_NAME_BYTES)
    limits.check_text("namespace", namespace, limits.MAX_NAME_BYTES)
    limits.check_text("holder", holder, limits.MAX_NAME_BYTES)


def check_commit_interval(seconds: float) -> None:
    """Refuse a ``kafka_commit_interval`` out of range."""
    limits.check_number("kafka_commit_interval", seconds, 0, 3600, whole=False)


def check_handling(*, batch_size: int, max_attempts: int, handler_timeout: float) -> None:
    """Refuse settings of how a handler is run that are out of range: the consumer's, and
    :func:`dedup.testing.deliver`'s."""
    limits.check_number("batch_size", batch_size, 1, 100_000, whole=True)
    limits.check_number("max_attempts", max_attempts, 1, 1000, whole=True)
    limits.check_number("handler_timeout", handler_timeout, 0.001, 86_400, whole=False)


def consumer_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options for aiokafka's consumer: known to aiokafka, no auto-commit, read_committed,
    from the log start."""
    unknown = sorted(set(options) - _AIOKAFKA_OPTIONS)
    if unknown:
        raise errors.ConfigurationError(
            f"unknown option(s) {', '.join(unknown)}: not a dedup setting nor an "
            "aiokafka consumer option"
        )
    if options.get("enable_auto_commit"):
        raise errors.ConfigurationError(
            "enable_auto_commit=True: dedup stores offsets in Postgres; leave it off"
        )
    checked = {name: value for name, value in options.items() if name != "enable_auto_commit"}
    kafka_client.client_options(checked)  # a bad protocol or a missing CA file fails here
    # Records of aborted transactions must never be applied: read only what
    # producers committed, unless the caller says otherwise.
    checked.setdefault("isolation_level", DEFAULT_ISOLATION_LEVEL)
    checked.setdefault("auto_offset_reset", DEFAULT_AUTO_OFFSET_RESET)
    if checked["isolation_level"] not in ("read_committed", "read_uncommitted"):
        raise errors.ConfigurationError(
            f"isolation_level={checked['isolation_level']!r}: expected 'read_committed' "
            "(the default) or 'read_uncommitted'"
        )
    return checked


def is_batch_handler(handler: Callable[..., Any]) -> bool:
    """True when the handler's first parameter is annotated as a list or sequence."""
    try:
        params = list(inspect.signature(handler).parameters.values())
    except (TypeError, ValueError):
        return False
    if not params or params[0].annotation is inspect.Parameter.empty:
        return False
    text = str(params[0].annotation).replace("typing.", "").replace("collections.abc.", "")
    return text.startswith(("list[", "List[", "Sequence[", "<class 'list'>"))


def check_handler(handler: Any) -> None:
    """Refuse, at construction, a handler that can't be awaited."""
    target = handler.func if isinstance(handler, functools.partial) else handler
    if inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(
        getattr(target, "__call__", None)  # noqa: B004 - an object with an async __call__
    ):
        return
    what = "not callable" if not callable(handler) else "a function that is not async"
    raise errors.ConfigurationError(
        f"handler={handler!r} is {what}: expected `async def handler(msg, tx)` (or a batch "
        "handler `async def handler(msgs: list[dedup.Message], tx)`); run blocking code "
        "with asyncio.to_thread inside it"
    )


def check_key(key: Any) -> None:
    """Refuse, at construction, a ``key`` that is not a key strategy."""
    if key in _KEY_FACTORIES:
        raise errors.ConfigurationError(
            f"key={key.__name__}: that makes a strategy; call it, e.g. key={_KEY_FACTORIES[key]}"
        )
    if not callable(key):
        raise errors.ConfigurationError(
            f"key={key!r}: expected a key strategy, e.g. dedup.keys.json_field('id') or any "
            "callable (Message) -> str | None"
        )


def policies(
    on_missing_key: object, on_conflict: object
) -> tuple[message_.OnMissingKey, message_.OnConflict]:
    """Both policies as Enums, or a ConfigurationError naming the setting and its choices."""
    return (
        message_.policy(message_.OnMissingKey, "on_missing_key", on_missing_key),
        message_.policy(message_.OnConflict, "on_conflict", on_conflict),
    )
