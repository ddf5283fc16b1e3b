"""The ``dedup`` command line.

Every command takes ``--dsn`` (default: the ``DEDUP_DSN`` variable) and
``--schema`` (default ``dedup``).  Exit codes: 0 done, 1 the command ran and
found a problem (a mismatch, a failed task), 2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from dedup import errors, migrations, schema

Command = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dsn",
        default=os.environ.get("DEDUP_DSN"),
        help="Postgres DSN (default: $DEDUP_DSN)",
    )
    parser.add_argument(
        "--schema",
        default=schema.DEFAULT_SCHEMA,
        help="schema holding dedup's tables (default: %(default)s)",
    )


def _dsn(args: argparse.Namespace) -> str:
    if not args.dsn:
        raise errors.ConfigurationError(
            "no database: pass --dsn postgresql://... or set DEDUP_DSN "
            "(compose/local/up writes one to .services/env)"
        )
    return str(args.dsn)


async def _migrate(args: argparse.Namespace) -> int:
    applied = await migrations.migrate(_dsn(args), schema_name=args.schema)
    for name in applied:
        print(f"applied {name}")
    print(f"schema {args.schema} is up to date ({len(applied)} applied now)")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every ``dedup`` command."""
    parser = argparse.ArgumentParser(
        prog="dedup", description="Exactly-once effects for Kafka consumers and scheduled jobs."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("migrate", help="create or update dedup's tables (safe to rerun)")
    _common(p)
    p.set_defaults(func=_migrate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``dedup`` command and return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Command = args.func
    try:
        return asyncio.run(func(args))
    except errors.ConfigurationError as exc:
        print(f"dedup {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except errors.DedupError as exc:
        print(f"dedup {args.command}: {exc}", file=sys.stderr)
        return EXIT_PROBLEM


if __name__ == "__main__":
    sys.exit(main())
