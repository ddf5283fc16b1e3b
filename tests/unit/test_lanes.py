"""The lanes' policy: when batches share, when they run alone, how long a cool-down lasts."""

from __future__ import annotations

import asyncio
import types

import asyncpg
import pytest

from dedup import _lanes as lanes
from tests import helpers


def test_a_deadlock_or_a_lock_wait_on_a_shared_lane_means_contention() -> None:
    deadlock = asyncpg.DeadlockDetectedError("deadlock detected")
    waited = asyncpg.LockNotAvailableError("canceling statement due to lock timeout")
    assert lanes.contended(deadlock, shared=True)
    assert lanes.contended(deadlock, shared=False)
    assert lanes.contended(waited, shared=True)
    # Alone, the lock_timeout was the session's own (a handler's choice): a plain retry.
    assert not lanes.contended(waited, shared=False)
    assert not lanes.contended(asyncpg.SerializationError("could not serialize"), shared=True)


async def test_a_lane_is_shared_unless_the_lanes_are_serial_and_then_batches_take_turns() -> None:
    pool = types.SimpleNamespace()  # lending never touches the pool; connection() does
    ls = lanes.Lanes(pool, 4)
    async with ls.lane() as lane:
        assert lane.shared
    assert ls.turn("g") is None
    ls.deadlocked()
    assert ls.serial
    async with ls.lane() as lane:
        assert not lane.shared
    first, second, third = ls.turn("g"), ls.turn("g"), ls.turn("g")
    assert first is not None and second is not None and third is not None
    pings: list[str] = []

    async def keepalive() -> None:
        pings.append("ping")

    await first.wait(keepalive, None)
    waiting = asyncio.create_task(second.wait(keepalive, 0.01))
    # While it waits, the waiting batch keeps its idle session alive.
    await helpers.wait_for(lambda: _at_least(pings, 2), within=5, what="two keep-alives")
    assert not waiting.done()  # one handler at a time in the consumer
    # A batch cancelled while it waits (a shutdown) leaves the turns as they were.
    given_up = asyncio.create_task(third.wait(keepalive, None))
    await asyncio.sleep(0)
    given_up.cancel()
    with pytest.raises(asyncio.CancelledError):
        await given_up
    first.end()
    first.end()  # ending twice (a rollback after a failed commit) frees one turn only
    await asyncio.wait_for(waiting, 1)
    second.end()
    third_again = ls.turn("g")
    assert third_again is not None
    await asyncio.wait_for(third_again.wait(keepalive, None), 1)  # free again
    third_again.end()
    async with lanes.Lanes(pool, 1).lane() as lane:  # concurrency=1: nothing to share
        assert not lane.shared


async def _at_least(items: list[str], n: int) -> bool:
    return len(items) >= n


