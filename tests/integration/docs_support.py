"""The fenced code blocks of a docs page, for the tests that run them."""

from __future__ import annotations

import re
from pathlib import Path

BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def snippets(page: Path) -> list[tuple[str, str]]:
    """(language, text) of each fenced code block of ``page``, in order."""
    return [(m[1], m[2]) for m in BLOCK.finditer(page.read_text(encoding="utf-8"))]
