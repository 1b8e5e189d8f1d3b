"""kvstore as LMCache's remote backend (LMCache 0.5.6, in-process engine).

LMCache config (docs/lmcache.md)::

    remote_storage_plugins: ["kvstore"]
    extra_config:
      remote_storage_plugin.kvstore.module_path: kvstore_connectors.lmcache.remote
      remote_storage_plugin.kvstore.class_name: KVStoreConnectorAdapter
      remote_storage_plugin.kvstore.address: unix:/tmp/kvstore.sock   # or host:port

LMCache's RemoteBackend drives the connector from its event loop; every
method here runs the daemon calls on one worker thread of the connector's
own (so the loop keeps turning) and turns any failure into a miss: the
daemon down costs the engine one warning per outage (kvstore_connectors.lmcache.store).

Reference counts follow LMCache's built-in connectors exactly: RemoteBackend
takes a reference and the serializer another, drops one, and LMCache's
``InstrumentedRemoteConnector`` (which wraps every connector CreateConnector
returns) drops the last after ``put``/``batched_put`` return. So ``put``
must NOT ``ref_count_down`` (redis_connector and fs_connector do not either;
a connector that did would free the local CPU backend's copy while it is
still cached). Objects ``get`` returns carry the one reference the caller owns.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvstore import errors
from kvstore.client import DEFAULT_ADDRESS
from kvstore.namespace import NamespaceSpec
from kvstore_connectors.lmcache.blocks import slot_bytes
from kvstore_connectors.lmcache.keys import ChunkLayout, block_hash, tenant_of
from kvstore_connectors.lmcache.store import Chunk, ChunkKey, ChunkStore

logger = logging.getLogger(__name__)
T = TypeVar("T")

PLUGIN_TYPE = "kvstore"
MAX_CACHED_SPECS = 4096  # (model, rank, tenant) combinations remembered; more are recomputed


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def plugin_options(extra_config: dict[str, Any] | None, plugin_name: str) -> dict[str, Any]:
    """The ``remote_storage_plugin.<name>.*`` entries of LMCache's extra_config."""
    prefix = f"remote_storage_plugin.{plugin_name}."
    return {k[len(prefix) :]: v for k, v in (extra_config or {}).items() if k.startswith(prefix)}


