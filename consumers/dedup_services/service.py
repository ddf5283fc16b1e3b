"""What every bundled service shares: options, migrations, logging, telemetry, the run loop.

Each option is a flag that can also come from an environment variable (the
flag wins); ``--help`` names both.  At start a service applies dedup's
migrations and its own (``consumers/dedup_services/sql/<component>/``, recorded in dedup's
``migrations`` table under the component's name), unless ``--no-migrate``;
``--migrate-only`` applies them and exits.  Services use ``dedup``'s public API
only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dedup
from dedup_services import otel

log = logging.getLogger(__name__)

SQL = Path(__file__).resolve().parent / "sql"
"""The services' migrations, one folder per component."""

Handler = Callable[[dedup.Message, dedup.Tx], Awaitable[object]]

TELEMETRY_HELP = f"""\
telemetry (the OpenTelemetry SDK, configured as opentelemetry-instrument does):
  OTEL_TRACES_EXPORTER    otlp, console or none (comma-separate for several); default:
                          otlp if an OTLP endpoint is set, else none
  OTEL_METRICS_EXPORTER   otlp, console, prometheus or none; default: the same
  OTEL_LOGS_EXPORTER      otlp, console or none; default: the same
  OTEL_EXPORTER_OTLP_PROTOCOL  grpc (default, port 4317) or http/protobuf (port 4318)
  OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_HEADERS, ...: where otlp sends
  OTEL_SERVICE_NAME       default dedup-<service>
  OTEL_SDK_DISABLED=true  install nothing
on stop, the exporters get {otel.FLUSH_DEADLINE:g}s to send what they hold
"""


def option(
    parser: argparse.ArgumentParser | Any,
    flag: str,
    *,
    env: str,
    help: str,
    default: Any = None,
    type: Callable[[str], Any] = str,
    dest: str | None = None,
) -> None:
    """Add ``flag``, defaulting to ``$env`` and then to ``default``; the help names both."""
    raw = os.environ.get(env)
    value = default
    if raw not in (None, ""):
        try:
            value = type(raw)
        except ValueError as exc:
            raise dedup.ConfigurationError(f"${env}={raw!r}: {exc}") from exc
    shown = "" if default is None else f"; default: {default}"
    parser.add_argument(
        flag,
        type=type,
        default=value,
        help=f"{help} (${env}{shown})",
        dest=dest or flag.lstrip("-").replace("-", "_"),
    )


def require(value: Any, flag: str, env: str) -> Any:
    """``value``, or a ConfigurationError naming the flag and its variable."""
    if value in (None, ""):
        raise dedup.ConfigurationError(f"{flag} is required: pass {flag} ... or set {env}")
    return value


