"""How the operator commands print what they found: an aligned table, or one JSON document.

A :class:`Report` is a query (what was asked), named sections of rows, a
command's figures, and whether the row limit cut the answer short.  Every
command prints one, and both formats are made from it, so they always agree.

JSON encoding, the same for every command (documented in docs/reference/cli.md):
times are ISO 8601 in UTC with microseconds (``2026-11-30T10:00:00.123456+00:00``), hashes are
lowercase hex, message bytes (Kafka key, value, header values) are base64.

Keys, header names, topics, errors and holders come from producers and
handlers, so nothing printed may carry a control character to the terminal
(a producer could retitle it, clear it or forge lines).  :func:`escape` is the
one place that makes text safe: tables escape every cell and line with it, and
JSON escapes DEL and the C1 characters (``\\u009b``) that orjson leaves raw.
"""

from __future__ import annotations

import base64
import datetime
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

DEFAULT_LIMIT = 1000
"""Most rows per list, unless a command's ``--limit`` says otherwise."""
MAX_LIMIT = 1_000_000
"""The largest ``--limit``: every row is held in memory and printed as one document."""

MAX_CELL = 60
"""Most characters of a table's cell; a longer value is cut, ``...`` at its end (JSON always
has the whole value)."""


# C0 (incl. ESC, BEL, CR, LF, TAB), DEL and C1 (incl. CSI, U+009B): what a
# terminal may act on instead of showing.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
# What JSON may still carry raw: orjson escapes C0 itself.
_JSON_RAW_CONTROL = re.compile("[\x7f-\x9f]")
_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(match: re.Match[str]) -> str:
    char = match[0]
    return _SHORT_ESCAPES.get(char) or f"\\x{ord(char):02x}"


def escape(text: str) -> str:
    """``text`` with every control character shown as an escape (``\\x1b``, ``\\r``, ``\\x9b``).

    For everything the commands print to a terminal.  Backslashes are left as
    they are, so a key copied from a table can be looked up again.
    """
    return _CONTROL.sub(_escaped, text)


def _json_escaped(match: re.Match[str]) -> str:
    return f"\\u{ord(match[0]):04x}"


def hex_bytes(value: bytes | None) -> str | None:
    """``value`` as lowercase hex (hashes)."""
    return None if value is None else value.hex()


def b64_bytes(value: bytes | None) -> str | None:
    """``value`` as standard base64 with padding (message key, value and header values)."""
    return None if value is None else base64.b64encode(value).decode("ascii")


def utc(value: datetime.datetime | None) -> str | None:
    """A timestamp as ISO 8601 in UTC, microseconds kept."""
    if value is None:
        return None
    return value.astimezone(datetime.UTC).isoformat(timespec="microseconds")


HEX_FIELDS = frozenset({"payload_hash"})
"""Byte fields shown as hex; every other byte field is base64."""


def json_value(name: str, value: Any) -> Any:
    """One database value as JSON: times in UTC, bytes as hex or base64 (lists too)."""
    if isinstance(value, datetime.datetime):
        return utc(value)
    if isinstance(value, bytes):
        return hex_bytes(value) if name in HEX_FIELDS else b64_bytes(value)
    if isinstance(value, list):
        return [json_value(name, v) for v in value]
    return value


def json_row(record: Mapping[str, Any]) -> dict[str, Any]:
    """A database row with JSON-ready values, field names as the columns are named."""
    return {name: json_value(name, value) for name, value in record.items()}


@dataclass(frozen=True)
class Column:
    """One column of a table: the JSON field it shows, and its heading."""

    field: str
    """The row's JSON field name."""
    heading: str = ""
    """The table heading (default: the field name)."""
    right: bool = False
    """Align the cells right (figures)."""
    width: int = MAX_CELL
    """Most characters of a cell (a longer value is cut, ``...`` at its end)."""

    @property
    def title(self) -> str:
        """The heading shown in tables."""
        return self.heading or self.field


def columns(spec: str) -> tuple[Column, ...]:
    """Columns from ``"field, field:heading, ..."`` (``idempotency_key:key``)."""
    found = []
    for part in spec.split(","):
        name, _, heading = part.strip().partition(":")
        found.append(Column(name, heading))
    return tuple(found)


