"""A FastStream app in its own OS process, one member of a group, for tests that kill it.

    python -m dedup_dev.faststream_member --dsn DSN --bootstrap-servers HOST:PORT \
        --topic T --group G [--max-records N]

Its batch subscriber, exactly-once through ``dedup.FastStreamDedup``, writes the
``effects`` rows of :mod:`dedup_dev.effects` (no unique constraint: a double
shows as two rows) on the transaction it takes from FastStream's context.  It
prints ``READY`` once the broker runs and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from typing import Any

from faststream import Context
from faststream.kafka import KafkaBroker, KafkaRouter
from faststream.middlewares import AckPolicy

import dedup
from dedup_dev import children
from dedup_dev.children import say


async def main(args: argparse.Namespace) -> None:
    pool = await dedup.create_pool(args.dsn)  # the test made the effects table
    exactly_once = dedup.FastStreamDedup(
        pool=pool, namespace=args.group, key=dedup.keys.json_field("id")
    )
    broker = KafkaBroker(args.bootstrap_servers, logger=None)
    router = KafkaRouter(middlewares=[exactly_once])

    @router.subscriber(
        args.topic,
        group_id=args.group,
        batch=True,
        max_records=args.max_records,
        auto_offset_reset="earliest",
        ack_policy=AckPolicy.NACK_ON_ERROR,
        session_timeout_ms=3000,
        heartbeat_interval_ms=500,
    )
    async def apply(
        bodies: list[dict[str, Any]],
        tx: dedup.Tx = Context("dedup_tx"),
        message: Any = Context("message"),
    ) -> None:
        records = message.raw_message
        await tx.conn.execute(
            'INSERT INTO effects (key, payload, token, "partition", "offset")'
            " SELECT * FROM unnest($1::text[], $2::jsonb[], $3::bigint[], $4::int[], $5::bigint[])",
            [str(b["id"]) for b in bodies],
            [b for b in bodies],
            [tx.token] * len(bodies),
            [r.partition for r in records],
            [r.offset for r in records],
        )

    broker.include_router(router)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await broker.start()
    say("READY")
    try:
        await stop.wait()
    finally:
        await broker.stop()
        await pool.close()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = children.consumer_parser()
    p.add_argument("--max-records", type=int, default=200)
    return p.parse_args(argv)


def started(*args: str) -> contextlib.AbstractAsyncContextManager[children.Child]:
    """This module as a child process (killed on the way out)."""
    return children.started(__name__, *args)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(main(parse()))
