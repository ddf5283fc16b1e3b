"""What every ``dedup`` command shares: options, argument types, the connection, exit codes.

The commands connect without asyncpg's statement cache: each is short-lived and
sends each statement a few times at most, and without it they work unchanged
through a pooler in transaction mode (pgbouncer), where a prepared statement
does not outlive its transaction.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import os
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import asyncpg

from dedup import _db as db
from dedup import _errors as errors
from dedup import _kafka_client as kafka_client
from dedup import _migrations as migrations
from dedup import _report as report
from dedup import _sql as sql
from dedup import _timespec as timespec

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


def add_common(parser: argparse.ArgumentParser) -> None:
    """``--dsn`` and ``--schema``, which every command takes."""
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


def integer(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise ValueError(f"invalid value {text!r}: expected an integer >= {minimum}")
        return value

    return argtype(parse, "integer")


def pause(text: str) -> float:
    """An argparse ``type``: seconds to pause, zero or more."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"invalid pause {text!r}: expected seconds >= 0")
    return value


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
            type=integer(1),
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
        async with db.connection(dsn(args)) as conn:
            await migrations.check(conn, schema=args.schema)
            yield conn
    except (asyncpg.UndefinedTableError, asyncpg.InvalidSchemaNameError) as exc:
        raise errors.ConfigurationError(
            f"no dedup tables in schema {args.schema!r} ({exc}): check --schema, or run "
            "`dedup migrate`"
        ) from exc
    except asyncpg.InsufficientPrivilegeError as exc:
        raise errors.ConfigurationError(
            f"{exc}: connect as a role granted dedup_audit (reading) or dedup_runtime "
            "(replay, purge); see docs/howto/audit-and-purge.md"
        ) from exc
    except (asyncpg.PostgresConnectionError, asyncpg.InterfaceError) as exc:
        raise errors.ServiceUnavailableError(
            f"lost the connection to Postgres ({exc}); run the command again"
        ) from exc


def show(found: report.Report, args: argparse.Namespace, *, ok: bool | None = None) -> int:
    """Print ``found``; exit 0 when ``ok`` (default: something matched), else 1."""
    print(found.render(args.format), flush=True)
    return EXIT_OK if (found.found if ok is None else ok) else EXIT_PROBLEM