def parser(name: str, description: str, *, dedup_tables: bool = True) -> argparse.ArgumentParser:
    """The parser every service starts from: Postgres, migrations, logging.

    ``dedup_tables=False`` for a service that needs none of dedup's tables (the
    receiver): its migrations are then recorded in its own schema.
    """
    p = argparse.ArgumentParser(
        prog=f"dedup run dedup_services.{name}",
        description=description,
        epilog=TELEMETRY_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if dedup_tables:
        option(p, "--dsn", env="DEDUP_DSN", help="Postgres: dedup's tables and this service's")
        p.add_argument(
            "--schema", default="dedup", help="the schema of dedup's tables (default: dedup)"
        )
    else:
        option(p, "--dsn", env="DEDUP_DSN", help=f"Postgres: the {name}'s own tables")
    p.add_argument(
        "--no-migrate",
        action="store_true",
        help="don't apply migrations at start (when a more privileged role applies them)",
    )
    p.add_argument(
        "--migrate-only",
        action="store_true",
        help="apply dedup's and this service's migrations, then exit",
    )
    option(p, "--log-level", env="DEDUP_LOG_LEVEL", default="INFO", help="DEBUG, INFO or WARNING")
    option(
        p,
        "--metrics-port",
        env="DEDUP_METRICS_PORT",
        type=int,
        help="serve metrics for Prometheus on this port, at /metrics (OTEL_EXPORTER_PROMETHEUS_HOST"
        " is the address, default localhost; adds prometheus to OTEL_METRICS_EXPORTER)",
    )
    return p


def consumer_options(p: argparse.ArgumentParser, name: str) -> None:
    """Kafka and consumer options; variables are prefixed with the service's name."""
    prefix = name.upper()
    group = p.add_argument_group("consumer")
    option(group, "--bootstrap-servers", env="KAFKA_BOOTSTRAP_SERVERS", help="Kafka, host:port")
    option(group, "--topic", env=f"{prefix}_TOPIC", default=name, help="the topic to consume")
    option(
        group,
        "--group",
        env=f"{prefix}_GROUP",
        default=name,
        help="the consumer group (keys are unique per service, whatever the group)",
    )
    option(
        group,
        "--batch-size",
        env=f"{prefix}_BATCH_SIZE",
        default=500,
        type=int,
        help="most messages per transaction",
    )
    option(
        group,
        "--max-attempts",
        env=f"{prefix}_MAX_ATTEMPTS",
        default=3,
        type=int,
        help="tries of a failing message before it is dead-lettered",
    )
    group.add_argument("--holder", help="this instance's name in leases and events")
    option(
        group,
        "--client-id",
        env=f"{prefix}_CLIENT_ID",
        help="this instance's client id in Kafka's group tools (default: the holder)",
    )
    security = p.add_argument_group("secured Kafka (aiokafka's settings of the same names)")
    dedup.add_kafka_options(security)


def kafka_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The client id and security settings given to a service, for dedup.IdempotentConsumer."""
    client = {"client_id": args.client_id} if args.client_id else {}
    return {**client, **dedup.kafka_options(args)}


async def migrate(
    target: Any, components: Sequence[str], *, schema: str | None = "dedup"
) -> list[str]:
    """Apply dedup's migrations, then each component's; return what was applied now.

    With ``schema=None`` dedup's tables are left alone and each component's
    migrations are recorded in a schema of the component's name.
    """
    applied = [] if schema is None else await dedup.migrate(target, schema=schema)
    for component in components:
        applied += await dedup.migrate(
            target,
            schema=schema or component,
            directory=SQL / component,
            component=component,
        )
    return applied


async def connect(dsn: str, *, max_size: int = 4) -> Any:
    """dedup's pool (``dedup.create_pool``) for a service's own queries, named in pg_stat_activity.

    The services send and read JSON as text, so the pool's codecs don't matter.
    """
    return await dedup.create_pool(
        dsn, max_size=max_size, server_settings={"application_name": "dedup-consumers"}
    )


@contextlib.asynccontextmanager
async def started(
    args: argparse.Namespace, name: str, components: Sequence[str]
) -> AsyncIterator[bool]:
    """Logging, the OpenTelemetry SDK and migrations for one service process.

    Yields False when the service should not go on (``--migrate-only``).
    """
    try:
        logging.basicConfig(
            level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    except ValueError as exc:
        raise dedup.ConfigurationError(f"--log-level {args.log_level!r}: {exc}") from exc
    require(args.dsn, "--dsn", "DEDUP_DSN")
    if not args.no_migrate:
        applied = await migrate(args.dsn, components, schema=getattr(args, "schema", None))
        log.info("%s: migrations applied now: %s", name, ", ".join(applied) or "none")
    if args.migrate_only:
        yield False
        return
    shutdown = otel.setup(f"dedup-{name}", metrics_port=args.metrics_port)
    try:
        yield True
    finally:
        shutdown()


@contextlib.contextmanager
def stop_signals() -> Iterator[asyncio.Event]:
    """An event set by SIGTERM or SIGINT, for loops that are not a dedup consumer."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


class InvalidEvent(ValueError):
    """An event a service cannot apply (a missing field, a wrong type).

    Raised from a handler, it is retried ``--max-attempts`` times and then
    dead-lettered whole, ``InvalidEvent: <this message>`` as its ``error``.
    """


def event(msg: dedup.Message, what: str) -> dict[str, Any]:
    """The message's JSON object, or InvalidEvent naming ``what`` it should be."""
    body = msg.json()
    if not isinstance(body, dict):
        raise InvalidEvent(f"{what} is a JSON object, not {type(body).__name__}")
    return body


def business_date(msg: dedup.Message, body: Mapping[str, Any]) -> dt.date:
    """The event's ``date`` (YYYY-MM-DD), else the UTC date of the record's timestamp.

    Both are part of the record, so a replay lands on the same date.
    """
    given = body.get("date")
    if given is None:
        return dt.datetime.fromtimestamp(msg.timestamp / 1000, dt.UTC).date()
    try:
        return dt.date.fromisoformat(given)
    except (TypeError, ValueError):
        raise InvalidEvent(f"date must be a YYYY-MM-DD string, not {given!r}") from None


def text_field(body: Mapping[str, Any], name: str) -> str:
    """The non-empty string field ``name`` of an event, or InvalidEvent."""
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidEvent(f"field {name!r} must be a non-empty string, not {value!r}")
    return value


@dataclass(frozen=True)
class ConsumerService:
    """A bundled service that applies one topic with a dedup.IdempotentConsumer."""

    name: str
    """The service's name: its namespace of keys, default topic and group."""
    description: str
    """What ``--help`` says first."""
    handler: Callable[[str], Handler]
    """Makes the handler for a consumer group (fencing tokens are per group and partition)."""
    key: Any
    """The idempotency key strategy."""
    components: tuple[str, ...]
    """Migrations to apply, in order (consumers/dedup_services/sql/<component>/)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """More dedup.IdempotentConsumer options."""

    def consumer(
        self,
        *,
        topic: str,
        bootstrap_servers: str,
        dsn: str | None = None,
        pool: Any = None,
        group_id: str | None = None,
        **options: Any,
    ) -> dedup.IdempotentConsumer:
        """A consumer of ``topic`` applying this service's handler (for embedding and tests)."""
        group = group_id or self.name
        settings: dict[str, Any] = {"auto_offset_reset": "earliest", **self.options, **options}
        return dedup.IdempotentConsumer(
            self.handler(group),
            topics=[topic],
            group_id=group,
            namespace=self.name,
            bootstrap_servers=bootstrap_servers,
            dsn=dsn,
            pool=pool,
            key=self.key,
            **settings,
        )

    async def migrate(self, target: Any, *, schema: str = "dedup") -> list[str]:
        """Apply dedup's migrations and this service's (a DSN, pool or connection)."""
        return await migrate(target, self.components, schema=schema)

    def parser(self) -> argparse.ArgumentParser:
        """The service's flags."""
        p = parser(self.name, self.description)
        consumer_options(p, self.name)
        return p

    async def run(self, args: argparse.Namespace) -> int:
        """Consume until SIGTERM or SIGINT, with ``args`` from :meth:`parser`."""
        async with started(args, self.name, self.components) as go_on:
            if not go_on:
                return 0
            consumer = self.consumer(
                topic=args.topic,
                bootstrap_servers=require(
                    args.bootstrap_servers, "--bootstrap-servers", "KAFKA_BOOTSTRAP_SERVERS"
                ),
                dsn=args.dsn,
                group_id=args.group,
                schema=args.schema,
                batch_size=args.batch_size,
                max_attempts=args.max_attempts,
                holder=args.holder,
                **kafka_settings(args),
            )
            log.info("%s: consuming %s as group %s", self.name, args.topic, args.group)
            await consumer.run()
            log.info("%s: stopped; %s", self.name, dict(consumer.stats))
        return 0

    async def main(self, argv: Sequence[str]) -> int:
        """``dedup run dedup_services.<name> [options]``."""
        return await self.run(self.parser().parse_args(list(argv)))
