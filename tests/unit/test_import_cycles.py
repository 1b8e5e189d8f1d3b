"""No import circle among the modules of any package of this repository
(kvstore, the bench, the connectors, the routing library), counting every
import: top level, in functions, under TYPE_CHECKING.

The same rule as the project's import-cycle tool: an edge to a package's
``__init__`` is not followed (importing a package for a name it re-exports is
not a circle through its submodules); generated protobuf modules are left out.
tests/unit/test_layers.py checks the direction of the block store's core.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules(root: Path) -> dict[str, Path]:
    mods = {}
    for init in sorted(root.glob("*/__init__.py")):
        if init.parent.name == "tests":
            continue
        for path in init.parent.rglob("*.py"):
            rel = path.relative_to(root)
            if "v1" in rel.parts or path.name.endswith("_pb2.py"):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def import_graph(root: Path) -> dict[str, set[str]]:
    mods = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    up = parts[: len(parts) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != module and mods[name].name != "__init__.py":
                    graph[module].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
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
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_circle_in_any_package():
    graph = import_graph(ROOT)
    assert "kvstore.manager" in graph and any(m.split(".")[0] != "kvstore" for m in graph)
    found = cycles(graph)
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_check_sees_a_circle_through_type_checking_and_functions(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.a import A\n")  # re-export: not an edge
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\nA = 1\n"
    )
    (pkg / "b.py").write_text("def f():\n    from . import c\nB = 2\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from pkg import A\n")
    graph = import_graph(tmp_path)
    assert graph["pkg.d"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
