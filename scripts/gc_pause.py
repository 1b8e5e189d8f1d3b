"""What a full garbage collection costs a block manager holding N blocks (issue 12).

A full (generation 2) collection stops the whole daemon. This script builds an
in-process ``BlockManager`` over a temporary region (sparse, not prefaulted),
commits N blocks of 4 KiB in batches of 16,384, and prints the median of five
``gc.collect()`` calls, the objects the collector tracks, and what storing a
block cost. Run it on two checkouts to compare (docs/status.md, 2026-12-07
afternoon: 1M blocks, 229 ms before ``Block`` left the collector, 59 ms after).

    .venv/bin/python scripts/gc_pause.py                 # 100,000 and 1,000,000 blocks
    BLOCKS=200000 .venv/bin/python scripts/gc_pause.py
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstore.config import load_config
from kvstore.manager import BlockManager
from kvstore.namespace import NamespaceSpec
from kvstore.tiers.dram import Region

BLOCK_BYTES = 4096
BATCH_BLOCKS = 16384
COLLECTS = 5


def measure(blocks: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(
            environ={},
            assignments=[
                f"dram.path={tmp}/region",
                f"dram.capacity_bytes={blocks * BLOCK_BYTES + (64 << 20)}",
                "dram.chunk_bytes=4MiB",
            ],
        )
        region = Region(
            config.dram.path, config.dram.capacity_bytes, prefault=False, huge_pages="off"
        )
        try:
            manager = BlockManager(config, region)
            spec = NamespaceSpec(
                model="gc-pause",
                dtype="float16",
                block_size_tokens=16,
                num_layers=1,
                num_kv_heads=1,
                head_dim=1,
                block_bytes=BLOCK_BYTES,
            )
            ns_id = manager.declare_namespace(spec).namespace_id
            store_us = []
            for lo in range(1, blocks + 1, BATCH_BLOCKS):
                hashes = list(range(lo, min(lo + BATCH_BLOCKS, blocks + 1)))
                started = time.perf_counter()
                plan = manager.prepare_store(ns_id, hashes, 30)
                manager.commit_store(plan.lease_id, hashes)
                store_us.append((time.perf_counter() - started) * 1e6 / len(hashes))
            gc.collect()
            pauses_ms = []
            for _ in range(COLLECTS):
                started = time.perf_counter()
                gc.collect()
                pauses_ms.append((time.perf_counter() - started) * 1e3)
            tracked = len(gc.get_objects())
            del manager
        finally:
            region.close(unlink=True)
    return (
        f"{blocks:>9,} blocks: full collection {statistics.median(pauses_ms):7.1f} ms "
        f"(min {min(pauses_ms):.1f}); {tracked:,} tracked objects; "
        f"store {statistics.median(store_us):.2f} us/block"
    )


def main() -> None:
    raw = os.environ.get("BLOCKS", "100000,1000000")
    for blocks in (int(b) for b in raw.split(",")):
        print(measure(blocks), flush=True)


if __name__ == "__main__":
    main()
