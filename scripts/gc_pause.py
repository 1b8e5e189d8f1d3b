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
import tempfile
import time

from in_process import fill, open_manager

BLOCK_BYTES = 4096
COLLECTS = 5


def measure(blocks: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        region, manager, ns_id = open_manager(
            tmp, blocks * BLOCK_BYTES + (64 << 20), BLOCK_BYTES, "gc-pause"
        )
        try:
            store_us = [s * 1e6 for s in fill(manager, ns_id, blocks)]
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
