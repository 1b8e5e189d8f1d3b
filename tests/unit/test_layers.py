"""The dependency direction of the block store's core, checked from the source.

    manager -> movers (disk, GPU, warm restart) -> placement
            -> storage media, eviction, events -> namespace -> errors

A module may import its own layer or the ones below, never one above, not even
under TYPE_CHECKING or inside a function, and not through a module outside the
list (the check follows every kvstore import, transitively). docs/architecture.md
says who owns what; this test keeps the arrows pointing down.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Top first. Each module is named exactly (a package means its __init__).
LAYERS: list[tuple[str, list[str]]] = [
    ("manager", ["kvstore.manager"]),
    ("movers", ["kvstore.tiers.hierarchy", "kvstore.tiers.gpu_layer", "kvstore.tiers.warm"]),
    ("placement", ["kvstore.placement"]),
    (
        "media, eviction, events",
        [
            "kvstore.tiers",
            "kvstore.tiers.dram",
            "kvstore.tiers.disk",
            "kvstore.tiers.gpu",
            "kvstore.tiers.pool",
            "kvstore.eviction",
            "kvstore.eviction.base",
            "kvstore.eviction.lru",
            "kvstore.eviction.s3fifo",
            "kvstore.events",
            "kvstore.events.sink",
            "kvstore.events.wire",
            "kvstore.events.publisher",
        ],
    ),
    ("namespace", ["kvstore.namespace"]),
    ("errors", ["kvstore.errors"]),
]
LAYER_OF = {module: i for i, (_, modules) in enumerate(LAYERS) for module in modules}


def _path(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@cache
def direct_imports(module: str) -> frozenset[str]:
    """Every kvstore module ``module`` imports anywhere in its text (top level,
    functions, TYPE_CHECKING blocks)."""
    path = _path(module)
    assert path is not None, f"no source for {module}"
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # `from kvstore.tiers import warm` names a module, not just a package.
            names = [base] + [
                f"{base}.{alias.name}" for alias in node.names if _path(f"{base}.{alias.name}")
            ]
        else:
            continue
        for name in names:
            if name == "kvstore" or not name.startswith("kvstore."):
                continue
            while name and _path(name) is None:  # `import kvstore.a.b.attr` -> kvstore.a.b
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return frozenset(found)


def reachable(module: str) -> dict[str, list[str]]:
    """Every kvstore module ``module`` depends on, each with one import path to it."""
    paths: dict[str, list[str]] = {}
    todo = [(module, [module])]
    while todo:
        current, path = todo.pop()
        for nxt in sorted(direct_imports(current)):
            if nxt not in paths and nxt != module:
                paths[nxt] = [*path, nxt]
                todo.append((nxt, paths[nxt]))
    return paths


@pytest.mark.parametrize("module", sorted(LAYER_OF))
def test_imports_point_down(module):
    layer = LAYER_OF[module]
    upward = {
        target: " -> ".join(path)
        for target, path in reachable(module).items()
        if LAYER_OF.get(target, layer) < layer
    }
    assert not upward, f"{module} ({LAYERS[layer][0]}) depends on a layer above it: " + "; ".join(
        upward.values()
    )


def test_the_check_sees_type_checking_and_function_imports(tmp_path, monkeypatch):
    """The parser counts an import under TYPE_CHECKING or in a function as an arrow."""
    pkg = tmp_path / "kvstore"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvstore.high import X\n"
        "def f():\n    import kvstore.other\n"
    )
    (pkg / "high.py").write_text("X = 1\n")
    (pkg / "other.py").write_text("from . import high\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    direct_imports.cache_clear()
    try:
        assert direct_imports("kvstore.low") == {"kvstore.high", "kvstore.other"}
        assert direct_imports("kvstore.other") == {"kvstore.high"}
        assert reachable("kvstore.low")["kvstore.high"] == ["kvstore.low", "kvstore.high"]
    finally:
        direct_imports.cache_clear()


def test_every_listed_module_exists():
    missing = [m for m in LAYER_OF if _path(m) is None]
    assert not missing, f"listed in LAYERS but not in the tree: {missing}"
