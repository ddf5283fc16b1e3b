"""Every ``python`` block of docs/concepts/guarantees.md runs, in page order.

The blocks share one namespace, like cells of a notebook, and may use
top-level ``await``.  They run against this test's own database and Kafka:
``DEDUP_DSN`` and ``KAFKA_BOOTSTRAP_SERVERS`` are set for them.  A block whose
``assert`` fails, or that raises, fails the test with the block's number.
"""

from __future__ import annotations

import ast
import inspect

import pytest

from dedup_dev import docs as docs_support
from dedup_dev.services import ROOT

PAGE = ROOT / "docs" / "concepts" / "guarantees.md"


async def test_every_python_block_of_the_guarantees_page_runs(
    dsn: str, bootstrap_servers: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEDUP_DSN", dsn)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", bootstrap_servers)
    blocks = [text for lang, text in docs_support.snippets(PAGE) if lang == "python"]
    assert blocks, f"{PAGE.name} has no python block"
    namespace: dict[str, object] = {"__name__": "guarantees_page"}
    for number, text in enumerate(blocks, 1):
        code = compile(
            text,
            f"{PAGE.name}, python block {number}",
            "exec",
            flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
        )
        done = eval(code, namespace)  # noqa: S307 - the page's own code is the subject
        if inspect.iscoroutine(done):
            await done
