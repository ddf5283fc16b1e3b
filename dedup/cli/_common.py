"""What every ``dedup`` command shares: options, argument types, the connection, exit codes.

The commands connect without asyncpg's statement cache: each is short-lived and
sends each statement a few times at most, and without it they work unchanged
through a pooler in transaction mode (pgbouncer), where a prepared statement
does not outlive its transaction.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import inspect
import math
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import asyncpg

from dedup import _errors as errors
from dedup import _kafka_client as kafka_client
from dedup import _report as report
from dedup import _timespec as timespec
from dedup.data import _db as db
from dedup.data import _migrations as migrations
from dedup.data import _sql as sql

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2

T = TypeVar("T")

POOL_OPTIONS = {"statement_cache_size": 0}
"""asyncpg options of every command's connections (see the module docstring)."""

Command = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]
"""What a command does with its arguments; returns the exit code."""


def command(
    sub: Any,
    name: str,
    run: Command | None = None,
    *,
    help: str | None = None,
    description: str | None = None,
) -> argparse.ArgumentParser:
    """Declare ``name`` in ``sub`` (an ``add_subparsers()``) and return its parser.

    ``run`` is what the command does; its docstring is the command's help: the
    first line for the list of commands, the rest (the exit codes, say) for
    ``--help``.  ``help`` and ``description`` say it instead (a group of
    actions, which has no ``run``, or one ``run`` behind two commands).
    """
    doc = inspect.getdoc(run) if run is not None else None
    if doc:
        first, _, rest = doc.partition("\n\n")
        help = help or first
        description = description or rest or None
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help, description=description)
    if run is not None:
        parser.set_defaults(func=run)
    return parser


def add_filters(parser: argparse.ArgumentParser, **helps: str) -> None:
    """Text options narrowing what a command reads: ``business_key=HELP`` is ``--business-key``."""
    for name, help in helps.items():
        parser.add_argument(f"--{name.replace('_', '-')}", help=help)


MAX_CONNECT_TIMEOUT = 300.0
"""The longest ``--connect-timeout`` in seconds: past five minutes, a server is
not slow but gone, and a command waiting that long looks hung."""


def add_common(parser: argparse.ArgumentParser) -> None:
    """``--dsn``, ``--schema`` and ``--connect-timeout``, which every command takes."""
    parser.add_argument(
        "--dsn",
        default=os.environ.get("DEDUP_DSN"),
        help="Postgres DSN (default: $DEDUP_DSN)",
    )
    parser.add_argument(
        "--schema",
        default=sql.DEFAULT_SCHEMA,
        help="schema holding dedup's tables (default: %(default)s)",
    )
    # argparse checks a string default with the option's type too.
    parser.add_argument(
        "--connect-timeout",
        type=seconds(0, MAX_CONNECT_TIMEOUT, above=True),
        default=os.environ.get("DEDUP_CONNECT_TIMEOUT", str(db.DEFAULT_CONNECT_TIMEOUT)),
        metavar="SECONDS",
        help="how long to wait for Postgres to answer when connecting "
        "(default: $DEDUP_CONNECT_TIMEOUT, else %(default)s)",
    )


def dsn(args: argparse.Namespace) -> str:
    """The ``--dsn`` given, or a ConfigurationError saying how to give one."""
    if not args.dsn:
        raise errors.ConfigurationError(
            "no database: pass --dsn postgresql://... or set DEDUP_DSN "
            "(compose/local/up writes one to .services/env)"
        )
    return str(args.dsn)


