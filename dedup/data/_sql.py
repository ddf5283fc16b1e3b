"""Every SQL statement of dedup, and the one way the library runs them.

The statements live in files, never in Python, at the top of the repository::

    sql/migrations/NNNN_name.sql   numbered migrations (``dedup migrate``)
    sql/queries/AREA.sql           named queries, one file per area

The wheel carries them as ``dedup/sql/...``; a checkout (an editable install)
reads them where they are (:func:`_statements`).

A named query starts with a ``-- name: NAME`` line; comment lines after it say
what it does.  Its parameters are named (``:group_id``), bound by keyword where
it runs, and sent to asyncpg as the positional ``$1, $2, ...`` it speaks::

    q = Queries(schema)
    row = await q.partition_position.fetchrow(conn, group_id=g, topic=t, partition=p)

The schema name is the only identifier that comes from configuration.  It is
validated and quoted here, once, and substituted for ``{schema}``; no message
content ever reaches SQL text.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dedup import _errors as errors
from dedup.data import _db_telemetry as db_telemetry

DEFAULT_SCHEMA = "dedup"

_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_QUERY_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
# A named parameter, or something that only looks like one: a quoted string or
# identifier, a comment, a `::type` cast.  Only the first kind is rewritten.
_PARAMETER = re.compile(
    r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|--[^\n]*|::|(?<![:\w]):([a-z_][a-z0-9_]*)"
)
_COMMENT = re.compile(r"--[^\n]*")
_OPERATION = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE|MERGE|LOCK|CREATE)\b")
_TABLE = re.compile(r"\{schema\}\.(\w+)")


def _statements() -> Path:
    """The folder of the statements: ``dedup/sql`` in an installed wheel, else the
    checkout's ``sql/`` beside the package."""
    packaged = importlib.resources.files("dedup") / "sql"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[2] / "sql"


_SQL = _statements()


def plain_identifier(name: object) -> bool:
    """Whether ``name`` is lowercase letters, digits and '_' (at most 63), not led by a digit."""
    return isinstance(name, str) and _IDENTIFIER.fullmatch(name) is not None


def quote(schema: str) -> str:
    """Return ``schema`` quoted for SQL, after checking it is a plain identifier."""
    if not plain_identifier(schema):
        raise errors.ConfigurationError(
            f"invalid schema name {schema!r}: use lowercase letters, digits and '_' "
            "(at most 63, not starting with a digit)"
        )
    return f'"{schema}"'


def render(text: str, schema: str) -> str:
    """Substitute the quoted schema for ``{schema}`` in ``text``."""
    return text.replace("{schema}", quote(schema))


def migrations_dir() -> Path:
    """The folder of numbered migrations, inside the installed package."""
    return Path(str(_SQL / "migrations"))


def positional(text: str) -> tuple[str, tuple[str, ...]]:
    """Rewrite ``:name`` parameters as ``$n``; return the text and the names in order."""
    names: list[str] = []

    def number(found: re.Match[str]) -> str:
        name = found.group(1)
        if name is None:
            return found.group(0)
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    return _PARAMETER.sub(number, text), tuple(names)


def summarize(text: str, schema: str | None) -> tuple[str, str]:
    """``db.operation.name`` and ``db.query.summary`` of a query's text (before rendering).

    The summary names each of dedup's tables the text touches, in order, with
    the operation that touches it (``UPDATE dedup.partitions INSERT
    dedup.processed``), as the conventions build it; a text that touches none is
    its first operation (``SELECT``).
    """
    code = _COMMENT.sub("", text)
    operations = list(_OPERATION.finditer(code))
    first = operations[0].group(1) if operations else "EXECUTE"
    parts: list[str] = []
    for table in _TABLE.finditer(code):
        before = [op.group(1) for op in operations if op.start() < table.start()]
        part = f"{before[-1] if before else first} {schema or 'dedup'}.{table.group(1)}"
        if part not in parts:
            parts.append(part)
    return first, " ".join(parts) or first


