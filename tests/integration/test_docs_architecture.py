"""docs/architecture.md stays true: it names every module; its query example is real and runs."""

from __future__ import annotations

import re
import textwrap
from typing import Any

from dedup.data import _sql as sql
from dedup_dev import docs as docs_support
from dedup_dev.services import ROOT

PAGE = ROOT / "docs" / "architecture.md"


def test_the_page_names_every_module_of_the_library() -> None:
    text = PAGE.read_text(encoding="utf-8")
    library = ROOT / "dedup"
    modules = sorted(
        ".".join(path.relative_to(library).with_suffix("").parts).removesuffix(".__init__")
        for path in library.rglob("*.py")
        if path.relative_to(library).as_posix() not in ("__init__.py", "__main__.py")
    )
    missing = [m for m in modules if not re.search(rf"(?<![\w.]){re.escape(m)}\b", text)]
    assert missing == []


async def test_the_query_example_is_shipped_and_runs_as_written(pool: Any) -> None:
    blocks = docs_support.snippets(PAGE)
    # The tree, the consumer in one picture, then the query and its call.
    assert [lang for lang, _ in blocks] == ["text", "text", "sql", "python"]
    (_, query), (_, call) = blocks[2], blocks[3]
    shipped = (ROOT / "sql" / "queries" / "consumer.sql").read_text(encoding="utf-8")
    assert query.strip() in shipped

    async def run_the_call(conn: Any) -> Any:
        scope: dict[str, Any] = {"conn": conn}
        exec(  # noqa: S102 - the page's own snippet, as a reader would paste it
            "async def snippet():\n" + textwrap.indent(call, "    ") + "\n    return row\n",
            scope,
        )
        return await scope["snippet"]()

    async with pool.acquire() as conn:
        assert await run_the_call(conn) is None  # nobody holds it yet
        await sql.Queries("dedup").take_partitions.fetch(
            conn, group_id="payments", holder="me", topics=["payments"], partitions=[0]
        )
        row = await run_the_call(conn)
    assert (row["holder"], row["token"], row["next_offset"]) == ("me", 1, None)


def test_the_tree_shows_every_part_and_top_level_module() -> None:
    section = PAGE.read_text(encoding="utf-8").split("## The face and the rest")[1]
    tree = section.split("```text")[1].split("```")[0]
    library = ROOT / "dedup"
    shown = {
        *(f"{p.name}/" for p in library.iterdir() if (p / "__init__.py").exists()),
        *(p.name for p in library.glob("*.py") if p.name != "__main__.py"),
    }
    missing = sorted(name for name in shown if not re.search(rf"(?<![\w/]){re.escape(name)}", tree))
    assert missing == []
    assert all(
        (ROOT / line.split()[0]).exists() for line in tree.splitlines()[1:] if line[:1] not in " "
    )
