"""The handler's connection guard and the lanes' scheduling, without services."""

from __future__ import annotations

import asyncio

import pytest

from dedup import _errors as errors
from dedup import _guard as guard
from dedup import _lanes as lanes


@pytest.mark.parametrize(
    "sql",
    [
        "COMMIT",
        "commit;",
        "  end",
        "ABORT",
        "rollback",
        "ROLLBACK AND CHAIN",
        "COMMIT AND CHAIN",
        "PREPARE TRANSACTION 'x'",
        "-- a comment\nCOMMIT",
        "/* a /* nested */ comment */ COMMIT",
        "SELECT 1; COMMIT",
        "SELECT 'a; b'; END; SELECT 2",
        "UPDATE t SET x = 1;\n\n  commit",
    ],
)
def test_statements_that_end_the_transaction_are_refused(sql: str) -> None:
    with pytest.raises(errors.HandlerError, match="the handler ran"):
        guard.check_statement(sql)


@pytest.mark.parametrize(
    "sql",
    [
        "INSERT INTO t VALUES ($1, $2)",
        "ROLLBACK TO SAVEPOINT s1",
        "rollback to s1",
        "SAVEPOINT s1",
        "RELEASE SAVEPOINT s1",
        "SELECT 'x; COMMIT'",
        'SELECT "a;commit" FROM t',
        "SELECT E'it\\'s; COMMIT'",
        "DO $$ BEGIN PERFORM 1; END $$",
        "DO $body$ BEGIN RAISE NOTICE 'x; COMMIT'; END $body$",
        "SELECT 1 -- ; COMMIT",
        "SELECT 1 /* ; COMMIT */",
        "UPDATE commits SET n = 1",
        "SELECT endpoint FROM t; SELECT aborted FROM t",
        "BEGIN",  # a warning inside a transaction, not an end
    ],
)
def test_other_statements_pass(sql: str) -> None:
    guard.check_statement(sql)


async def test_after_a_deadlock_lanes_still_run_side_by_side_but_none_is_shared() -> None:
    # Serial lanes overlap their transactions; their handlers take turns in
    # Postgres (tests/integration/test_lanes.py), so no lock wait is cut short.
    pool = lanes.Lanes(pool=None, size=4)
    assert not pool.serial
    pool.deadlocked()
    assert pool.serial
    inside = 0
    most = 0
    all_in = asyncio.Event()

    async def batch() -> None:
        nonlocal inside, most
        async with pool.lane() as lane:
            assert not lane.shared
            inside += 1
            most = max(most, inside)
            if inside == 4:
                all_in.set()
            await all_in.wait()
            inside -= 1

    await asyncio.wait_for(asyncio.gather(*(batch() for _ in range(5))), 5)
    assert most == 4
