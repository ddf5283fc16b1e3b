"""``dedup relay``: publish the outbox's Kafka records, on any number of machines.

A :class:`dedup.Relay` until SIGTERM or SIGINT: one relay of a name holds its
lease and publishes, the others wait to take over.
"""

from __future__ import annotations

import argparse
from typing import Any

from dedup import _errors as errors
from dedup import _kafka_client as kafka_client
from dedup import _limits as limits
from dedup import _relay as relaying
from dedup import _report as report
from dedup.cli import _common as common


async def _relay(args: argparse.Namespace) -> int:
    """publish the outbox's Kafka records once each, in order, until SIGTERM

    Every relay of a --name competes for one lease; the holder publishes the
    pending records of the outbox (tx.publish) and the others wait. --mode
    at-least-once marks records sent once the broker acknowledged them (a
    relay killed in between sends them again; dedup-key makes them harmless
    downstream); --mode exactly-once publishes each batch in a Kafka
    transaction with its position, so a read_committed reader sees each record
    once. Exit code 0 once stopped.
    """
    if not args.bootstrap_servers:
        raise errors.ConfigurationError(
            "dedup relay publishes to Kafka: pass --bootstrap-servers host:port "
            "or set KAFKA_BOOTSTRAP_SERVERS"
        )
    relay = relaying.Relay(
        dsn=common.dsn(args),
        bootstrap_servers=args.bootstrap_servers,
        name=args.name,
        mode=args.mode.replace("-", "_"),
        holder=args.holder,
        schema=args.schema,
        lease_ttl=args.ttl,
        batch_size=args.batch_size,
        state_topic=args.state_topic,
        kafka_options=kafka_client.kafka_options(args),
        pool_options={**common.POOL_OPTIONS, "timeout": args.connect_timeout},
    )
    await common.run_until_signalled(relay.run, relay.stop)
    s = relay.stats
    print(
        report.escape(
            f"relay {relay.name}: stopped; {s.published} published in {s.batches} batches, "
            f"{s.failed} failed, {s.recovered} recovered, lease taken {s.takeovers} times"
        )
    )
    return common.EXIT_OK


def add_relay(sub: Any) -> None:
    """``dedup relay``."""
    p = common.command(sub, "relay", _relay)
    p.add_argument("--name", default="relay", help="the relay's lease name (default: relay)")
    p.add_argument(
        "--mode",
        choices=("at-least-once", "exactly-once"),
        default="at-least-once",
        help="how records are published (default: at-least-once)",
    )
    p.add_argument("--holder", help="this relay's name (default: hostname:pid:xxxxxx)")
    p.add_argument(
        "--ttl",
        type=common.seconds(limits.MIN_LEASE_TTL, limits.MAX_LEASE_TTL),
        default=relaying.DEFAULT_LEASE_TTL,
        help="lease seconds (default: %(default)s)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=relaying.DEFAULT_BATCH_SIZE,
        help="records per batch (default: %(default)s)",
    )
    p.add_argument(
        "--state-topic",
        default=relaying.DEFAULT_STATE_TOPIC,
        help="exactly-once: the compacted topic of each batch's position (default: %(default)s)",
    )
    common.add_kafka(p, "the Kafka brokers to publish to", secured=True)
    common.add_common(p)
