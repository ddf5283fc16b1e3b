"""A relay of the chaos suite, in its own process, with failpoints armed from stdin.

    python -m tests.chaos.relay_child --dsn DSN --bootstrap-servers B --name N --holder H \
        --mode exactly_once|at_least_once [--ttl SECONDS]

It runs :class:`dedup.Relay` until SIGTERM.  Commands on stdin arm a failpoint
for the next batch this relay handles:

``kill_after_send``
    SIGKILL itself once the broker took the batch (exactly-once: its Kafka
    transaction committed), before the rows are marked sent.
``pause_before_send``
    SIGSTOP itself with the batch read, before any record of it is sent: a
    zombie, until the driver sends SIGCONT.

Lines on stdout: ``READY <holder>``, ``STRUCK <command> <token>`` right before
a failpoint acts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import Any

import dedup
from dedup import _faults as faults

ARMED: set[str] = set()


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def kill_after_send(*, token: int, **_: Any) -> None:
    if "kill_after_send" in ARMED:
        say(f"STRUCK kill_after_send {token}")
        os.kill(os.getpid(), signal.SIGKILL)


async def pause_before_send(*, token: int, **_: Any) -> None:
    if "pause_before_send" in ARMED:
        ARMED.discard("pause_before_send")
        say(f"STRUCK pause_before_send {token}")
        os.kill(os.getpid(), signal.SIGSTOP)


async def read_commands() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        ARMED.add(line.decode().strip())


async def main(args: argparse.Namespace) -> int:
    relay = dedup.Relay(
        dsn=args.dsn,
        bootstrap_servers=args.bootstrap_servers,
        name=args.name,
        holder=args.holder,
        mode=args.mode,
        lease_ttl=args.ttl,
        batch_size=args.batch_size,
        producer_options={"request_timeout_ms": 5000},
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(relay.stop()))
    faults.install(faults.Point.RELAY_AFTER_SEND, kill_after_send)
    faults.install(faults.Point.RELAY_BEFORE_SEND, pause_before_send)
    commands = asyncio.create_task(read_commands())
    say(f"READY {args.holder}")
    try:
        await relay.run()
    finally:
        commands.cancel()
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.chaos.relay_child")
    p.add_argument("--dsn", required=True)
    p.add_argument("--bootstrap-servers", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--holder", required=True)
    p.add_argument("--mode", choices=("exactly_once", "at_least_once"), required=True)
    p.add_argument("--ttl", type=float, default=2.0)
    p.add_argument("--batch-size", type=int, default=50)
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse(sys.argv[1:]))))
