"""Named points where a test may inject a fault: kill, pause, slow down, write, fail.

The library awaits :func:`point` at a few places of a batch's life; each does
nothing unless a hook is installed for it, so production pays one dict lookup
per point.  A hook is an async callable that takes the point's context as
keyword arguments (below) and may do anything a fault does: raise, sleep,
write on the connection it is given, or kill its own process::

    from dedup import _faults as faults

    async def die(**context):
        os.kill(os.getpid(), signal.SIGKILL)

    with faults.install(faults.Point.BEFORE_COMMIT, die):
        await consumer.run()

The chaos suite (``tests/chaos/consumer_child.py``) builds its failpoints and
its deliberately broken consumers from these points, instead of patching the
library's private methods.  The points, in the order a consumer's batch meets
them:

``BEFORE_BEGIN``
    A lane has taken a turn's records and is about to open its transaction
    (nothing is locked, no transaction is open).  Context: ``conn``,
    ``parts`` (the turn's :class:`dedup._store.Part` list: ``topic``,
    ``partition``, ``fence``, ``msgs``, ``dead``).
``BEFORE_FENCE`` / ``AFTER_FENCE``
    Around the statement that moves a partition's offset under its fence
    (the batch's fence-and-claim, or the move past records Kafka never
    handed out), on that statement's connection: inside the batch's
    transaction for a batch, on its own for a move.  Context: ``conn``,
    ``fence`` (:class:`dedup._store.Fence`), ``topic``, ``partition``,
    ``next_offset`` (where the statement moves the offset).
``BEFORE_COMMIT``
    Inside the batch's transaction, once dedup's and the handler's writes are
    done, before COMMIT.  What a hook writes on ``conn`` commits with the
    batch.  Context: ``conn``, ``fence``, ``msgs`` (the messages tried),
    ``dead`` (the dead letters asked for), ``result``
    (:class:`dedup._store.BatchResult`).
``AFTER_COMMIT``
    Right after the batch's COMMIT returned, before the consumer does anything
    else.  Context: ``fence``, ``msgs``, ``dead``, ``result``.
``OWNER_LOOK``
    Before the consumer's periodic look for partitions of its own taken in
    Postgres (by a newer owner, or by ``dedup offsets``).  A hook that raises
    a retriable error (``OSError``, say) makes the look fail: the consumer
    logs it and looks again next ``kafka_commit_interval``.  Context:
    ``conn``, ``group_id``, ``partitions`` (``(topic, partition)`` pairs).

The relay's points, in a batch's order:

``RELAY_BEFORE_SEND``
    The relay holds its lease and has read a batch of pending outbox rows; no
    record of it is sent yet.  Context: ``pool``, ``ids`` (the rows' ids),
    ``token`` (the relay's lease token).
``RELAY_AFTER_SEND``
    Every record of the batch is acknowledged by the broker (exactly-once: its
    Kafka transaction committed); the rows are not marked sent yet.  Context:
    ``pool``, ``ids``, ``token``.

The HTTP dispatcher's:

``DISPATCH_AFTER_POST``
    A message was POSTed and answered; its row is not marked yet.  Context:
    ``key`` (the row key), ``token`` (the claim token), ``status`` (the answer).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

Hook = Callable[..., Awaitable[None]]
"""An async callable taking a point's context as keyword arguments."""


class Point(enum.Enum):
    """Where the library awaits :func:`point` (see the module docstring for each)."""

    BEFORE_BEGIN = "before_begin"
    BEFORE_FENCE = "before_fence"
    AFTER_FENCE = "after_fence"
    BEFORE_COMMIT = "before_commit"
    AFTER_COMMIT = "after_commit"
    OWNER_LOOK = "owner_look"
    RELAY_BEFORE_SEND = "relay_before_send"
    RELAY_AFTER_SEND = "relay_after_send"
    DISPATCH_AFTER_POST = "dispatch_after_post"


_hooks: dict[Point, list[Hook]] = {}


async def point(where: Point, **context: Any) -> None:
    """Run the hooks installed at ``where`` (in the order installed), if any."""
    hooks = _hooks.get(where)
    if not hooks:
        return
    for hook in list(hooks):
        await hook(**context)


@contextlib.contextmanager
def _installed(where: Point, hook: Hook) -> Iterator[Hook]:
    try:
        yield hook
    finally:
        uninstall(where, hook)


def install(where: Point, hook: Hook) -> contextlib.AbstractContextManager[Hook]:
    """Run ``hook`` at ``where`` from now on; the result, used as a context manager,
    uninstalls it on exit (or call :func:`uninstall`)."""
    _hooks.setdefault(Point(where), []).append(hook)
    return _installed(where, hook)


def uninstall(where: Point, hook: Hook) -> None:
    """Stop running ``hook`` at ``where`` (nothing happens if it is not installed)."""
    hooks = _hooks.get(where, [])
    if hook in hooks:
        hooks.remove(hook)
    if not hooks:
        _hooks.pop(where, None)
