"""Control flows down: no import cycle in dedup/, and the architecture page shows the real layers.

Every module of the package is read with `ast` (nothing is imported), and every
import of a dedup module is collected: `from dedup import _x as x`, `import
dedup._x`, `from dedup._x import y`, relative imports, imports inside functions
and under `if TYPE_CHECKING:`, and `importlib.import_module("dedup._x")` with a
literal name. `from dedup import Name` for a public name is an
import of the package itself (`dedup/__init__.py`), the top of the layers.
Importing `dedup._x` also runs `dedup/__init__.py` first; that implicit import
of a parent package is not counted, or every module would sit in a cycle.

docs/architecture.md holds two things this file checks against those imports:

- under `## Layers`, a table `| Layer | Modules | Owns |`: `Layer` a number (1
  is the bottom), `Modules` backticked names relative to dedup/, comma-separated
  (`_store`, `consumer._worker`, `consumer` for `dedup/consumer/__init__.py`),
  `Owns` a few words. Every module appears exactly once, and every import goes
  to a module of the same layer or a lower one. The package itself
  (`__init__`) may be left out (it is above every layer) or listed in the
  highest layer.
- under `## One message, from fetch to COMMIT`, a numbered list whose items each
  start with a backticked module name: at most six modules, each pair of
  consecutive ones linked by an import, one way or the other.

`python -m tests.unit.test_layers` prints the import graph, the layer each
module would need and a draft of the table.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "dedup"
LIBRARY = ROOT / PACKAGE
PAGE = ROOT / "docs" / "architecture.md"
LAYERS_HEADING = "## Layers"
PATH_HEADING = "## One message, from fetch to COMMIT"
# Issue 27: a newcomer follows one message from fetch to COMMIT through at most
# six modules.
MOST_MODULES_ON_THE_PATH = 6
T = TypeVar("T")
_TABLE_HINT = (
    f"a table `| Layer | Modules | Owns |` under `{LAYERS_HEADING}` "
    "(`python -m tests.unit.test_layers` prints the layer each module needs)"
)
_PATH_HINT = (
    f"a numbered list under `{PATH_HEADING}`, one item per step, each starting with "
    "the backticked module it happens in, like 1. `_consumer` fetches ..."
)


@dataclass(frozen=True)
class Import:
    """One import of a dedup module by another, where it is written."""

    source: str
    target: str
    path: Path
    line: int
    where: str  # "" at module level, "in a function" or "under TYPE_CHECKING"

    def __str__(self) -> str:
        try:
            shown = self.path.relative_to(ROOT)
        except ValueError:
            shown = self.path
        where = f" ({self.where})" if self.where else ""
        return f"{shown}:{self.line} imports {self.target}{where}"


# Every module of the package, by dotted name, with the imports it makes
# (the first of each target, in line order).
Graph = dict[str, dict[str, Import]]


@dataclass(frozen=True)
class Layer:
    """One row of the page's layer table, the module names as the page writes them."""

    number: int
    modules: tuple[str, ...]
    owns: str


class PageError(Exception):
    """The page lacks a section this file checks, or writes it in another shape."""


# -- the imports --------------------------------------------------------------


def modules(package_dir: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Every module under `package_dir`, by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = path.relative_to(package_dir).with_suffix("").parts
        if "__pycache__" in parts:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((package, *parts))] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_by_name(node: ast.Call) -> str | None:
    """The module a call like `importlib.import_module("dedup._x")` imports, by its literal name."""
    if not node.args:
        return None
    func, first = node.func, node.args[0]
    called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    if called in ("import_module", "__import__") and isinstance(first, ast.Constant):
        return first.value if isinstance(first.value, str) else None
    return None


