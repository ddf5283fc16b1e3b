"""Start consumer processes and read what they announce on stdout."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class ConsumerProcess:
    """One ``tests.integration.consumer_process`` child."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []

    @classmethod
    async def start(cls, *args: str, hide: Sequence[str] = ()) -> ConsumerProcess:
        """Start the child; the modules named in ``hide`` fail to import in it."""
        # `python -c` with runpy is `python -m`, after the hidden modules are blocked.
        code = (
            f"import runpy, sys; sys.modules.update(dict.fromkeys({list(hide)!r})); "
            "runpy.run_module('tests.integration.consumer_process', run_name='__main__')"
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            code,
            *args,
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        return cls(proc)

    async def expect(self, prefix: str, within: float = 30.0) -> str:
        """Read lines until one starts with ``prefix``; fail after ``within`` seconds."""
        assert self.proc.stdout is not None

        async def read() -> str:
            while True:
                raw = await self.proc.stdout.readline()  # type: ignore[union-attr]
                if not raw:
                    stderr = await self.proc.stderr.read()  # type: ignore[union-attr]
                    raise AssertionError(
                        f"consumer exited ({self.proc.returncode}) before {prefix!r}:\n"
                        + stderr.decode()[-3000:]
                    )
                line = raw.decode().rstrip("\n")
                self.lines.append(line)
                if line.startswith(prefix):
                    return line

        try:
            return await asyncio.wait_for(read(), within)
        except TimeoutError:
            raise AssertionError(f"no {prefix!r} line within {within:.0f}s") from None

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await self.proc.wait()

    async def terminate(self, within: float = 30.0) -> int:
        """SIGTERM, then wait for a clean exit; return the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(self.proc.wait(), within)


@contextlib.asynccontextmanager
async def started(*args: str, hide: Sequence[str] = ()) -> AsyncIterator[ConsumerProcess]:
    """A consumer process that is killed on exit if still running."""
    child = await ConsumerProcess.start(*args, hide=hide)
    try:
        yield child
    finally:
        if child.proc.returncode is None:
            await child.kill()
