"""Import layers: a module of relayrl imports only from its own layer or lower ones, and the import
graph between modules has no cycle.

Every import counts, at module level or inside a function, except those under
``if TYPE_CHECKING:`` (they never run). A module's layer is that of its first name under
``relayrl`` (``relayrl.executors.trainer`` is ``executors``); the package's own ``__init__`` is
below every layer. docs/architecture.md lists the layers.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import relayrl

LAYERS: tuple[tuple[str, ...], ...] = (
    ("types", "faults", "parallel", "devices"),
    (
        "algorithms",
        "models",
        "engines",
        "envs",
        "data",
        "rewards",
        "weight_sync",
        "observability",
        "channels",
    ),
    ("config",),  # validates against the registries of the layer below
    ("executors", "checkpoint_format"),
    ("roles", "launch", "recovery", "checkpoint"),  # roles, weight sync, replacement, checkpointer
    ("workloads",),
    ("controller",),
    ("job", "pipeline", "evaluate", "evaluate_embodied", "preflight", "wm"),
    ("cli",),
)
SOURCE = Path(relayrl.__file__).parent
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``line``."""

    source: str
    target: str
    line: int


def modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package at ``root``, by dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements under ``node`` at any depth, leaving out ``if TYPE_CHECKING:``
    bodies (their ``else`` runs, so it counts)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [node]
    if isinstance(node, ast.If) and _type_checking(node.test):
        children: list[ast.AST] = list(node.orelse)
    else:
        children = list(ast.iter_child_nodes(node))
    return [found for child in children for found in _imports(child)]


def edges(found: dict[str, Path], package: str) -> list[Edge]:
    """Every import between two modules of ``found``, resolved to the module it loads: ``from
    a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b``."""

    def resolve(name: str) -> str:
        while name not in found:
            name = name.rpartition(".")[0]
        return name

    out = []
    for source, path in found.items():
        here = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                if target == package or target.startswith(package + "."):
                    out.append(Edge(source, resolve(target), node.lineno))
    return out


def layer(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> int | None:
    """1 + the index of the module's layer in ``layers``; 0 for the package itself; None when
    no layer lists it."""
    parts = module.split(".")
    if len(parts) == 1:
        return 0
    return next((i + 1 for i, names in enumerate(layers) if parts[1] in names), None)


def upward(graph: list[Edge], layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """One line per import of a module of a higher layer than the importer's."""
    return [
        f"{e.source} (layer {layer(e.source, layers)}) line {e.line} imports {e.target} "
        f"(layer {layer(e.target, layers)})"
        for e in graph
        if (layer(e.target, layers) or 0) > (layer(e.source, layers) or 0)
    ]


def cycles(graph: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing
    itself), each sorted (Tarjan's algorithm, iterative)."""
    after: dict[str, set[str]] = {}
    for e in graph:
        after.setdefault(e.source, set()).add(e.target)
        after.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(after):
        if start in index:
            continue
        work = [(start, iter(sorted(after[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, rest = work[-1]
            step = next(rest, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(after[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in after[node]:
                    found.append(sorted(component))
    return sorted(found)


def test_every_module_of_relayrl_has_a_layer():
    unlisted = [name for name in modules(SOURCE, "relayrl") if layer(name) is None]
    assert unlisted == [], f"add these to a layer in LAYERS and docs/architecture.md: {unlisted}"


def test_docs_architecture_lists_these_layers():
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    items = re.split(r"^\d+\. ", section, flags=re.MULTILINE)[1:]
    listed = tuple(tuple(re.findall(r"`([a-z_]+)`", item)) for item in items)
    assert listed == LAYERS


def test_no_module_imports_from_a_higher_layer():
    found = upward(edges(modules(SOURCE, "relayrl"), "relayrl"))
    assert not found, "imports of a higher layer:\n" + "\n".join(found)


def test_the_import_graph_has_no_cycle():
    found = cycles(edges(modules(SOURCE, "relayrl"), "relayrl"))
    assert not found, "modules that import each other:\n" + "\n".join(map(" <-> ".join, found))


def test_the_checks_find_a_planted_upward_import_and_cycle_and_skip_type_checking(tmp_path):
    root = tmp_path / "pkg"
    (root / "low").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "low/__init__.py": "from .a import x\n",
        # an upward import inside a function counts; one only for annotations does not
        "low/a.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from pkg.high import Thing\n"
            "else:\n"
            "    import os\n"
            "x = 1\n"
            "def f():\n"
            "    from pkg import high\n"
        ),
        "low/b.py": "from . import c\n",
        "low/c.py": "def g():\n    import pkg.low.b\n",
        "high.py": "from pkg.low import a\nfrom pkg.low.a import x\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    layers = (("low",), ("high",))
    graph = edges(modules(root, "pkg"), "pkg")
    assert sorted((e.source, e.target) for e in graph) == [
        ("pkg.high", "pkg.low.a"),
        ("pkg.high", "pkg.low.a"),
        ("pkg.low", "pkg.low.a"),
        ("pkg.low.a", "pkg.high"),
        ("pkg.low.b", "pkg.low.c"),
        ("pkg.low.c", "pkg.low.b"),
    ]
    assert upward(graph, layers) == ["pkg.low.a (layer 1) line 8 imports pkg.high (layer 2)"]
    assert cycles(graph) == [["pkg.high", "pkg.low.a"], ["pkg.low.b", "pkg.low.c"]]
    assert layer("pkg.other.x", layers) is None and layer("pkg", layers) == 0
