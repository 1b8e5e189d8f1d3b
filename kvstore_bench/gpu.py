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
  empty pool;
- page-locking cost: ``cudaHostRegister`` of a host buffer the size of the
  context, in ms per GiB (what a daemon pays once at start for its region);
- device-to-device put/get through the IPC mapping: a real daemon in another
  process with the GPU tier, this process a client putting from and getting into
  CUDA tensors (``tier="gpu"``), vs a same-process device copy of the same bytes;
  and the time to map the pool (``open_handle``) once.

``--figures PATH`` appends every figure as a JSON line (scripts/gpu_check.sh).

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

from kvstore_bench._common import Figure, Summary, gbps, repeat, summarize, write_figures

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
    p.add_argument(
        "--ipc-bytes", type=int, default=0, help="bytes per IPC put/get (default: --context-bytes)"
    )
    p.add_argument("--no-ipc", action="store_true", help="skip the daemon put/get through IPC")
    p.add_argument("--figures", default="", help="append figures as JSON lines to this file")


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
    figures: list[Figure] = []
    manager = BlockManager(config, region)
    try:
        rc = asyncio.run(
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
                figures,
            )
        )
    finally:
        asyncio.run(manager.close())
        region.close(unlink=True)
    figures.append(_registration_cost(nbytes))
    print(f"  page-locking (cudaHostRegister): {_show(figures[-1])}")
    if not args.no_ipc:
        figures.extend(_ipc_put_get(device, args.ipc_bytes or nbytes, block, args.repeats))
    write_figures(args.figures, figures)
    return rc


def _show(fig: Figure) -> str:
    if fig.value is None:
        return f"not measured: {fig.note}"
    return f"{fig.value:.2f} {fig.unit}" + (f" ({fig.note})" if fig.note else "")


def _registration_cost(nbytes: int) -> Figure:
    """ms per GiB of cudaHostRegister on a faulted-in host buffer (then unregistered)."""
    from kvstore.tiers.gpu import pin_host_memory, unpin_host_memory

    name = "page-locking a host region (cudaHostRegister)"
    buf = np.ones(nbytes, dtype=np.uint8)  # faulted in: registration, not page faults, is timed
    t0 = time.perf_counter()
    pinned = pin_host_memory(buf)
    elapsed = time.perf_counter() - t0
    if not pinned:
        return Figure(figure=name, value=None, unit="ms/GiB", note="no CUDA, or it refused")
    unpin_host_memory(buf)
    return Figure(
        figure=name,
        value=elapsed * 1e3 / (nbytes / 2**30),
        unit="ms/GiB",
        note=f"{nbytes / MiB:.0f} MiB in {elapsed * 1e3:.1f} ms",
    )


