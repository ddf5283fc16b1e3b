"""One lane's turn: one transaction for what its partitions fetched.

:func:`run` sends, on the lane's connection:

1. ``BEGIN``;
2. **one** ``fence_and_claim`` for every partition of the turn
   (:meth:`dedup._store.Store.fence_and_claim`): each partition's offset moves
   under its token, the keys of the fenced partitions are claimed, and only the
   keys seen before come back;
3. the handler, once per partition (a batch handler: the partition's fresh
   messages in offset order, ``tx.token`` its token) or once per fresh
   message, with ``handler_timeout`` per call;
4. the partition's dead letters and events;
5. the session reset and ``COMMIT``, in one round trip.

A failure rolls the transaction back (and resets the session in the same
round trip) and is raised for the lane's retry policy (:mod:`dedup.consumer._retry`):
a refused fence as :class:`dedup.consumer._retry.Refused`, the handler's errors as
:class:`dedup.consumer._retry.HandlerFailed`, anything else as it came.  Traced as the
conventions have it: a CONSUMER span ``process <topic>`` for the turn, an
INTERNAL span ``dedup transaction`` inside it (the handler runs in it), and
a CLIENT span per statement dedup sends, BEGIN and COMMIT included.  The
fault points ``BEFORE_COMMIT`` and ``AFTER_COMMIT`` (:mod:`dedup._faults`)
sit around the COMMIT, once per partition.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from dedup import _errors as errors
from dedup import _faults as faults
from dedup import _handler as handler_
from dedup import _message as message_
from dedup import _results as results
from dedup import _semconv as semconv
from dedup import _store as store
from dedup import _telemetry as telemetry
from dedup import keys
from dedup.consumer import _retry as retry
from dedup.data import _db as db
from dedup.data import _db_telemetry as db_telemetry

log = logging.getLogger("dedup.consumer")


@dataclass(frozen=True)
class Settings:
    """What every turn of one consumer shares."""

    group_id: str
    namespace: str
    holder: str
    store: store.Store
    handler: Callable[..., Any]
    batch_handler: bool
    key: keys.Strategy
    on_missing_key: str
    batch_size: int
    max_attempts: int
    handler_timeout: float
    idle_timeout: float
    """The server's idle_in_transaction_session_timeout in each transaction, in seconds."""
    database: str
    secrets: frozenset[str] = frozenset()
    """The passwords this consumer was given (its DSN's, the SASL password): masked wherever a
    handler's error quotes them (dedup._handler.describe)."""
    run_handler: Callable[..., Awaitable[None]] = handler_.run
    """How the handler is called (:func:`dedup._handler.run`'s arguments): awaited within
    ``handler_timeout``; ``dedup.sync.Consumer`` calls its blocking handler instead."""
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    """How a lane waits out a backoff: ``asyncio.sleep``; ``dedup.sync.Consumer`` blocks."""
    message: Callable[[Any], message_.Message] = message_.Message.from_record
    """A fetched record as a message: aiokafka's ``ConsumerRecord`` built into one;
    ``dedup.sync.Consumer`` queues messages it built from confluent-kafka's."""


async def run(
    conn: asyncpg.Connection,
    s: Settings,
    parts: Sequence[store.Part],
    stats: MutableMapping[str, int],
) -> list[results.BatchResult]:
    """Apply ``parts`` in one transaction on ``conn``; what each part did once committed."""
    measured = [_process_point(s.group_id, p.topic, p.partition) for p in parts]
    traced = telemetry.tracing()  # asked once a turn: it costs more than a statement's span
    started = time.perf_counter()
    try:
        with _process_span(s, parts, traced):
            found = await _transaction(conn, s, parts, traced)
    except BaseException as exc:
        failed = semconv.error_type(exc)
        measured = [{**m, "error.type": failed} for m in measured]
        raise
    finally:
        took = time.perf_counter() - started
        for m in measured:
            telemetry.record(telemetry.process_duration, took, m)
    elapsed = time.perf_counter() - started
    for part, result in zip(parts, found, strict=True):
        _count(stats, s, part, result, elapsed)
    return found


def _process_span(
    s: Settings, parts: Sequence[store.Part], traced: bool
) -> contextlib.AbstractContextManager[object]:
    """The turn's CONSUMER span, made current; nothing built while tracing is off."""
    if not traced:
        return contextlib.nullcontext()
    attributes = _process_attributes(s, parts)
    links, dropped = telemetry.producer_links(m.raw_headers for p in parts for m in p.msgs)
    if dropped:
        attributes["dedup.links.dropped"] = dropped
    return telemetry.consumer_span(f"process {parts[0].topic}", attributes, links)


