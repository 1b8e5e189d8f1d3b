"""SGLang's side of `kvstore-bench sglang`; runs inside .venv-sglang only.

Times what SGLang's cache controller does per storage batch, on one real
MHATokenToKVPoolHost, for two backends on the same pages:

- kvstore (``kvstore_connectors.sglang.backend``, built by SGLang's factory, zero-copy
  ``batch_set_v1`` / ``batch_get_v1``: the controller's ``interface_v1`` path);
- SGLang's own ``HiCacheFile`` (its generic path, as ``_generic_page_set`` /
  ``_generic_page_get`` drive it: a flat page tensor per page, then
  ``set_from_flat_data_page`` on load).

Prints one JSON object: per backend and direction, the seconds of each
repetition. Every repetition stores fresh keys (stores of present keys are
skipped by both) and loads those back, then clears.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time

import torch

from tests.integration.sglang_worker import BACKEND, make_pool, storage_config


def _keys(rep: int, n: int) -> list[str]:
    return [hashlib.sha256(f"{rep}:{i}".encode()).hexdigest() for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layout", default="page_first")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=128)  # SGLang's STORAGE_BATCH_SIZE
    ap.add_argument("--file-dir", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    ps = args.page_size
    pool = make_pool(
        mla=False,
        layout=args.layout,
        page_size=ps,
        pages=args.pages,
        layers=args.layers,
        heads=args.heads,
        dim=args.dim,
    )
    g = torch.Generator().manual_seed(1)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.kv_buffer.dtype))
    page_bytes = pool.get_data_page(0, flat=True).numel() * pool.dtype.itemsize
    pages = list(range(args.pages))
    cfg_args = {"mla": False, "layout": args.layout}
    kv = StorageBackendFactory.create_backend(
        "dynamic",
        storage_config(cfg_args, {**BACKEND, "kvstore_address": args.address}),
        pool,
    )
    kv.register_mem_pool_host(pool)
    file_dir = args.file_dir or tempfile.mkdtemp(prefix="hicache-bench-")
    hf = HiCacheFile(storage_config(cfg_args, {}), file_path=file_dir)
    hf.register_mem_pool_host(pool)

    def batches(keys):
        for s in range(0, len(keys), args.batch):
            part = pages[s : s + args.batch]
            idx = torch.tensor([p * ps + t for p in part for t in range(ps)], dtype=torch.int64)
            yield keys[s : s + args.batch], part, idx

    def kv_set(keys):
        for k, _, idx in batches(keys):
            assert all(kv.batch_set_v1(k, idx)), "kvstore store refused pages"

    def kv_get(keys):
        for k, _, idx in batches(keys):
            assert all(kv.batch_get_v1(k, idx)), "kvstore load missed pages"

    def file_set(keys):
        for k, part, _ in batches(keys):
            data = [pool.get_data_page(p * ps) for p in part]
            assert hf.batch_set(k, data), "file store failed"

    def file_get(keys):
        for k, part, _ in batches(keys):
            got = hf.batch_get(k, [pool.get_dummy_flat_data_page() for _ in k])
            for p, page in zip(part, got, strict=True):
                assert page is not None, "file load missed a page"
                pool.set_from_flat_data_page(p * ps, page)

    results: dict[str, list[float]] = {}
    # Repetition 0 is a warm-up, not counted: first connection, namespace
    # declaration, the region's and the file system's first touch.
    for rep in range(args.reps + 1):
        for name, put, get, backend in (
            ("kvstore", kv_set, kv_get, kv),
            ("file", file_set, file_get, hf),
        ):
            keys = _keys(rep, len(pages))
            t0 = time.perf_counter()
            put(keys)
            t1 = time.perf_counter()
            get(keys)
            t2 = time.perf_counter()
            if rep:
                results.setdefault(f"{name}_set", []).append(t1 - t0)
                results.setdefault(f"{name}_get", []).append(t2 - t1)
            backend.clear()
    kv.close()
    if not args.file_dir:
        shutil.rmtree(file_dir, ignore_errors=True)
    json.dump(
        {
            "pages": len(pages),
            "page_bytes": page_bytes,
            "layout": args.layout,
            "file_dir": file_dir,
            "seconds": results,
        },
        sys.stdout,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
