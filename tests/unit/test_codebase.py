"""The shape of the library's code: what a newcomer can rely on when reading it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[2] / "dedup"
# A string that is SQL: a statement keyword followed by more text.  (A docstring
# that starts with a verb is prose, and docstrings are not looked at.)
_SQL_STATEMENT = re.compile(
    r"\s*(SELECT|INSERT|UPDATE|DELETE|WITH|CREATE|ALTER|DROP|GRANT|REVOKE|DO|SET|RESET"
    r"|SHOW|LOCK|TRUNCATE|COPY|BEGIN|COMMIT|ROLLBACK|ANALYZE|VACUUM|NOTIFY|LISTEN)\s+\S"
)


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _sql_literals(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            skip.update(id(part) for part in node.values)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and node.values:
            first = node.values[0]
            text = first.value if isinstance(first, ast.Constant) else ""
        elif isinstance(node, ast.Constant) and id(node) not in skip:
            text = node.value
        else:
            continue
        if isinstance(text, str) and _SQL_STATEMENT.match(text):
            found.append(f"{path.name}:{node.lineno}: {text.strip().splitlines()[0][:60]}")
    return found


def test_no_sql_text_in_the_librarys_python() -> None:
    # Every statement lives under sql/ and runs through dedup/data/_sql.py.
    found = [hit for path in sorted(LIBRARY.rglob("*.py")) for hit in _sql_literals(path)]
    assert found == []


def test_the_sql_check_sees_sql(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""SELECT is prose in a docstring."""\n'
        'A = "SELECT 1"\n'
        'B = f"""\n  INSERT INTO {t} VALUES (1)"""\n'
        'C = "Select the partition"\n'
    )
    assert [hit.split(":")[1] for hit in _sql_literals(sample)] == ["2", "3"]


def test_queries_name_their_parameters() -> None:
    # `:group_id`, bound by keyword: never a `$1` whose meaning lives in a comment.
    positional = re.compile(r"\$[0-9]")
    found = [
        f"{path.name}:{n}"
        for path in sorted((LIBRARY.parent / "sql" / "queries").glob("*.sql"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if positional.search(line.split("--")[0])
    ]
    assert found == []


_CONFTEST_IMPORT = re.compile(
    r"^\s*(from\s+(tests\.)?conftest\s+import|import\s+(tests\.)?conftest)", re.M
)


def test_no_test_imports_conftest() -> None:
    """conftest holds the fixtures; what tests import lives in dedup_dev, the one home."""
    root = LIBRARY.parent
    importing = [
        str(path.relative_to(root))
        for path in sorted(root.glob("tests/**/*.py"))
        if _CONFTEST_IMPORT.search(path.read_text(encoding="utf-8"))
    ]
    assert importing == []
    assert _CONFTEST_IMPORT.search("from tests.conftest import ROOT\n")
