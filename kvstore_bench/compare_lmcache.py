"""LMCache's side of `kvstore-bench compare`; runs inside .venv-lmcache only.

lmcache-cpu: LMCache's in-process CPU tier (see LMCacheCPUSystem).

lmcache-local / lmcache-kvstore / lmcache-redis: a whole LMCacheEngine (what
a vLLM worker's LMCache runs) storing and retrieving the same chunks with its
CPU tier only, with kvstore as its remote backend (kvstore_connectors.lmcache.remote
over the daemon's Unix socket), or with LMCache's own Redis connector
(resp://, its native Redis client). The remote variants keep no local copy (local_cpu: false, the CPU
backend is only their buffer), so every retrieve comes from the remote.

lmcache-mp: LMCache's per-node MP server (`lmcache server
--supported-transfer-mode engine_driven`) through the path a vLLM worker
uses: the worker registers its KV cache layout (engine-driven shared-memory
transfer context), then stores and retrieves contiguous KV tensors with the
same calls LMCache's own SDK makes (lmcache/sdk/context.py): STORE through
the shared-memory L1 pool; LOOKUP -> QUERY_PREFETCH_STATUS -> RETRIEVE ->
END_SESSION. (The SDK itself cannot be used as is: it only finds layouts
that a GPU vLLM instance registered.)

The same bytes as every other system are handed over: the (n, block_bytes)
array is viewed, without a copy, as a [2, 1 layer, n * chunk tokens, D]
float16 KV tensor, D chosen so one LMCache chunk is exactly one block's bytes.
"""

from __future__ import annotations

import hashlib
import time
import uuid
import zlib
from typing import Any

import numpy as np

CHUNK_TOKENS = 256  # `lmcache server --chunk-size` default
MODEL = "kvstore-bench/compare"
TIMEOUT_S = 60.0