async def _transaction(
    conn: asyncpg.Connection, s: Settings, parts: Sequence[store.Part], traced: bool
) -> list[results.BatchResult]:
    schema = s.store.schema
    queries = db.queries()
    with _transaction_span(s, parts, traced):
        await faults.point(faults.Point.BEFORE_BEGIN, conn=conn, parts=parts)
        with db_telemetry.db_call(conn, db_telemetry.Call("BEGIN", "BEGIN", schema), traced):
            await conn.execute(queries.begin.sql)
        began = time.monotonic()
        longest = 0.0  # seconds of the longest handler call
        try:
            found = await _fence_and_claim(conn, s, parts)
            longest = await _handle(conn, s, parts, found)
            await _record(conn, s, parts, found)
            with db_telemetry.db_call(conn, db_telemetry.Call("COMMIT", "COMMIT", schema), traced):
                await commit(conn, parts[0])
        except BaseException as exc:
            await roll_back(conn, schema, traced)
            if not isinstance(exc, Exception):
                raise
            # The server ended a session kept idle past its limit: whatever the
            # handler or the next statement met then, that is what happened.
            took = time.monotonic() - began
            cut = db.session_timed_out(exc, took, s.idle_timeout)
            if isinstance(exc, retry.HandlerFailed) and (cut or _closed(conn)):
                if cut or took >= s.idle_timeout:
                    raise retry.HandlerFailed(_session_cut(s), exc.partition) from exc
            elif cut and _blocked(longest, s):
                raise retry.HandlerFailed(_session_cut(s), parts[0]) from exc
            raise
        for part, result in zip(parts, found, strict=True):
            if not part.size:
                continue
            await faults.point(
                faults.Point.AFTER_COMMIT,
                fence=part.fence,
                msgs=part.msgs,
                dead=part.dead,
                result=result,
            )
    return found


def _transaction_span(
    s: Settings, parts: Sequence[store.Part], traced: bool
) -> contextlib.AbstractContextManager[object]:
    """The INTERNAL span the handler runs in; nothing built while tracing is off."""
    if not traced:
        return contextlib.nullcontext()
    attributes: dict[str, Any] = {"dedup.namespace": s.namespace}
    if len(parts) == 1:
        attributes["dedup.token"] = parts[0].fence.token
    return telemetry.internal_span("dedup transaction", attributes)


async def roll_back(conn: asyncpg.Connection, schema: str, traced: bool) -> None:
    """Roll back and reset the session, in one round trip.

    Nothing to do once the transaction has ended: a COMMIT that failed (a
    deferred constraint, say) rolled back what the handler set in it (SET and
    SET ROLE are transactional), and the advisory unlock before it holds.  A
    rollback that fails because the connection is gone lets the turn's own
    error through (the server rolled back when the session ended); any other
    failure raises in its place, chained to it, as asyncpg's ``async with
    conn.transaction()`` does.
    """
    if _closed(conn) or not conn.is_in_transaction():
        return
    try:
        with db_telemetry.db_call(conn, db_telemetry.Call("ROLLBACK", "ROLLBACK", schema), traced):
            await conn.execute(db.queries().rollback_and_reset.sql)
    except Exception as exc:
        if not db.is_broken(conn, exc):
            raise


def _closed(conn: asyncpg.Connection) -> bool:
    """True when ``conn`` is closed, or detached by its pool (asyncpg does that to a
    pooled connection the server closed)."""
    try:
        return bool(conn.is_closed())
    except asyncpg.InterfaceError:
        return True


async def _fence_and_claim(
    conn: asyncpg.Connection, s: Settings, parts: Sequence[store.Part]
) -> list[results.BatchResult]:
    """The turn's first statement; raises Refused when the fence refused any partition."""
    refused, found = await s.store.fence_and_claim(conn, parts, s.idle_timeout)
    if refused:
        raise retry.Refused(list(refused))
    return found


async def _handle(
    conn: asyncpg.Connection,
    s: Settings,
    parts: Sequence[store.Part],
    found: Sequence[results.BatchResult],
) -> float:
    """The handler, on the fresh messages of every part held under the same token at once;
    the seconds its longest call took."""
    longest = 0.0
    for token, group in _by_token(parts, found):
        msgs = [m for _, result in group for m in result.applied]
        if not msgs:
            continue
        started = time.monotonic()
        try:
            await s.run_handler(
                s.handler,
                batch_handler=s.batch_handler,
                msgs=msgs,
                conn=conn,
                token=token,
                deadline_s=s.handler_timeout,
                namespace=s.namespace,
                schema=s.store.schema,
            )
        except errors.StaleTokenError as exc:
            # The handler's own fence (tx.token against a row it keeps) found a newer
            # owner: as if dedup's fence had refused the partition.
            failed = _failed_part(exc, [part for part, _ in group])
            raise retry.Refused([failed] if failed else [p for p, _ in group]) from exc
        except Exception as exc:
            failed = _failed_part(exc, [part for part, _ in group])
            raise _handler_failure(conn, s, exc, failed, time.monotonic() - started) from None
        longest = max(longest, time.monotonic() - started)
        telemetry.transition("applied", {"namespace": s.namespace, "count": len(msgs)})
    return longest