def _statements(tree: ast.AST, where: str = "") -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement in `tree`, with where it sits."""
    found: list[tuple[ast.Import | ast.ImportFrom, str]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append((node, where))
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                found.extend(_statements(ast.Module([child], []), "under TYPE_CHECKING"))
            for child in node.orelse:
                found.extend(_statements(ast.Module([child], []), where))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            found.extend(_statements(node, where or "in a function"))
        elif isinstance(node, ast.Call) and (name := _imported_by_name(node)) is not None:
            # importlib.import_module("dedup._x") hides a cycle as well as an import does.
            found.append((ast.Import([ast.alias(name)], lineno=node.lineno), where))
            found.extend(_statements(node, where))
        else:
            found.extend(_statements(node, where))
    return found


def _ours(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _targets(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str], package: str
) -> list[str]:
    """The dedup modules one import statement binds names from."""

    def owning(name: str) -> str:
        # `from dedup._x import y`: y is an attribute of the longest module prefix.
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    if isinstance(node, ast.Import):
        return [owning(alias.name) for alias in node.names if _ours(alias.name, package)]
    if node.level:
        base = module if is_package else module.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
            base = base.rsplit(".", 1)[0]
        base = f"{base}.{node.module}" if node.module else base
    else:
        base = node.module or ""
    if not _ours(base, package):
        return []
    found = []
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        found.append(submodule if submodule in known else owning(base))
    return found


def collect(package_dir: Path = LIBRARY, package: str = PACKAGE) -> Graph:
    """The import graph of the package under `package_dir`: every module, each with its imports."""
    paths = modules(package_dir, package)
    known = set(paths)
    graph: Graph = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        imports: dict[str, Import] = {}
        statements = sorted(_statements(tree), key=lambda found: found[0].lineno)
        for node, where in statements:
            for target in _targets(node, module, path.name == "__init__.py", known, package):
                if target != module and target not in imports:
                    imports[target] = Import(module, target, path, node.lineno, where)
        graph[module] = imports
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The shortest cycle through each tangle of modules that import one another, shortest first.

    A cycle is written from its first module by name back to that module.
    """

    def shortest_back(start: str) -> list[str] | None:
        came_from: dict[str, str] = {}
        queue = deque([start])
        while queue:
            here = queue.popleft()
            for there in sorted(graph.get(here, {})):
                if there == start:
                    path = [here]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if there not in came_from and there in graph:
                    came_from[there] = here
                    queue.append(there)
        return None

    best: dict[frozenset[str], list[str]] = {}
    for start in sorted(graph):
        cycle = shortest_back(start)
        if cycle is None:
            continue
        tangle = _tangle(graph, start)
        if tangle not in best or len(cycle) < len(best[tangle]):
            best[tangle] = cycle
    return sorted(best.values(), key=lambda cycle: (len(cycle), cycle))


def _reachable(graph: Graph, start: str) -> set[str]:
    seen = {start}
    queue = deque([start])
    while queue:
        for there in graph.get(queue.popleft(), {}):
            if there not in seen:
                seen.add(there)
                queue.append(there)
    return seen


def _tangle(graph: Graph, module: str) -> frozenset[str]:
    """The modules that `module` reaches and that reach it back (itself included)."""
    return frozenset(m for m in _reachable(graph, module) if module in _reachable(graph, m))


def describe_cycle(graph: Graph, cycle: list[str]) -> str:
    """A cycle on one line, the import behind each of its steps, and the rest of its tangle."""
    steps = [f"      {graph[a][b]}" for a, b in itertools.pairwise(cycle)]
    rest = sorted(_tangle(graph, cycle[0]) - set(cycle))
    tangle = [f"    also in this tangle: {', '.join(rest)}"] if rest else []
    return "\n".join([" -> ".join(cycle), *steps, *tangle])


def needed_layers(graph: Graph) -> dict[str, int]:
    """The lowest layer each module can sit in with every import going strictly down.

    A module that imports no other is 1; modules of one cycle share a layer.
    """
    tangles = {module: _tangle(graph, module) for module in graph}
    needed: dict[frozenset[str], int] = {}

    def layer(tangle: frozenset[str]) -> int:
        if tangle not in needed:
            below = {tangles[t] for m in tangle for t in graph[m] if t in graph and t not in tangle}
            needed[tangle] = 1 + max((layer(b) for b in below), default=0)
        return needed[tangle]

    return {module: layer(tangles[module]) for module in graph}


# -- the page -----------------------------------------------------------------