class LMCacheMPSystem:
    name = "lmcache-mp"

    def __init__(self, p: dict[str, Any]) -> None:
        import torch
        import zmq
        from lmcache.sdk.wrapper.contiguous import ContiguousTransferWrapper
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
        from lmcache.v1.multiprocess.transfer_context.worker_transfer import (
            create_transfer_context,
        )
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        self.torch = torch
        bb = p["block_bytes"]
        if bb % (2 * CHUNK_TOKENS * 2):
            raise ValueError(f"block_bytes {bb} is not a multiple of {4 * CHUNK_TOKENS}")
        self.head_dim = bb // (2 * CHUNK_TOKENS * 2)
        self.bb = bb
        # Register a layout as a vLLM worker would (one layer, one KV head,
        # engine block = one LMCache chunk), so the SDK can derive shapes.
        self._zctx = zmq.Context()
        self._reg_client = RequestClientFactory.create(p["url"], context=self._zctx)
        caches = {
            "layer.0": torch.zeros((1, 2, 1, CHUNK_TOKENS, self.head_dim), dtype=torch.float16)
        }
        self._reg_caches = caches
        self._reg = create_transfer_context(
            caches, instance_id=uuid.uuid4().int & ((1 << 63) - 1), req_client=self._reg_client
        )
        self._model = f"{MODEL}-{bb}"
        self._reg.register(
            caches,
            self._model,
            1,
            1,
            60.0,
            layout_hints={
                "kv_layout": "HND",
                "num_kv_heads": 1,
                "tokens_per_block": CHUNK_TOKENS,
                "head_dim": self.head_dim,
            },
        )
        # LMCache's SDK object (not kvstore's) has no public getter for it.
        self._instance_id = self._reg._instance_id  # noqa: SLF001
        self._xfer = ContiguousTransferWrapper(self._reg.engine_driven_context, CHUNK_TOKENS)
        self._key_cls = IPCCacheServerKey

    def _key(self, tokens: list[int], request_id: str, worker_id: int | None = 0):
        return self._key_cls(
            model_name=self._model,
            world_size=1,
            num_kv_readers=1,
            worker_id=worker_id,
            token_ids=tuple(tokens),
            start=0,
            end=len(tokens),
            request_id=request_id,
            cache_salt="",
            request_configs=None,
        )

    def _end(self, request_id: str) -> None:
        self._reg_client.end_session(request_id).result(timeout=TIMEOUT_S)

    def _tokens(self, keys: list[str]) -> list[int]:
        base = zlib.crc32(keys[0].encode()) % (1 << 30)
        return list(range(base, base + len(keys) * CHUNK_TOKENS))

    def _as_kv(self, blocks: np.ndarray):
        n = len(blocks)
        flat = self.torch.from_numpy(blocks.reshape(-1))
        return flat.view(self.torch.float16).view(2, 1, n * CHUNK_TOKENS, self.head_dim)

    def store(self, keys: list[str], blocks: np.ndarray) -> None:
        rid = f"store-{uuid.uuid4().hex}"
        try:
            if not self._xfer.store(
                self._key(self._tokens(keys), rid), self._instance_id, self._as_kv(blocks)
            ):
                raise RuntimeError("lmcache store failed")
        finally:
            self._end(rid)

    def load(self, keys: list[str], out: np.ndarray) -> None:
        tokens = self._tokens(keys)
        rid = f"retrieve-{uuid.uuid4().hex}"
        try:
            lookup_key = self._key(tokens, rid).no_worker_id_version()
            self._reg_client.lookup(lookup_key, 1).result(timeout=TIMEOUT_S)
            deadline = time.monotonic() + TIMEOUT_S
            chunks = None
            while chunks is None and time.monotonic() < deadline:
                chunks = self._reg_client.query_prefetch_status(rid).result(timeout=TIMEOUT_S)
            if chunks is None or chunks * CHUNK_TOKENS != len(tokens):
                raise RuntimeError(f"lmcache lookup found {chunks} of {len(keys)} chunks")
            got = self._xfer.retrieve(self._key(tokens, rid), self._instance_id)
            if got is None or got.numel() * 2 != out.nbytes:
                raise RuntimeError(
                    f"lmcache retrieve returned {None if got is None else got.shape}"
                )
            self._as_kv(out).copy_(got)
        finally:
            self._end(rid)

    def remove(self, keys: list[str]) -> None:
        # The SDK has no delete; the L1 pool is sized for every round plus
        # slack and evicts LRU, so old rounds only age out.
        pass

    def close(self) -> None:
        self._reg_client.close()

    def settings(self) -> dict[str, Any]:
        return {
            "server": f"lmcache server, chunk {CHUNK_TOKENS} tokens, LRU, shared-memory L1",
            "client": "engine-driven SHM transfer context + the SDK's call sequence",
        }


class LMCacheCPUSystem:
    """LMCache's in-process CPU tier (LocalCPUBackend over its MixedMemoryAllocator):
    the engine's own process holds the cache, so a store or load is an
    allocation plus a copy, with no other process involved."""

    name = "lmcache-cpu"

    def __init__(self, p: dict[str, Any]) -> None:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        self.torch = torch
        self._key_cls = CacheEngineKey
        self._fmt = MemoryFormat.KV_2LTD
        size = int(p["capacity_bytes"])
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK_TOKENS, local_cpu=True, max_local_cpu_size=size / 2**30
        )
        self.backend = LocalCPUBackend(cfg, memory_allocator=MixedMemoryAllocator(size))
        self.bb = p["block_bytes"]

    def _key(self, k: str):
        chunk_hash = int.from_bytes(hashlib.blake2b(k.encode(), digest_size=8).digest(), "little")
        return self._key_cls(MODEL, 1, 0, chunk_hash, self.torch.uint8)

    def store(self, keys: list[str], blocks: np.ndarray) -> None:
        shape = self.torch.Size([self.bb])
        for k, b in zip(keys, blocks, strict=True):
            obj = self.backend.allocate(shape, self.torch.uint8, fmt=self._fmt)
            if obj is None:
                raise RuntimeError("lmcache-cpu: allocation failed")
            np.copyto(obj.tensor.numpy(), b)
            self.backend.submit_put_task(self._key(k), obj)
            obj.ref_count_down()  # the backend holds its own reference

    def load(self, keys: list[str], out: np.ndarray) -> None:
        for i, k in enumerate(keys):
            obj = self.backend.get_blocking(self._key(k))
            if obj is None:
                raise RuntimeError(f"lmcache-cpu: {k} missing")
            np.copyto(out[i], obj.tensor.numpy().reshape(-1))
            obj.ref_count_down()

    def remove(self, keys: list[str]) -> None:
        for k in keys:
            self.backend.remove(self._key(k))

    def close(self) -> None:
        self.backend.close()

    def settings(self) -> dict[str, Any]:
        return {
            "engine": "LocalCPUBackend + MixedMemoryAllocator, in the measuring process",
            "note": "in-process: no IPC at all, unlike every other system here",
        }


