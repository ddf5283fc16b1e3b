"""Each page a reader follows has names of its own: tables, topics, groups, namespaces, tasks.

A reader works through the pages on one database and one broker, in any
order; two pages that both make a table ``accounts`` (with other columns), or
both consume as group ``orders``, would meet there and give numbers neither
page shows.  The names are read from the pages' code blocks; the ones a page
may share are the bundled services' own (their task codes, which are also
their namespaces, topics and schemas: their tables are in those schemas),
since any page may run the services.
The integration tests run the pages one after another on one database
(``docs_page``, tests/conftest.py); this checks every order at once.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections import defaultdict
from pathlib import Path

from dedup_dev.services import ROOT

PAGES = [ROOT / "docs" / "quickstart.md", *sorted((ROOT / "docs" / "howto").glob("*.md"))]
SCRATCH = {"audit-and-purge.md"}
"""Pages that say to load their story into a scratch database of its own."""
NAME = r"([a-z_][\w.-]*)"
"""A name as the pages write them (a placeholder, as ``--task T``, is upper case)."""
PATTERNS = {
    "table": [
        rf"CREATE TABLE (?:IF NOT EXISTS )?{NAME}",
        rf'__tablename__ = "{NAME}"',
        rf'write_fenced\(\s*\w+,\s*"{NAME}"',
    ],
    "topic": [
        rf"--topic {NAME}",
        rf'_TOPIC", "{NAME}"\)',
        rf"_TOPIC:-{NAME}\}}",
        rf'topics=\["{NAME}"',
        rf'publish\(\s*"{NAME}"',
        rf'topic: str = "{NAME}"',
    ],
    "group": [
        rf'group_id="{NAME}"',
        rf'group_id: str = "{NAME}"',
        rf'"group\.id": "{NAME}"',  # confluent-kafka's configuration
        rf"--group {NAME}",
    ],
    "namespace": [rf'namespace="{NAME}"', rf"--namespace {NAME}"],
    "task": [rf"--task {NAME}", rf'task="{NAME}"', rf'"task": "{NAME}"', rf'\.run\(\s*"{NAME}",'],
}


def names(page: Path) -> set[tuple[str, str]]:
    """(kind, name) of what the page's code (its blocks, and inline code too) makes or uses."""
    code = page.read_text(encoding="utf-8")
    return {
        (kind, found)
        for kind, patterns in PATTERNS.items()
        for pattern in patterns
        for found in re.findall(pattern, code)
    }


def bundled() -> set[str]:
    """The bundled services' task codes (their reconcile entry points)."""
    return {e.name for e in importlib.metadata.entry_points(group="dedup.reconcile")}


def test_no_two_pages_share_a_name_but_the_bundled_services() -> None:
    services = bundled()
    assert {"payments", "statements", "notifications"} <= services, services
    pages_of: dict[tuple[str, str], list[str]] = defaultdict(list)
    for page in PAGES:
        if page.name not in SCRATCH:
            for name in names(page):
                pages_of[name].append(page.name)
    shared = {
        f"{kind} {name!r}: {', '.join(pages)}"
        for (kind, name), pages in pages_of.items()
        if len(pages) > 1 and (kind == "table" or name not in services)
    }
    assert not shared, "pages that would meet on one database or broker:\n" + "\n".join(shared)


def test_the_names_are_found() -> None:
    """The patterns see the names, so the check above can fail."""
    found = {p.stem: names(p) for p in PAGES}
    quickstart, sqlalchemy, django = found["quickstart"], found["sqlalchemy"], found["django"]
    assert {("table", "accounts"), ("group", "quickstart-app")} <= quickstart
    assert {("table", "ledger_accounts"), ("namespace", "ledger")} <= sqlalchemy
    assert ("group", "donations") in django
    assert ("table", "accounts") not in sqlalchemy


def test_every_page_with_a_test_of_its_own_runs_on_the_docs_database() -> None:
    """The page's test is marked ``docs_page``: it runs after the others, on one database."""
    for page in PAGES:
        if page.name in SCRATCH or page.stem == "quickstart":
            continue  # the quickstart's whole run starts from an empty database (test_install.py)
        test = ROOT / "tests" / "integration" / f"test_docs_{page.stem.replace('-', '_')}.py"
        assert "pytestmark = pytest.mark.docs_page" in test.read_text(encoding="utf-8"), test
