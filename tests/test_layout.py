"""The package's layout is its architecture: its folders are layers, imports run only downward, no modules
import each other, and no module grows past a size one reader can hold. Read from the source with `ast`
(every import, function-level ones too), so a lazy import cannot hide a cycle."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "moonep_moe"

LAYERS = (
    ("base",),
    ("fp8", "transport", "plan"),
    ("weights",),
    ("comm", "gemm"),
    ("config",),
    ("layers", "engine"),
    ("parallel",),
    ("integrations",),
    ("__init__",),
    ("apps",),
)
"""The package's parts, bottom up: a part imports only parts of lower rows (and itself). Parts of one row
are independent of each other. `__init__` is the public API (`from moonep_moe import ...`)."""

MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports anywhere in its code (`from a.b import c` names module
    `a.b.c` where that is a module, else `a.b`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            found.update(name if name in modules else node.module for name in names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in modules}


def package_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: imported_modules(path, set(paths)) - {name} for name, path in paths.items()}


def part_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def row_of(part: str) -> int:
    for row, parts in enumerate(LAYERS):
        if part in parts:
            return row
    raise AssertionError(f"{part!r} is in no row of LAYERS: give it one")


def test_every_part_of_the_package_has_a_row():
    parts = {part_of(module) for module in package_graph()}
    assert parts == {part for row in LAYERS for part in row}


def test_imports_run_only_downward():
    upward = [f"{module} -> {target}" for module, targets in package_graph().items() for target in targets
              if part_of(target) != part_of(module) and row_of(part_of(target)) >= row_of(part_of(module))]
    assert not upward, "imports that climb or cross a row:\n" + "\n".join(sorted(upward))


def test_no_modules_import_each_other():
    graph = package_graph()
    state: dict[str, str] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_is_at_most_600_lines(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines: split it by idea"


def test_the_checks_see_a_planted_upward_import_and_cycle(tmp_path, monkeypatch):
    """The walker finds an upward import and a cycle when one is there (a copy of two modules, one made to
    import the other back)."""
    fake = tmp_path / "moonep_moe"
    (fake / "base").mkdir(parents=True)
    (fake / "apps").mkdir()
    for init in (fake / "__init__.py", fake / "base" / "__init__.py", fake / "apps" / "__init__.py"):
        init.write_text("")
    (fake / "base" / "sizes.py").write_text("def f():\n    from moonep_moe.apps import cli\n")
    (fake / "apps" / "cli.py").write_text("from moonep_moe.base.sizes import f\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    with pytest.raises(AssertionError, match="moonep_moe.base.sizes -> moonep_moe.apps.cli"):
        test_imports_run_only_downward()
    with pytest.raises(AssertionError, match="import cycles"):
        test_no_modules_import_each_other()
