"""A ``dedup.sync.Consumer`` in its own OS process, for tests that kill it or run a group.

    python -m dedup_dev.sync_consumer_process --dsn DSN --bootstrap-servers HOST:PORT \
        --topic T --group G [--batch-size N] [--hold SECONDS] [--holder NAME]

It applies the ``effects`` rows of :mod:`dedup_dev.effects` with a blocking batch
handler on psycopg (the test makes the table).  ``--hold`` keeps each batch's
transaction open that long after its writes, and prints ``IN_BATCH <partition>
<first offset> <token>`` just before, so a test can strike while a batch is in
flight.  It prints ``READY <holder>`` once running and ``STATS <json>`` when it
stops cleanly (SIGTERM): what :mod:`dedup_dev.consumer_process` does for the
async consumer.

The test side is :func:`started`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time

import orjson

import dedup
from dedup_dev import children
from dedup_dev.children import say

INSERT_EFFECTS = (
    'INSERT INTO effects (key, payload, token, "partition", "offset")'
    " SELECT * FROM unnest(%s::text[], %s::text[]::jsonb[], %s::bigint[], %s::int[], %s::bigint[])"
)
""":func:`dedup_dev.effects.record_effects`' rows, one statement per batch, on psycopg."""


def record_effects(msgs: list[dedup.Message], tx: dedup.sync.Tx) -> None:
    """The blocking batch handler: one ``effects`` row per applied message."""
    tx.conn.execute(
        INSERT_EFFECTS,
        (
            [m.idempotency_key for m in msgs],
            [orjson.dumps(m.json()).decode() for m in msgs],
            [tx.token] * len(msgs),
            [m.partition for m in msgs],
            [m.offset for m in msgs],
        ),
    )


def main(args: argparse.Namespace) -> None:
    def handler(msgs: list[dedup.Message], tx: dedup.sync.Tx) -> None:
        record_effects(msgs, tx)
        if args.hold:
            say(f"IN_BATCH {msgs[0].partition} {msgs[0].offset} {tx.token}")
            time.sleep(args.hold)

    consumer = dedup.sync.Consumer(
        handler,
        topics=[args.topic],
        group_id=args.group,
        config={
            "bootstrap.servers": args.bootstrap_servers,
            # A killed member's partitions move on after this long.
            "session.timeout.ms": args.session_timeout_ms,
            "heartbeat.interval.ms": max(args.session_timeout_ms // 6, 100),
        },
        dsn=args.dsn,
        key=dedup.keys.json_field("id"),
        batch_size=args.batch_size,
        holder=args.holder,
        install_signal_handlers=True,  # SIGTERM stops it: the tests' clean exit
    )
    say(f"READY {consumer.holder}")
    try:
        consumer.run()
    finally:
        children.say_json("STATS", dict(consumer.stats))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = children.consumer_parser()
    p.add_argument("--holder")
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--hold", type=float, default=0.0)
    p.add_argument("--session-timeout-ms", type=int, default=3000)
    return p.parse_args(argv)


def started(*args: str) -> contextlib.AbstractAsyncContextManager[children.Child]:
    """This module as a child process (killed on the way out)."""
    return children.started(__name__, *args)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    main(parse())
