"""The disk tier through the daemon, against plain file I/O (``kvstore-bench tiers``).

Three figures, each against a reference measured in the same run:

1. Disk write and read of ``--total-bytes`` (1 GiB) in ``--block-bytes``
   (2 MiB) blocks *through the daemon*, against a plain sequential write
   (buffered, then fsync) and read (page cache dropped first) of the same
   bytes in a file on the same filesystem. Goal: >= 0.8x.
   - write: the client stores the blocks; the daemon's demoter (write-behind,
     ``disk.demote_free_fraction = 1``) makes them durable on disk; timed
     from the first store to the last block acknowledged by the disk tier.
   - read: the daemon is killed (-9) and restarted, so the blocks are on disk
     only (recovered from the journal); the client loads them, which promotes
     them into DRAM (checksum verified) and copies them out. Timed end to end.
     The plain read runs just before it, after all of the round's writes, so
     both reads meet the disk in the same state (writeback done or not).
2. Promotion of a 195k-token context's blocks (one PrepareLoad of the whole
   prefix) from disk into DRAM: GB/s, against the plain read.
3. Eviction cost per block, in-process: making room in a full DRAM tier by
   dropping clean blocks (their disk copy stays) vs allocating in free DRAM;
   and the demoter's disk write per block, from (1).

Medians and spread (p10..p90) over ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvstore.client import PIPELINE_CHUNK_BYTES, gather
from kvstore_bench._common import Summary, gbps, summarize, wait_collapsed

MiB = 1024 * 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dir",
        default="",
        help="directory on the filesystem to test (default: a temp dir in /var/tmp)",
    )
    p.add_argument("--total-bytes", type=int, default=1024 * MiB)
    p.add_argument("--block-bytes", type=int, default=2 * MiB)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--context-tokens", type=int, default=195_000)
    p.add_argument(
        "--block-tokens", type=int, default=128, help="tokens per block (vLLM CPU default)"
    )
    p.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=4096,
        help="KV bytes of one token on one rank (4 KiB: a small model; 128 KiB for Llama-3-8B fp16)",
    )
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument(
        "--eviction-blocks", type=int, default=2048, help="64 KiB blocks in the eviction test"
    )
    p.add_argument("--direct-io", choices=["on", "off"], default="on")
    p.add_argument(
        "--read-path",
        choices=["get", "manual"],
        default="get",
        help="get: Client.get (pipelined); manual: PrepareLoad then copy, phases timed apart",
    )


def _fmt(s: Summary, nbytes: int) -> str:
    return (
        f"{gbps(nbytes, s.median_s):6.2f} GB/s (p10..p90 {gbps(nbytes, s.p90_s):.2f}.."
        f"{gbps(nbytes, s.p10_s):.2f})"
    )


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def plain_write(path: str, pool: np.ndarray, n_blocks: int) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(n_blocks):
            os.write(fd, pool[i % len(pool)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def plain_read(path: str, block_bytes: int, n_blocks: int) -> float:
    _drop_cache(path)
    buf = bytearray(block_bytes)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        for _ in range(n_blocks):
            f.readinto(buf)
    return time.perf_counter() - t0


class _Node:
    def __init__(self, root: Path, args: argparse.Namespace, region_bytes: int) -> None:
        from kvstore.process import DaemonProcess

        self.disk_dir = root / "disk"
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else root
        self.daemon = DaemonProcess(
            root / "node",
            name=f"bench-tiers-{os.getpid()}",
            dram_bytes=region_bytes,
            chunk_bytes=64 * MiB,
            tcp=False,
            settings={
                "dram.path": str(shm / f"kvstore-bench-tiers-{os.getpid()}.dram"),
                "dram.prefault": "true",
                "disk.path": str(self.disk_dir),
                "disk.capacity_bytes": args.total_bytes + 2 * 64 * MiB + region_bytes,
                "disk.slab_bytes": 64 * MiB,
                "disk.io_threads": args.io_threads,
                "disk.direct_io": "true" if args.direct_io == "on" else "false",
                "disk.demote_free_fraction": 1.0,
                "leases.max_ttl_s": 600,
            },
        )

    def start(self):  # type: ignore[no-untyped-def]
        from kvstore.client import Client

        self.daemon.start()
        wait_collapsed(self.daemon.address)  # its region in 2 MiB pages before timing
        return Client(self.daemon.address, timeout_s=300)

    def crash(self) -> None:
        self.daemon.kill()

    def stop(self) -> None:
        self.daemon.stop()
        region = self.daemon.settings["dram.path"]
        for leftover in (region, region + ".manifest"):
            if os.path.exists(leftover):
                os.unlink(leftover)


def _disk_blocks(client) -> int:  # type: ignore[no-untyped-def]
    return next((t.blocks for t in client.stats().tiers if t.tier == 3), 0)


def _wait_disk(client, n: int, stall_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    """Until the disk tier holds n blocks; fails if it stops making progress."""
    last, last_change = -1, time.monotonic()
    while (have := _disk_blocks(client)) < n:
        if have != last:
            last, last_change = have, time.monotonic()
        elif time.monotonic() - last_change > stall_s:
            raise RuntimeError(f"demotion stalled: {have} of {n} blocks on disk")
        time.sleep(0.002)


def _spec(block_bytes: int, model: str):  # type: ignore[no-untyped-def]
    from kvstore.namespace import NamespaceSpec

    return NamespaceSpec(
        model=model,
        dtype="bfloat16",
        block_size_tokens=16,
        num_layers=1,
        num_kv_heads=1,
        head_dim=64,
        block_bytes=block_bytes,
    )


def daemon_round(
    root: Path,
    args: argparse.Namespace,
    pool: np.ndarray,
    rep: int,
    between: Callable[[], float],
    phases: list[tuple[float, float]],
) -> tuple[float, float, float, float]:
    """(write_s, reference read_s, read_s, promotion_s) of one run through a fresh daemon.

    Appends the read's (PrepareLoad_s, client copy_s) to ``phases``.

    ``between`` (the plain-file read) runs after every write of the round and
    just before the daemon reads, so both reads meet the disk in the same state.
    """
    n = args.total_bytes // args.block_bytes
    ctx_blocks = -(-args.context_tokens // args.block_tokens)
    ctx_block_bytes = args.block_tokens * args.kv_bytes_per_token
    region = max(args.total_bytes, ctx_blocks * ctx_block_bytes) + 128 * MiB
    region = -(-region // (64 * MiB)) * (64 * MiB)
    node = _Node(root, args, region)
    try:
        client = node.start()
        ns = client.declare_namespace(_spec(args.block_bytes, f"bench-{rep}"))
        hashes = list(range(1 + rep * 10_000_000, 1 + rep * 10_000_000 + n))
        batch = max(1, (64 * MiB) // args.block_bytes)
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            idx = np.arange(i, min(n, i + batch)) % len(pool)
            client.put(ns, hashes[i : i + batch], pool[idx])
        _wait_disk(client, n)
        write_s = time.perf_counter() - t0

        # The 195k-token context, stored now and promoted after the crash.
        ctx = client.declare_namespace(_spec(ctx_block_bytes, f"ctx-{rep}"))
        ctx_hashes = list(range(1, ctx_blocks + 1))
        ctx_pool = np.random.default_rng(rep).integers(
            0, 256, (64, ctx_block_bytes), dtype=np.uint8
        )
        for i in range(0, ctx_blocks, 64):
            part = ctx_hashes[i : i + 64]
            client.put(ctx, part, ctx_pool[: len(part)])
        _wait_disk(client, n + ctx_blocks)
        client.close()
        node.crash()  # DRAM index gone: every block is on disk only

        # Fair to the reference: no page-cache copy of the data file either.
        _drop_cache(str(node.disk_dir / "blocks.dat"))
        ref_read_s = between()
        client = node.start()
        ns = client.declare_namespace(_spec(args.block_bytes, f"bench-{rep}"))
        # Loads of 256 MiB, as an engine loads a long prefix in one request, into
        # a reused, pre-faulted buffer (the reference reads into a reused one too).
        read_batch = max(1, (256 * MiB) // args.block_bytes)
        out = np.ones((min(n, read_batch), args.block_bytes), dtype=np.uint8)
        t0 = time.perf_counter()
        if args.read_path == "get":
            # What users call: Client.get pipelines each load in chunks (the
            # daemon promotes chunk k+1 while the client copies chunk k).
            for i in range(0, n, read_batch):
                part = hashes[i : i + read_batch]
                found = client.get(ns, part, out[: len(part)]).found
                if found != len(part):
                    raise RuntimeError(f"only {found} blocks came back from disk")
        else:
            # One PrepareLoad per load, then the copy, timed apart: PrepareLoad
            # (the daemon promotes the blocks: disk reads, checksums), then the
            # client's copy out of the region; the release goes in the background.
            promote_s = copy_s = 0.0
            for i in range(0, n, read_batch):
                part = hashes[i : i + read_batch]
                t1 = time.perf_counter()
                handle = client.prepare_load(ns, part)
                t2 = time.perf_counter()
                if handle.found != len(part):
                    raise RuntimeError(f"only {handle.found} blocks came back from disk")
                gather(client.region, handle.offsets, out[: len(part)], args.block_bytes)
                client.release(handle, wait=False)
                promote_s += t2 - t1
                copy_s += time.perf_counter() - t2
            phases.append((promote_s, copy_s))
        read_s = time.perf_counter() - t0
        # Make room: the next promotion must not evict (and time) these.
        client.delete(ns, hashes)

        ctx = client.declare_namespace(_spec(ctx_block_bytes, f"ctx-{rep}"))
        t0 = time.perf_counter()
        handle = client.prepare_load(ctx, ctx_hashes, lease_ttl_s=300)
        promotion_s = time.perf_counter() - t0
        if handle.found != ctx_blocks:
            raise RuntimeError(f"promoted {handle.found} of {ctx_blocks} context blocks")
        client.release(handle)
        client.close()
    finally:
        node.stop()
        shutil.rmtree(node.disk_dir, ignore_errors=True)
    return write_s, ref_read_s, read_s, promotion_s


def eviction_cost(blocks: int = 2048, block_bytes: int = 64 * 1024) -> tuple[Summary, Summary]:
    """µs per block to allocate with free DRAM vs by dropping clean blocks (disk copy kept)."""
    from kvstore.config import load_config
    from kvstore.manager import BlockManager
    from kvstore.tiers.dram import Region

    async def one() -> tuple[float, float]:
        with tempfile.TemporaryDirectory() as tmp:
            os.mkdir(f"{tmp}/disk")
            capacity = blocks * block_bytes
            config = load_config(
                environ={},
                assignments=[
                    f"dram.path={tmp}/region",
                    f"dram.capacity_bytes={capacity}",
                    "dram.chunk_bytes=4MiB",
                    f"disk.path={tmp}/disk",
                    f"disk.capacity_bytes={4 * capacity}",
                    "disk.slab_bytes=4MiB",
                    "disk.demote_free_fraction=1.0",
                ],
            )
            region = Region(config.dram.path, capacity, prefault=True, huge_pages="off")
            m = BlockManager(config, region)
            try:
                ns = m.declare_namespace(_spec(block_bytes, "evict"))
                t0 = time.perf_counter()
                plan = m.prepare_store(ns.namespace_id, list(range(blocks)))
                free_s = time.perf_counter() - t0
                m.commit_store(plan.lease_id)
                assert m.disk is not None
                await m.disk.drain(timeout_s=120)
                t0 = time.perf_counter()
                plan = m.prepare_store(ns.namespace_id, list(range(blocks, 2 * blocks)))
                evict_s = time.perf_counter() - t0
                if m.counters.demoted_blocks != blocks:
                    raise RuntimeError(
                        f"{m.counters.demoted_blocks} of {blocks} evictions were demotions"
                    )
                m.commit_store(plan.lease_id)
                return free_s / blocks, evict_s / blocks
            finally:
                await m.close()
                region.close_hooks.clear()
                region.close(unlink=True)

    runs = [asyncio.run(one()) for _ in range(5)]
    return summarize([r[0] for r in runs]), summarize([r[1] for r in runs])


def run(args: argparse.Namespace) -> int:
    base = args.dir or tempfile.mkdtemp(prefix="kvstore-bench-tiers-", dir="/var/tmp")
    root = Path(base)
    root.mkdir(parents=True, exist_ok=True)
    n = args.total_bytes // args.block_bytes
    nbytes = n * args.block_bytes
    ctx_blocks = -(-args.context_tokens // args.block_tokens)
    ctx_bytes = ctx_blocks * args.block_tokens * args.kv_bytes_per_token
    pool = np.random.default_rng(0).integers(
        0, 256, (max(1, (64 * MiB) // args.block_bytes), args.block_bytes), dtype=np.uint8
    )
    print(
        f"tiers: {nbytes / MiB:.0f} MiB in {args.block_bytes / MiB:g} MiB blocks on {root} "
        f"(direct I/O {args.direct_io}, {args.io_threads} I/O threads), {args.repeats} repeats; "
        f"context {args.context_tokens} tokens = {ctx_blocks} blocks = {ctx_bytes / MiB:.0f} MiB"
    )
    ref_w, ref_r, kv_w, kv_r, promo = [], [], [], [], []
    phases: list[tuple[float, float]] = []
    load_before = os.getloadavg()
    ref_path = str(root / "plain.dat")

    def read_reference() -> float:
        return plain_read(ref_path, args.block_bytes, n)

    try:
        for rep in range(args.repeats):
            ref_w.append(plain_write(ref_path, pool, n))
            w, ref, r, p = daemon_round(root, args, pool, rep, read_reference, phases)
            os.unlink(ref_path)
            ref_r.append(ref)
            kv_w.append(w)
            kv_r.append(r)
            promo.append(p)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    sw, sr, kw, kr, sp = map(summarize, (ref_w, ref_r, kv_w, kv_r, promo))
    print(f"plain file write+fsync   {_fmt(sw, nbytes)}")
    print(
        f"daemon -> disk write     {_fmt(kw, nbytes)}   ratio {sw.median_s / kw.median_s:.2f}x (goal >= 0.8x)"
    )
    print(f"plain file read (cold)   {_fmt(sr, nbytes)}")
    print(
        f"disk -> daemon read      {_fmt(kr, nbytes)}   ratio {sr.median_s / kr.median_s:.2f}x (goal >= 0.8x)"
    )
    ratios = summarize([ref / kv for ref, kv in zip(ref_r, kv_r, strict=True)])
    print(
        f"  read ratio per run: median {ratios.median_s:.2f}x (p10..p90 "
        f"{ratios.p10_s:.2f}..{ratios.p90_s:.2f}, min {ratios.min_s:.2f}x); runs: "
        + " ".join(f"{ref / kv:.2f}" for ref, kv in zip(ref_r, kv_r, strict=True))
    )
    if phases:
        prep, copy = (summarize([ph[i] for ph in phases]) for i in (0, 1))
        print(
            f"  read phases (medians): PrepareLoad with promotion {prep.median_s * 1e3:.0f} ms "
            f"({gbps(nbytes, prep.median_s):.2f} GB/s), client copy {copy.median_s * 1e3:.0f} ms, "
            f"plain read {sr.median_s * 1e3:.0f} ms"
        )
    else:
        print(
            "  read path: Client.get in 256 MiB loads, each pipelined in "
            f"{PIPELINE_CHUNK_BYTES // MiB} MiB chunks (--read-path manual: one "
            "PrepareLoad per load, phases timed apart)"
        )
    print(
        f"promotion of a {args.context_tokens}-token context ({ctx_bytes / MiB:.0f} MiB, one PrepareLoad): "
        f"{_fmt(sp, ctx_bytes)}   vs plain read {gbps(ctx_bytes, sp.median_s) / gbps(nbytes, sr.median_s):.2f}x"
    )
    print(
        f"demotion (disk write) per {args.block_bytes / MiB:g} MiB block: {kw.median_s / n * 1e6:.0f} us"
    )
    load_after = os.getloadavg()
    print(
        f"load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after the "
        f"disk runs ({os.cpu_count()} CPUs)"
    )
    free, evict = eviction_cost(args.eviction_blocks)
    print(
        f"allocation per 64 KiB block, free DRAM: {free.median_s * 1e6:.1f} us; "
        f"making room by dropping a clean block (kept on disk): {evict.median_s * 1e6:.1f} us "
        f"(p10..p90 {evict.p10_s * 1e6:.1f}..{evict.p90_s * 1e6:.1f}); "
        f"eviction cost {max(0.0, evict.median_s - free.median_s) * 1e6:.1f} us/block"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvstore-bench tiers", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
