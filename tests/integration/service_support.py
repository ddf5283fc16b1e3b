"""Helpers for the bundled-service tests: `dedup ...` child processes and JSON events."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson

from tests import helpers
from tests.conftest import ROOT

DEDUP = str(Path(sys.executable).parent / "dedup")


def environment(dsn: str, bootstrap_servers: str = "", **extra: str) -> dict[str, str]:
    """The child's environment: this one, the test's services, no telemetry unless asked."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DEDUP_"))}
    env.update(DEDUP_DSN=dsn, KAFKA_BOOTSTRAP_SERVERS=bootstrap_servers, **extra)
    return env


async def spawn(
    *argv: str,
    env: Mapping[str, str],
    via_shell: bool = False,
    program: str = DEDUP,
    cwd: Path = ROOT,
) -> asyncio.subprocess.Process:
    """``dedup ARGV`` (``program ARGV``; with ``via_shell``, the command line ARGV[0] in sh)."""
    command = ("/bin/sh", "-c", *argv) if via_shell else (program, *argv)
    return await asyncio.create_subprocess_exec(
        *command,
        cwd=cwd,
        env=dict(env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


class Child:
    """One ``dedup ...`` process; its stdout is read line by line as it comes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, *argv: str, env: Mapping[str, str], via_shell: bool = False) -> Child:
        return cls(await spawn(*argv, env=env, via_shell=via_shell))

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            self.lines.append(raw.decode().rstrip("\n"))

    async def expect(self, prefix: str, within: float = 30.0) -> str:
        """The first stdout line that starts with ``prefix``; fail after ``within`` seconds."""

        async def found() -> str | None:
            for line in self.lines:
                if line.startswith(prefix):
                    return line
            if self._reader.done():
                raise AssertionError(f"exited before {prefix!r}:\n{await self.stderr()}")
            return None

        return await helpers.wait_for(found, within=within, what=f"a {prefix!r} line")

    async def stderr(self) -> str:
        assert self.proc.stderr is not None
        return (await self.proc.stderr.read()).decode()[-4000:]

    async def stop(self, sig: signal.Signals = signal.SIGTERM, within: float = 30.0) -> int:
        """Send ``sig`` and wait for the exit code (and the rest of stdout)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)
        code = await asyncio.wait_for(self.proc.wait(), within)
        await self._reader
        return code

    @property
    def stdout(self) -> str:
        return "\n".join(self.lines)


@contextlib.asynccontextmanager
async def child(
    *argv: str, env: Mapping[str, str], via_shell: bool = False
) -> AsyncIterator[Child]:
    """A ``dedup ...`` process (or a shell command), killed on the way out if it still runs."""
    started = await Child.start(*argv, env=env, via_shell=via_shell)
    try:
        yield started
    finally:
        if started.proc.returncode is None:
            await started.stop(signal.SIGKILL)


async def run(
    *argv: str,
    env: Mapping[str, str],
    via_shell: bool = False,
    program: str = DEDUP,
    cwd: Path = ROOT,
    within: float = 60.0,
) -> tuple[int, str, str]:
    """Run ``dedup ...`` (see :func:`spawn`) to its end: (exit code, stdout, stderr)."""
    proc = await spawn(*argv, env=env, via_shell=via_shell, program=program, cwd=cwd)
    out, err = await asyncio.wait_for(proc.communicate(), within)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def produce_events(
    bootstrap_servers: str, topic: str, events: Iterable[Mapping[str, Any]], key: str
) -> int:
    """Produce JSON events, each keyed by its field ``key``."""
    records = [(str(e[key]).encode(), orjson.dumps(e)) for e in events]
    return await helpers.produce(bootstrap_servers, topic, records)


async def handled(consumer: Any, n: int) -> bool:
    """The consumer committed ``n`` messages, whatever their outcome."""
    return bool(consumer.stats["messages"] >= n)
