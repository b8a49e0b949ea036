"""The tests themselves: every test function checks something, and no test module imports another.

A test checks something when its body (nested functions included) holds an ``assert``, a
``pytest.raises``, ``pytest.warns`` or ``pytest.fail``, a call of an ``assert_*`` function
(``torch.testing.assert_close``, ``numpy.testing.assert_allclose``), or a call of a helper that
does: a function of its own module, of a ``conftest.py`` or of a helper module (a module of
tests/ whose name does not start with ``test_``) that holds one of those, or calls such a helper
in turn. A measurement with nothing to assert belongs in benchmarks/.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CHECKS = {"raises", "warns", "fail"}  # of pytest


def parsed(path: Path) -> ast.Module:
    """The syntax tree of a file under tests/."""
    return ast.parse(path.read_text(), filename=str(path))


def called_name(node: ast.Call) -> str | None:
    """The last name of what a call calls: ``f`` for ``f(...)`` and ``m.f(...)``."""
    if isinstance(node.func, ast.Name):
        return node.func.id
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def checks_directly(node: ast.AST) -> bool:
    """Whether a function body holds an assert or a pytest check."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Assert):
            return True
        if isinstance(inner, ast.Call) and (called_name(inner) or "").startswith("assert"):
            return True  # torch.testing.assert_close, numpy.testing.assert_allclose, ...
        if (
            isinstance(inner, ast.Call)
            and isinstance(inner.func, ast.Attribute)
            and inner.func.attr in CHECKS
            and isinstance(inner.func.value, ast.Name)
            and inner.func.value.id == "pytest"
        ):
            return True
    return False


def calls(node: ast.AST) -> set[str]:
    """The names a function body calls."""
    return {called_name(n) for n in ast.walk(node) if isinstance(n, ast.Call)} - {None}


def top_functions(tree: ast.Module) -> dict[str, ast.AST]:
    """The functions a module defines at its top level and in its classes, by name."""
    found: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for inner in node.body:
                if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
                    found[inner.name] = inner
    return found


def checkers(functions: dict[str, ast.AST], known: set[str]) -> set[str]:
    """The names of ``functions`` that check something, given helpers ``known`` to (a fixpoint:
    a function that calls a checker is one)."""
    found = set(known)
    while True:
        more = {
            name
            for name, node in functions.items()
            if name not in found and (checks_directly(node) or calls(node) & found)
        }
        if not more:
            return found
        found |= more


def modules_of_tests() -> list[Path]:
    """Every test module under tests/."""
    return sorted(TESTS.rglob("test_*.py"))


def shared_checkers() -> set[str]:
    """The helpers of every conftest.py and helper module that check something."""
    helpers: dict[str, ast.AST] = {}
    for path in sorted(TESTS.rglob("*.py")):
        if not path.name.startswith("test_"):
            helpers |= top_functions(parsed(path))
    return checkers(helpers, set())


def unchecked_tests() -> list[str]:
    """``path::name`` of each test function that checks nothing."""
    shared = shared_checkers()
    found = []
    for path in modules_of_tests():
        functions = top_functions(parsed(path))
        known = checkers({k: v for k, v in functions.items() if not k.startswith("test")}, shared)
        for name, node in functions.items():
            if name.startswith("test") and not (checks_directly(node) or calls(node) & known):
                found.append(f"{path.relative_to(TESTS)}::{name}")
    return found


def imported_modules(tree: ast.Module) -> set[str]:
    """The last part of every module a file imports (``test_x`` for ``from tests.test_x ...``,
    ``from .test_x ...`` and ``import test_x``), wherever the import statement is."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.rpartition(".")[2] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.module:
                names.add(node.module.rpartition(".")[2])
            else:  # from . import test_x
                names |= {alias.name for alias in node.names}
    return names


def test_every_test_function_checks_something():
    assert unchecked_tests() == []


def test_no_test_module_imports_another():
    test_names = {path.stem for path in modules_of_tests()}
    offenders = {
        str(path.relative_to(TESTS)): sorted(imported_modules(parsed(path)) & test_names)
        for path in sorted(TESTS.rglob("*.py"))
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_checks_catch_what_they_look_for(tmp_path):
    source = (
        "import pytest\n"
        "from conftest import check_books\n"
        "import test_other\n"
        "def helper(x):\n    assert x\n"
        "def indirect(x):\n    helper(x)\n"
        "def test_asserts():\n    assert 1\n"
        "def test_raises():\n    with pytest.raises(ValueError):\n        int('x')\n"
        "def test_helper():\n    indirect(1)\n"
        "def test_conftest():\n    check_books({})\n"
        "def test_nothing():\n    print(1)\n"
    )
    tree = ast.parse(source)
    functions = top_functions(tree)
    known = checkers(
        {k: v for k, v in functions.items() if not k.startswith("test")}, {"check_books"}
    )
    checked = {
        name
        for name, node in functions.items()
        if name.startswith("test") and (checks_directly(node) or calls(node) & known)
    }
    assert checked == {"test_asserts", "test_raises", "test_helper", "test_conftest"}
    assert {"conftest", "test_other", "pytest"} <= imported_modules(tree)
    assert "check_books" in shared_checkers()