@dataclass
class Section:
    """A named list of rows, e.g. ``processed`` or ``dead_letters``."""

    name: str
    """Its JSON field name."""
    title: str
    """What a table calls it (``processed keys``); empty: the table alone."""
    columns: Sequence[Column]
    """What a table shows, in order (JSON rows carry every field)."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    """The rows, already JSON-ready (see the module docstring)."""
    table_rows: list[dict[str, Any]] | None = None
    """What a table shows instead of ``rows``, when that is easier to read."""
    in_json: bool = True
    """False for a table's view of figures the JSON document gives as ``fields``."""

    @property
    def shown(self) -> list[dict[str, Any]]:
        """The rows a table shows."""
        return self.table_rows if self.table_rows is not None else self.rows


@dataclass
class Report:
    """The answer of one command, as a table for people and one JSON document.

    JSON: ``query``, each section's rows under its name, ``fields``, then
    ``found`` and ``truncated`` when the report has lists.  Table: the
    ``heading`` line, then each section with rows.
    """

    query: Mapping[str, Any] | None
    """What was asked, under the option names without dashes (None: no ``query`` field)."""
    sections: list[Section] = field(default_factory=list)
    """What was found."""
    fields: Mapping[str, Any] = field(default_factory=dict)
    """More of the JSON document: a command's figures (``purge``, ``reconcile``)."""
    heading: str = ""
    """A table's first line."""
    truncated: bool = False
    """True when the row limit cut the answer short."""
    nothing: str = "nothing found"
    """What a table says when no section has a row."""
    vertical: bool = False
    """Tables show each row as ``field  value`` lines, values whole."""

    @property
    def found(self) -> int:
        """Rows in all sections."""
        return sum(len(s.rows) for s in self.sections)

    def section(self, name: str) -> Section:
        """The section called ``name``."""
        for section in self.sections:
            if section.name == name:
                return section
        raise KeyError(name)

    def to_json(self) -> str:
        """The report as one JSON document."""
        doc: dict[str, Any] = {} if self.query is None else {"query": dict(self.query)}
        lists = [s for s in self.sections if s.in_json]
        for section in lists:
            doc[section.name] = section.rows
        doc.update(self.fields)
        if lists:
            doc["found"] = self.found
            doc["truncated"] = self.truncated
        text = orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode()
        # Outside strings a document is ASCII, so these are inside strings,
        # where \u007f...\u009f reads back as the same character.
        return _JSON_RAW_CONTROL.sub(_json_escaped, text)

    def to_table(self) -> str:
        """The report as aligned tables, one per non-empty section."""
        parts = []
        for section in self.sections:
            rows = section.shown
            if not rows:
                continue
            if self.vertical:
                body = "\n\n".join(vertical(row) for row in rows)
            else:
                body = table(section.columns, rows)
            parts.append(f"{section.title} ({len(rows)}):\n{body}" if section.title else body)
        if not parts:
            parts.append(self.nothing)
        elif self.truncated:
            parts.append("(more rows match: raise --limit or narrow the query)")
        text = "\n\n".join(parts)
        text = f"{self.heading}\n{text}" if self.heading else text
        # Cells are escaped already; the heading and the nothing-found line
        # quote what was asked, which may have been pasted from a message.
        return "\n".join(escape(line) for line in text.split("\n"))

    def render(self, fmt: str) -> str:
        """The report in ``fmt`` (``table`` or ``json``)."""
        return self.to_json() if fmt == "json" else self.to_table()


def cell(value: Any, *, width: int | None = MAX_CELL) -> str:
    """One value as table text: ``-`` for none, compact JSON for mappings and lists."""
    if value is None:
        text = "-"
    elif isinstance(value, bool):
        text = "yes" if value else "no"
    elif isinstance(value, str):
        text = value
    elif isinstance(value, dict | list):
        text = orjson.dumps(value).decode()
    else:
        text = str(value)
    text = escape(text)
    if width is not None and len(text) > width:
        text = text[: width - 3] + "..."
    return text


def table(columns: Sequence[Column], rows: Sequence[Mapping[str, Any]]) -> str:
    """``rows`` as a table with a heading line; columns padded to their widest cell."""
    cells = [[c.title.upper() for c in columns]]
    cells += [[cell(row.get(c.field), width=c.width) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(
            text.rjust(w) if c.right else text.ljust(w)
            for text, w, c in zip(line, widths, columns, strict=True)
        ).rstrip()
        for line in cells
    )


def vertical(row: Mapping[str, Any]) -> str:
    """One row as ``field: value`` lines, values whole (for ``show``)."""
    width = max(len(k) for k in row)
    return "\n".join(f"{k.ljust(width)}  {cell(v, width=None)}".rstrip() for k, v in row.items())
