"""`kvstore-bench gpu`: the GPU tier's moves, against a plain torch copy of the same bytes.

Inside one process, with the daemon's own BlockManager (no RPC): the pool on
``--device`` (``cuda:N``, or ``cpu`` = host mode, the same code over a
shared-memory file) above a DRAM region, page-locked on CUDA as the daemon does.

Measured, each as a median with its p10..p90 spread over ``--repeats``:

- promotion DRAM -> GPU: ``prepare_load_async(tier=GPU)`` of a context whose
  blocks are in DRAM (they move up), vs one torch ``copy_`` of the same bytes
  host -> pool (the reference, measured in the same run);
- demotion GPU -> DRAM: ``prepare_load_async(tier=DRAM)`` of blocks in the pool
  (they move down), vs torch pool -> host;
- demotion to make room: µs per block of ``prepare_store(tier=GPU)`` into a full
  pool (each slot comes from a block moved to DRAM) minus the same store into an
  empty pool.

In host mode the figures describe the tier's bookkeeping and a host memcpy; they
say nothing about HBM. On CUDA they are the HBM <-> pinned DRAM rates the issue
asks for.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np

from bench._common import Summary, gbps, repeat, summarize

MiB = 1024 * 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device", default="", help='"cuda:N", or "cpu" (host mode); default: cuda:0 if present'
    )
    p.add_argument("--block-bytes", type=int, default=2 * MiB)
    p.add_argument(
        "--context-bytes", type=int, default=256 * MiB, help="bytes moved per measurement"
    )
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="small sizes, 3 repeats (CI smoke)")


def _fmt(s: Summary, nbytes: int) -> str:
    return f"{gbps(nbytes, s.median_s):6.2f} GB/s (p10..p90 {gbps(nbytes, s.p90_s):.2f}..{gbps(nbytes, s.p10_s):.2f})"


def run(args: argparse.Namespace) -> int:
    import torch

    from kvstore.config import load_config
    from kvstore.manager import BlockManager
    from kvstore.namespace import NamespaceSpec
    from kvstore.tiers import Tier
    from kvstore.tiers.dram import Region

    if args.quick:
        args.context_bytes, args.block_bytes, args.repeats = 16 * MiB, 1 * MiB, 3
    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    block = args.block_bytes
    n = max(1, args.context_bytes // block)
    nbytes = n * block
    chunk = max(4 * MiB, block)
    pool_bytes = -(-nbytes // chunk) * chunk
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    region_path = str(shm / f"kvstore-bench-gpu-{time.time_ns()}.dram")
    config = load_config(
        environ={},
        assignments=[
            f"dram.path={region_path}",
            f"dram.capacity_bytes={2 * pool_bytes + 2 * chunk}",
            f"dram.chunk_bytes={chunk}",
            "dram.warm_restart=false",  # a bench leaves nothing behind in /dev/shm
            f"gpu.device={device}",
            f"gpu.capacity_bytes={pool_bytes}",
            f"gpu.chunk_bytes={chunk}",
            # Measure the moves themselves: no background demotion racing them.
            "gpu.demote_free_fraction=0",
        ],
    )
    region = Region(config.dram.path, config.dram.capacity_bytes, prefault=True, huge_pages="off")
    manager = BlockManager(config, region)
    try:
        return asyncio.run(
            _measure(
                manager,
                NamespaceSpec(
                    model="bench-gpu",
                    dtype="float16",
                    block_size_tokens=16,
                    num_layers=1,
                    num_kv_heads=1,
                    head_dim=block // 32,
                    block_bytes=block,
                ),
                n,
                block,
                args.repeats,
                device,
                Tier,
            )
        )
    finally:
        asyncio.run(manager.close())
        region.close(unlink=True)


async def _measure(manager, spec, n: int, block: int, repeats: int, device: str, Tier) -> int:
    import torch

    gpu = manager.gpu
    assert gpu is not None
    ns = manager.declare_namespace(spec)
    nbytes = n * block
    print(
        f"kvstore-bench gpu: device {device}{' (host mode: no HBM involved)' if device == 'cpu' else ''}, "
        f"{n} blocks of {block // 1024} KiB = {nbytes / MiB:.0f} MiB per measurement, "
        f"{repeats} repeats, page-locked region: {gpu.pinned}"
    )
    hashes = list(range(1, n + 1))
    plan = manager.prepare_store(ns.namespace_id, hashes, tier=Tier.DRAM)
    manager.commit_store(plan.lease_id)
    region = manager.region.array
    region[:nbytes] = 7

    async def move(tier) -> None:
        plan = await manager.prepare_load_async(ns.namespace_id, hashes, tier=tier)
        assert len(plan.blocks) == n, f"only {len(plan.blocks)} of {n} blocks reached {tier.name}"
        manager.release([plan.lease_id])

    up: list[float] = []
    down: list[float] = []
    for _ in range(repeats + 1):  # the first round warms up
        t0 = time.perf_counter()
        await move(Tier.GPU)
        up.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await move(Tier.DRAM)
        down.append(time.perf_counter() - t0)
    host = torch.from_numpy(region[:nbytes])
    pool = gpu.tier.pool[:nbytes]

    def sync() -> None:
        if pool.is_cuda:
            torch.cuda.synchronize(pool.device)

    ref_up = summarize(repeat(lambda: (pool.copy_(host, non_blocking=True), sync()), repeats))
    ref_down = summarize(repeat(lambda: (host.copy_(pool, non_blocking=True), sync()), repeats))
    s_up, s_down = summarize(up[1:]), summarize(down[1:])
    print(
        f"  promotion DRAM -> GPU  {_fmt(s_up, nbytes)}   torch copy {_fmt(ref_up, nbytes)}   ratio {ref_up.median_s / s_up.median_s:.2f}x"
    )
    print(
        f"  demotion  GPU -> DRAM  {_fmt(s_down, nbytes)}   torch copy {_fmt(ref_down, nbytes)}   ratio {ref_down.median_s / s_down.median_s:.2f}x"
    )

    # Demotion to make room: store into a full pool vs into an empty one.
    await move(Tier.GPU)  # the context fills the pool
    batch = min(64, n)
    full: list[float] = []
    empty: list[float] = []
    next_hash = n + 1
    for _ in range(repeats):
        new = list(range(next_hash, next_hash + batch))
        next_hash += batch
        t0 = time.perf_counter()
        plan = manager.prepare_store(ns.namespace_id, new, tier=Tier.GPU)  # demotes `batch` blocks
        full.append(time.perf_counter() - t0)
        assert plan.lease_id, "the pool refused the store"
        manager.release([plan.lease_id])
        t0 = time.perf_counter()
        plan = manager.prepare_store(ns.namespace_id, new, tier=Tier.GPU)  # free slots now
        empty.append(time.perf_counter() - t0)
        manager.release([plan.lease_id])
        await move(Tier.GPU)  # back to a full pool
    per_block_us = [(f - e) / batch * 1e6 for f, e in zip(full, empty, strict=True)]
    med = float(np.median(per_block_us))
    p10, p90 = np.percentile(per_block_us, [10, 90])
    print(
        f"  demotion to make room: {med:.1f} us per {block // 1024} KiB block "
        f"(p10..p90 {p10:.1f}..{p90:.1f}; a store into a free slot: "
        f"{float(np.median(empty)) / batch * 1e6:.1f} us per block)"
    )
    return 0