def argtype(parse: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """An argparse ``type`` that shows the parser's own message (it names the input)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name
    return convert


INT32_MAX = 2**31 - 1
"""The largest Kafka partition number (and Postgres ``integer``)."""
INT64_MAX = 2**63 - 1
"""The largest Kafka offset and dedup id (Postgres ``bigint``)."""


def integer(minimum: int, maximum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer from ``minimum`` to ``maximum``.

    Every number a command takes goes through this or :func:`seconds`, so a
    value out of range is refused before connecting, naming the range.
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if not minimum <= value <= maximum:
            raise ValueError(
                f"invalid value {text!r}: expected an integer from {minimum} to {maximum}"
            )
        return value

    return argtype(parse, "integer")


def seconds(minimum: float, maximum: float, *, above: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: seconds from ``minimum`` (excluded with ``above``) to ``maximum``."""
    expected = (
        f"more than {minimum:g} and at most {maximum:g}"
        if above
        else f"from {minimum:g} to {maximum:g}"
    )

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        # NaN fails both comparisons, so it is refused too.
        if not ((value > minimum if above else value >= minimum) and value <= maximum):
            raise ValueError(f"invalid value {text!r}: expected seconds {expected}")
        return value

    return argtype(parse, "seconds")


TIME = argtype(timespec.parse_time, "time")
DURATION = argtype(timespec.parse_duration, "duration")


def add_output(parser: argparse.ArgumentParser, *, limit: bool = True) -> None:
    """``--format`` (and ``--limit`` for lists), then the common options."""
    parser.add_argument(
        "--format",
        choices=("table", "json"),
        default="table",
        help="aligned table, or one JSON document (fields: docs/reference/cli.md)",
    )
    if limit:
        parser.add_argument(
            "--limit",
            type=integer(1, report.MAX_LIMIT),
            default=report.DEFAULT_LIMIT,
            help="most rows per list (default: %(default)s); JSON says truncated: true when cut",
        )
    add_common(parser)


def add_window(parser: argparse.ArgumentParser, what: str) -> None:
    """``--since`` and ``--until``, about ``what``."""
    parser.add_argument(
        "--since",
        type=TIME,
        help=f"{what} at or after: ISO 8601 (UTC unless given), or 2h, 7d ago",
    )
    parser.add_argument("--until", type=TIME, help=f"{what} before (same forms as --since)")


def add_kafka(parser: argparse.ArgumentParser, help: str, *, secured: bool = False) -> None:
    """``--bootstrap-servers``, defaulting to ``$KAFKA_BOOTSTRAP_SERVERS``; with ``secured``,
    the security settings too (``--security-protocol``..., each defaulting to its variable)."""
    parser.add_argument(
        "--bootstrap-servers",
        default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"),
        help=f"{help} (default: $KAFKA_BOOTSTRAP_SERVERS)",
    )
    if not secured:
        return
    kafka_client.add_kafka_options(parser)


def from_args(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """A dataclass of what a command was asked: each field from the option of its name."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    values = {name: getattr(args, name) for name in names if hasattr(args, name)}
    return cls(**{**values, **given})


@contextlib.asynccontextmanager
async def connection(args: argparse.Namespace) -> AsyncIterator[asyncpg.Connection]:
    """A connection to ``--dsn`` whose schema is migrated; errors say what to do."""
    sql.quote(args.schema)  # a bad name is bad usage, found before connecting
    try:
        async with db.connection(dsn(args), connect_timeout=args.connect_timeout) as conn:
            await migrations.check(conn, schema=args.schema)
            yield conn
    except (asyncpg.UndefinedTableError, asyncpg.InvalidSchemaNameError) as exc:
        raise errors.ConfigurationError(
            f"no dedup tables in schema {args.schema!r} ({exc}): check --schema, or run "
            "`dedup migrate`"
        ) from exc
    except asyncpg.InsufficientPrivilegeError as exc:
        raise errors.ConfigurationError(
            f"{exc}: connect as a role granted schema {args.schema}'s audit role (reading) or "
            "its runtime role (replay, purge), as `dedup migrate` printed them; see "
            "docs/howto/audit-and-purge.md"
        ) from exc
    except (asyncpg.PostgresConnectionError, asyncpg.InterfaceError) as exc:
        raise errors.ServiceUnavailableError(
            f"lost the connection to Postgres ({exc}); run the command again"
        ) from exc


def show(found: report.Report, args: argparse.Namespace, *, ok: bool | None = None) -> int:
    """Print ``found``; exit 0 when ``ok`` (default: something matched), else 1."""
    print(found.render(args.format), flush=True)
    return EXIT_OK if (found.found if ok is None else ok) else EXIT_PROBLEM


async def run_until_signalled(
    run: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]
) -> None:
    """``await run()``, with SIGTERM and SIGINT calling ``stop()`` (a service's clean stop)."""
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(stop()))
    try:
        await run()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
