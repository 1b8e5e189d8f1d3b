"""Describe a vLLM version's connector interface from its source, without installing it.

    python scripts/vllm_interface_fixture.py vllm-0.33.0-...whl tests/fixtures/vllm/0.33.0.json
    python scripts/vllm_interface_fixture.py .venv/lib/python3.11/site-packages out.json

Reads two pure-Python files (from a wheel, or a directory holding ``vllm/``) with
``ast`` (vLLM's modules need its compiled parts and torch to import): the members
of ``KVConnectorBase_V1`` (kind, parameters, abstract), the attributes its
``__init__`` sets on ``self``, and the fields of the KV event structs, and
writes them as JSON. tests/unit/test_vllm_interface.py checks the connector
(kvstore_connectors.vllm.compat) and kvstore's event structs against such a file.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
EVENTS = "vllm/distributed/kv_events.py"
EVENT_STRUCTS = ("EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared")


def read_sources(source: Path) -> tuple[dict[str, str], str]:
    """The two files' text, and the vLLM version."""
    if source.is_file():
        with zipfile.ZipFile(source) as whl:
            texts = {name: whl.read(name).decode() for name in (BASE, EVENTS)}
        match = re.match(r"vllm-([^-]+)-", source.name)
        return texts, match.group(1) if match else "unknown"
    texts = {name: (source / name).read_text() for name in (BASE, EVENTS)}
    version = "unknown"
    dist = sorted(source.glob("vllm*.dist-info/METADATA"))
    for meta in dist:
        m = re.search(r"^Version: (\S+)", meta.read_text(), re.M)
        if m:
            version = m.group(1).split("+")[0]
    return texts, version


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = fn.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    return names[1:] if names and names[0] in ("self", "cls") else names


def _decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    out = set()
    for d in fn.decorator_list:
        if isinstance(d, ast.Name):
            out.add(d.id)
        elif isinstance(d, ast.Attribute):
            out.add(d.attr)
    return out


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise SystemExit(f"class {name} not found")


def describe_base(text: str) -> tuple[dict[str, dict[str, Any]], list[str]]:
    cls = _class(ast.parse(text), "KVConnectorBase_V1")
    members: dict[str, dict[str, Any]] = {}
    init_attrs: list[str] = []
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name.startswith("__") and node.name != "__init__":
                continue
            decos = _decorators(node)
            if "setter" in decos or "deleter" in decos:
                continue
            kind = (
                "classmethod"
                if "classmethod" in decos
                else "staticmethod"
                if "staticmethod" in decos
                else "property"
                if "property" in decos
                else "method"
            )
            members[node.name] = {
                "kind": kind,
                "params": [] if kind == "property" else _params(node),
                "abstract": "abstractmethod" in decos,
            }
            if node.name == "__init__":
                for sub in ast.walk(node):
                    targets = (
                        sub.targets
                        if isinstance(sub, ast.Assign)
                        else [sub.target]
                        if isinstance(sub, ast.AnnAssign)
                        else []
                    )
                    for t in targets:
                        if (
                            isinstance(t, ast.Attribute)
                            and isinstance(t.value, ast.Name)
                            and t.value.id == "self"
                            and t.attr not in init_attrs
                        ):
                            init_attrs.append(t.attr)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    members[t.id] = {"kind": "attribute", "params": [], "abstract": False}
    return members, init_attrs


def describe_events(text: str) -> dict[str, dict[str, Any]]:
    tree = ast.parse(text)
    out: dict[str, dict[str, Any]] = {}
    for name in EVENT_STRUCTS:
        cls = _class(tree, name)
        fields = [
            {"name": node.target.id, "has_default": node.value is not None}
            for node in cls.body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        ]
        options = {
            kw.arg: ast.literal_eval(kw.value)
            for kw in cls.keywords
            if kw.arg and isinstance(kw.value, ast.Constant)
        }
        bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in cls.bases]
        out[name] = {"bases": bases, "options": options, "fields": fields}
    return out


def describe(source: Path) -> dict[str, Any]:
    texts, version = read_sources(source)
    members, init_attrs = describe_base(texts[BASE])
    return {
        "vllm_version": version,
        "source": source.name,
        "KVConnectorBase_V1": members,
        "init_attributes": init_attrs,
        "events": describe_events(texts[EVENTS]),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = describe(Path(argv[0]))
    Path(argv[1]).parent.mkdir(parents=True, exist_ok=True)
    Path(argv[1]).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
