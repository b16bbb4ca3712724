"""The import graph of `layerzoo`: no cycles, and no upward imports.

Every ``from layerzoo... import`` / ``import layerzoo...`` in the package's modules is an edge,
whether at module level or inside a function (a lazy import still ties two modules together). The
walk is over source (`ast`), so nothing is imported to check it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"layerzoo": ROOT / "core", "layerzoo.kernels": ROOT / "kernels"}


def module_files() -> dict[str, Path]:
    files = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            if "embedded" in path.parts:
                continue
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            files[".".join([package, *parts])] = path
    return files


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The `layerzoo` modules ``name`` imports (a package's module when a name is imported from it)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" for a in node.names] + [module]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("layerzoo"):
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: imports_of(name, path, known) for name, path in files.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def without_package_inits(edges):
    """Edges into a package's ``__init__`` that only re-exports are not dependencies of its
    submodules on each other; drop the top-level ``layerzoo`` re-export module from the walk."""
    return {n: {t for t in ts if t != "layerzoo"} for n, ts in edges.items() if n != "layerzoo"}


def test_no_import_cycle_in_layerzoo():
    cycle = find_cycle(without_package_inits(graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize(
    "lower, upper",
    [
        ("layerzoo.layers.model", "layerzoo.runtime"),
        ("layerzoo.layers", "layerzoo.runtime"),
        ("layerzoo.layers", "layerzoo.loading.model_loading"),
        ("layerzoo.layers.model", "layerzoo.loading.loader"),
        ("layerzoo.runtime", "layerzoo.runtime.engine"),
        ("layerzoo.runtime", "layerzoo.llm"),
        ("layerzoo.kernels", "layerzoo.runtime"),
        ("layerzoo.layers.kv_cache", "layerzoo.runtime"),
        # the folders: front ends on top, then the runtime, then layers, loading and plugins
        ("layerzoo.runtime", "layerzoo.entrypoints"),
        ("layerzoo.runtime", "layerzoo.server"),
        ("layerzoo.layers", "layerzoo.entrypoints"),
        ("layerzoo.tokenization", "layerzoo.entrypoints"),
        ("layerzoo.plugins", "layerzoo.runtime"),
        ("layerzoo.plugins", "layerzoo.loading"),
        ("layerzoo.loading", "layerzoo.server"),
    ],
)
def test_nothing_imports_upward(lower, upper):
    bad = [
        (name, target)
        for name, targets in graph().items()
        if name == lower or name.startswith(lower + ".")
        for target in targets
        if target == upper or target.startswith(upper + ".")
    ]
    assert not bad, f"{lower} must not import {upper}: {bad}"


def test_plugins_import_nothing_from_the_runtime():
    offenders = []
    for path in (ROOT / "plugins").rglob("*.py"):
        if "build" in path.parts or "tests" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [module or ""]
            if any(n and n.startswith("layerzoo.runtime") for n in names):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"plugins importing layerzoo.runtime: {sorted(set(offenders))}"
