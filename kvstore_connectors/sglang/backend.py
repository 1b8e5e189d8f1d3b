"""``KVStoreHiCacheStorage``: kvstore as SGLang HiCache's storage (L3) backend.

Selected with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore_connectors.sglang.backend", "class_name": "KVStoreHiCacheStorage",
        "interface_v1": 1, "kvstore_address": "unix:/run/kvstore/kvstore.sock"}'

``interface_v1`` makes SGLang call the zero-copy ``batch_get_v1`` /
``batch_set_v1(keys, host_indices)``: pages go between SGLang's host pool and
the daemon's shared region with one memmove per contiguous run, no staging
tensor (kvstore_connectors.sglang.pages). Without it SGLang uses the tensor path
(``batch_get`` / ``batch_set`` of flat pages); both store the same bytes.

Every daemon call goes through ``DaemonSession`` (kvstore_connectors.vllm.session):
the daemon down or failing costs one warning and turns into misses / "not
stored", never an exception into SGLang's storage threads. SGLang calls a
backend from its prefetch, prefetch-IO and backup threads at once; one lock
serialises the calls (the session and its client are not thread-safe).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import numpy as np
import xxhash
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from kvstore.client import Client, Namespace
from kvstore.namespace import NamespaceSpec
from kvstore.v1 import store_pb2 as pb
from kvstore_connectors.sglang.identity import KV_POOL, namespace_spec
from kvstore_connectors.sglang.keys import key_to_block_hash, keys_to_block_hashes
from kvstore_connectors.sglang.pages import (
    PageLayout,
    is_view_of,
    pages_to_region,
    pages_to_rows,
    region_to_pages,
    rows_to_pages,
)
from kvstore_connectors.vllm.session import DaemonSession

logger = logging.getLogger(__name__)

T = TypeVar("T")

# SGLang's STORAGE_BATCH_SIZE: the controller never asks for more pages at once;
# a larger call is still served, in pieces of this many.
MAX_BATCH_PAGES = 128
_STORED_OK = (pb.STORE_PRESENT, pb.STORE_IN_FLIGHT)


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """The ``kvstore_*`` keys of ``--hicache-storage-backend-extra-config``."""

    address: str
    timeout_s: float = 0.5
    retry_initial_s: float = 0.5
    retry_max_s: float = 10.0
    tenant: str = ""
    model: str = ""
    verify_checksums: bool = True
    # False: never map the daemon's region, bytes go inline over gRPC (what a
    # daemon on another host gets anyway; set it to test that path).
    map_region: bool = True

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> BackendConfig:
        extra = extra or {}
        problems = []
        known = {
            "kvstore_address",
            "kvstore_timeout_s",
            "kvstore_retry_initial_s",
            "kvstore_retry_max_s",
            "kvstore_tenant",
            "kvstore_model",
            "kvstore_verify_checksums",
            "kvstore_map_region",
        }
        unknown = sorted(k for k in extra if k.startswith("kvstore_") and k not in known)
        if unknown:
            problems.append(f"unknown keys {unknown} (known: {sorted(known)})")
        try:
            config = cls(
                address=str(
                    extra.get("kvstore_address")
                    or os.environ.get("KVSTORE_ADDRESS", "unix:/tmp/kvstore.sock")
                ),
                timeout_s=float(extra.get("kvstore_timeout_s", 0.5)),
                retry_initial_s=float(extra.get("kvstore_retry_initial_s", 0.5)),
                retry_max_s=float(extra.get("kvstore_retry_max_s", 10.0)),
                tenant=str(extra.get("kvstore_tenant", "")),
                model=str(extra.get("kvstore_model", "")),
                verify_checksums=bool(extra.get("kvstore_verify_checksums", True)),
                map_region=bool(extra.get("kvstore_map_region", True)),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"kvstore HiCache backend: bad extra config: {exc}") from None
        if config.timeout_s <= 0:
            problems.append("kvstore_timeout_s must be > 0")
        if not 0 < config.retry_initial_s <= config.retry_max_s:
            problems.append("need 0 < kvstore_retry_initial_s <= kvstore_retry_max_s")
        if problems:
            raise ValueError("kvstore HiCache backend: bad extra config: " + "; ".join(problems))
        return config


class _Pool:
    """One registered host pool: how its pages lie and which namespace they go in."""

    def __init__(
        self, name: str, host_pool: Any, spec_of: Callable[[Any, str, int], NamespaceSpec]
    ):
        self.name = name
        self.host_pool = host_pool
        self.page_size = int(getattr(host_pool, "page_size", 1) or 1)
        view = host_pool.get_data_page(0, flat=False)
        buffer = getattr(host_pool, "kv_buffer", None)
        # Zero copy where the page view lies in host memory the pool owns (every
        # MHA/MLA layout); otherwise the pool's own flat-page copies (Mamba...).
        self.zero_copy = (
            getattr(view, "device", None) is not None
            and view.device.type == "cpu"
            and buffer is not None
            and not isinstance(buffer, list | tuple)
            and is_view_of(view, buffer)
        )
        if self.zero_copy:
            self.layout: PageLayout | None = PageLayout.of_view(view)
            page_bytes = self.layout.page_bytes
        else:
            self.layout = None
            dummy = host_pool.get_dummy_flat_data_page()
            page_bytes = dummy.numel() * dummy.element_size()
        self.page_bytes = page_bytes
        self.spec = spec_of(host_pool, name, page_bytes)

    def page_addrs(self, page_indices: Sequence[int]) -> list[int]:
        get = self.host_pool.get_data_page
        return [get(i, flat=False).data_ptr() for i in page_indices]

    # The copy path, for pools whose pages are not one view of host memory.
    def read_rows(self, page_indices: Sequence[int]) -> np.ndarray:
        rows = np.empty((len(page_indices), self.page_bytes), dtype=np.uint8)
        if self.layout is not None:
            pages_to_rows(self.layout, self.page_addrs(page_indices), rows)
            return rows
        for r, i in enumerate(page_indices):
            page = self.host_pool.get_data_page(i, flat=True)
            rows[r] = page.contiguous().view(-1).cpu().view(_torch_uint8()).numpy()
        return rows

    def write_rows(self, page_indices: Sequence[int], rows: np.ndarray) -> None:
        if self.layout is not None:
            rows_to_pages(self.layout, self.page_addrs(page_indices), rows)
            return
        import torch

        dummy = self.host_pool.get_dummy_flat_data_page()
        for r, i in enumerate(page_indices):
            page = torch.from_numpy(rows[r].copy()).view(dummy.dtype)
            self.host_pool.set_from_flat_data_page(i, page)


def _torch_uint8() -> Any:
    import torch

    return torch.uint8


class KVStoreHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage backend over a kvstore daemon (module docstring)."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        self.storage_config = storage_config
        self.config = BackendConfig.from_extra(storage_config.extra_config)
        self.model = self.config.model or storage_config.model_name or ""
        if not self.model:
            raise ValueError(
                "kvstore HiCache backend: no model name (SGLang gave none); set kvstore_model"
            )
        self.session = DaemonSession(
            self.config.address,
            timeout_s=self.config.timeout_s,
            retry_initial_s=self.config.retry_initial_s,
            retry_max_s=self.config.retry_max_s,
            map_region=self.config.map_region,
        )
        self._lock = threading.Lock()
        self._pools: dict[str, _Pool] = {}
        self.counters = {
            "stored_pages": 0,
            "loaded_pages": 0,
            "store_failures": 0,
            "checksum_failures": 0,
        }

    # ------------------------------------------------------------ pools

    def _spec_of(self, host_pool: Any, name: str, page_bytes: int) -> NamespaceSpec:
        return namespace_spec(
            self.storage_config,
            host_pool,
            pool_name=name,
            page_bytes=page_bytes,
            model=self.model,
            tenant=self.config.tenant,
        )

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        with self._lock:
            self._pools[KV_POOL] = _Pool(KV_POOL, mem_pool_host, self._spec_of)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        with self._lock:
            known = self._pools.get(name)
            if known is None or known.host_pool is not host_pool:
                self._pools[name] = _Pool(name, host_pool, self._spec_of)

    def namespace_spec(self, pool_name: str = KV_POOL) -> NamespaceSpec | None:
        """The namespace a registered pool's pages go in (None: no such pool yet)."""
        pool = self._pools.get(pool_name)
        return pool.spec if pool is not None else None

    def _pool(self, name: str) -> _Pool | None:
        pool = self._pools.get(name)
        if pool is None:
            logger.warning("kvstore: no host pool %r registered; treating as a miss", name)
        return pool

    # ------------------------------------------------------------ core ops

    def _prefix(self, pool: _Pool, hashes: np.ndarray) -> int:
        found = 0
        for start in range(0, len(hashes), MAX_BATCH_PAGES):
            chunk = hashes[start : start + MAX_BATCH_PAGES]
            n = self.session.call_in("lookup", pool.spec, partial(_prefix_blocks, hashes=chunk))
            if not n:
                break
            found += min(int(n), len(chunk))
            if n < len(chunk):
                break
        return found

    def _store(
        self,
        pool: _Pool,
        hashes: np.ndarray,
        page_indices: list[int] | None,
        rows: np.ndarray | None,
        parent: int | None,
    ) -> list[bool]:
        """Store pages (from the pool at ``page_indices``, or ``rows``); per page: stored."""
        results: list[bool] = []
        for start in range(0, len(hashes), MAX_BATCH_PAGES):
            end = start + MAX_BATCH_PAGES
            chunk = hashes[start:end]
            idx = page_indices[start:end] if page_indices is not None else None
            part = rows[start:end] if rows is not None else None
            ok = self.session.call_in(
                "store",
                pool.spec,
                partial(
                    self._store_chunk,
                    pool=pool,
                    hashes=chunk,
                    page_indices=idx,
                    rows=part,
                    parent=parent,
                ),
            )
            results.extend(ok if ok is not None else [False] * len(chunk))
            parent = int(chunk[-1])
        stored = sum(results)
        self.counters["stored_pages"] += stored
        self.counters["store_failures"] += len(results) - stored
        return results

    def _store_chunk(
        self,
        client: Client,
        ns: Namespace,
        pool: _Pool,
        hashes: np.ndarray,
        page_indices: list[int] | None,
        rows: np.ndarray | None,
        parent: int | None,
    ) -> list[bool]:
        if client.region is None:  # a daemon on another host: bytes inline over gRPC
            if rows is None:
                assert page_indices is not None
                rows = pool.read_rows(page_indices)
            put = client.put(ns, hashes, rows)
            # put reports counts only; a refusal (no room) leaves the tail unstored.
            return [True] * len(hashes) if put.no_room == 0 else [False] * len(hashes)
        handle = client.prepare_store(ns, hashes)
        todo = handle.allocated
        ok = [bool(s in _STORED_OK) for s in handle.statuses.tolist()]
        if len(todo):
            region = client.region
            try:
                if rows is not None:
                    region_rows = [
                        region[int(o) : int(o) + ns.block_bytes] for o in handle.offsets[todo]
                    ]
                    for dst, i in zip(region_rows, todo.tolist(), strict=True):
                        dst[:] = rows[i]
                elif pool.layout is not None:
                    assert page_indices is not None
                    pages_to_region(
                        pool.layout,
                        pool.page_addrs([page_indices[i] for i in todo.tolist()]),
                        region.ctypes.data,
                        handle.offsets[todo],
                    )
                else:
                    assert page_indices is not None
                    staged = pool.read_rows([page_indices[i] for i in todo.tolist()])
                    for r, off in enumerate(handle.offsets[todo].tolist()):
                        region[off : off + ns.block_bytes] = staged[r]
            except BaseException:
                client.release(handle, wait=False)
                raise
            if client.expired(handle):
                client.release(handle, wait=False)
                return [False] * len(hashes)
            client.commit_store(handle, parent_block_hash=parent)
            for i in todo.tolist():
                ok[i] = True
        elif handle.lease_id:
            client.release(handle, wait=False)
        return ok

    def _load(
        self,
        pool: _Pool,
        hashes: np.ndarray,
        page_indices: list[int] | None,
        outs: list[Any] | None,
    ) -> int:
        """Load the longest present prefix into the pool's pages (or ``outs`` tensors)."""
        loaded = 0
        for start in range(0, len(hashes), MAX_BATCH_PAGES):
            end = start + MAX_BATCH_PAGES
            chunk = hashes[start:end]
            idx = page_indices[start:end] if page_indices is not None else None
            part = outs[start:end] if outs is not None else None
            got = self.session.call_in(
                "load",
                pool.spec,
                partial(self._load_chunk, pool=pool, hashes=chunk, page_indices=idx, outs=part),
            )
            n = int(got or 0)
            loaded += n
            if n < len(chunk):
                break
        self.counters["loaded_pages"] += loaded
        return loaded

    def _load_chunk(
        self,
        client: Client,
        ns: Namespace,
        pool: _Pool,
        hashes: np.ndarray,
        page_indices: list[int] | None,
        outs: list[Any] | None,
    ) -> int:
        if client.region is None:
            got = client.get(ns, hashes)
            self._deliver_rows(pool, got.data, page_indices, outs)
            return int(got.found)
        # Direct where the presence table shows the pages in DRAM (no call, no
        # lease), else pinned; either way ``intact`` says what to trust after the copy.
        handle = client.prepare_load(ns, hashes, pin=False)
        try:
            found = min(int(handle.found), len(hashes))
            region = client.region
            if found and self.config.verify_checksums:
                found = self._verified(handle, region, found)
            if not found:
                return 0
            offsets = handle.offsets[:found]
            if outs is None and pool.layout is not None:
                assert page_indices is not None
                region_to_pages(
                    pool.layout, pool.page_addrs(page_indices[:found]), region.ctypes.data, offsets
                )
            else:
                rows = np.stack([region[int(o) : int(o) + ns.block_bytes] for o in offsets])
                self._deliver_rows(pool, rows, page_indices, outs)
            # Bytes read after the lease ran out, or read directly from a slot its
            # block left meanwhile, may be another block's.
            return min(found, client.intact(handle))
        finally:
            client.release(handle, wait=False)

    def _verified(self, handle: Any, region: np.ndarray, found: int) -> int:
        """The prefix of blocks whose bytes match the daemon's checksum (where it has one)."""
        sums = handle.checksums[:found]
        bb = handle.namespace.block_bytes
        for i in np.flatnonzero(sums).tolist():
            off = int(handle.offsets[i])
            if xxhash.xxh3_64_intdigest(region[off : off + bb].data) != int(sums[i]):
                self.counters["checksum_failures"] += 1
                logger.warning("kvstore: page %d of a load failed its checksum; a miss from it", i)
                return i
        return found

    @staticmethod
    def _deliver_rows(
        pool: _Pool, rows: np.ndarray, page_indices: list[int] | None, outs: list[Any] | None
    ) -> None:
        if outs is not None:
            for r, out in enumerate(outs[: len(rows)]):
                _tensor_bytes(out)[:] = rows[r]
        else:
            assert page_indices is not None
            pool.write_rows(page_indices[: len(rows)], rows)

    # ------------------------------------------------------------ guard

    def _guarded(self, what: str, miss: T, fn: Callable[[], T]) -> T:
        """``fn()`` under the lock; an unexpected error is logged and becomes ``miss``:
        SGLang's storage threads must never see an exception from the cache."""
        with self._lock:
            try:
                return fn()
            except Exception:
                logger.exception("kvstore: %s failed; going on without the cache", what)
                return miss

    def _page_indices(self, pool: _Pool, n: int, host_indices: Any) -> list[int] | None:
        flat = host_indices.reshape(-1)
        if flat.numel() != n * pool.page_size:
            logger.error(
                "kvstore: %d keys need %d host indices (page size %d), got %d",
                n,
                n * pool.page_size,
                pool.page_size,
                flat.numel(),
            )
            return None
        starts = [int(x) for x in flat[:: pool.page_size].tolist()]
        # The copies write through raw addresses: a page outside the pool would
        # overwrite other memory, so refuse it before touching anything.
        limit = getattr(pool.host_pool, "size", None)
        if starts and (
            min(starts) < 0 or (limit is not None and max(starts) + pool.page_size > limit)
        ):
            logger.error(
                "kvstore: host indices outside the pool (%d tokens): %d..%d",
                limit,
                min(starts),
                max(starts),
            )
            return None
        return starts

    @staticmethod
    def _parent(keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None) -> int | None:
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        return key_to_block_hash(prefix[-1]) if prefix else None

    # ------------------------------------------------------------ zero-copy v1

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._set_pool(KV_POOL, keys, host_indices, extra_info)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._get_pool(KV_POOL, keys, host_indices)

    def _set_pool(
        self,
        name: str,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None,
    ) -> list[bool]:
        def run() -> list[bool]:
            pool = self._pool(name)
            if pool is None or not keys:
                return [False] * len(keys)
            idx = self._page_indices(pool, len(keys), host_indices)
            if idx is None:
                return [False] * len(keys)
            hashes = keys_to_block_hashes(keys)
            return self._store(pool, hashes, idx, None, self._parent(keys, extra_info))

        return self._guarded("batch_set", [False] * len(keys), run)

    def _get_pool(self, name: str, keys: list[str], host_indices: Any) -> list[bool]:
        def run() -> list[bool]:
            pool = self._pool(name)
            if pool is None or not keys:
                return [False] * len(keys)
            idx = self._page_indices(pool, len(keys), host_indices)
            if idx is None:
                return [False] * len(keys)
            n = self._load(pool, keys_to_block_hashes(keys), idx, None)
            return [i < n for i in range(len(keys))]

        return self._guarded("batch_get", [False] * len(keys), run)

    # ------------------------------------------------------------ existence

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages of ``keys`` the daemon holds (SGLang's contract)."""

        def run() -> int:
            pool = self._pool(KV_POOL)
            if pool is None or not keys:
                return 0
            return self._prefix(pool, keys_to_block_hashes(keys))

        return self._guarded("batch_exists", 0, run)

    # ------------------------------------------------------------ tensor path

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0] if got else None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        """Flat pages into ``target_locations`` (new tensors when None); None where missing."""

        def run() -> list[Any]:
            pool = self._pool(KV_POOL)
            if pool is None or not keys:
                return [None] * len(keys)
            outs = list(target_locations) if target_locations is not None else None
            if outs is None:
                outs = [pool.host_pool.get_dummy_flat_data_page() for _ in keys]
            for out in outs:
                if out.numel() * out.element_size() != pool.page_bytes:
                    logger.error(
                        "kvstore: a %d-byte target for %d-byte pages",
                        out.numel() * out.element_size(),
                        pool.page_bytes,
                    )
                    return [None] * len(keys)
            n = self._load(pool, keys_to_block_hashes(keys), None, outs)
            return [outs[i] if i < n else None for i in range(len(keys))]

        return self._guarded("batch_get", [None] * len(keys), run)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat pages (``values``, one tensor per key); True when all are stored."""

        def run() -> bool:
            pool = self._pool(KV_POOL)
            if pool is None or not keys or values is None or len(values) != len(keys):
                return False
            rows = np.empty((len(keys), pool.page_bytes), dtype=np.uint8)
            for r, value in enumerate(values):
                data = _tensor_bytes(value)
                if len(data) != pool.page_bytes:
                    logger.error(
                        "kvstore: a %d-byte value for %d-byte pages", len(data), pool.page_bytes
                    )
                    return False
                rows[r] = data
            return all(self._store(pool, keys_to_block_hashes(keys), None, rows, None))

        return self._guarded("batch_set", False, run)

    # ------------------------------------------------------------ v2: several pools

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {
            str(t.name): self._set_pool(str(t.name), t.keys or [], t.host_indices, extra_info)
            for t in transfers
        }

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {
            str(t.name): self._get_pool(str(t.name), t.keys or [], t.host_indices)
            for t in transfers
        }

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The longest KV prefix every extra pool can restore (SGLang's hit policies:
        ALL_PAGES needs every page of the prefix in the pool, TRAILING_PAGES only
        its last ``len(transfer.keys)``)."""

        def run() -> PoolTransferResult:
            kv_pages = self.batch_exists_unlocked(keys)
            hits: dict[str, int] = {KV_POOL: kv_pages} if kv_pages else {}
            restorable = set(range(1, kv_pages + 1))
            for t in pool_transfers or []:
                if not restorable:
                    break
                pool = self._pool(str(t.name))
                if pool is None:
                    restorable = set()
                    break
                present = self._present(pool, keys[:kv_pages])
                if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                    boundary = present.index(False) if False in present else kv_pages
                    ok = set(range(1, boundary + 1))
                elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                    trailing = max(1, len(t.keys) if t.keys else 1)
                    ok = {
                        n for n in range(1, kv_pages + 1) if all(present[max(0, n - trailing) : n])
                    }
                    boundary = max(ok, default=0)
                else:
                    logger.warning("kvstore: hit policy %s not supported: a miss", t.hit_policy)
                    ok, boundary = set(), 0
                if boundary:
                    hits[str(t.name)] = boundary
                restorable &= ok
            ordered = sorted(restorable)
            return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

        return self._guarded("batch_exists_v2", PoolTransferResult.empty(), run)

    def batch_exists_unlocked(self, keys: list[str]) -> int:
        pool = self._pools.get(KV_POOL)
        if pool is None or not keys:
            return 0
        return self._prefix(pool, keys_to_block_hashes(keys))

    def _present(self, pool: _Pool, keys: list[str]) -> list[bool]:
        """Per key, whether the pool's namespace holds it (one lookup per key: extra
        pools hold scattered pages, so a prefix answer is not enough)."""
        return [self._prefix(pool, keys_to_block_hashes([k])) == 1 for k in keys]

    # ------------------------------------------------------------ admin

    def clear(self) -> None:
        """Drop every page of this backend's namespaces from the daemon."""

        def run() -> None:
            for pool in list(self._pools.values()):
                self.session.call_in("clear", pool.spec, lambda c, ns: c.clear(ns))

        self._guarded("clear", None, run)

    def get_stats(self) -> dict[str, int]:
        return dict(self.counters)

    def close(self) -> None:
        with self._lock:
            self.session.close()


def _prefix_blocks(client: Client, ns: Namespace, hashes: np.ndarray) -> int:
    return client.lookup(ns, hashes).prefix_blocks


def _tensor_bytes(tensor: Any) -> np.ndarray:
    """A CPU tensor's bytes as a writable uint8 numpy view (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("kvstore: page tensors must be contiguous")
    return tensor.view(-1).view(_torch_uint8()).numpy()