def section(text: str, heading: str) -> list[str]:
    """The lines under `heading`, up to the next heading of its level or above (not in code)."""
    lines: list[str] | None = None
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,2} ", line):
            if lines is not None:
                return lines
            if line.rstrip() == heading:
                lines = []
                continue
        if lines is not None:
            lines.append(line)
    if lines is None:
        raise PageError(f"docs/architecture.md has no `{heading}` section")
    return lines


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def layer_table(text: str) -> list[Layer]:
    """The rows of the table under `## Layers`."""
    try:
        lines = section(text, LAYERS_HEADING)
    except PageError as error:
        raise PageError(f"{error}: add {_TABLE_HINT}") from None
    rows = [line for line in lines if line.lstrip().startswith("|")]
    if len(rows) < 3:
        raise PageError(
            f"docs/architecture.md's `{LAYERS_HEADING}` section has no table: add {_TABLE_HINT}"
        )
    header = [cell.lower() for cell in _cells(rows[0])]
    missing = [name for name in ("layer", "modules", "owns") if name not in header]
    if missing:
        raise PageError(
            f"the layer table has no column {', '.join(missing)}: it needs {_TABLE_HINT}"
        )
    at = {name: header.index(name) for name in ("layer", "modules", "owns")}
    layers = []
    for row in rows[2:]:
        cells = _cells(row)
        if len(cells) != len(header):
            raise PageError(
                f"the layer table's row {row!r} has {len(cells)} cells, not {len(header)}"
            )
        number, listed, owns = cells[at["layer"]], cells[at["modules"]], cells[at["owns"]]
        if not re.fullmatch(r"[1-9][0-9]*", number):
            raise PageError(
                f"the layer table's row {row!r}: Layer is {number!r}, not a number from 1"
            )
        if not re.fullmatch(r"`[^`]+`(\s*,\s*`[^`]+`)*", listed):
            raise PageError(
                f"the layer table's row {row!r}: Modules is {listed!r}, not backticked names "
                "separated by commas, like `_store`, `_sql`"
            )
        if not re.search(r"[A-Za-z]", owns):
            raise PageError(f"the layer table's row {row!r}: Owns says nothing")
        layers.append(Layer(int(number), tuple(re.findall(r"`([^`]+)`", listed)), owns))
    numbers = sorted(layer.number for layer in layers)
    if numbers != list(range(1, len(layers) + 1)):
        raise PageError(
            f"the layer table numbers its rows {numbers}, not 1 to {len(layers)}, once each"
        )
    return layers


def dotted(name: str, package: str = PACKAGE) -> str:
    """A module as the page writes it (`_store`, `part._worker`, `__init__`), as Python names it."""
    name = name.removesuffix("__init__").rstrip(".")
    return f"{package}.{name}" if name else package


def table_problems(layers: list[Layer], graph: Graph, package: str = PACKAGE) -> list[str]:
    """What the table gets wrong about which modules there are."""
    problems = []
    placed: dict[str, list[int]] = {}
    for layer in layers:
        for name in layer.modules:
            module = dotted(name, package)
            if module not in graph:
                problems.append(f"layer {layer.number} lists `{name}`: there is no {module}")
            placed.setdefault(module, []).append(layer.number)
    for module in sorted(graph):
        where = placed.get(module, [])
        if module == package and where and where != [max(lay.number for lay in layers)]:
            problems.append(
                f"{module} (the package) is listed in layer {', '.join(map(str, where))}: "
                "it is the top, so the highest layer or none"
            )
        elif len(where) > 1:
            problems.append(f"{module} is listed {len(where)} times, in layers {where}")
        elif not where and module != package:
            problems.append(f"{module} is in no layer")
    return problems


def upward_imports(layers: list[Layer], graph: Graph, package: str = PACKAGE) -> list[str]:
    """Every import that goes from a module to one of a higher layer."""
    top = max((layer.number for layer in layers), default=0) + 1
    layer_of = {package: top}
    for layer in layers:
        layer_of.update((dotted(name, package), layer.number) for name in layer.modules)
    problems = []
    for module in sorted(graph):
        for target, found in sorted(graph[module].items()):
            source_layer, target_layer = layer_of.get(module), layer_of.get(target)
            if source_layer is None or target_layer is None:
                continue  # table_problems names what is not in the table
            if target_layer > source_layer:
                above = ", the package, above every layer" if target == package else ""
                problems.append(
                    f"{module} (layer {source_layer}) imports {target} "
                    f"(layer {target_layer}{above}): {found}"
                )
    return problems


def message_path(text: str) -> list[str]:
    """The module each item of the numbered list under `PATH_HEADING` starts with, in order."""
    try:
        lines = section(text, PATH_HEADING)
    except PageError as error:
        raise PageError(f"{error}: add {_PATH_HINT}") from None
    items = [line for line in lines if re.match(r"[0-9]+\.\s", line)]
    if not items:
        raise PageError(
            f"docs/architecture.md's `{PATH_HEADING}` section has no numbered list: "
            f"add {_PATH_HINT}"
        )
    path = []
    for item in items:
        start = re.match(r"[0-9]+\.\s+`([^`]+)`", item)
        if start is None:
            raise PageError(
                f"the step {item.strip()!r} does not start with a backticked module name"
            )
        path.append(start.group(1))
    return path


