"""The consumer's retry policy (dedup/consumer/_retry.py) and the placing of partitions on lanes,
without services: each error, raised in the handler or in dedup's statements, gets the
action the table in the module's docstring gives it."""

from __future__ import annotations

import asyncpg
import psycopg
import pytest
from aiokafka.structs import TopicPartition

from dedup import _errors as errors
from dedup.consumer import _lanes as lanes
from dedup.consumer import _retry as retry

Action = retry.Action


def pg(cls: type[asyncpg.PostgresError], message: str = "x") -> asyncpg.PostgresError:
    return cls(message)


@pytest.mark.parametrize(
    ("exc", "in_handler", "action", "counted"),
    [
        (retry.Refused([]), False, Action.DROP, None),
        (errors.StaleTokenError("g:t:0", 3), False, Action.DROP, None),
        (pg(asyncpg.DeadlockDetectedError), True, Action.AGAIN, "deadlocks"),
        (pg(asyncpg.DeadlockDetectedError), False, Action.AGAIN, "deadlocks"),
        (pg(asyncpg.SerializationError), True, Action.AGAIN, "retries"),
        (pg(asyncpg.SerializationError), False, Action.AGAIN, "retries"),
        # The handler's own NOWAIT or lock_timeout: its failure, never contention.
        (pg(asyncpg.LockNotAvailableError), True, Action.SPLIT, None),
        (pg(asyncpg.LockNotAvailableError), False, Action.AGAIN, "retries"),
        (pg(asyncpg.IdleInTransactionSessionTimeoutError), True, Action.SPLIT, None),
        # Cut while the handler was within its deadline: the network held a statement.
        (pg(asyncpg.IdleInTransactionSessionTimeoutError), False, Action.AGAIN, "retries"),
        # A handler's own network error or timeout is its failure; dedup's are outages.
        (OSError("connection refused"), True, Action.SPLIT, None),
        (TimeoutError(), True, Action.SPLIT, None),
        (OSError("connection reset"), False, Action.AGAIN, "retries"),
        (asyncpg.InterfaceError("connection is closed"), False, Action.AGAIN, "retries"),
        (pg(asyncpg.AdminShutdownError), False, Action.AGAIN, "retries"),
        (pg(asyncpg.TooManyConnectionsError), False, Action.AGAIN, "retries"),
        (ValueError("bad value"), True, Action.SPLIT, None),
        (errors.HandlerError("forgot an await"), True, Action.SPLIT, None),
        (pg(asyncpg.UniqueViolationError), True, Action.SPLIT, None),
        (pg(asyncpg.UndefinedTableError), False, Action.STOP, None),
        (RuntimeError("a bug of dedup's"), False, Action.STOP, None),
        # psycopg's errors (dedup.sync.Consumer), read by the same SQLSTATEs.
        (psycopg.errors.DeadlockDetected("x"), True, Action.AGAIN, "deadlocks"),
        (psycopg.errors.SerializationFailure("x"), False, Action.AGAIN, "retries"),
        (psycopg.errors.LockNotAvailable("x"), True, Action.SPLIT, None),
        (psycopg.errors.LockNotAvailable("x"), False, Action.AGAIN, "retries"),
        (psycopg.errors.IdleInTransactionSessionTimeout("x"), True, Action.SPLIT, None),
        (psycopg.errors.AdminShutdown("x"), False, Action.AGAIN, "retries"),
        (psycopg.OperationalError("server closed the connection"), False, Action.AGAIN, "retries"),
        (psycopg.InterfaceError("the connection is closed"), False, Action.AGAIN, "retries"),
        (psycopg.errors.UniqueViolation("x"), True, Action.SPLIT, None),
        (psycopg.errors.UndefinedTable("x"), False, Action.STOP, None),
    ],
)
def test_each_error_gets_the_action_of_its_row(
    exc: BaseException, in_handler: bool, action: Action, counted: str | None
) -> None:
    rule = retry.decide(exc, in_handler=in_handler)
    assert rule.action is action, rule
    assert rule.counted == counted, rule


def test_only_a_lost_connection_asks_for_a_fresh_one() -> None:
    assert retry.decide(OSError(), in_handler=False).fresh_connection
    cut = pg(asyncpg.IdleInTransactionSessionTimeoutError)
    assert retry.decide(cut, in_handler=False).fresh_connection
    assert not retry.decide(pg(asyncpg.DeadlockDetectedError), in_handler=False).fresh_connection
    assert not retry.decide(ValueError(), in_handler=True).fresh_connection


def test_every_action_but_split_leaves_the_handlers_attempts_alone() -> None:
    # Only SPLIT leads to a dead letter; nothing in the table turns anything serial.
    assert {rule.action for rule in retry.RULES} == set(Action)
    assert retry.RULES[-1].matches(Exception()) and retry.RULES[-1].action is Action.STOP


def test_backoff_doubles_with_jitter_up_to_its_cap() -> None:
    for tries in range(1, 12):
        full = min(retry.FIRST_BACKOFF * 2 ** (tries - 1), retry.MAX_BACKOFF)
        for _ in range(50):
            assert full / 2 <= retry.backoff(tries) <= full
    assert retry.backoff(100) <= retry.MAX_BACKOFF


@pytest.mark.parametrize(
    ("culprit", "pieces"),
    [
        (None, [(0, 3), (3, 6)]),
        (13, [(0, 3), (3, 4), (4, 6)]),
        (10, [(0, 1), (1, 6)]),
        (15, [(0, 5), (5, 6)]),
        (99, [(0, 3), (3, 6)]),
    ],
)
def test_a_failed_batch_splits_around_its_culprit_or_in_halves(
    culprit: int | None, pieces: list[tuple[int, int]]
) -> None:
    assert retry.halves([10, 11, 12, 13, 14, 15], culprit) == pieces


class FakeLane:
    def __init__(self, index: int) -> None:
        self.index = index
        self.partitions: dict[TopicPartition, object] = {}


def test_partitions_keep_their_lanes_across_rebalances_where_the_lanes_stay_even() -> None:
    fleet = [FakeLane(i) for i in range(4)]
    before: dict[TopicPartition, int] = {}
    tps = [TopicPartition("t", p) for p in range(8)]
    first = lanes.place(tps, fleet, before)  # type: ignore[arg-type]
    assert sorted(sum(1 for lane in first.values() if lane is f) for f in fleet) == [2, 2, 2, 2]
    # A rebalance keeps half the partitions (one per lane): each keeps the lane it had.
    kept = [tp for tp in tps if first[tp] is fleet[0]][:1] + [
        tp for i in (1, 2, 3) for tp in tps if first[tp] is fleet[i]
    ][::2]
    again = lanes.place(kept, fleet, before)  # type: ignore[arg-type]
    assert all(again[tp] is first[tp] for tp in kept)
    # A new partition goes to the lane with the fewest.
    for tp, lane in again.items():
        lane.partitions[tp] = object()
    new = TopicPartition("t", 8)
    [(_, lane)] = lanes.place([new], fleet, before).items()  # type: ignore[arg-type]
    assert len(lane.partitions) == min(len(f.partitions) for f in fleet)
