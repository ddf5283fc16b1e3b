"""Docstrings and docs name modules and files that exist.

Three kinds of reference are read in the Python of the library, the services,
dedup_dev and bench, and in every page under docs/ (and the README): a
repository path (``dedup/data/_sql.py``, ``../sql/queries/consumer.sql``), a private
module (``dedup.consumer._lanes``), and a Sphinx role (``:mod:`dedup.consumer._turn```,
``:func:`dedup.keys.json_field```), which must import.
"""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(
    [
        *ROOT.glob("dedup/**/*.py"),
        *ROOT.glob("consumers/**/*.py"),
        *ROOT.glob("dedup_dev/**/*.py"),
        *ROOT.glob("bench/**/*.py"),
        *ROOT.glob("docs/**/*.md"),
        ROOT / "README.md",
    ]
)
_PATH = re.compile(
    r"(?<![\w/.-])(?:\.\./)*((?:dedup|consumers|bench|tests|sql|dedup_dev|compose|docs)/[\w/.-]*\w)"
)
_PRIVATE = re.compile(r"(?<![\w.])dedup\.(_[a-z][a-z_]*)")
_ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|exc|obj):`~?(dedup(?:\.\w+)+)`")

NOT_IN_THE_TREE = {
    "dedup/sql": "the statements' place inside the wheel (sql/ in the checkout)",
}
_WRITTEN_BY_A_RUN = re.compile(r"bench/results[\w-]*\.json")
"""What ``python -m bench`` writes (ignored by git)."""


def _tracked() -> set[str]:
    """The files git tracks, and their folders: what a fresh clone has."""
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return {str(parent) for name in listed for parent in [Path(name), *Path(name).parents]}


TRACKED = _tracked()
_PLACEHOLDER = re.compile(r"NNNN|AREA")
_MIGRATION_NAME = re.compile(r"dedup/\d{4}_\w+\.sql")
"""How ``dedup migrate`` names a migration in its output: component/file."""


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module, or an attribute of one, that imports."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


def _broken(where: str, text: str) -> list[str]:
    """The references in ``text`` (of the file ``where``) to nothing that exists."""
    broken = []
    for m in _PATH.finditer(text):
        ref = m.group(1)
        if (
            ref in NOT_IN_THE_TREE
            or _PLACEHOLDER.search(ref)
            or _MIGRATION_NAME.fullmatch(ref)
            or _WRITTEN_BY_A_RUN.fullmatch(ref)
        ):
            continue
        if ref not in TRACKED:
            broken.append(f"{where}: path {ref}")
    for m in _PRIVATE.finditer(text):
        name = m.group(1)
        if not ((ROOT / "dedup" / f"{name}.py").exists() or (ROOT / "dedup" / name).is_dir()):
            broken.append(f"{where}: module dedup.{name}")
    broken += [f"{where}: {m.group(0)}" for m in _ROLE.finditer(text) if not _resolves(m.group(1))]
    return broken


def test_docstrings_and_docs_name_modules_and_files_that_exist() -> None:
    broken = [
        ref
        for path in FILES
        for ref in _broken(str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"))
    ]
    assert not broken, "\n".join(broken)


def test_the_reference_check_sees_a_broken_reference() -> None:
    sample = (
        "see :mod:`dedup._worker`, :func:`dedup.keys.no_such_strategy`, "
        "[the loop](../dedup/_consumer_loop.py) and `dedup._batch`; "
        "but :mod:`dedup.consumer._lanes` and [the claim](../sql/queries/consumer.sql) exist\n"
    )
    assert [ref.split(": ", 1)[1] for ref in _broken("docs/page.md", sample)] == [
        "path dedup/_consumer_loop.py",
        "module dedup._worker",
        "module dedup._batch",
        ":mod:`dedup._worker`",
        ":func:`dedup.keys.no_such_strategy`",
    ]