def path_problems(path: list[str], graph: Graph, package: str = PACKAGE) -> list[str]:
    """What is wrong with the page's path of one message through the modules."""
    problems = [
        f"the step in `{name}`: there is no {dotted(name, package)}"
        for name in path
        if dotted(name, package) not in graph
    ]
    distinct = list(dict.fromkeys(path))
    if len(distinct) > MOST_MODULES_ON_THE_PATH:
        problems.append(
            f"the path goes through {len(distinct)} modules, more than {MOST_MODULES_ON_THE_PATH}: "
            + ", ".join(distinct)
        )
    for a, b in itertools.pairwise(path):
        here, there = dotted(a, package), dotted(b, package)
        if here in graph and there in graph and here != there:
            if there not in graph[here] and here not in graph[there]:
                problems.append(f"`{a}` then `{b}`: neither imports the other")
    return problems


# -- the library and its page ---------------------------------------------------


def _page(read: Callable[[str], T]) -> T:
    try:
        return read(PAGE.read_text(encoding="utf-8"))
    except PageError as error:
        problem = str(error)
    pytest.fail(problem, pytrace=False)


def test_no_import_cycle_in_the_library() -> None:
    graph = collect()
    found = cycles(graph)
    assert not found, (
        "import cycles in dedup/ (imports in functions and under TYPE_CHECKING count); "
        "the shortest through each tangle of modules:\n"
        + "\n".join(describe_cycle(graph, cycle) for cycle in found)
    )


def test_the_layer_table_lists_every_module_once() -> None:
    graph = collect()
    layers = _page(layer_table)
    problems = table_problems(layers, graph)
    assert not problems, "docs/architecture.md's layer table:\n" + "\n".join(problems)


def test_every_import_goes_to_the_same_layer_or_a_lower_one() -> None:
    graph = collect()
    layers = _page(layer_table)
    problems = upward_imports(layers, graph)
    assert not problems, "imports that climb the layers of docs/architecture.md:\n" + "\n".join(
        problems
    )


def test_one_message_goes_from_fetch_to_commit_through_six_modules_at_most() -> None:
    graph = collect()
    path = _page(message_path)
    problems = path_problems(path, graph)
    assert not problems, f"docs/architecture.md's `{PATH_HEADING}`:\n" + "\n".join(problems)


# -- the checks themselves, on a package and a page of their own ---------------


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / PACKAGE


def test_every_kind_of_import_of_the_package_is_seen(tmp_path: Path) -> None:
    library = _package(
        tmp_path,
        {
            "__init__.py": "from dedup._a import A\nfrom dedup import keys\n",
            "keys.py": "",
            "_a.py": (
                "from typing import TYPE_CHECKING\n"
                "import os\n"
                "from dedup import _b as b\n"
                "import dedup._c\n"
                "from . import _d\n"
                "from dedup import Public\n"
                "def late():\n"
                "    from dedup._e import E\n"
                "    return importlib.import_module('dedup.part._h'), import_module(name)\n"
                "if TYPE_CHECKING:\n"
                "    from dedup import _f\n"
                "else:\n"
                "    from dedup import keys\n"
            ),
            **{f"_{name}.py": "" for name in "bcdef"},
            "part/__init__.py": "from . import _g\nfrom .. import _b\n",
            "part/_g.py": "from .._c import C\nfrom dedup.part import _h as h\n",
            "part/_h.py": "import dedup.part\n",
        },
    )
    graph = collect(library)
    assert {m: sorted(graph[m]) for m in graph} == {
        "dedup": ["dedup._a", "dedup.keys"],
        "dedup._a": [
            "dedup",
            "dedup._b",
            "dedup._c",
            "dedup._d",
            "dedup._e",
            "dedup._f",
            "dedup.keys",
            "dedup.part._h",
        ],
        **{f"dedup._{name}": [] for name in "bcdef"},
        "dedup.keys": [],
        "dedup.part": ["dedup._b", "dedup.part._g"],
        "dedup.part._g": ["dedup._c", "dedup.part._h"],
        "dedup.part._h": ["dedup.part"],
    }
    where = {target: found.where for target, found in graph["dedup._a"].items()}
    assert where["dedup._e"] == where["dedup.part._h"] == "in a function"
    assert where["dedup._f"] == "under TYPE_CHECKING"
    assert where["dedup.keys"] == ""  # the else of `if TYPE_CHECKING:` runs
    assert str(graph["dedup._a"]["dedup._f"]).endswith(
        "_a.py:11 imports dedup._f (under TYPE_CHECKING)"
    )