class KVStoreConnector(RemoteConnector):
    """LMCache RemoteConnector over a kvstore daemon."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any,
        metadata: Any,
        plugin_name: str = PLUGIN_TYPE,
    ) -> None:
        super().__init__(config, metadata)
        if config.use_layerwise:
            raise errors.ConfigError(
                "kvstore's LMCache connector stores whole chunks: set use_layerwise: false"
            )
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        opts = plugin_options(config.extra_config, plugin_name)
        address = str(opts.get("address") or os.environ.get("KVSTORE_ADDRESS", DEFAULT_ADDRESS))
        num_layers, _, _, num_kv_heads, head_dim = metadata.kv_shape
        self._layout = ChunkLayout(
            dtype=_dtype_name(metadata.kv_dtype),
            chunk_tokens=int(metadata.chunk_size),
            num_layers=int(num_layers),
            num_kv_heads=int(num_kv_heads),
            head_dim=int(head_dim),
            block_bytes=slot_bytes(self.remote_metadata_bytes, self.full_chunk_size_bytes),
            shapes=",".join(
                f"{_dtype_name(d)}{list(s)}"
                for s, d in zip(self.meta_shapes, self.meta_dtypes, strict=True)
            ),
            fmt=self.meta_fmt.name,
        )
        self._store = ChunkStore(
            address,
            meta_bytes=self.remote_metadata_bytes,
            timeout_s=float(opts.get("timeout_s", 5.0)),
            retry_initial_s=float(opts.get("retry_initial_s", 1.0)),
            retry_max_s=float(opts.get("retry_max_s", 30.0)),
            map_region=str(opts.get("map_region", "true")).lower() not in ("0", "false", "no"),
        )
        self._specs: dict[tuple[str, int, int, Any], NamespaceSpec] = {}
        # One thread: the store serialises its calls anyway; this keeps them off the loop.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-lmcache")
        logger.info(
            "kvstore: LMCache remote backend on %s, chunk slot %d bytes",
            address,
            self._layout.block_bytes,
        )

    # ------------------------------------------------------------ keys

    def _key(self, key: CacheEngineKey) -> ChunkKey:
        ident = (key.model_name, key.world_size, key.worker_id, key.tags)
        spec = self._specs.get(ident)
        if spec is None:
            if len(self._specs) >= MAX_CACHED_SPECS:
                self._specs.clear()
            spec = self._specs[ident] = self._layout.spec(
                key.model_name, key.world_size, key.worker_id, tenant_of(key.tags)
            )
        return spec, block_hash(key.chunk_hash)

    # ------------------------------------------------------------ chunks

    def _chunk(self, key: CacheEngineKey, obj: MemoryObj) -> Chunk:
        payload = np.frombuffer(obj.byte_array, dtype=np.uint8)
        meta = RemoteMetadata(
            len(payload), obj.get_shapes(), obj.get_dtypes(), obj.get_memory_format()
        ).serialize()
        spec, h = self._key(key)
        return Chunk(spec, h, meta, payload)

    def _make(self, meta: bytes, payload: np.ndarray) -> MemoryObj | None:
        md = RemoteMetadata.deserialize(meta)
        if md.length != len(payload):
            raise errors.DataCorruption(
                f"chunk header says {md.length} bytes, slot holds {len(payload)}"
            )
        # No busy loop: this runs under the store's lock, and the puts that would
        # free CPU memory wait for that lock. Out of memory = a miss from here on.
        obj = self.local_cpu_backend.allocate(md.shapes, md.dtypes, md.fmt, busy_loop=False)
        if obj is None:
            return None
        dst = np.frombuffer(obj.byte_array, dtype=np.uint8)
        if len(dst) != len(payload):
            obj.ref_count_down()
            raise errors.DataCorruption(
                f"chunk of {len(payload)} bytes, LMCache allocated {len(dst)} for its shapes"
            )
        dst[:] = payload
        return obj

    @staticmethod
    def _drop(obj: MemoryObj) -> None:
        obj.ref_count_down()

    # ------------------------------------------------------------ sync core

    def _guard(self, what: str, fn: Callable[[], T], miss: T) -> T:
        """``fn()``, or ``miss`` on any error: nothing reaches the engine."""
        try:
            return fn()
        except Exception as exc:
            logger.warning("kvstore: LMCache %s failed (%s); treated as a miss", what, exc)
            return miss

    def _prefix(self, keys: Sequence[CacheEngineKey]) -> int:
        return self._guard("lookup", lambda: self._store.prefix([self._key(k) for k in keys]), 0)

    def _put_all(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> int:
        def put() -> int:
            chunks = [self._chunk(k, o) for k, o in zip(keys, objs, strict=True)]
            return self._store.put(chunks).stored

        return self._guard("store", put, 0)

    def _get_all(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj]:
        def get() -> list[MemoryObj]:
            return self._store.get([self._key(k) for k in keys], self._make, self._drop)

        return self._guard("load", get, [])

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ------------------------------------------------------------ RemoteConnector

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._off_loop(self._prefix, [key]) == 1

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._prefix([key]) == 1

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        got = await self._off_loop(self._get_all, [key])
        return got[0] if got else None

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        # No ref_count_down here: InstrumentedRemoteConnector does it (module docstring).
        await self._off_loop(self._put_all, [key], [memory_obj])

    async def list(self) -> list[str]:
        # The daemon lists namespaces, not keys; LMCache only uses list for tooling.
        return []

    async def close(self) -> None:
        await self._off_loop(self._store.close)
        self._pool.shutdown(wait=False)

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        got: list[MemoryObj | None] = list(await self._off_loop(self._get_all, keys))
        return got + [None] * (len(keys) - len(got))

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        await self._off_loop(self._put_all, keys, memory_objs)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        # pin: the daemon pins per load lease, not across calls; a chunk evicted
        # between this and the load is a miss there (as with LMCache's fs connector).
        return await self._off_loop(self._prefix, keys)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey]
    ) -> list[MemoryObj]:
        return await self._off_loop(self._get_all, keys)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        return self._prefix(keys)

    def remove_sync(self, key: CacheEngineKey) -> bool:
        return self._guard("remove", lambda: self._store.delete([self._key(key)]) > 0, False)

    def __repr__(self) -> str:
        return f"<KVStoreConnector {self._store.address}>"


class KVStoreConnectorAdapter(ConnectorAdapter):
    """What ``remote_storage_plugin.<name>.class_name`` names; LMCache builds it with no
    arguments and asks it for the connector of ``plugin://<name>``."""

    def __init__(self) -> None:
        super().__init__(f"plugin://{PLUGIN_TYPE}")

    def can_parse(self, url: str) -> bool:
        # "plugin://kvstore" or an instance of it ("plugin://kvstore.node")
        return url.startswith("plugin://") and url[len("plugin://") :].split(".")[0] == PLUGIN_TYPE

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        return KVStoreConnector(
            context.loop,
            context.local_cpu_backend,
            context.config,
            context.metadata,
            plugin_name=context.plugin_name or PLUGIN_TYPE,
        )
