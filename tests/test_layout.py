"""The package layout: the root holds the public face only, docs/architecture.md's module map and
layer list are the source tree's and import-linter's, the layers hold, and no import loops."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "kvpool"
ARCH = (ROOT / "docs" / "architecture.md").read_text()
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _modules() -> set[str]:
    """Every module under src/kvpool as a path relative to it (packages as ``name/``)."""
    found = set()
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG)
        if rel.name == "__init__.py" and rel.parent != Path("."):
            found.add(f"{rel.parent.as_posix()}/")
        else:
            found.add(rel.as_posix())
    return found


def _module_map() -> set[str]:
    """The modules docs/architecture.md's module map lists (its code block under src/kvpool/)."""
    block = ARCH.split("\n```\nsrc/kvpool/\n", 1)[1].split("\n```", 1)[0]
    listed, package = set(), ""
    for line in block.splitlines():
        if m := re.fullmatch(r"  (\S+/)", line):
            package = m.group(1)
            listed.add(package)
        elif m := re.match(r"  (\S+\.py) ", line):
            listed.add(m.group(1))
            package = ""
        elif m := re.match(r"    (\S+\.py) ", line):
            listed.add(package + m.group(1))
    return listed


def test_root_holds_only_the_public_face() -> None:
    root = sorted(p.name for p in PKG.glob("*.py"))
    assert len(root) <= 6, root
    assert {"__init__.py", "config.py", "errors.py", "cli.py"} <= set(root)


def test_module_map_lists_exactly_the_modules_that_exist() -> None:
    listed, present = _module_map(), _modules()
    assert sorted(present - listed) == [], "modules missing from docs/architecture.md's map"
    assert sorted(listed - present) == [], "docs/architecture.md's map names missing modules"


def test_documented_layers_are_the_import_linter_contract() -> None:
    block = ARCH.split("```layers\n", 1)[1].split("```", 1)[0]
    documented = [line.strip() for line in block.splitlines() if line.strip()]
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    assert documented == contract["layers"]


def _imports(path: Path) -> set[str]:
    """Every kvpool module ``path`` imports, anywhere in it (functions, TYPE_CHECKING too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kvpool")}
        elif (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
              and node.module.startswith("kvpool")):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _graph() -> dict[str, set[str]]:
    names = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        names[".".join(parts)] = path
    return {m: {i for i in _imports(p) if i in names and i != m} for m, p in names.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_loops_lazy_imports_included() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_loop() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"import-linter is not installed beside {sys.executable} (the lint extra)")
    tree = tmp_path_factory.mktemp("layout")
    shutil.copytree(PKG, tree / "src" / "kvpool", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


def test_layer_contracts_hold(tree_copy: Path) -> None:
    result = _lint_imports(tree_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 1 kept, 0 broken." in result.stdout


@pytest.mark.parametrize(("module", "upward"), [
    ("tiers/storage.py", "kvpool.core.state"),   # a tier library reaching into the manager
    ("router/walk.py", "kvpool.core.radix"),     # the router importing the core
    ("hashing/keys.py", "kvpool.config"),        # hashing reaching up to the configuration
])
def test_an_upward_import_breaks_the_contract(tree_copy: Path, module: str, upward: str) -> None:
    target = tree_copy / "src" / "kvpool" / module
    original = target.read_text()
    try:
        target.write_text(original + f"\n\ndef _upward() -> None:\n    import {upward}\n")
        result = _lint_imports(tree_copy)
    finally:
        target.write_text(original)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout
    assert upward in result.stdout
