"""SGLang's side of tests/integration/test_sglang_backend.py; runs in .venv-sglang only.

Builds SGLang 0.5.23's own host pools (MHATokenToKVPoolHost, MLATokenToKVPoolHost)
on CPU and the kvstore backend through SGLang's own StorageBackendFactory
(``dynamic``, as ``--hicache-storage-backend dynamic`` does), then serves
commands, one JSON object per stdin line, one JSON answer per stdout line, so
the test can kill the daemon between two commands. Page contents are reported
as SHA-256 digests of the pool's own flat page (``get_data_page(i, flat=True)``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import traceback
from typing import Any

import msgspec
import torch
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MambaStateBufferInfo,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory

BACKEND = {
    "backend_name": "kvstore",
    "module_path": "kvstore_connectors.sglang.backend",
    "class_name": "KVStoreHiCacheStorage",
    "interface_v1": 1,
}


class WarningCount(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


WARNINGS = WarningCount()
logging.getLogger("kvstore_connectors").addHandler(WARNINGS)


def make_pool(
    *, mla: bool, layout: str, page_size: int, pages: int, layers: int, heads: int, dim: int
) -> Any:
    """A real SGLang host pool of ``pages`` pages (+ SGLang's padding page)."""
    dtype = torch.bfloat16
    tokens = pages * page_size
    with host_memory_budget_scope(1 << 40):  # tests size pools themselves
        if mla:
            # The device pool's per-layer rows [tokens, 1, kv_cache_dim], on CPU here.
            rows = tuple(
                torch.zeros(tokens + page_size, 1, dim, dtype=dtype) for _ in range(layers)
            )
            mla_info = MLABufferInfo(
                buffers=rows,
                data_ptrs=torch.tensor([t.data_ptr() for t in rows], dtype=torch.uint64),
                layer_indices=tuple(range(layers)),
                device_layer_num=layers,
                page_size=page_size,
                kv_lora_rank=dim - 16,
                qk_rope_head_dim=16,
                kv_cache_dim=dim,
                dtype=dtype,
                device=torch.device("cpu"),
            )
            return MLATokenToKVPoolHost(
                mla_info,
                host_to_device_ratio=1.0,
                host_size=0,
                page_size=page_size,
                layout=layout,
                pin_memory=False,
                device="cpu",
                device_capacity_tokens=tokens,
                start_layer=0,
                end_layer=layers - 1,
                target_layer_num=layers,
            )
        k = tuple(torch.zeros(tokens + page_size, heads, dim, dtype=dtype) for _ in range(layers))
        v = tuple(torch.zeros(tokens + page_size, heads, dim, dtype=dtype) for _ in range(layers))
        ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
        info = MHABufferInfo(
            buffers=KVBuffers(
                k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD
            ),
            page_size=page_size,
            head_num=heads,
            head_dim=dim,
            v_head_dim=dim,
            dtype=dtype,
            device=torch.device("cpu"),
        )
        return MHATokenToKVPoolHost(
            info,
            host_to_device_ratio=1.0,
            host_size=0,
            page_size=page_size,
            layout=layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=tokens,
            start_layer=0,
            end_layer=layers - 1,
        )


def make_mamba_pool(pages: int) -> Any:
    """A real Mamba state host pool (page = one request's state checkpoint)."""
    info = MambaStateBufferInfo(
        temporal=torch.zeros(2, pages + 1, 4, 8),
        conv=(torch.zeros(2, pages + 1, 3, 8, dtype=torch.bfloat16),),
    )
    with host_memory_budget_scope(1 << 40):
        return MambaPoolHost(
            info, 1.0, 0, device_capacity=pages, pin_memory=False, device="cpu", layout="page_first"
        )


def storage_config(args: dict[str, Any], extra: dict[str, Any]) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=args.get("tp_rank", 0),
        tp_size=args.get("tp_size", 1),
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=args["mla"],
        enable_storage_metrics=False,
        is_page_first_layout=args["layout"] == "page_first",
        model_name=args.get("model", "tiny-model"),
        extra_config=extra,
    )


