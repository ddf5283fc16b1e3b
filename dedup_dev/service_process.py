"""Helpers for the bundled-service tests: `dedup ...` child processes and JSON events."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson

from dedup_dev import children, kafka
from dedup_dev.services import ROOT

DEDUP = str(Path(sys.executable).parent / "dedup")


def environment(dsn: str, bootstrap_servers: str = "", **extra: str) -> dict[str, str]:
    """The child's environment: this one, the test's services, and ``extra``.

    No ``OTEL_*`` of this process's: a service then exports nothing (its default)
    unless ``extra`` says where.
    """
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


@contextlib.asynccontextmanager
async def child(
    *argv: str, env: Mapping[str, str], via_shell: bool = False
) -> AsyncIterator[children.Child]:
    """A ``dedup ...`` process (or a shell command), killed on the way out if it still runs."""
    command = ("/bin/sh", "-c", *argv) if via_shell else (DEDUP, *argv)
    started = await children.Child.spawn(command, env=env)
    try:
        yield started
    finally:
        await started.close()


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
    return await kafka.produce(bootstrap_servers, topic, records)


async def handled(consumer: Any, n: int) -> bool:
    """The consumer committed ``n`` messages, whatever their outcome."""
    return bool(consumer.stats["messages"] >= n)
