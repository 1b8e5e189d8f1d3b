"""The dependency direction of the block store's core, checked from the source.

    manager -> movers (kvstore/movers/: disk, GPU, warm restart) -> placement
            -> storage media (kvstore/tiers/), eviction, events -> namespace -> errors

A layer is a module or a whole folder. A module may import its own layer or the ones below, never one above, not even
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

# Top first. A layer is a list of modules and folders: a folder (a package)
# stands for its __init__ and every module under it, so a file added to
# kvstore/movers/ or kvstore/tiers/ is checked without editing this list.
LAYERS: list[tuple[str, list[str]]] = [
    ("manager", ["kvstore.manager"]),
    ("movers (disk, GPU, warm restart)", ["kvstore.movers"]),
    ("placement", ["kvstore.placement"]),
    ("storage media, eviction, events", ["kvstore.tiers", "kvstore.eviction", "kvstore.events"]),
    ("namespace", ["kvstore.namespace"]),
    ("errors", ["kvstore.errors"]),
]


def layer_of(module: str) -> int | None:
    """The layer ``module`` belongs to: the one listing it or a folder above it
    (the longest such name wins), None for a module outside the layers."""
    best: tuple[int, int] | None = None  # (length of the listed name, layer)
    for i, (_, names) in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (
                best is None or len(name) > best[0]
            ):
                best = (len(name), i)
    return None if best is None else best[1]


def modules_of(name: str) -> list[str]:
    """``name`` and, for a folder, every module under it (from the tree)."""
    base = ROOT.joinpath(*name.split("."))
    if not (base / "__init__.py").is_file():
        return [name]
    found = []
    for path in sorted(base.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


LAYERED = sorted({m for _, names in LAYERS for name in names for m in modules_of(name)})


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


@pytest.mark.parametrize("module", LAYERED)
def test_imports_point_down(module):
    layer = layer_of(module)
    assert layer is not None
    upward = {
        target: " -> ".join(path)
        for target, path in reachable(module).items()
        if (above := layer_of(target)) is not None and above < layer
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
    missing = [name for _, names in LAYERS for name in names if _path(name) is None]
    assert not missing, f"listed in LAYERS but not in the tree: {missing}"


def test_folders_are_layers():
    """Every module of a listed folder is checked, at its folder's layer: the
    movers, the media and the eviction and event packages are layers as folders."""
    media = layer_of("kvstore.tiers")
    for folder, layer in [
        ("kvstore.movers", 1),
        ("kvstore.tiers", media),
        ("kvstore.eviction", media),
        ("kvstore.events", media),
    ]:
        modules = modules_of(folder)
        assert folder in modules and len(modules) > 1, modules
        assert set(modules) <= set(LAYERED)
        assert {layer_of(m) for m in modules} == {layer}, folder
    # the movers left the media folder; nothing in kvstore/tiers/ moves blocks
    assert {"kvstore.movers.disk", "kvstore.movers.gpu", "kvstore.movers.warm"} <= set(LAYERED)
    assert layer_of("kvstore.movers.anything_new") == layer_of("kvstore.movers")
    assert (
        layer_of("kvstore.tiers.pool") > layer_of("kvstore.placement") > layer_of("kvstore.movers")
    )
    assert layer_of("kvstore.service") is None


# -- the installed packages ---------------------------------------------------------
# Which first-party package may import which (pip installs these four, and only
# these, at the top level: tests/integration/test_installed_package.py). The
# benchmarks sit on top; the product never imports them or the engine connectors.
PACKAGES = ("kvstore", "kvstore_bench", "kvstore_connectors", "kvstore_router_client")
PACKAGE_USES: dict[str, set[str]] = {
    "kvstore": {"kvstore_router_client"},  # kvstore.router only: the proxy routes with it
    "kvstore_router_client": {"kvstore"},
    "kvstore_connectors": {"kvstore"},
    "kvstore_bench": {"kvstore", "kvstore_connectors", "kvstore_router_client"},
}
# The names these packages had before they were renamed (never to come back).
OLD_PACKAGES = ("bench", "connectors", "router_client")  # rename_packages: keep


def _absolute_imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.append(node.module)
    return names


def test_packages_import_only_the_packages_below_them():
    wrong = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            for name in _absolute_imports(path):
                top = name.split(".")[0]
                if top in PACKAGES and top != package and top not in PACKAGE_USES[package]:
                    wrong.append(f"{module} imports {name}")
                router_only = package == "kvstore" and top == "kvstore_router_client"
                if router_only and not module.startswith("kvstore.router."):
                    wrong.append(f"{module} imports {name} (only kvstore.router may)")
    assert not wrong, "; ".join(wrong)


def test_no_code_imports_the_old_package_names():
    """The three packages were renamed kvstore_*: an import of an old name (from a
    branch written before the rename) would find nothing once installed, or
    someone else's package of that name."""
    wrong = [
        f"{path.relative_to(ROOT)} imports {name}"
        for top_dir in (*PACKAGES, "tests", "scripts")
        for path in sorted((ROOT / top_dir).rglob("*.py"))
        for name in _absolute_imports(path)
        if name.split(".")[0] in OLD_PACKAGES
    ]
    assert not wrong, "; ".join(wrong)