async def _record(
    conn: asyncpg.Connection,
    s: Settings,
    parts: Sequence[store.Part],
    found: Sequence[results.BatchResult],
) -> None:
    """Each part's dead letters and events, after the handler."""
    for part, result in zip(parts, found, strict=True):
        if not part.size:
            continue  # only moves the offset past records never handed out
        try:
            await s.store.record_outcomes(conn, result, part.fence)
            await faults.point(
                faults.Point.BEFORE_COMMIT,
                conn=conn,
                fence=part.fence,
                msgs=part.msgs,
                dead=part.dead,
                result=result,
            )
        except Exception as exc:
            if db.sqlstate(exc) == _IN_FAILED_TRANSACTION:
                raise retry.HandlerFailed(db.ABORTED, part) from exc
            raise


def _by_token(
    parts: Sequence[store.Part], found: Sequence[results.BatchResult]
) -> list[tuple[int, list[tuple[store.Part, results.BatchResult]]]]:
    """The turn's parts grouped by their token, so ``tx.token`` is every message's own.

    Partitions taken together share their token until a rebalance moves one of
    them: then the batch handler is called once per token, still in one
    transaction.
    """
    groups: dict[int, list[tuple[store.Part, results.BatchResult]]] = {}
    for part, result in zip(parts, found, strict=True):
        groups.setdefault(part.fence.token, []).append((part, result))
    return list(groups.items())


def _failed_part(exc: BaseException, parts: Sequence[store.Part]) -> store.Part | None:
    """The part whose message a per-message handler failed on (None: not known)."""
    where = handler_.failed_partition(exc)
    if len(parts) == 1:
        return parts[0]
    return next((p for p in parts if (p.topic, p.partition) == where), None)


_IN_FAILED_TRANSACTION = "25P02"
"""The SQLSTATE of a statement sent in a transaction a failed statement aborted."""


async def commit(conn: asyncpg.Connection, part: store.Part | None) -> None:
    """Reset the session and COMMIT, in one round trip (``commit_and_reset``).

    A handler's ``SET search_path``, ``SET ROLE`` or advisory lock must not meet
    the lane's next turn; the reset runs inside the transaction, before its
    COMMIT, so it is one message with it.  A transaction the handler left
    aborted fails here, before the COMMIT, and rolls back; so does one whose
    writes break a deferred constraint, at the COMMIT: both are the handler's
    failures, raised as :class:`dedup.consumer._retry.HandlerFailed` for ``part``
    (:func:`dedup.testing.deliver` commits its transactions here too).
    """
    try:
        await conn.execute(db.queries().commit_and_reset.sql)
    except Exception as exc:
        # By SQLSTATE: the same rule on asyncpg and psycopg (dedup.sync.Consumer).
        state = db.sqlstate(exc)
        if state == _IN_FAILED_TRANSACTION:
            raise retry.HandlerFailed(db.ABORTED, part) from exc
        if state.startswith("23"):  # integrity constraint violation
            raise retry.HandlerFailed(exc, part) from exc
        raise


def _handler_failure(
    conn: asyncpg.Connection, s: Settings, exc: Exception, part: store.Part | None, took: float
) -> Exception:
    """What a handler's exception means for the retry policy.

    The server cut the session for idling during a call that outlasted its
    deadline: the handler's fault (it blocked the event loop with the
    transaction idle).  During a call within its deadline, or dedup's
    connection lost: an outage, raised as dedup's own.  Anything else: the
    handler's failure.
    """
    if db.session_timed_out(exc, took, s.idle_timeout):
        return retry.HandlerFailed(_session_cut(s), part) if _blocked(took, s) else exc
    if handler_.lost_connection(conn, exc):
        return exc
    return retry.HandlerFailed(exc, part)


def _blocked(took: float, s: Settings) -> bool:
    """Whether a handler call of ``took`` seconds can be why the server cut the session.

    The server cuts a session idle in its transaction for ``idle_timeout``;
    ``handler_timeout`` is shorter, and cancels a call that awaits past it.
    A call that lasted that long blocked the event loop, so nothing could be
    sent: the cut is the handler's.  After calls that returned in time, the
    idle time was spent elsewhere: a statement held on its way by the network,
    or the whole process paused.  That is an outage, and the turn runs again
    without counting an attempt against the messages.
    """
    return took >= s.handler_timeout


