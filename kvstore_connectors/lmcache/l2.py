"""kvstore as an L2 of LMCache's multiprocess server (LMCache 0.5.6)::

    lmcache server ... --l2-adapter '{"type": "plugin",
        "module_path": "kvstore_connectors.lmcache.l2", "class_name": "KVStoreL2Adapter",
        "adapter_params": {"address": "unix:/tmp/kvstore.sock"}}'

The server's StoreController and PrefetchController threads submit tasks;
one worker thread of the adapter runs them in order through the same daemon
link as the in-process connector (kvstore_connectors.lmcache.store: the shared region
for a local daemon, inline gRPC for a remote one; the daemon down means failed
stores and misses, and one warning), then posts the result and signals the
task kind's eventfd.

Namespaces: an ObjectKey's model, kv_rank (world size and rank as the
namespace's tp world size / rank, the whole packed rank in the layout),
object group and cache_salt (the tenant), plus the object's layout (shapes
and dtypes: one namespace has one block size). Stores learn the layout from
the objects, lookups from ``group_layout_descs``, or else from what this
adapter stored for that (model, rank, group) before; a lookup with neither
misses.

Locks: lookup-and-lock does not pin (as LMCache's fs adapter: unlock is a
no-op): the daemon evicts on its own, so a block evicted between lookup and
load is a failed load, which the controller already handles.
Usage: capacity is the daemon's (it evicts by itself), so the adapter
declares none (no global eviction by LMCache) and reports what it stored.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier

from kvstore.client import DEFAULT_ADDRESS
from kvstore.namespace import NamespaceSpec
from kvstore_connectors.lmcache.blocks import slot_bytes
from kvstore_connectors.lmcache.keys import LAYOUT_VERSION, block_hash
from kvstore_connectors.lmcache.store import Chunk, ChunkStore

logger = logging.getLogger(__name__)

MAX_DONE_TASKS = 65536  # results nobody collected are dropped beyond this (oldest first)
MAX_LEARNT_LAYOUTS = 4096


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _layout_text(shapes: Any, dtypes: Any) -> tuple[str, int]:
    """("float16[2, 4, 256, 128],...", payload bytes) of a layout."""
    text = ",".join(f"{_dtype_name(d)}{list(s)}" for s, d in zip(shapes, dtypes, strict=True))
    nbytes = 0
    for s, d in zip(shapes, dtypes, strict=True):
        n = d.itemsize
        for dim in s:
            n *= int(dim)
        nbytes += n
    return text, nbytes


def object_spec(key: ObjectKey, layout: str, payload_bytes: int) -> NamespaceSpec:
    """The namespace of ``key``'s objects of one layout."""
    world = max(1, (key.kv_rank >> 24) & 0xFF)
    rank = (key.kv_rank >> 16) & 0xFF
    return NamespaceSpec(
        model=key.model_name,
        dtype=layout.split("[", 1)[0],
        # An MP-server object is opaque here: its shapes are in the layout string.
        block_size_tokens=1,
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        block_bytes=slot_bytes(0, payload_bytes),
        tp_rank=rank if rank < world else 0,
        tp_world_size=world,
        tenant=key.cache_salt,
        layout=(
            f"lmcache-mp/v{LAYOUT_VERSION};kv_rank={key.kv_rank:08x};"
            f"group={key.object_group_id};shapes={layout}"
        ),
    )


def _writer(objects: list[MemoryObj], idx: list[int]) -> Callable[[bytes, np.ndarray], int | None]:
    """ChunkStore.get's ``make`` for a load: the n-th chunk found goes into objects[idx[n]]."""
    it = iter(idx)

    def write(meta: bytes, payload: np.ndarray) -> int | None:
        i = next(it)
        dst = np.frombuffer(objects[i].byte_array, dtype=np.uint8)
        if len(dst) != len(payload):
            logger.warning(
                "kvstore: L2 object of %d bytes, buffer of %d: not loaded", len(payload), len(dst)
            )
            return None
        dst[:] = payload
        return i

    return write


