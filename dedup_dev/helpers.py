"""What the integration and chaos tests share: waiting for a condition, records, a free port."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from dedup_dev.kafka import produce as produce  # the tests call it helpers.produce

T = TypeVar("T")


async def wait_for(
    probe: Callable[[], Awaitable[T]],
    *,
    within: float = 30.0,
    interval: float = 0.1,
    what: str = "condition",
) -> T:
    """Poll ``probe`` until it returns something truthy; fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    last: T | None = None
    while time.monotonic() < deadline:
        last = await probe()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {within:.0f}s waiting for {what} (last: {last!r})")


async def equal(found: Awaitable[T], expected: T) -> bool:
    """``await found == expected``, as a probe for :func:`wait_for`."""
    return bool(await found == expected)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a child's server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