def test_a_cycle_is_named_by_its_shortest_loop_with_the_imports_behind_it(
    tmp_path: Path,
) -> None:
    library = _package(
        tmp_path,
        {
            "__init__.py": "",
            "_a.py": "from dedup import _c\nfrom dedup import _b\n",
            "_b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import dedup._a\n",
            "_c.py": "from dedup import _d\n",
            "_d.py": "def late():\n    from dedup._a import A\n",
            "_e.py": "from dedup import _f\n",
            "_f.py": "from dedup import _g\n",
            "_g.py": "from dedup import _e, _h\n",
            "_h.py": "",
        },
    )
    graph = collect(library)
    found = cycles(graph)
    assert found == [
        ["dedup._a", "dedup._b", "dedup._a"],
        ["dedup._e", "dedup._f", "dedup._g", "dedup._e"],
    ]
    assert describe_cycle(graph, found[0]).splitlines() == [
        "dedup._a -> dedup._b -> dedup._a",
        f"      {library / '_a.py'}:2 imports dedup._b",
        f"      {library / '_b.py'}:3 imports dedup._a (under TYPE_CHECKING)",
        "    also in this tangle: dedup._c, dedup._d",
    ]
    needed = needed_layers(graph)
    assert needed["dedup._h"] == 1
    assert needed["dedup._e"] == needed["dedup._f"] == needed["dedup._g"] == 2
    assert needed["dedup._a"] == needed["dedup._d"] == 1
    assert cycles(collect(_package(tmp_path / "acyclic", {"__init__.py": "", "_h.py": ""}))) == []


_PAGE = """\
# Architecture

## Layers

| Layer | Modules | Owns |
| --- | --- | --- |
| 3 | `_consumer` | the loop |
| 2 | `_store`, `part._g` | a batch's statements |
| 1 | `_sql`, `_nowhere` | every statement |

### Not the end of the section

```text
## not a heading
```

## One message, from fetch to COMMIT

1. `_consumer` fetches.
   - in detail
2. `_store` claims the keys,
   over two lines.
3. `_sql` runs them.
4. `_consumer` tells Kafka.

## Afterwards
"""


def _graph(imports: dict[str, list[str]]) -> Graph:
    return {
        module: {t: Import(module, t, Path(f"{module}.py"), 1, "") for t in targets}
        for module, targets in imports.items()
    }


def test_the_layer_table_is_read_and_checked_against_the_imports() -> None:
    layers = layer_table(_PAGE)
    assert [(layer.number, layer.modules) for layer in layers] == [
        (3, ("_consumer",)),
        (2, ("_store", "part._g")),
        (1, ("_sql", "_nowhere")),
    ]
    graph = _graph(
        {
            "dedup": ["dedup._consumer"],
            "dedup._consumer": ["dedup._store"],
            "dedup._store": ["dedup._consumer", "dedup"],
            "dedup._sql": [],
            "dedup._lost": [],
            "dedup.part._g": ["dedup._sql"],
        }
    )
    assert table_problems(layers, graph) == [
        "layer 1 lists `_nowhere`: there is no dedup._nowhere",
        "dedup._lost is in no layer",
    ]
    assert upward_imports(layers, graph) == [
        "dedup._store (layer 2) imports dedup (layer 4, the package, above every layer): "
        "dedup._store.py:1 imports dedup",
        "dedup._store (layer 2) imports dedup._consumer (layer 3): "
        "dedup._store.py:1 imports dedup._consumer",
    ]
    twice = [*layers, Layer(4, ("_sql", "__init__"), "all of it")]
    assert table_problems(twice, graph) == [
        "layer 1 lists `_nowhere`: there is no dedup._nowhere",
        "dedup._lost is in no layer",
        "dedup._sql is listed 2 times, in layers [1, 4]",
    ]
    low = [*layers[:2], Layer(1, ("_sql", "__init__"), "SQL"), Layer(4, ("_lost",), "lost")]
    assert table_problems(low, graph) == [
        "dedup (the package) is listed in layer 1: it is the top, so the highest layer or none"
    ]


