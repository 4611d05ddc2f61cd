"""Guardrails on the code itself: lint, format, types, layering, no import cycles, exports, size.

These run in the test command (and so in CI) so that the layout stays as docs/architecture.md
describes it. Each check names the offending module and what to do about it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The packages of the distribution, lowest layer first.
PACKAGES = ("transport", "supervision", "mesh", "job", "recovery", "chaos", "observe", "meshvisor")
#: Modules whose `__all__` is public API.
PUBLIC_MODULES = (
    *("transport", "supervision", "mesh", "mesh.testing", "job", "job.testing", "job.formats"),
    *("recovery", "chaos", "observe"),
)
MAX_MODULE_LINES = 400
MAX_CLASS_METHODS = 25
#: A module longer than MAX_MODULE_LINES says why in its docstring, starting with this.
LONG_MODULE_REASON = "Long because"


def _tool(name: str) -> str:
    """The command-line tool `name` of this interpreter's environment."""
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; install the test extras: pip install -e '.[test]'")
    return found


def _run(*command: str) -> None:
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"`{' '.join(command)}` failed:\n{done.stdout}{done.stderr}"


@pytest.mark.timeout(300)
def test_ruff_lint_is_clean() -> None:
    _run(_tool("ruff"), "check", ".")


@pytest.mark.timeout(300)
def test_ruff_format_is_clean() -> None:
    _run(_tool("ruff"), "format", "--check", ".")


@pytest.mark.timeout(600)
def test_mypy_strict_is_clean() -> None:
    _run(sys.executable, "-m", "mypy")


@pytest.mark.timeout(300)
def test_import_layering_contracts_hold() -> None:
    _run(_tool("lint-imports"), "--no-cache")


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected sets of more than one module (import cycles), by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles_counting_type_checking_imports() -> None:
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False)
    cycles = _cycles(graph)
    assert not cycles, "import cycles (break each with a Protocol or a callable passed in):\n" + (
        "\n".join(" <-> ".join(cycle) for cycle in cycles)
    )


def _public_names(module_name: str) -> tuple[str, ...]:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    assert isinstance(names, tuple), f"{module_name} must list its public names in __all__"
    return names


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_name_is_exported_importable_and_documented(module_name: str) -> None:
    module = importlib.import_module(module_name)
    exported = _public_names(module_name)
    assert len(set(exported)) == len(exported), f"{module_name}.__all__ lists a name twice"
    for name in exported:
        value = getattr(module, name)  # importable
        if inspect.isclass(value) or inspect.isfunction(value):
            assert inspect.getdoc(value), f"{module_name}.{name} has no docstring"
    undeclared = [
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and (getattr(value, "__module__", "") or "").split(".")[0] in PACKAGES
        and name not in exported
    ]
    assert not undeclared, f"{module_name} has public names missing from __all__: {undeclared}"


def _modules() -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def test_modules_are_short_or_say_why() -> None:
    long = []
    for path in _modules():
        text = path.read_text()
        lines = text.count("\n")
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if lines > MAX_MODULE_LINES and LONG_MODULE_REASON not in docstring:
            long.append(f"{path.relative_to(ROOT)} ({lines} lines)")
    assert not long, (
        f"modules over {MAX_MODULE_LINES} lines: split them, or say why in the module docstring "
        f"({LONG_MODULE_REASON!r} ...): " + ", ".join(long)
    )


def test_classes_have_at_most_25_methods() -> None:
    large = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = [
                    item
                    for item in node.body
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                ]
                if len(methods) > MAX_CLASS_METHODS:
                    large.append(f"{path.relative_to(ROOT)}:{node.name} ({len(methods)})")
    assert not large, f"classes over {MAX_CLASS_METHODS} methods: " + ", ".join(large)


def _calls_at_import(tree: ast.AST) -> Iterator[ast.Call]:
    """The calls a module makes when imported: not those inside functions and lambdas."""
    for child in ast.iter_child_nodes(tree):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            if isinstance(child, ast.Call):
                yield child
            yield from _calls_at_import(child)


def test_no_logger_is_made_at_import() -> None:
    """`get_logger` reads this process's log settings when first called: at module level it
    would read them at import, before a program or a test could set them."""
    offenders = [
        f"{path.relative_to(ROOT)}:{call.lineno}"
        for path in _modules()
        for call in _calls_at_import(ast.parse(path.read_text()))
        if isinstance(call.func, ast.Name) and call.func.id == "get_logger"
    ]
    assert not offenders, (
        "get_logger() called at import time (make the logger where it is used, or in "
        "__init__): " + ", ".join(offenders)
    )


def test_tests_use_only_public_api() -> None:
    """Tests import public modules and `mesh.testing`, never `_private` modules."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] in PACKAGES and any(part.startswith("_") for part in parts):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not offenders, "tests must use the public API or mesh.testing:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    ("name", "new_home"),
    [("ReplicaGroup", "recovery"), ("replay_training", "recovery"), ("probe", "mesh.testing")],
)
def test_names_that_left_mesh_say_where_they_live_now(name: str, new_home: str) -> None:
    with pytest.raises(ImportError, match=rf"use `from {new_home} import {name}`"):
        exec(f"from mesh import {name}", {})
    assert getattr(importlib.import_module(new_home), name) is not None
