"""A real LMCache 0.5.6 engine on CPU with kvstore as its remote backend; runs in
.venv-lmcache only (tests/integration/test_lmcache.py starts it as a child).

    python -m tests.lmcache.driver ADDRESS [--model M] [--instance I]

Reads one JSON command per line on stdin, answers one line "@@ {json}" on
stdout (LMCache logs go to the same streams; the marker tells them apart):

    {"op": "store", "seed": s, "tokens": n, "salt": ""}   -> chunks, hashes, refcounts
    {"op": "retrieve", "seed": s, "tokens": n, "salt": ""} -> retrieved tokens, exact
    {"op": "lookup", "seed": s, "tokens": n, "salt": ""}   -> tokens hit
    {"op": "clear_local"}                                   -> the CPU tier emptied
    {"op": "quit"}

Everything is LMCache's own (LMCacheEngineBuilder, StorageManager,
LocalCPUBackend, RemoteBackend loading the plugin by module path) except the
GPU connector: LMCache's are CUDA kernels, so the bench's CPU one copies the
engine's "KV cache" (a CPU tensor per request, [2, layers, tokens,
heads*head_dim]) in and out of the memory objects with torch. KV bytes are a function of the
seed, so another process knows what a retrieve must return.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from typing import Any

import torch
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata

from kvstore_bench.compare_lmcache import gpu_connector_class, wait_remote_puts
from kvstore_connectors.lmcache.keys import block_hash

CHUNK = 16
LAYERS, HEADS, HEAD_DIM = 2, 2, 8
DTYPE = torch.float16
PUT_WAIT_S = 20.0


def tokens_of(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 30000, (n,), generator=g).tolist()


def kv_of(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randn((2, LAYERS, n, HEADS * HEAD_DIM), generator=g).to(DTYPE)


def build(
    address: str, model: str, instance: str, cpu_gib: float, retry_initial_s: float, map_region: str
) -> Any:
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=True,
        max_local_cpu_size=cpu_gib,
        remote_serde="naive",
        save_unfull_chunk=True,
        remote_storage_plugins=["kvstore"],
        extra_config={
            "remote_storage_plugin.kvstore.module_path": "kvstore_connectors.lmcache.remote",
            "remote_storage_plugin.kvstore.class_name": "KVStoreConnectorAdapter",
            "remote_storage_plugin.kvstore.address": address,
            "remote_storage_plugin.kvstore.timeout_s": 2.0,
            "remote_storage_plugin.kvstore.retry_initial_s": retry_initial_s,
            "remote_storage_plugin.kvstore.map_region": map_region,
        },
    )
    metadata = LMCacheMetadata(
        model_name=model,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=DTYPE,
        kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM),
        chunk_size=CHUNK,
    )
    engine = LMCacheEngineBuilder.get_or_create(
        instance,
        config,
        metadata,
        gpu_connector_class()(LAYERS, HEADS * HEAD_DIM),
        lambda t, r: None,
        lambda o, r: o,
    )
    engine.post_init()
    return engine


class Driver:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        backends = engine.storage_manager.storage_backends
        self.remote = backends["RemoteBackend-kvstore"]
        self.local = backends["LocalCPUBackend"]

    def _configs(self, cmd: dict[str, Any]) -> dict[str, str] | None:
        salt = cmd.get("salt", "")
        return {"lmcache.tag.cache_salt": salt} if salt else None

    def _keys(self, tokens: list[int], configs: dict[str, str] | None) -> list[Any]:
        db = self.engine.token_database
        return [k for _, _, k in db.process_tokens(tokens, request_configs=configs)]

    def store(self, cmd: dict[str, Any]) -> dict[str, Any]:
        tokens, configs = tokens_of(cmd["seed"], cmd["tokens"]), self._configs(cmd)
        self.engine.store(tokens, kv=kv_of(cmd["seed"], cmd["tokens"]), request_configs=configs)
        keys = self._keys(tokens, configs)
        wait_remote_puts(self.remote, PUT_WAIT_S)
        refcounts = []
        with self.local.cpu_lock:
            for k in keys:
                obj = self.local.hot_cache.get(k)
                refcounts.append(None if obj is None else obj.get_ref_count())
        return {
            "chunks": len(keys),
            "hashes": [block_hash(k.chunk_hash) for k in keys],
            "refcounts": refcounts,
            "put_failed": self.remote.put_failed_count,
        }

    def retrieve(self, cmd: dict[str, Any]) -> dict[str, Any]:
        n = cmd["tokens"]
        tokens, configs = tokens_of(cmd["seed"], n), self._configs(cmd)
        out = torch.zeros((2, LAYERS, n, HEADS * HEAD_DIM), dtype=DTYPE)
        mask = self.engine.retrieve(tokens, kv=out, request_configs=configs)
        got = int(mask.sum().item())
        want = kv_of(cmd["seed"], n)
        return {"retrieved": got, "exact": bool(torch.equal(out[:, :, :got], want[:, :, :got]))}

    def lookup(self, cmd: dict[str, Any]) -> dict[str, Any]:
        tokens = tokens_of(cmd["seed"], cmd["tokens"])
        return {"hit": int(self.engine.lookup(tokens, request_configs=self._configs(cmd)))}

    def clear_local(self, cmd: dict[str, Any]) -> dict[str, Any]:
        removed = int(self.engine.clear(locations=["LocalCPUBackend"]))
        with self.local.cpu_lock:
            return {"removed": removed, "left": len(self.local.hot_cache)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("address")
    ap.add_argument("--model", default="tiny-lmcache")
    ap.add_argument("--instance", default="kvstore-test")
    ap.add_argument("--cpu-gib", type=float, default=0.05)
    ap.add_argument("--retry-initial-s", type=float, default=1.0)
    ap.add_argument("--map-region", default="true", help="false: bytes inline over gRPC")
    args = ap.parse_args()
    # The connector's own warnings (daemon down, reconnected) next to LMCache's.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    engine = build(
        args.address, args.model, args.instance, args.cpu_gib, args.retry_initial_s, args.map_region
    )
    driver = Driver(engine)
    print("@@ " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            reply = getattr(driver, cmd["op"])(cmd)
        except Exception as exc:  # the test asserts on it; the driver stays up
            reply = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        print("@@ " + json.dumps(reply), flush=True)
    driver.engine.close()


if __name__ == "__main__":
    main()