def gpu_connector_class() -> Any:
    from lmcache.v1.gpu_connector import GPUConnectorInterface

    class CPUKVConnector(GPUConnectorInterface):
        """LMCache's GPU connector, on CPU: copies between memory objects and
        kwargs["kv"] ([2, layers, tokens, hidden]); LMCache's own are CUDA kernels."""

        def __init__(self, layers: int, hidden: int) -> None:
            self.kvcaches = None
            self._layers, self._hidden = layers, hidden

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            memory_obj.tensor.copy_(kw["kv"][:, :, start:end])

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            kw["kv"][:, :, start:end].copy_(memory_obj.tensor)

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for m, s, e in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(m, s, e, **kw)

        def batched_to_gpu(
            self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kw: Any
        ) -> None:
            for m, s, e in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(m, s, e, **kw)

        def get_shape(self, num_tokens: int) -> Any:
            import torch

            return torch.Size([2, self._layers, num_tokens, self._hidden])

    return CPUKVConnector


def wait_remote_puts(remote_backend: Any, timeout_s: float) -> None:
    """Until the puts an LMCache RemoteBackend has in flight are done: they run as
    tasks on its event loop, and its put_tasks set does not track batched puts."""
    import asyncio

    async def drain() -> None:
        puts = [
            t
            for t in asyncio.all_tasks()
            if t is not asyncio.current_task()
            and t.get_coro().__qualname__.rsplit(".", 1)[-1] in ("put", "batched_put")
        ]
        if puts:
            await asyncio.wait(puts, timeout=timeout_s)

    asyncio.run_coroutine_threadsafe(drain(), remote_backend.loop).result(timeout_s + 5)


