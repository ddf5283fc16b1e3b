"""What a partition's row says happened, read after a refused fence or by the periodic look.

A partition's fence (its token, and the offset it last stored) fails for one of
four reasons, told apart by the row (:func:`judge`):

``LANDED``     a COMMIT of ours succeeded on the server but its answer never came
               back, so the retry fenced on the old offset: our token holds the
               partition at a later offset; go on from there
``MOVED``      an operator's ``dedup offsets`` moved the partition: the consumer
               takes it back from the offset the operator set
``FORGOTTEN``  Postgres lost commits of ours (a failover to an asynchronous
               standby, a restore from a backup): the row shows our token at an
               earlier offset, an older token, or is gone.  The effects of the lost
               commits went with them (one transaction), so the consumer takes the
               partition back from the stored offset and Kafka delivers those
               records again (:func:`resume_at`)
``TAKEN``      another consumer took it: stop until Kafka assigns it to us again
               (the refusal is recorded: :func:`record_stale`)
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from aiokafka.structs import TopicPartition

from dedup import _errors as errors
from dedup import _results as store
from dedup import _telemetry as telemetry
from dedup.data import _db as db
from dedup.operations import _offsets as offsets


class Held(Protocol):
    """A partition as its holder knows it (:class:`dedup.consumer._lanes.Partition`)."""

    tp: TopicPartition
    token: int
    expected: int | None
    began: int | None


class Recorder(Protocol):
    """What recording a refusal needs of the consumer's settings."""

    @property
    def group_id(self) -> str: ...

    @property
    def holder(self) -> str: ...

    @property
    def store(self) -> Any: ...


log = logging.getLogger("dedup.consumer")

LANDED = "landed"
MOVED = "moved"
FORGOTTEN = "forgotten"
TAKEN = "taken"


def judge(now: store.Position | None, token: int, expected: int | None) -> str:
    """Which of the four ``now`` shows, to a holder of ``token`` that stored ``expected``."""
    if now is not None and now.token == token:
        if now.next_offset is not None and (expected is None or now.next_offset > expected):
            return LANDED
    elif now is not None and offsets.is_operator(now.holder):
        return MOVED
    if now is None or now.token < token:
        return FORGOTTEN
    if expected is not None and (now.next_offset is None or now.next_offset < expected):
        return FORGOTTEN  # our token, an earlier offset
    return TAKEN


def resume_at(now: store.Position | None, owner: Held, holder: str) -> store.Position:
    """Where to take a FORGOTTEN partition back from: its row, or, with no row (nothing of
    the partition survived), the offset its holder began at."""
    log.warning(
        "%s: Postgres holds %s, behind our token %d offset %s: our last commits were lost "
        "(a failover?); consuming again from its offset",
        owner.tp,
        now,
        owner.token,
        owner.expected,
    )
    return now or store.Position(holder, 0, owner.began)


async def record_stale(
    conn: Any,
    settings: Recorder,
    exc: errors.StaleTokenError,
    token: int,
    expected: int | None,
) -> None:
    """Record that the fence refused a stale holder (``stale_rejected``), if Postgres can be
    reached; the partition is dropped either way."""
    try:
        with telemetry.tracer.start_as_current_span(
            "dedup stale", attributes={"messaging.consumer.group.name": settings.group_id}
        ):
            await settings.store.stale_rejected(
                conn, exc.resource, holder=settings.holder, token=token, expected=expected
            )
    except Exception as record_exc:
        if not db.is_retriable(record_exc):
            raise
        log.warning("could not record stale_rejected for %s: %r", exc.resource, record_exc)