def _session_cut(s: Settings) -> errors.HandlerError:
    return errors.HandlerError(
        "the server ended the session after idle_in_transaction_session_timeout="
        f"{s.idle_timeout:g}s: the handler kept the transaction idle that long "
        "(blocking code in an async handler?)"
    )


def messaging(s: Settings, topic: str, partition: int) -> dict[str, Any]:
    """The messaging attributes every span and metric of a partition's batch carries."""
    return _messaging(s.group_id, topic, partition)


def _messaging(group_id: str, topic: str, partition: int) -> dict[str, Any]:
    return {
        "messaging.system": "kafka",
        "messaging.consumer.group.name": group_id,
        "messaging.destination.name": topic,
        "messaging.destination.partition.id": str(partition),
    }


@functools.lru_cache(maxsize=4096)
def _process_point(group_id: str, topic: str, partition: int) -> dict[str, Any]:
    """A partition's ``messaging.process.duration`` attributes (shared: never changed)."""
    return {**_messaging(group_id, topic, partition), "messaging.operation.name": "process"}


def _process_attributes(s: Settings, parts: Sequence[store.Part]) -> dict[str, Any]:
    """The CONSUMER span's attributes (OpenTelemetry messaging conventions for Kafka).

    A turn of one message is a single-message span (its offset, key and
    tombstone flag); a larger one a batch span (its message count).  A turn
    of several partitions names them all in ``dedup.partitions`` (each
    partition's id and token are on its own statements' events).
    """
    first = parts[0]
    count = sum(p.size for p in parts)
    attributes: dict[str, Any] = {
        **messaging(s, first.topic, first.partition),
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "dedup.namespace": s.namespace,
    }
    if len(parts) > 1:
        del attributes["messaging.destination.partition.id"]
        if any(p.topic != first.topic for p in parts):
            del attributes["messaging.destination.name"]
        attributes["dedup.partitions"] = [f"{p.topic}:{p.partition}" for p in parts]
    else:
        attributes["dedup.token"] = first.fence.token
    if count != 1:
        if count:
            attributes["messaging.batch.message_count"] = count
        return attributes
    single = next(m for p in parts for m in [*p.msgs, *(d.msg for d in p.dead)])
    attributes["messaging.kafka.offset"] = single.offset
    if single.key is not None:
        key = telemetry.key_attribute(single.key)
        if key is not None:
            attributes["messaging.kafka.message.key"] = key
    if single.tombstone:
        attributes["messaging.kafka.message.tombstone"] = True
    return attributes


def _count(
    stats: MutableMapping[str, int],
    s: Settings,
    part: store.Part,
    result: results.BatchResult,
    elapsed: float,
) -> None:
    """Add a committed part to the consumer's stats and metrics."""
    count = part.size
    stats["batches"] += 1
    stats["messages"] += count
    stats["processed"] += len(result.applied)
    stats["duplicates"] += len(result.duplicates)
    stats["conflicts"] += len(result.conflicts)
    stats["dead_lettered"] += len(result.dead_letters)
    attrs = counted(s, part.topic)
    telemetry.processed.add(len(result.applied), attrs)
    if result.duplicates:
        telemetry.duplicates.add(len(result.duplicates), attrs)
    if result.conflicts:
        telemetry.conflicts.add(len(result.conflicts), attrs)
    if result.dead_letters:
        telemetry.dead_lettered.add(len(result.dead_letters), attrs)
    for letter in result.dead_letters:
        # A handler's failures were logged as they happened; these were never tried.
        if letter.error is None:
            log.warning("dead-lettered %s: %s", letter.msg.where, letter.reason)
    if count:
        telemetry.batch_size.record(count, attrs)
    telemetry.transaction_duration.record(elapsed, attrs)
    if result.applied:
        lag = time.time() - result.applied[-1].timestamp / 1000
        telemetry.end_to_end_lag.record(max(lag, 0.0), attrs)


def counted(s: Settings, topic: str) -> dict[str, Any]:
    """The attributes of dedup's counters for one topic of a consumer (shared: never changed)."""
    return _counted(s.group_id, topic, s.namespace)


@functools.lru_cache(maxsize=1024)
def _counted(group_id: str, topic: str, namespace: str) -> dict[str, Any]:
    return {
        "messaging.system": "kafka",
        "messaging.consumer.group.name": group_id,
        "messaging.destination.name": topic,
        "dedup.namespace": namespace,
    }
