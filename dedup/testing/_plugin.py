"""The pytest plugin of ``dedup-kafka[testing]``: the ``dedup_schema`` fixture, ``--dedup-dsn``.

pytest loads it through the ``pytest11`` entry point whenever dedup-kafka is
installed (``-p no:dedup`` turns it off); ``import dedup`` never imports it.
The fixture is synchronous, so it serves sync and async tests under any async
plugin: it makes and drops its schema on an event loop of its own, in a thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from dedup import _errors as errors
from dedup.testing import _schema as schema_

T = TypeVar("T")

HOW_TO_SET = (
    "give the test database with pytest --dedup-dsn=postgresql://USER@HOST/DB, or set "
    "DEDUP_TEST_DSN (else DEDUP_DSN is used); its login needs CREATEROLE"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--dedup-dsn``: the test database of ``dedup_schema``."""
    parser.getgroup("dedup").addoption(
        "--dedup-dsn",
        dest="dedup_dsn",
        default=None,
        metavar="DSN",
        help="the Postgres database the dedup_schema fixture makes its schemas in "
        "(default: DEDUP_TEST_DSN, else DEDUP_DSN)",
    )


def database(config: pytest.Config) -> tuple[str, str] | None:
    """The test database and where it was given: ``--dedup-dsn``, ``DEDUP_TEST_DSN`` or
    ``DEDUP_DSN``, the first one set; None when none is."""
    given = config.getoption("dedup_dsn")
    if given:
        return str(given), "--dedup-dsn"
    for variable in ("DEDUP_TEST_DSN", "DEDUP_DSN"):
        found = os.environ.get(variable)
        if found:
            return found, variable
    return None


@pytest.fixture
def dedup_schema(request: pytest.FixtureRequest) -> Iterator[schema_.Schema]:
    """A fresh, migrated dedup schema on the test database, dropped after the test."""
    found = database(request.config)
    if found is None:
        pytest.fail(f"dedup_schema has no test database: {HOW_TO_SET}", pytrace=False)
    dsn, source = found
    try:
        made = _run(schema_.Schema.create(dsn))
    except errors.DedupError as exc:
        pytest.fail(
            f"dedup_schema could not migrate a schema on the test database of {source}: "
            f"{exc}\n({HOW_TO_SET})",
            pytrace=False,
        )
    yield made
    _run(made.drop())


def _run(call: Coroutine[Any, Any, T]) -> T:
    """``call`` run to its end on an event loop of its own, in a thread: whatever loop the
    test runs on is left alone."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dedup_schema") as thread:
        return thread.submit(asyncio.run, call).result()
