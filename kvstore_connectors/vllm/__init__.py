"""kvstore's vLLM KV connector: ``--kv-transfer-config '{"kv_connector": "KVStoreConnector",
"kv_connector_module_path": "kvstore_connectors.vllm", "kv_role": "kv_both", ...}'`` (docs/vllm.md).

    config      kv_connector_extra_config, typed
    namespace   engine config -> the daemon's namespace (layout + tenant)
    hashes      vLLM block hashes -> uint64 keys
    session     the daemon link: deadlines, one warning, reconnect
    metadata    the per-step plan the scheduler sends the workers
    scheduler   external hits and the step plan          (no vLLM import)
    copier      batched copies, CPU caches               (torch)
    cuda        batched copies, CUDA caches              (torch + CUDA)
    worker      loads, saves, load errors                (no vLLM import)
    connector   KVStoreConnector, the vLLM adapter       (imports vLLM)

``KVStoreConnector`` is resolved lazily, so the rest of the package imports
and tests without vLLM installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore_connectors.vllm.connector import KVStoreConnector

__all__ = ["KVStoreConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVStoreConnector":
        from kvstore_connectors.vllm.connector import KVStoreConnector

        return KVStoreConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
