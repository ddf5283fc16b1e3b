"""Child processes of a chaos run: what they print, their stderr in a file, and signals."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

from tests.chaos.services import ROOT


class Child:
    """One child process (a consumer or a task runner) of a run."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.name = name
        self.proc = proc
        self.log = log
        self.lines: list[str] = []
        self.struck = False
        """The run killed or stopped it on purpose (its exit code is not a failure)."""
        self.paused = False
        self._changed = asyncio.Condition()
        self._reader = asyncio.create_task(self._read(), name=f"chaos-read {name}")

    @classmethod
    async def start(
        cls,
        module: str,
        args: list[str],
        *,
        name: str,
        logs: Path,
        env: dict[str, str] | None = None,
    ) -> Child:
        """Start ``python -m module args``; its stderr goes to ``logs/<name>.log``."""
        log = logs / f"{name}.log"
        with log.open("ab") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                module,
                *args,
                cwd=ROOT,
                env={**os.environ, **(env or {})},
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
            )
        return cls(name, proc, log)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while raw := await self.proc.stdout.readline():
            async with self._changed:
                self.lines.append(raw.decode().rstrip("\n"))
                self._changed.notify_all()
        await self.proc.wait()
        async with self._changed:
            self._changed.notify_all()

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def stderr_tail(self, chars: int = 2500) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    async def expect(self, prefix: str, *, after: int = 0, within: float = 30.0) -> tuple[int, str]:
        """The first line at index ``after`` or later that starts with ``prefix``: (index, line)."""

        def found() -> tuple[int, str] | None:
            for i in range(after, len(self.lines)):
                if self.lines[i].startswith(prefix):
                    return i, self.lines[i]
            return None

        async def wait() -> tuple[int, str]:
            async with self._changed:
                while (hit := found()) is None:
                    if self._reader.done():
                        raise AssertionError(
                            f"{self.name} exited ({self.proc.returncode}) before printing "
                            f"{prefix!r}:\n{self.stderr_tail()}"
                        )
                    await self._changed.wait()
                return hit

        try:
            return await asyncio.wait_for(wait(), within)
        except TimeoutError:
            raise AssertionError(
                f"{self.name} printed no {prefix!r} within {within:.0f}s"
            ) from None

    def send(self, command: str) -> None:
        """Write a command line to its stdin."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    async def wait(self, within: float = 30.0) -> int:
        """Wait for it to exit; its exit code."""
        code = await asyncio.wait_for(self.proc.wait(), within)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._reader, 5)
        return code

    async def kill(self) -> None:
        """SIGKILL (also of a stopped process) and reap it."""
        self.struck = True
        self.signal(signal.SIGKILL)
        await self.wait()

    async def terminate(self, within: float = 40.0) -> int:
        """SIGTERM (SIGCONT first if stopped); the exit code, or SIGKILL after ``within``."""
        if self.paused:
            self.signal(signal.SIGCONT)
            self.paused = False
        self.signal(signal.SIGTERM)
        try:
            return await self.wait(within)
        except TimeoutError:
            await self.kill()
            return -1

    async def close(self) -> None:
        """Make sure it is gone (end of run, or a failed test)."""
        if self.alive:
            await self.kill()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
