"""The handler's connection guard, without services."""

from __future__ import annotations

import pytest

from dedup import _errors as errors
from dedup import _guard as guard


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
