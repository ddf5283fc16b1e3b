"""A consumer in its own OS process, for tests that kill, pause or crowd it.

    python -m dedup_dev.consumer_process --dsn DSN --bootstrap-servers HOST:PORT \
        --topic T --group G [--batch-size N] [--hold SECONDS] [--idle-timeout-ms MS] \
        [--exit-on KEY [--exit-how system-exit|keyboard-interrupt|kill]]

It applies the ``effects`` rows of :mod:`dedup_dev.effects`
with the batch handler.  ``--hold`` keeps each batch's transaction open that long
after its writes, and prints ``IN_BATCH <partition> <first offset> <token>`` just before, so
a test can strike while a batch is in flight.  It prints ``READY <holder>`` once
running and ``STATS <json>`` when it stops cleanly (SIGTERM).

The test side is :func:`started`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

import dedup
from dedup.data import _db as db
from dedup_dev import children
from dedup_dev import effects as support
from dedup_dev.children import say


async def main(args: argparse.Namespace) -> None:
    pool = await db.create_pool(
        args.dsn,
        server_settings={"idle_in_transaction_session_timeout": str(args.idle_timeout_ms)},
    )
    await pool.execute(support.EFFECTS)

    async def handler(msgs: list[dedup.Message], tx: dedup.Tx) -> None:
        await support.record_effects(msgs, tx)
        if args.exit_on and any(m.idempotency_key == args.exit_on for m in msgs):
            say(f"EXITING {args.exit_how}")
            end_the_process(args.exit_how)
        if args.hold:
            say(f"IN_BATCH {msgs[0].partition} {msgs[0].offset} {tx.token}")
            await asyncio.sleep(args.hold)
        if args.hang:
            say(f"HUNG {msgs[0].partition} {msgs[0].offset} {tx.token}")
            await asyncio.Event().wait()

    consumer = support.consumer(
        handler,
        args.topic,
        args.bootstrap_servers,
        pool,
        group_id=args.group,
        install_signal_handlers=True,  # SIGTERM stops it: the tests' clean exit
        batch_size=args.batch_size,
        session_timeout_ms=args.session_timeout_ms,
        heartbeat_interval_ms=max(args.session_timeout_ms // 6, 100),
        max_poll_interval_ms=args.max_poll_interval_ms,
        holder=args.holder,
        shutdown_timeout=args.shutdown_timeout,
        max_attempts=args.max_attempts,
        # The server cuts a paused process's session after --idle-timeout-ms; the
        # handler's deadline stays inside it.
        handler_timeout=args.handler_timeout
        or max(args.idle_timeout_ms / 1000 - dedup.consumer._consumer.IDLE_MARGIN, 0.5),
    )
    say(f"READY {consumer.holder}")
    try:
        await consumer.run()
    finally:
        children.say_json("STATS", dict(consumer.stats))
        await pool.close()


def end_the_process(how: str) -> None:
    """What a handler that ends its process does (``--exit-on``)."""
    if how == "system-exit":
        sys.exit(3)
    if how == "keyboard-interrupt":
        raise KeyboardInterrupt
    os.kill(os.getpid(), signal.SIGKILL)  # a segfault or an OOM kill: no cleanup at all


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = children.consumer_parser()
    p.add_argument("--holder")
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--hold", type=float, default=0.0)
    p.add_argument("--hang", action="store_true", help="every batch's handler hangs")
    p.add_argument("--exit-on", help="the handler ends the process on this key (--exit-how)")
    p.add_argument(
        "--exit-how", choices=["system-exit", "keyboard-interrupt", "kill"], default="system-exit"
    )
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    p.add_argument("--max-attempts", type=int, default=3)
    p.add_argument("--handler-timeout", type=float, default=None)
    p.add_argument("--idle-timeout-ms", type=int, default=3000)
    p.add_argument("--session-timeout-ms", type=int, default=3000)
    p.add_argument("--max-poll-interval-ms", type=int, default=300_000)
    return p.parse_args(argv)


def started(
    *args: str, hide: Sequence[str] = ()
) -> contextlib.AbstractAsyncContextManager[children.Child]:
    """This module as a child process (killed on the way out); ``hide``: modules it can't import."""
    return children.started(__name__, *args, hide=hide)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(main(parse()))