def test_the_cool_down_doubles_only_for_a_new_tangle(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(lanes, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    ls = lanes.Lanes(types.SimpleNamespace(), 4)
    cool = lanes.SERIAL_COOLDOWN

    def serial_for() -> float:
        """Seconds from now until the lanes share again."""
        start = now[0]
        while ls.serial:
            now[0] += 1
        took, now[0] = now[0] - start, start
        return took

    # Three lanes lose in the same tangle (transactions opened before the first
    # deadlock went serial): one cool-down, not three doublings.
    ls.deadlocked()
    now[0] += 1
    ls.deadlocked()
    ls.deadlocked()
    assert serial_for() == pytest.approx(cool - 1, abs=1)
    # Sharing again soon after, a new tangle: twice as long.
    now[0] += cool
    ls.deadlocked()
    assert serial_for() == pytest.approx(2 * cool, abs=1)
    # Long after the last cool-down ended: back to the first length.
    now[0] += 10 * lanes.MAX_SERIAL_COOLDOWN
    ls.deadlocked()
    assert serial_for() == pytest.approx(cool, abs=1)


async def test_a_lane_gathers_small_batches_that_wait_or_come_in_the_same_turn() -> None:
    ls = lanes.Lanes(types.SimpleNamespace(), 2)
    async with ls.lane() as first, ls.lane():
        assert first is not None
        # Both lanes are lent: this batch of 3 waits for one, and may ride instead.
        waiting = lanes.Rider("waiting", 3)
        waited = asyncio.create_task(_ride(ls, waiting))
        await asyncio.sleep(0)
        too_big = lanes.Rider("too big", 8)
        too_big_waits = asyncio.create_task(_ride(ls, too_big))
        await asyncio.sleep(0)
        # A batch of 5 of batch_size 10 leaves room for 5: the waiting 3, and a 2 whose
        # worker woke in the same turn (fed by the same fetch); not the 8.
        coming = lanes.Rider("coming", 2)
        came = asyncio.create_task(_ride(ls, coming))
        riders = await ls.gather(5)
        assert [r.batch for r in riders] == ["waiting", "coming"]
        assert not too_big.boarded
        lanes.tell(riders, True)
        assert await asyncio.wait_for(waited, 1) == "rode: True"
        assert await asyncio.wait_for(came, 1) == "rode: True"
    # The 8 never boarded: it got a lane once one was free.
    assert await asyncio.wait_for(too_big_waits, 1) == "lane"
    assert await ls.gather(0) == []  # no room: a full batch gathers nobody


async def test_nobody_rides_on_serial_lanes_and_a_cut_gathering_lets_its_riders_go() -> None:
    ls = lanes.Lanes(types.SimpleNamespace(), 1)
    async with ls.lane():
        rider = lanes.Rider("r", 1)
        rides = asyncio.create_task(_ride(ls, rider))
        await asyncio.sleep(0)
        gathering = asyncio.create_task(ls.gather(10))
        await asyncio.sleep(0)  # it took the waiting rider and yields its turn
        gathering.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gathering
        # Its batch runs alone: told False, it never waits for a seat again.
        assert await asyncio.wait_for(rides, 1) == "rode: False"
    ls.deadlocked()
    async with ls.lane():
        assert await ls.gather(10) == []  # handlers take turns: no riders


async def _ride(ls: lanes.Lanes, rider: lanes.Rider) -> str:
    async with ls.lane_or_ride(rider) as lane:
        if lane is None:
            return f"rode: {await rider.seat}"
        return "lane"


def test_lock_waits_turn_the_lanes_serial_at_their_second_incident(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(lanes, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    ls = lanes.Lanes(types.SimpleNamespace(), 4)
    ls.waited()  # one slow COMMIT: every lane queued behind its rows waits at once
    now[0] += 0.1
    ls.waited()
    ls.waited()
    assert not ls.serial, "one incident is a hiccup: the batches run again side by side"
    now[0] += lanes.LOCK_WAITS_WINDOW + 1
    ls.waited()  # long after: a new first incident
    assert not ls.serial
    now[0] += 1.0
    ls.waited()  # tangled handlers meet again within a second
    assert ls.serial
    # A deadlock needs no second time.
    other = lanes.Lanes(types.SimpleNamespace(), 4)
    other.deadlocked()
    assert other.serial


async def test_nobody_rides_for_a_while_after_handlers_too_slow_to_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(lanes, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    ls = lanes.Lanes(types.SimpleNamespace(), 1)
    ls.riders_too_slow()
    async with ls.lane():
        waiting = asyncio.create_task(_ride(ls, lanes.Rider("r", 1)))
        await asyncio.sleep(0)
        assert await ls.gather(10) == []  # its handler will run on a lane of its own
        now[0] += lanes.RIDERS_PAUSE + 1
        riders = await ls.gather(10)
        assert [r.batch for r in riders] == ["r"]
        lanes.tell(riders, True)
    assert await asyncio.wait_for(waiting, 1) == "rode: True"