class Engine:
    """One engine rank: a host pool and the backend SGLang's factory made for it."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.pool = make_pool(
            mla=args["mla"],
            layout=args["layout"],
            page_size=args["page_size"],
            pages=args.get("pages", 16),
            layers=args.get("layers", 3),
            heads=args.get("heads", 2),
            dim=args.get("dim", 32),
        )
        self.page_size = args["page_size"]
        kind = args.get("backend", "kvstore")
        if kind == "file":
            config = storage_config(args, {"file_storage_path": args["file_path"]})
            self.backend = HiCacheFile(config, file_path=args["file_path"])
        else:
            extra = {**BACKEND, "kvstore_address": args["address"], **args.get("extra", {})}
            config = storage_config(args, extra)
            self.backend = StorageBackendFactory.create_backend("dynamic", config, self.pool)
        self.backend.register_mem_pool_host(self.pool)
        self.pools = {"kv": self.pool}  # + extra pools registered through the v2 API
        self.args = args

    def add_pool(self, pool_name: str, args: dict[str, Any]) -> None:
        from sglang.srt.mem_cache.hicache_storage import PoolName

        a = {**self.args, **args}
        if a.get("kind") == "mamba":
            self.pools[pool_name] = pool = make_mamba_pool(a.get("pages", 16))
            self.backend.register_mem_host_pool_v2(pool, PoolName(pool_name))
            return
        pool = make_pool(
            mla=a["mla"],
            layout=a["layout"],
            page_size=a["page_size"],
            pages=a.get("pages", 16),
            layers=a.get("layers", 3),
            heads=a.get("heads", 2),
            dim=a.get("dim", 32),
        )
        self.pools[pool_name] = pool
        self.backend.register_mem_host_pool_v2(pool, PoolName(pool_name))

    def transfers(self, specs: list[dict[str, Any]]) -> list[Any]:
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        return [
            PoolTransfer(
                name=PoolName(t["pool"]),
                host_indices=(
                    self.host_indices(t["pages"], self.pools[t["pool"]].page_size)
                    if "pages" in t
                    else None
                ),
                keys=t["keys"],
                hit_policy=PoolHitPolicy(t.get("policy", "all_pages")),
            )
            for t in specs
        ]

    def host_indices(self, pages: list[int], ps: int | None = None) -> torch.Tensor:
        ps = ps or self.page_size
        return torch.tensor([p * ps + t for p in pages for t in range(ps)], dtype=torch.int64)

    def fill(self, pages: list[int], seed: int, pool: str = "kv") -> list[str]:
        g = torch.Generator().manual_seed(seed)
        host = self.pools[pool]
        ps = host.page_size
        for p in pages:
            if isinstance(host, MambaPoolHost):  # its page is a copy: write through the pool
                dummy = host.get_dummy_flat_data_page()
                page = torch.randint(0, 256, dummy.shape, generator=g, dtype=torch.uint8)
                host.set_from_flat_data_page(p * ps, page.view(dummy.dtype))
                continue
            view = host.get_data_page(p * ps, flat=False)
            view.copy_(torch.randn(view.shape, generator=g).to(view.dtype))
        return self.digests(pages, pool)

    def digests(self, pages: list[int], pool: str = "kv") -> list[str]:
        out = []
        host = self.pools[pool]
        for p in pages:
            page = host.get_data_page(p * host.page_size, flat=True)
            out.append(hashlib.sha256(page.view(torch.uint8).numpy().tobytes()).hexdigest())
        return out

    def threads(self, keys: list[list[str]], pages: list[list[int]], rounds: int) -> list[bool]:
        """Each thread stores its own pages, loads them into the same pages and
        checks existence, ``rounds`` times; True per thread when every answer was right."""
        import threading

        ok = [True] * len(keys)

        def run(t: int) -> None:
            idx = self.host_indices(pages[t])
            for _ in range(rounds):
                ok[t] &= all(self.backend.batch_set_v1(keys[t], idx))
                ok[t] &= self.backend.batch_exists(keys[t]) == len(keys[t])
                ok[t] &= all(self.backend.batch_get_v1(keys[t], idx))

        threads = [threading.Thread(target=run, args=(t,)) for t in range(len(keys))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return ok

    def zero(self, pages: list[int]) -> None:
        for p in pages:
            self.pool.get_data_page(p * self.page_size, flat=False).zero_()


def serve() -> None:
    engines: dict[str, Engine] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            out: Any = None
            if op == "reset":  # a new test: drop the engines, their links and warnings
                for e in engines.values():
                    close = getattr(e.backend, "close", None)
                    if close is not None:
                        close()
                engines.clear()
                WARNINGS.messages.clear()
            elif op == "sglang_keys":  # SGLang's own page hashing (its C++ extension)
                from sglang.srt.mem_cache.utils import get_hash_str

                out = get_hash_str(cmd["tokens"], cmd.get("prior"), page_size=cmd["page_size"])
            elif op == "make":
                engines[cmd["name"]] = Engine(cmd)
                b = engines[cmd["name"]].backend
                out = {"class": type(b).__name__, "bases": [c.__name__ for c in type(b).__mro__]}
                spec = getattr(b, "namespace_spec", None)
                if spec is not None:
                    out["namespace"] = msgspec.structs.asdict(spec())
            else:
                e = engines[cmd.pop("name")]
                b = e.backend
                if op == "fill":
                    out = e.fill(cmd["pages"], cmd["seed"], cmd.get("pool", "kv"))
                elif op == "add_pool":
                    e.add_pool(cmd.pop("pool"), cmd)
                elif op == "set_v2":
                    out = b.batch_set_v2(e.transfers(cmd["transfers"]))
                elif op == "get_v2":
                    out = b.batch_get_v2(e.transfers(cmd["transfers"]))
                elif op == "exists_v2":
                    r = b.batch_exists_v2(cmd["keys"], e.transfers(cmd["transfers"]))
                    out = {
                        "kv_hit_pages": r.kv_hit_pages,
                        "extra": {str(k): v for k, v in r.extra_pool_hit_pages.items()},
                    }
                elif op == "zero":
                    e.zero(cmd["pages"])
                elif op == "digests":
                    out = e.digests(cmd["pages"], cmd.get("pool", "kv"))
                elif op == "set_v1":
                    out = b.batch_set_v1(cmd["keys"], e.host_indices(cmd["pages"]), None)
                elif op == "set_v1_prefix":
                    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

                    info = HiCacheStorageExtraInfo(prefix_keys=cmd["prefix_keys"])
                    out = b.batch_set_v1(cmd["keys"], e.host_indices(cmd["pages"]), info)
                elif op == "get_v1":
                    out = b.batch_get_v1(cmd["keys"], e.host_indices(cmd["pages"]), None)
                elif op == "set_flat":
                    pages = [e.pool.get_data_page(p * e.page_size, flat=True) for p in cmd["pages"]]
                    out = b.batch_set(cmd["keys"], pages)
                elif op == "get_flat":
                    dummies = [e.pool.get_dummy_flat_data_page() for _ in cmd["keys"]]
                    got = b.batch_get(cmd["keys"], dummies)
                    out = [
                        None
                        if t is None
                        else hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
                        for t in got
                    ]
                elif op == "threads":  # SGLang's prefetch, prefetch-IO and backup threads at once
                    out = e.threads(cmd["keys"], cmd["pages"], cmd["rounds"])
                elif op == "exists":
                    out = b.batch_exists(cmd["keys"])
                elif op == "exists_one":
                    out = [b.exists(k) for k in cmd["keys"]]
                elif op == "clear":
                    b.clear()
                elif op == "stats":
                    out = b.get_stats()
                else:
                    raise ValueError(f"unknown op {op}")
            reply = {"ok": True, "out": out, "warnings": list(WARNINGS.messages)}
        except Exception as exc:
            reply = {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc(),
                "warnings": list(WARNINGS.messages),
            }
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    serve()