class LMCacheEngineSystem:
    """A real LMCacheEngine on CPU; one LMCache chunk (256 tokens) = one block."""

    def __init__(self, p: dict[str, Any]) -> None:
        import torch
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata

        self.name = p["system"]
        self.torch = torch
        bb = p["block_bytes"]
        if bb % (2 * CHUNK_TOKENS * 2):
            raise ValueError(f"block_bytes {bb} is not a multiple of {4 * CHUNK_TOKENS}")
        self.head_dim = bb // (2 * CHUNK_TOKENS * 2)
        remote = self.name != "lmcache-local"
        extra: dict[str, Any] = {}
        kw: dict[str, Any] = {}
        if self.name == "lmcache-kvstore":
            kw["remote_storage_plugins"] = ["kvstore"]
            extra = {
                "remote_storage_plugin.kvstore.module_path": "kvstore_connectors.lmcache.remote",
                "remote_storage_plugin.kvstore.class_name": "KVStoreConnectorAdapter",
                "remote_storage_plugin.kvstore.address": p["address"],
            }
        elif self.name == "lmcache-redis":
            # resp://: LMCache's native Redis client. Its redis:// (redis-py)
            # connector did not finish 128 x 64 KiB chunks in 120 s here.
            kw["remote_url"] = f"resp://127.0.0.1:{p['redis_port']}"
            extra = {"save_chunk_meta": False}  # RESP requires it
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK_TOKENS,
            local_cpu=not remote,
            max_local_cpu_size=int(p["capacity_bytes"]) / 2**30,
            remote_serde="naive",
            save_unfull_chunk=False,
            extra_config=extra or None,
            **kw,
        )
        metadata = LMCacheMetadata(
            model_name=f"{MODEL}-{bb}",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.float16,
            kv_shape=(1, 2, CHUNK_TOKENS, 1, self.head_dim),
            chunk_size=CHUNK_TOKENS,
        )
        self.engine = LMCacheEngineBuilder.get_or_create(
            f"bench-{self.name}-{bb}",
            config,
            metadata,
            gpu_connector_class()(1, self.head_dim),
            lambda t, r: None,
            lambda o, r: o,
        )
        self.engine.post_init()
        backends = self.engine.storage_manager.storage_backends
        self._remote = next((b for n, b in backends.items() if n.startswith("RemoteBackend")), None)
        if remote and self._remote is None:
            raise RuntimeError(f"{self.name}: LMCache created no remote backend")

    def _tokens(self, keys: list[str]) -> list[int]:
        base = zlib.crc32(keys[0].encode()) % (1 << 30)
        return list(range(base, base + len(keys) * CHUNK_TOKENS))

    def _as_kv(self, blocks: np.ndarray):
        n = len(blocks)
        flat = self.torch.from_numpy(blocks.reshape(-1))
        return flat.view(self.torch.float16).view(2, 1, n * CHUNK_TOKENS, self.head_dim)

    def store(self, keys: list[str], blocks: np.ndarray) -> None:
        self.engine.store(self._tokens(keys), kv=self._as_kv(blocks))
        if self._remote is not None:  # done = in the remote, as for every other system
            wait_remote_puts(self._remote, TIMEOUT_S)

    def load(self, keys: list[str], out: np.ndarray) -> None:
        tokens = self._tokens(keys)
        mask = self.engine.retrieve(tokens, kv=self._as_kv(out))
        got = int(mask.sum().item())
        if got != len(tokens):
            raise RuntimeError(f"{self.name}: retrieved {got} of {len(tokens)} tokens")

    def remove(self, keys: list[str]) -> None:
        if self.name == "lmcache-redis":
            # LMCache's Redis connectors cannot remove (NotImplementedError, logged
            # per key); Redis runs with an LRU maxmemory policy instead.
            return
        self.engine.clear(self._tokens(keys))

    def close(self) -> None:
        if self.name == "lmcache-redis":
            # LMCache 0.5.6's RedisConnector.close deadlocks (its job executor's
            # shutdown, run on the loop, waits for a future of that same loop);
            # the worker exits with os._exit right after the result anyway.
            return
        self.engine.close()

    def settings(self) -> dict[str, Any]:
        where = {
            "lmcache-local": "LocalCPUBackend only (local_cpu: true)",
            "lmcache-kvstore": "remote = kvstore (kvstore_connectors.lmcache.remote, Unix socket)",
            "lmcache-redis": "remote = LMCache's RESP connector (resp://, TCP loopback)",
        }[self.name]
        return {
            "engine": f"LMCacheEngine, chunk {CHUNK_TOKENS} tokens, CPU copy as GPU connector",
            "storage": where,
        }


ENGINE_SYSTEMS = ("lmcache-local", "lmcache-kvstore", "lmcache-redis")


def make(p: dict[str, Any]) -> Any:
    if p["system"] == "lmcache-mp":
        return LMCacheMPSystem(p)
    if p["system"] in ENGINE_SYSTEMS:
        return LMCacheEngineSystem(p)
    return LMCacheCPUSystem(p)