@pytest.mark.parametrize(
    ("page", "error"),
    [
        ("# Architecture\n", "has no `## Layers` section: add a table"),
        ("## Layers\n\nProse only.\n", "`## Layers` section has no table"),
        (
            "## Layers\n| Layer | Modules |\n| - | - |\n| 1 | `_sql` |\n",
            "the layer table has no column owns",
        ),
        (
            "## Layers\n| Layer | Modules | Owns |\n|-|-|-|\n| one | `_sql` | SQL |\n",
            "not a number",
        ),
        ("## Layers\n| Layer | Modules | Owns |\n|-|-|-|\n| 1 | _sql | SQL |\n", "backticked"),
        ("## Layers\n| Layer | Modules | Owns |\n|-|-|-|\n| 2 | `_sql` | SQL |\n", "not 1 to 1"),
    ],
)
def test_a_layer_table_of_another_shape_is_refused(page: str, error: str) -> None:
    with pytest.raises(PageError, match=re.escape(error)):
        layer_table(page)


def test_the_path_of_one_message_is_read_and_checked_against_the_imports() -> None:
    path = message_path(_PAGE)
    assert path == ["_consumer", "_store", "_sql", "_consumer"]
    graph = _graph(
        {
            "dedup._consumer": ["dedup._store"],
            "dedup._store": ["dedup._sql"],
            "dedup._sql": [],
        }
    )
    assert path_problems(path, graph) == ["`_sql` then `_consumer`: neither imports the other"]
    graph["dedup._consumer"]["dedup._sql"] = Import("dedup._consumer", "dedup._sql", Path(), 1, "")
    assert path_problems(path, graph) == []
    long = [f"_m{n}" for n in range(MOST_MODULES_ON_THE_PATH + 1)]
    chain = _graph({f"dedup.{a}": [f"dedup.{b}"] for a, b in itertools.pairwise(long)})
    chain[f"dedup.{long[-1]}"] = {}
    assert path_problems(long, chain) == [
        f"the path goes through 7 modules, more than 6: {', '.join(long)}"
    ]
    assert path_problems(["_consumer", "_gone"], graph) == [
        "the step in `_gone`: there is no dedup._gone"
    ]
    with pytest.raises(PageError, match="does not start with a backticked module name"):
        message_path("## One message, from fetch to COMMIT\n\n1. **Fetch.** `_consumer`\n")
    with pytest.raises(PageError, match="has no `## One message, from fetch to COMMIT` section"):
        message_path(_PAGE.replace("fetch to COMMIT", "poll to commit"))


# -- python -m tests.unit.test_layers -------------------------------------------


def _relative(module: str) -> str:
    """A module as the table names it (the package as `__init__`)."""
    return module.removeprefix(PACKAGE + ".") if module != PACKAGE else "__init__"


def main() -> None:
    """Print each module's imports and the layer it needs, then a draft of the page's table."""
    graph = collect()
    needed = needed_layers(graph)
    found = cycles(graph)
    in_cycle = {module for cycle in found for module in _tangle(graph, cycle[0])}
    print("Each module, the lowest layer it can have with every import going strictly down,")
    print("and what it imports (* in a function, ! under TYPE_CHECKING, @ in an import cycle):\n")
    marks = {"": "", "in a function": "*", "under TYPE_CHECKING": "!"}
    width = max(len(module) for module in graph)
    for module in sorted(graph, key=lambda m: (needed[m], m)):
        imports = " ".join(
            (target if target == PACKAGE else _relative(target)) + marks[found_at.where]
            for target, found_at in sorted(graph[module].items())
        )
        cycle_mark = "@" if module in in_cycle else " "
        print(f"{needed[module]:>3} {cycle_mark} {module:<{width}}  {imports or '-'}")
    if found:
        print(
            "\nImport cycles (the shortest through each tangle; the test fails until none is left):"
        )
        for cycle in found:
            print(describe_cycle(graph, cycle))
    to_the_top = sorted(
        str(found)
        for module in graph
        for target, found in graph[module].items()
        if target == PACKAGE
    )
    if to_the_top:
        print("\nImports of the package itself (the top; the layer check refuses them):")
        print(*(f"      {found}" for found in to_the_top), sep="\n")
    print("\nA draft of the table (merge layers as you like; an import may stay in its layer):\n")
    print(LAYERS_HEADING, "", "| Layer | Modules | Owns |", "| --- | --- | --- |", sep="\n")
    # The package is the top and stays out of the table; the rows are numbered 1 to N.
    rows = sorted({needed[m] for m in graph if m != PACKAGE})
    for number, need in reversed(list(enumerate(rows, 1))):
        names = [_relative(m) for m in sorted(graph) if needed[m] == need and m != PACKAGE]
        print(f"| {number} | {', '.join(f'`{name}`' for name in names)} | ... |")


if __name__ == "__main__":
    main()