class KVStoreL2Adapter(L2AdapterInterface):
    def __init__(self, params: dict[str, Any] | None = None, **_: Any) -> None:
        super().__init__(max_capacity_bytes=0)
        params = dict(params or {})
        self._store = ChunkStore(
            str(params.get("address") or DEFAULT_ADDRESS),
            meta_bytes=0,
            timeout_s=float(params.get("timeout_s", 5.0)),
            retry_initial_s=float(params.get("retry_initial_s", 1.0)),
            retry_max_s=float(params.get("retry_max_s", 30.0)),
            map_region=bool(params.get("map_region", True)),
        )
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._next_id = 0
        self._stores_done: dict[L2TaskId, L2StoreResult] = {}
        self._lookups_done: dict[L2TaskId, Bitmap] = {}
        self._loads_done: dict[L2TaskId, Bitmap] = {}
        # (model, kv_rank, group) -> (layout text, payload bytes) seen in stores
        self._layouts: dict[tuple[str, int, int], tuple[str, int]] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstore-l2")

    # ------------------------------------------------------------ event fds

    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # ------------------------------------------------------------ tasks

    def _submit(
        self, run: Callable[[], Any], done: dict[L2TaskId, Any], efd: Any, miss: Any
    ) -> L2TaskId:
        with self._lock:
            task_id = self._next_id
            self._next_id += 1

        def task() -> None:
            try:
                result = run()
            except Exception as exc:  # never into LMCache's controller threads
                logger.warning("kvstore: L2 task failed (%s); reported as failed", exc)
                result = miss()
            with self._lock:
                if len(done) >= MAX_DONE_TASKS:
                    done.pop(next(iter(done)))
                done[task_id] = result
            efd.notify()

        self._pool.submit(task)
        return task_id

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        def run() -> L2StoreResult:
            chunks = []
            for key, obj in zip(keys, objects, strict=True):
                layout, nbytes = _layout_text(obj.get_shapes(), obj.get_dtypes())
                payload = np.frombuffer(obj.byte_array, dtype=np.uint8)
                if len(payload) != nbytes:
                    raise ValueError(
                        f"object of {len(payload)} bytes, its shapes say {nbytes}: not stored"
                    )
                ident = (key.model_name, key.kv_rank, key.object_group_id)
                with self._lock:
                    if ident not in self._layouts and len(self._layouts) < MAX_LEARNT_LAYOUTS:
                        self._layouts[ident] = (layout, nbytes)
                chunks.append(
                    Chunk(
                        object_spec(key, layout, nbytes), block_hash(key.chunk_hash), b"", payload
                    )
                )
            report = self._store.put(chunks)
            sizes = [len(c.payload) for c in chunks]
            if report.ok:
                self._notify_keys_stored(keys, sizes)
            return L2StoreResult(report.ok, sum(sizes) if report.ok else 0)

        return self._submit(
            run, self._stores_done, self._store_efd, lambda: L2StoreResult(False, 0)
        )

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stores_done = self._stores_done, {}
        return done

    def _spec_for(
        self, key: ObjectKey, descs: dict[int, MemoryLayoutDesc] | None
    ) -> NamespaceSpec | None:
        desc = (descs or {}).get(key.object_group_id)
        if desc is not None:
            layout, nbytes = _layout_text(desc.shapes, desc.dtypes)
        else:
            with self._lock:
                learnt = self._layouts.get((key.model_name, key.kv_rank, key.object_group_id))
            if learnt is None:
                return None
            layout, nbytes = learnt
        return object_spec(key, layout, nbytes)

    def _groups(
        self, keys: list[ObjectKey], descs: dict[int, MemoryLayoutDesc] | None
    ) -> dict[NamespaceSpec, list[int]]:
        """Key indices per namespace, in order (each namespace's keys are one prefix)."""
        groups: dict[NamespaceSpec, list[int]] = {}
        for i, key in enumerate(keys):
            spec = self._spec_for(key, descs)
            if spec is not None:
                groups.setdefault(spec, []).append(i)
        return groups

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc] | None = None
    ) -> L2TaskId:
        def run() -> Bitmap:
            bitmap = Bitmap(len(keys))
            for spec, idx in self._groups(keys, group_layout_descs).items():
                found = self._store.prefix([(spec, block_hash(keys[i].chunk_hash)) for i in idx])
                for i in idx[:found]:
                    bitmap.set(i)
            return bitmap

        return self._submit(run, self._lookups_done, self._lookup_efd, lambda: Bitmap(len(keys)))

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._lookups_done.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        return None  # lookups pin nothing (module docstring)

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        def run() -> Bitmap:
            bitmap = Bitmap(len(keys))
            groups: dict[NamespaceSpec, list[int]] = {}
            for i, (key, obj) in enumerate(zip(keys, objects, strict=True)):
                layout, nbytes = _layout_text(obj.get_shapes(), obj.get_dtypes())
                groups.setdefault(object_spec(key, layout, nbytes), []).append(i)
            loaded: list[ObjectKey] = []
            for spec, idx in groups.items():
                write = _writer(objects, idx)
                hashes = [(spec, block_hash(keys[i].chunk_hash)) for i in idx]
                for i in self._store.get(hashes, write, lambda i: None):
                    bitmap.set(i)
                    loaded.append(keys[i])
            if loaded:
                self._notify_keys_accessed(loaded)
            return bitmap

        return self._submit(run, self._loads_done, self._load_efd, lambda: Bitmap(len(keys)))

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loads_done.pop(task_id, None)

    def delete(self, keys: list[ObjectKey]) -> None:
        groups = self._groups(keys, None)
        for spec, idx in groups.items():
            self._store.delete([(spec, block_hash(keys[i].chunk_hash)) for i in idx])

    def report_status(self) -> dict:
        return {
            "is_healthy": True,
            "type": "KVStoreL2Adapter",
            "address": self._store.address,
            "daemon_failures": self._store.failures,
        }

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._store.close()
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()