def _ipc_put_get(device: str, nbytes: int, block: int, repeats: int) -> list[Figure]:
    """put/get from this process into a daemon's GPU pool, vs a same-process copy."""
    import torch

    from kvstore.client import Client
    from kvstore.namespace import NamespaceSpec
    from kvstore.process import DaemonProcess

    n = max(1, nbytes // block)
    nbytes = n * block
    chunk = max(4 * MiB, block)
    pool_bytes = -(-nbytes // chunk) * chunk + chunk
    spec = NamespaceSpec(
        model="bench-gpu-ipc",
        dtype="float16",
        block_size_tokens=16,
        num_layers=1,
        num_kv_heads=1,
        head_dim=block // 32,
        block_bytes=block,
    )
    tensor_device = device if device.startswith("cuda") else "cpu"
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-gpu-") as tmp:
        daemon = DaemonProcess(
            tmp,
            name="bench-gpu",
            dram_bytes=pool_bytes + 2 * chunk,
            chunk_bytes=chunk,
            tcp=False,
            settings={
                "dram.warm_restart": "false",
                "gpu.device": device,
                "gpu.capacity_bytes": pool_bytes,
                "gpu.chunk_bytes": chunk,
                "gpu.demote_free_fraction": 0,
            },
            start_timeout_s=120.0,
        )
        daemon.start()
        try:
            with Client(daemon.address) as c:
                t0 = time.perf_counter()
                pool = c.gpu_pool()
                map_s = time.perf_counter() - t0
                ns = c.declare_namespace(spec)
                src = torch.randint(0, 256, (n, block), dtype=torch.uint8, device=tensor_device)
                out = torch.empty_like(src)
                hashes = list(range(1, n + 1))
                puts: list[float] = []
                gets: list[float] = []
                for _ in range(repeats + 1):  # the first round warms up
                    t0 = time.perf_counter()
                    stored = c.put(ns, hashes, src, tier="gpu").stored
                    puts.append(time.perf_counter() - t0)
                    assert stored == n, f"the pool took {stored} of {n} blocks"
                    out.zero_()
                    t0 = time.perf_counter()
                    found = c.get(ns, hashes, out, tier="gpu").found
                    gets.append(time.perf_counter() - t0)
                    assert found == n, f"{found} of {n} blocks came back"
                    # The get's lease is released in the background: a delete before
                    # it lands would leave the blocks present (doomed) for the next put.
                    c.flush_releases()
                    c.delete(ns, hashes)
                if not torch.equal(out, src):
                    raise AssertionError("the blocks read back differ from those written")
                pool_kind = type(pool).__module__.split(".")[0]
        finally:
            daemon.stop()
            daemon.remove_region()

    def sync() -> None:
        if src.is_cuda:
            torch.cuda.synchronize(src.device)

    dst = torch.empty_like(src)
    ref = summarize(repeat(lambda: (dst.copy_(src), sync()), repeats))
    s_put, s_get = summarize(puts[1:]), summarize(gets[1:])
    where = "device to device" if tensor_device != "cpu" else "host mode: a mapped file"
    figures = [
        Figure(
            figure=f"put through the pool's IPC mapping ({where})",
            value=gbps(nbytes, s_put.median_s),
            unit="GB/s",
            reference=gbps(nbytes, ref.median_s),
            reference_what="same-process torch copy",
            ratio=ref.median_s / s_put.median_s,
            goal=0.8,
            note=f"{n} blocks of {block // 1024} KiB per put",
        ),
        Figure(
            figure=f"get through the pool's IPC mapping ({where})",
            value=gbps(nbytes, s_get.median_s),
            unit="GB/s",
            reference=gbps(nbytes, ref.median_s),
            reference_what="same-process torch copy",
            ratio=ref.median_s / s_get.median_s,
            goal=0.8,
            note=f"{n} blocks of {block // 1024} KiB per get",
        ),
        Figure(
            figure="mapping the pool in a client (Client.gpu_pool, once)",
            value=map_s * 1e3,
            unit="ms",
            note=f"{pool_kind} {tuple(getattr(pool, 'shape', ()))}",
        ),
    ]
    for fig in figures:
        ratio = f"   ratio {fig.ratio:.2f}x (goal >= {fig.goal})" if fig.ratio is not None else ""
        print(f"  {fig.figure}: {_show(fig)}{ratio}")
    return figures


async def _measure(
    manager, spec, n: int, block: int, repeats: int, device: str, Tier, figures: list[Figure]
) -> int:
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
    mode = "host mode, no HBM" if device == "cpu" else "HBM <-> pinned DRAM"
    for what, s, ref in (
        ("promotion DRAM -> GPU", s_up, ref_up),
        ("demotion GPU -> DRAM", s_down, ref_down),
    ):
        figures.append(
            Figure(
                figure=f"{what} ({mode}, prepare_load)",
                value=gbps(nbytes, s.median_s),
                unit="GB/s",
                reference=gbps(nbytes, ref.median_s),
                reference_what="torch copy of the same bytes",
                ratio=ref.median_s / s.median_s,
                goal=0.9,
                note=f"{n} blocks of {block // 1024} KiB",
            )
        )
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
    figures.append(
        Figure(
            figure="demotion to make room (store into a full pool)",
            value=med,
            unit="us/block",
            note=f"{block // 1024} KiB blocks; into a free slot "
            f"{float(np.median(empty)) / batch * 1e6:.1f} us/block",
        )
    )
    print(
        f"  demotion to make room: {med:.1f} us per {block // 1024} KiB block "
        f"(p10..p90 {p10:.1f}..{p90:.1f}; a store into a free slot: "
        f"{float(np.median(empty)) / batch * 1e6:.1f} us per block)"
    )
    return 0