@dataclasses.dataclass(frozen=True)
class Query:
    """One named query, rendered for one schema, run with keyword arguments.

    Each run is a CLIENT span named after its ``summary``
    (:func:`dedup.data._db_telemetry.db_call`).
    """

    name: str
    sql: str
    params: tuple[str, ...]
    operation: str = "EXECUTE"
    """``db.operation.name``: its first operation."""
    summary: str = "EXECUTE"
    """``db.query.summary``: operations and tables (see :func:`summarize`)."""
    schema: str | None = None
    """The schema it was rendered for (None: a template on the caller's tables)."""

    def args(self, values: Mapping[str, Any]) -> list[Any]:
        """The positional arguments for ``values``, which must name every parameter."""
        if set(values) != set(self.params):
            missing = sorted(set(self.params) - set(values))
            extra = sorted(set(values) - set(self.params))
            raise TypeError(
                f"query {self.name} takes {', '.join(self.params) or 'no parameters'}"
                f" (missing: {missing}, unexpected: {extra})"
            )
        return [values[name] for name in self.params]

    async def fetch(self, conn: Any, **values: Any) -> list[Any]:
        args = self.args(values)
        with db_telemetry.db_call(conn, self):
            return list(await conn.fetch(self.sql, *args))

    async def fetchrow(self, conn: Any, **values: Any) -> Any:
        args = self.args(values)
        with db_telemetry.db_call(conn, self):
            return await conn.fetchrow(self.sql, *args)

    async def fetchval(self, conn: Any, **values: Any) -> Any:
        args = self.args(values)
        with db_telemetry.db_call(conn, self):
            return await conn.fetchval(self.sql, *args)

    async def execute(self, conn: Any, **values: Any) -> str:
        args = self.args(values)
        with db_telemetry.db_call(conn, self):
            return str(await conn.execute(self.sql, *args))

    async def executemany(self, conn: Any, rows: Iterable[Mapping[str, Any]]) -> None:
        args = [self.args(row) for row in rows]
        with db_telemetry.db_call(conn, self):
            await conn.executemany(self.sql, args)


@functools.cache
def _texts() -> dict[str, str]:
    """Every named query of ``sql/queries/*.sql``, by name (names are unique)."""
    found: dict[str, str] = {}
    for file in sorted((_SQL / "queries").iterdir(), key=lambda f: f.name):
        if not file.name.endswith(".sql"):
            continue
        parts = _QUERY_NAME.split(file.read_text(encoding="utf-8"))
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in found:
                raise RuntimeError(f"query {name} is named twice under sql/queries")
            found[name] = body.strip()
    return found


@functools.cache
def _rendered(schema: str) -> dict[str, Query]:
    """Every named query rendered for ``schema``: once per schema per process."""
    found = {}
    for name, text in _texts().items():
        rendered, params = positional(render(text, schema))
        operation, summary = summarize(text, schema)
        found[name] = Query(name, rendered, params, operation, summary, schema)
    return found


class Queries:
    """The named queries of ``sql/queries``, rendered for one schema."""

    def __init__(self, schema: str = DEFAULT_SCHEMA) -> None:
        self.schema = schema
        self._queries = _rendered(schema)

    def __getattr__(self, name: str) -> Query:
        try:
            return self._queries[name]
        except KeyError:
            raise AttributeError(f"no query named {name!r} under sql/queries") from None


def identifier(name: str, what: str) -> str:
    """``name`` (a column, a table or ``schema.table``) quoted, each part checked first.

    For the identifiers a caller configures (a table of its own); ``what``
    names the setting in the error.
    """
    parts = name.split(".") if isinstance(name, str) else [name]
    if len(parts) > 2 or not all(isinstance(p, str) and _IDENTIFIER.fullmatch(p) for p in parts):
        raise errors.ConfigurationError(
            f"invalid {what} {name!r}: use lowercase letters, digits and '_' "
            "(at most 63, not starting with a digit; a table may be schema.table)"
        )
    return ".".join(f'"{p}"' for p in parts)


def template(name: str, **parts: str) -> Query:
    """The named query ``name`` with each ``{part}`` replaced, ready to run.

    A template is a query of the files whose identifiers the caller chooses
    (its own table and columns); ``parts`` are built from :func:`identifier`
    and ``:name`` parameters only, never from values.
    """
    text = _texts()[name]
    for part, filled in parts.items():
        text = text.replace("{" + part + "}", filled)
    rendered, params = positional(text)
    operation, _ = summarize(text, None)
    return Query(name, rendered, params, operation, operation)
