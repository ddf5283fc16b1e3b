"""``dedup.sync._drive.run``: a coroutine that never suspends runs to its end without a loop;
one that suspends is closed and refused."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Generator
from typing import Any

import pytest

from dedup.sync import _drive as drive


async def answer(value: int) -> int:
    async def inner() -> int:
        return value * 2

    return await inner()


async def fails() -> None:
    raise ValueError("from inside")


@types.coroutine
def suspend() -> Generator[None, None, None]:
    yield  # what a bare `await asyncio.sleep(0)` does: wait for a loop's next turn


def test_a_coroutine_that_never_suspends_gives_its_result() -> None:
    assert drive.run(answer(21), "the call") == 42


def test_what_it_raises_propagates_as_it_is() -> None:
    with pytest.raises(ValueError, match="from inside"):
        drive.run(fails(), "the call")


def test_a_coroutine_that_suspends_is_closed_and_refused() -> None:
    cleaned: list[str] = []

    async def waits() -> None:
        try:
            await suspend()
        finally:
            cleaned.append("finally ran")

    coro = waits()
    with pytest.raises(RuntimeError, match=r"^dedup\.sync\.claim waited on an event loop"):
        drive.run(coro, "dedup.sync.claim")
    assert cleaned == ["finally ran"]
    assert coro.cr_frame is None, "closed"


def test_one_that_awaits_again_while_closing_is_refused_all_the_same() -> None:
    async def stubborn() -> None:
        try:
            await suspend()
        finally:
            await suspend()

    with pytest.raises(RuntimeError, match="waited on an event loop") as refused:
        drive.run(stubborn(), "the call")
    assert isinstance(refused.value.__cause__, RuntimeError)  # "coroutine ignored GeneratorExit"


async def test_on_a_thread_with_a_running_loop_what_it_waited_on_is_cancelled() -> None:
    waited: list[Any] = []

    async def sleeps() -> None:
        waiting = asyncio.ensure_future(asyncio.sleep(10))
        waited.append(waiting)
        await waiting

    with pytest.raises(RuntimeError, match="waited on an event loop"):
        drive.run(sleeps(), "the call")
    await asyncio.wait(waited, timeout=5)
    assert waited[0].cancelled(), "no timer left behind on the loop"
