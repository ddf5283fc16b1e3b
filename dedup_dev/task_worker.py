"""A ``dedup`` CLI process for the task tests: optionally a wrong wall clock and a start barrier.

    python -m dedup_dev.task_worker [--clock-offset S] [--ready F --go F] -- ARGS...

runs ``dedup ARGS...`` (``dedup.cli._main.main``) and exits with its code.

``--clock-offset S`` shifts this process's wall clock by S seconds *before*
dedup, asyncpg or the job module is imported: ``time.time``, ``time.time_ns``,
``datetime.datetime.now/utcnow/today`` and ``datetime.date.today`` all answer S
seconds off, as on a machine whose clock is wrong.  The event loop's monotonic
clock is left alone: a wrong clock does not change how fast time passes.

``--ready F --go F``: create F (ready) once imported, then wait for the go
file, so many processes can be released at the same moment.

The test side is :func:`start`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dedup_dev.services import ROOT


def shift_clock(seconds: float) -> None:
    """Make this process's wall clock ``seconds`` off (see the module docstring)."""
    offset = dt.timedelta(seconds=seconds)
    real_time, real_time_ns = time.time, time.time_ns

    # Empty __slots__ keep the instance layout C extensions (asyncpg) check.  A
    # shifted datetime is a shifted date too, as a datetime is a date: libraries
    # that test isinstance(x, datetime.date) after the swap (dateutil) accept it.
    class ShiftedDate(dt.date):
        __slots__ = ()

        @classmethod
        def today(cls) -> Any:
            return ShiftedDatetime.now().date()

    class ShiftedDatetime(dt.datetime, ShiftedDate):
        __slots__ = ()

        @classmethod
        def now(cls, tz: dt.tzinfo | None = None) -> Any:
            return super().now(tz) + offset

        @classmethod
        def utcnow(cls) -> Any:
            return super().now(dt.UTC).replace(tzinfo=None) + offset

        @classmethod
        def today(cls) -> Any:
            return cls.now()

    time.time = lambda: real_time() + seconds
    time.time_ns = lambda: real_time_ns() + int(seconds * 1e9)
    dt.datetime = ShiftedDatetime  # type: ignore[misc]
    dt.date = ShiftedDate  # type: ignore[misc]


def main() -> int:
    parser = argparse.ArgumentParser(prog="task_worker")
    parser.add_argument("--clock-offset", type=float)
    parser.add_argument("--ready", type=Path)
    parser.add_argument("--go", type=Path)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args()
    if opts.clock_offset:
        shift_clock(opts.clock_offset)
    from dedup.cli import _main as cli  # only now, so it sees the shifted clock

    if opts.ready:
        opts.ready.touch()
    if opts.go:
        while not opts.go.exists():
            time.sleep(0.005)
    args = opts.args[1:] if opts.args[:1] == ["--"] else opts.args
    return cli.main(args)


@dataclass
class Worker:
    """One running worker process."""

    proc: asyncio.subprocess.Process

    async def running(self) -> None:
        """Fail the test with the worker's output if it has exited."""
        if self.proc.returncode is not None:
            code, out, err = await self.finish()
            raise AssertionError(f"worker exited with {code}:\n{out}{err}")

    async def finish(self, within: float = 30.0) -> tuple[int, str, str]:
        """Wait for it to exit: (exit code, stdout, stderr)."""
        out, err = await asyncio.wait_for(self.proc.communicate(), within)
        assert self.proc.returncode is not None
        return self.proc.returncode, out.decode(), err.decode()


async def start(
    *args: str,
    clock_offset: float | None = None,
    ready: Path | None = None,
    go: Path | None = None,
    env: dict[str, str] | None = None,
) -> Worker:
    """Start ``dedup ARGS...`` in a new process (``sys.executable``)."""
    argv = [sys.executable, "-m", __name__]
    if clock_offset is not None:
        argv += ["--clock-offset", str(clock_offset)]
    if ready is not None and go is not None:
        argv += ["--ready", str(ready), "--go", str(go)]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        "--",
        *args,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    return Worker(proc)


if __name__ == "__main__":
    sys.exit(main())
