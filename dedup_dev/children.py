"""Child processes that talk in lines: the one protocol of every test and benchmark child.

A child says what it is doing with lines on stdout, a word first: ``READY <holder>``
once it runs, ``IN_BATCH ...``, ``FAILPOINT ...``; results as JSON after the word
(``STATS {...}``, ``OUTCOME {...}``).  The parent reads them with
:meth:`Child.expect` and sends commands, a line each, to its stdin.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from signal import Signals
from typing import Any

import orjson

from dedup_dev import services


def consumer_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The options every consumer child takes: where to read, where to write, which group."""
    p = argparse.ArgumentParser(prog=prog)
    for option in ("--dsn", "--bootstrap-servers", "--topic", "--group"):
        p.add_argument(option, required=True)
    return p


def say(line: str) -> None:
    """Print one protocol line, flushed at once (the parent is waiting for it)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def say_json(word: str, value: object) -> None:
    """Print ``WORD {json}``: a result the parent reads with :func:`json_of`."""
    say(f"{word} {orjson.dumps(value).decode()}")


def json_of(line: str) -> Any:
    """The JSON after the word of a line :func:`say_json` printed."""
    return orjson.loads(line.split(" ", 1)[1])


class Child:
    """One child process: its stdout read line by line as it comes, its stderr kept.

    Stderr goes to ``log`` when one is given (a long run's children write a lot),
    else it is read into memory.
    """

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log: Path | None) -> None:
        self.name = name
        self.proc = proc
        self.log = log
        self.lines: list[str] = []
        self.struck = False
        """The parent killed or stopped it on purpose (its exit code is not a failure)."""
        self.paused = False
        self._errors = bytearray()
        self._changed = asyncio.Condition()
        self._reader = asyncio.create_task(self._read(), name=f"read {name}")
        self._error_reader = asyncio.create_task(self._read_errors(), name=f"stderr {name}")

    @classmethod
    async def spawn(
        cls,
        argv: Sequence[str],
        *,
        name: str | None = None,
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path = services.ROOT,
    ) -> Child:
        """Start ``argv`` with ``env`` (this process's if None) in ``cwd``."""
        with contextlib.ExitStack() as stack:
            # The child holds the log open; ours closes once it is started.
            err = stack.enter_context(log.open("ab")) if log else asyncio.subprocess.PIPE
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=cwd,
                env=dict(os.environ if env is None else env),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
            )
        return cls(name or Path(argv[0]).name, proc, log)

    @classmethod
    async def start(
        cls,
        module: str,
        args: Sequence[str] = (),
        *,
        name: str | None = None,
        logs: Path | None = None,
        env: Mapping[str, str] | None = None,
        hide: Sequence[str] = (),
    ) -> Child:
        """``python -m module args``; its stderr in ``logs/<name>.log`` when ``logs`` is given.

        ``env`` is added to this process's environment; the modules named in
        ``hide`` fail to import in the child.
        """
        name = name or module.rpartition(".")[2]
        # `python -c` with runpy is `python -m`, after the hidden modules are blocked.
        code = (
            f"import runpy, sys; sys.modules.update(dict.fromkeys({list(hide)!r})); "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
        )
        argv = [sys.executable, "-m", module] if not hide else [sys.executable, "-c", code]
        return await cls.spawn(
            [*argv, *args],
            name=name,
            log=logs / f"{name}.log" if logs else None,
            env={**os.environ, **(env or {})},
        )

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while raw := await self.proc.stdout.readline():
            async with self._changed:
                self.lines.append(raw.decode().rstrip("\n"))
                self._changed.notify_all()
        await self.proc.wait()
        async with self._changed:
            self._changed.notify_all()

    async def _read_errors(self) -> None:
        if self.proc.stderr is not None:
            while chunk := await self.proc.stderr.read(65536):
                self._errors += chunk

    @property
    def alive(self) -> bool:
        """It has not exited yet."""
        return self.proc.returncode is None

    @property
    def stdout(self) -> str:
        """Its stdout so far."""
        return "\n".join(self.lines)

    def stderr_tail(self, chars: int = 4000) -> str:
        """The end of its stderr so far."""
        if self.log is None:
            return self._errors.decode(errors="replace")[-chars:]
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    async def stderr(self, chars: int = 4000) -> str:
        """The end of its stderr, all of it once it has exited."""
        if not self.alive:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._error_reader), 5)
        return self.stderr_tail(chars)

    async def expect(self, prefix: str, *, after: int = 0, within: float = 30.0) -> tuple[int, str]:
        """The first line that starts with ``prefix``: (index, line).

        It looks from index ``after`` on (``len(child.lines)`` before sending a
        command: its answer); it fails when the child exits first, or after
        ``within`` seconds.
        """

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
                            f"{prefix!r}:\n{await self.stderr()}"
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

    def signal(self, sig: Signals) -> None:
        """Send ``sig`` (nothing if it is gone)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    async def wait(self, within: float = 30.0) -> int:
        """Wait for it to exit (and its output to be read); its exit code."""
        code = await asyncio.wait_for(self.proc.wait(), within)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(self._reader, self._error_reader), 5)
        return code

    async def stop(self, sig: Signals = Signals.SIGTERM, within: float = 30.0) -> int:
        """Send ``sig`` and wait for the exit code."""
        self.signal(sig)
        return await self.wait(within)

    async def kill(self) -> None:
        """SIGKILL (also of a stopped process) and reap it."""
        self.struck = True
        await self.stop(Signals.SIGKILL)

    async def terminate(self, within: float = 40.0) -> int:
        """SIGTERM (SIGCONT first if stopped); the exit code, or -1 and SIGKILL after ``within``."""
        if self.paused:
            self.signal(Signals.SIGCONT)
            self.paused = False
        try:
            return await self.stop(Signals.SIGTERM, within)
        except TimeoutError:
            await self.kill()
            return -1

    async def close(self) -> None:
        """Make sure it is gone (at the end, or when a test failed)."""
        if self.alive:
            await self.kill()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        for reader in (self._reader, self._error_reader):
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader


@contextlib.asynccontextmanager
async def started(module: str, *args: str, hide: Sequence[str] = ()) -> AsyncIterator[Child]:
    """``python -m module args`` as a :class:`Child`, killed on the way out if it still runs."""
    child = await Child.start(module, args, hide=hide)
    try:
        yield child
    finally:
        await child.close()
