"""The package's layout: its modules import each other without a cycle (an import inside a
function counts: it is the same dependency, deferred)."""

from __future__ import annotations

import ast
from pathlib import Path

import compiled_moe

_ROOT = Path(compiled_moe.__file__).parent
_LOWERING = _ROOT.parent / "lowering"  # installed as compiled_moe.lowering


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, root in (("compiled_moe", _ROOT), ("compiled_moe.lowering", _LOWERING)):
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join((pkg,) + parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The package modules `name` imports, at any depth of its code. An import of a package's
    __init__ (``from compiled_moe import x`` where x is not a module) is left out: a package
    imports its submodules to re-export them, which is not a cycle of meaning."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in mods:
                    found.add(full)
                elif base in mods and mods[base].name != "__init__.py":
                    found.add(base)
    return found - {name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle():
    mods = _modules()
    assert "compiled_moe.lowering.passes" in mods and "compiled_moe.ops.grouped_mm" in mods
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    assert "compiled_moe.local_experts" in graph["compiled_moe.distributed.experts"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_environment_switches_are_one_documented_table():
    """The environment variables the package reads are exactly those of docs/architecture.md's
    table (the C++ layer's COMPILED_MOE_* macros are not variables)."""
    import re

    read = set()
    for path in list(_ROOT.rglob("*.py")) + list(_LOWERING.rglob("*.py")):
        read.update(re.findall(r'"(COMPILED_MOE_[A-Z0-9_]+)"', path.read_text()))
    docs = (_ROOT.parent / "docs" / "architecture.md").read_text()
    table = docs[docs.index("## Environment switches"):]
    table = table[:table.index("\n## ")]
    documented = set(re.findall(r"^\| `(COMPILED_MOE_[A-Z0-9_]+)` \|", table, re.M))
    assert read == documented, (read - documented, documented - read)
