"""The fenced code blocks of a docs page, and the ``console`` ones' commands and outputs."""

from __future__ import annotations

import re
from pathlib import Path

BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def snippets(page: Path) -> list[tuple[str, str]]:
    """(language, text) of each fenced code block of ``page``, in order."""
    return [(m[1], m[2]) for m in BLOCK.finditer(page.read_text(encoding="utf-8"))]


def console(text: str) -> list[tuple[str, str]]:
    """(command, expected output) pairs of a console block."""
    pairs: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            pairs.append((line[2:], []))
        else:
            assert pairs, f"console block must start with a $ line: {line!r}"
            pairs[-1][1].append(line)
    return [(command, "\n".join(out)) for command, out in pairs]


def expected_pattern(expected: str) -> re.Pattern[str]:
    """``...`` alone on a line: any lines; inside a line: anything on that line."""
    parts = []
    for line in expected.splitlines():
        if line == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(map(re.escape, line.split("..."))) + r"\n")
    return re.compile("".join(parts), re.DOTALL)
