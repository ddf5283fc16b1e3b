"""Schema names, the named-query layer (dedup/data/_sql.py) and migration discovery: pure logic."""

from __future__ import annotations

import re
from pathlib import Path

import asyncpg
import pytest

from dedup import _errors as errors
from dedup.data import _db as db
from dedup.data import _migrations as migrations
from dedup.data import _sql as sql


@pytest.mark.parametrize("name", ["dedup", "tenant_7", "_x"])
def test_plain_identifiers_are_quoted(name: str) -> None:
    assert sql.quote(name) == f'"{name}"'


@pytest.mark.parametrize("name", ["", "Dedup", "7up", 'a"; drop table x; --', "a-b", "x" * 64])
def test_anything_else_is_refused_naming_the_input(name: str) -> None:
    with pytest.raises(errors.ConfigurationError, match="invalid schema name"):
        sql.quote(name)


def test_render_substitutes_only_the_schema_placeholder() -> None:
    assert sql.render("SELECT '{x}' FROM {schema}.t", "s1") == "SELECT '{x}' FROM \"s1\".t"


def test_named_queries_are_rendered_for_the_schema() -> None:
    q = sql.Queries("other")
    assert '"other".migrations' in q.migration_rows.sql
    with pytest.raises(AttributeError, match="no query named"):
        _ = q.no_such_query


def test_shipped_migrations_are_numbered_in_order() -> None:
    found = migrations.discover(sql.migrations_dir())
    assert [m.version for m in found] == sorted(m.version for m in found)
    assert found[0].name == "core"


def test_badly_named_migration_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "first.sql").write_text("SELECT 1")
    with pytest.raises(errors.MigrationError, match=r"NNNN_name\.sql"):
        migrations.discover(tmp_path)


def test_transient_failures_are_retriable_and_bugs_are_not() -> None:
    assert db.is_retriable(asyncpg.exceptions.SerializationError())
    assert db.is_retriable(asyncpg.exceptions.DeadlockDetectedError())
    assert db.is_retriable(asyncpg.exceptions.AdminShutdownError())
    assert db.is_retriable(ConnectionResetError())
    assert not db.is_retriable(asyncpg.exceptions.UniqueViolationError())
    assert not db.is_retriable(ValueError("handler bug"))


def test_migrations_only_add() -> None:
    # An older dedup keeps running on a migrated schema (docs/operations.md,
    # "Upgrading"): no migration drops, renames or narrows what a release uses.
    narrowing = re.compile(
        r"\b(DROP\s+(TABLE|COLUMN|INDEX|SCHEMA|VIEW|FUNCTION|TYPE)|RENAME"
        r"|ALTER\s+COLUMN\s+\S+\s+(TYPE|SET\s+NOT\s+NULL))\b",
        re.IGNORECASE,
    )
    for migration in migrations.discover(sql.migrations_dir()):
        code = re.sub(r"--[^\n]*", "", migration.path.read_text(encoding="utf-8"))
        assert not narrowing.search(code), migration.path.name


def test_named_parameters_become_positional_in_order_of_first_use() -> None:
    text, params = sql.positional(
        "SELECT :b::int, ':not_a_param', \"col:x\", :a, :b -- :comment\nFROM t WHERE x = :a"
    )
    assert params == ("b", "a")
    assert (
        text == "SELECT $1::int, ':not_a_param', \"col:x\", $2, $1 -- :comment\nFROM t WHERE x = $2"
    )


def test_a_query_refuses_arguments_that_do_not_match_its_parameters() -> None:
    query = sql.Query("q", "SELECT $1, $2", ("a", "b"))
    assert query.args({"b": 2, "a": 1}) == [1, 2]
    with pytest.raises(
        TypeError, match=r"query q takes a, b \(missing: \['b'\], unexpected: \['c'\]\)"
    ):
        query.args({"a": 1, "c": 3})
