"""The GPU tier on real CUDA: IPC export to another process, and HBM<->DRAM copy rates.

Run where a GPU is available: ``pytest -m gpu tests/gpu -s`` (figures print with -s).
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import statistics
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CHUNK = 64 * 1024 * 1024


def _engine(handle_bytes: bytes, offset: int, nbytes: int, queue, via) -> None:  # in a child
    import msgspec
    import torch

    from kvstore.tiers.gpu import GpuPoolHandle, open_handle

    pool = open_handle(msgspec.msgpack.decode(handle_bytes, type=GpuPoolHandle), via=via)
    seen = int(pool[offset : offset + nbytes].to(torch.int64).sum().item())
    pool[offset : offset + nbytes] = 7  # the engine writes a block device to device
    torch.cuda.synchronize()
    queue.put(seen)


@pytest.mark.parametrize("via", [("torch",), ("cupy",)])
def test_engine_maps_the_pool_through_ipc(via):
    """Either export of the pool maps it in another process, bytes both ways."""
    import msgspec

    if via == ("cupy",):
        pytest.importorskip("cupy")

    from kvstore.tiers.gpu import GpuTier

    tier = GpuTier(2 * CHUNK, CHUNK, "cuda:0")
    offset = tier.allocate(1 << 20)
    assert offset is not None
    block = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    tier.copy_in(offset, block)
    tier.synchronize()
    exported = tier.export_handle()
    assert exported.storage_handle  # torch's export
    if importlib.util.find_spec("cupy") is not None:
        assert exported.cuda_ipc_handle  # and cupy's, where cupy is installed
    assert tier.export_handle() is exported  # once: Hello hands out the same handle
    handle = msgspec.msgpack.encode(exported)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_engine, args=(handle, offset, 1 << 20, queue, via))
    proc.start()
    seen = queue.get(timeout=120)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert seen == int(block.astype(np.int64).sum())  # the child read our bytes
    out = np.empty(1 << 20, dtype=np.uint8)
    tier.copy_out(offset, out)
    assert (out == 7).all()  # and we see the child's


def _gbps(fn, nbytes: int, repeats: int = 7) -> tuple[float, float, float]:
    rates = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates), min(rates), max(rates)


def test_hbm_dram_copy_rate_against_torch():
    from kvstore.tiers.gpu import GpuTier, pin_host_memory

    block_bytes, blocks = 2 << 20, 256  # 512 MiB
    tier = GpuTier(blocks * block_bytes, CHUNK, "cuda:0")
    host = np.zeros(blocks * block_bytes, dtype=np.uint8)
    assert pin_host_memory(host)
    offsets = [tier.allocate(block_bytes) for _ in range(blocks)]
    assert None not in offsets
    views = [host[i * block_bytes : (i + 1) * block_bytes] for i in range(blocks)]

    def promote() -> None:
        for off, view in zip(offsets, views, strict=True):
            tier.copy_in(off, view, non_blocking=True)

    def demote() -> None:
        for off, view in zip(offsets, views, strict=True):
            tier.copy_out(off, view, non_blocking=True)

    ref_host = torch.from_numpy(host)
    ref_dev = torch.empty(blocks * block_bytes, dtype=torch.uint8, device="cuda:0")
    h2d = _gbps(promote, host.nbytes)
    d2h = _gbps(demote, host.nbytes)
    ref_h2d = _gbps(lambda: ref_dev.copy_(ref_host, non_blocking=True), host.nbytes)
    ref_d2h = _gbps(lambda: ref_host.copy_(ref_dev, non_blocking=True), host.nbytes)
    print(
        f"\nDRAM->HBM per 2 MiB block: {h2d[0]:.1f} GB/s ({h2d[1]:.1f}..{h2d[2]:.1f}), "
        f"torch one copy: {ref_h2d[0]:.1f} GB/s, ratio {h2d[0] / ref_h2d[0]:.2f}x\n"
        f"HBM->DRAM per 2 MiB block: {d2h[0]:.1f} GB/s ({d2h[1]:.1f}..{d2h[2]:.1f}), "
        f"torch one copy: {ref_d2h[0]:.1f} GB/s, ratio {d2h[0] / ref_d2h[0]:.2f}x"
    )
    assert h2d[0] > 0.5 * ref_h2d[0]
    assert d2h[0] > 0.5 * ref_d2h[0]


def test_daemon_gpu_tier_device_to_device_and_demotion(daemon_factory):
    """A daemon with gpu.device=cuda:0: the client maps the pool through the IPC
    handle from Hello, stores from and loads into CUDA tensors device to device,
    and a full pool demotes to DRAM (pinned host memory) with bytes intact."""
    from kvstore.client import Client
    from tests.conftest import make_spec

    block = 1 << 20
    d = daemon_factory(
        dram_bytes=64 << 20,
        chunk_bytes=4 << 20,
        settings={
            "gpu.device": "cuda:0",
            "gpu.capacity_bytes": "16MiB",
            "gpu.chunk_bytes": "4MiB",
            # exact placements: the background demoter would keep 10% of the pool free
            "gpu.demote_free_fraction": 0,
        },
    )
    with Client(d.address) as c:
        assert c.info.gpu_device == "cuda:0" and c.info.gpu_ipc_handle
        assert c.gpu_pool().is_cuda
        ns = c.declare_namespace(make_spec(block))
        src = torch.randint(0, 256, (32, block), dtype=torch.uint8, device="cuda")
        hashes = list(range(1, 33))
        # One store's own pending blocks cannot make room for each other: two stores,
        # the second demotes the first's 16 blocks to DRAM.
        assert c.put(ns, hashes[:16], src[:16], tier="gpu").stored == 16
        assert c.put(ns, hashes[16:], src[16:], tier="gpu").stored == 16
        res = c.lookup(ns, hashes)
        assert res.prefix_blocks == 32 and res.by_tier == {"dram": 16, "gpu": 16}
        out = torch.zeros_like(src)
        got = c.get(ns, hashes[16:], out[16:], tier="gpu")  # in the pool: device to device
        assert got.found == 16
        assert torch.equal(out[16:], src[16:])
        back = c.get(ns, hashes)  # a host reader: the pool's blocks move down to DRAM
        assert back.found == 32 and np.array_equal(back.data, src.cpu().numpy())
