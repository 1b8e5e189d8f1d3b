"""The worst bookkeeping step of a block manager holding N blocks under churn (issue 12).

A daemon's index is a few maps with one entry per block. A Python dict that
keeps its size while entries come and go rebuilds its table every so often,
in one O(n) step: with a million blocks that stalled every caller of the
daemon for ~100-300 ms (docs/status.md, 2026-12-07). This script measures it
in process, with no I/O and no other process in the way: it fills a DRAM
region of exactly N blocks of 4 KiB, freezes the heap as the daemon does at
start, then runs STEPS engine-like steps, each storing 64 new blocks (which
evicts the 64 coldest), looking up the 64 stored the step before and pinning
and releasing them. It prints the step time's median, p99, p99.9 and the worst
steps, and how many steps took over 10 ms.

    .venv/bin/python scripts/step_stalls.py                   # 1,000,000 blocks, 30,000 steps
    BLOCKS=200000 STEPS=10000 .venv/bin/python scripts/step_stalls.py
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from in_process import fill, open_manager

from kvstore.heap import settle_heap

BLOCK_BYTES = 4096
CHUNK_BYTES = 4 << 20
STEP_BLOCKS = 64
SLOW_STEP_S = 0.010


def measure(blocks: int, steps: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        capacity = -(-blocks * BLOCK_BYTES // CHUNK_BYTES) * CHUNK_BYTES
        region, manager, ns_id = open_manager(
            tmp, capacity, BLOCK_BYTES, "step-stalls", chunk_bytes=CHUNK_BYTES
        )
        try:
            held = capacity // BLOCK_BYTES
            fill(manager, ns_id, held)
            settle_heap()
            step_s = []
            previous: list[int] = []
            next_hash = held + 1
            for _ in range(steps):
                hashes = list(range(next_hash, next_hash + STEP_BLOCKS))
                next_hash += STEP_BLOCKS
                started = time.perf_counter()
                plan = manager.prepare_store(ns_id, hashes, 30)
                manager.commit_store(plan.lease_id, hashes)
                if previous:
                    manager.lookup(ns_id, previous)
                    load = manager.prepare_load(ns_id, previous, 30)
                    manager.release([load.lease_id])
                step_s.append(time.perf_counter() - started)
                previous = hashes
            del manager
        finally:
            region.close(unlink=True)
    ordered = sorted(step_s)
    worst = ", ".join(f"{s * 1e3:.1f}" for s in reversed(ordered[-3:]))
    return (
        f"{held:>9,} blocks, {steps:,} steps of {STEP_BLOCKS}: "
        f"p50 {statistics.median(step_s) * 1e3:.3f} ms, "
        f"p99 {ordered[int(len(ordered) * 0.99)] * 1e3:.3f} ms, "
        f"p99.9 {ordered[int(len(ordered) * 0.999)] * 1e3:.3f} ms; "
        f"worst {worst} ms; {sum(s > SLOW_STEP_S for s in step_s)} steps over "
        f"{SLOW_STEP_S * 1e3:.0f} ms"
    )


def main() -> None:
    raw = os.environ.get("BLOCKS", "1000000")
    steps = int(os.environ.get("STEPS", "30000"))
    for blocks in (int(b) for b in raw.split(",")):
        print(measure(blocks, steps), flush=True)


if __name__ == "__main__":
    main()
