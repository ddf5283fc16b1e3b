"""Where dedup's SQL lives and how the configured schema name enters it.

The schema name is the only identifier that comes from configuration.  It is
validated and quoted here, once, and substituted for ``{schema}`` in the SQL
files; no message content ever reaches SQL text.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
from pathlib import Path

from dedup import _errors as errors

DEFAULT_SCHEMA = "dedup"

_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_QUERY_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def quote(schema: str) -> str:
    """Return ``schema`` quoted for SQL, after checking it is a plain identifier."""
    if not isinstance(schema, str) or not _IDENTIFIER.fullmatch(schema):
        raise errors.ConfigurationError(
            f"invalid schema name {schema!r}: use lowercase letters, digits and '_' "
            "(at most 63, not starting with a digit)"
        )
    return f'"{schema}"'


def render(sql: str, schema: str) -> str:
    """Substitute the quoted schema for ``{schema}`` in ``sql``."""
    return sql.replace("{schema}", quote(schema))


def migrations_dir() -> Path:
    """The folder of numbered migrations: inside the wheel, or ``sql/`` of a checkout."""
    packaged = importlib.resources.files("dedup") / "sql"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parent.parent / "sql"


@functools.cache
def _queries() -> dict[str, str]:
    text = (importlib.resources.files("dedup") / "queries.sql").read_text(encoding="utf-8")
    parts = _QUERY_NAME.split(text)
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


class Queries:
    """The named queries of ``dedup/queries.sql``, rendered for one schema."""

    def __init__(self, schema: str = DEFAULT_SCHEMA) -> None:
        self.schema = schema
        self._rendered = {name: render(sql, schema) for name, sql in _queries().items()}

    def __getattr__(self, name: str) -> str:
        try:
            return self._rendered[name]
        except KeyError:
            raise AttributeError(f"no query named {name!r} in dedup/queries.sql") from None
