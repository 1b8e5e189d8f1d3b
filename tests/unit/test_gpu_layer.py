"""GPU <-> DRAM <-> disk in-process, with the GPU tier in host mode (gpu.device = "cpu").

Host mode runs the daemon's GPU-tier code over a shared-memory tensor: slots,
eviction that demotes to DRAM, moves on load, pins, caps and events are the
same code as on CUDA; only the pool's memory differs (tests/gpu runs it on a
real device where one exists).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.config import load_config
from kvstore.errors import CapacityExhausted, InvalidRequest, StateConflict
from kvstore.manager import STORE_ALLOCATED, STORE_NO_ROOM, BlockManager
from kvstore.tiers import Tier
from kvstore.tiers.dram import Region
from tests.conftest import make_spec
from tests.sinks import RecordingSink

pytest.importorskip("torch")

BLOCK = 16 * 1024


def data(h: int) -> np.ndarray:
    return np.random.default_rng(h).integers(0, 256, BLOCK, dtype=np.uint8)


def same(got, hashes) -> bool:
    """got holds exactly the bytes of hashes, in order."""
    hashes = list(hashes)
    return len(got) == len(hashes) and all(
        np.array_equal(g, data(h)) for g, h in zip(got, hashes, strict=True)
    )


class Node:
    """A manager with GPU (host mode, 8 blocks), DRAM (16 blocks) and optionally disk."""

    def __init__(self, tmp_path, *, gpu="128KiB", dram="256KiB", disk=None, **extra):
        settings = {
            "dram.capacity_bytes": dram,
            "dram.chunk_bytes": "64KiB",
            "dram.path": str(tmp_path / "region"),
            "gpu.device": "cpu",
            "gpu.capacity_bytes": gpu,
            "gpu.chunk_bytes": "64KiB",
            # Exact placements below: no background demotion unless a test asks.
            "gpu.demote_free_fraction": 0,
            **extra,
        }
        if disk:
            (tmp_path / "disk").mkdir(exist_ok=True)
            settings |= {
                "disk.path": str(tmp_path / "disk"),
                "disk.capacity_bytes": disk,
                "disk.slab_bytes": "64KiB",
                "disk.io_threads": 2,
                "disk.demote_free_fraction": 1.0,
            }
        config = load_config(environ={}, assignments=[f"{k}={v}" for k, v in settings.items()])
        self.region = Region(
            config.dram.path, config.dram.capacity_bytes, prefault=False, huge_pages="off"
        )
        self.sink = RecordingSink()
        self.m = BlockManager(config, self.region, self.sink)
        assert self.m.gpu is not None
        self.pool = self.m.gpu.tier.pool.numpy()
        self.ns = self.m.declare_namespace(make_spec(BLOCK))

    def space(self, tier):
        return self.pool if tier is Tier.GPU else self.region.array

    def put(self, hashes, tier=Tier.GPU):
        plan = self.m.prepare_store(self.ns.namespace_id, hashes, tier=tier)
        for h, off, status in zip(hashes, plan.offsets, plan.statuses, strict=True):
            if status == STORE_ALLOCATED:
                self.space(tier)[off : off + BLOCK] = data(h)
        if plan.lease_id:
            self.m.commit_store(plan.lease_id)
        return plan

    async def get(self, hashes, tier=Tier.GPU):
        plan = await self.m.prepare_load_async(self.ns.namespace_id, hashes, tier=tier)
        assert plan.tier is tier
        out = [self.space(tier)[o : o + BLOCK].copy() for o in plan.offsets]
        if plan.lease_id:
            self.m.release([plan.lease_id])
        return out

    def tier_of(self, h):
        return self.ns.blocks[h].tier

    def check_accounting(self):
        """Every slot is owned by exactly one block, and no lease or pin is left."""
        m = self.m
        gpu_blocks = [b for b in self.ns.blocks.values() if b.tier is Tier.GPU]
        dram_blocks = [b for b in self.ns.blocks.values() if b.tier is Tier.DRAM]
        assert all(b.gpu_offset >= 0 and b.offset < 0 for b in gpu_blocks)
        assert all(b.offset >= 0 and b.gpu_offset < 0 for b in dram_blocks)
        assert len(m.gpu.owner) == len(gpu_blocks)
        assert m.gpu.used_bytes == len(gpu_blocks) * self.ns.slot_bytes
        assert m.allocator.used_bytes == len(dram_blocks) * self.ns.slot_bytes
        assert len(m.leases) == 0 and m.placement.pinned_blocks == 0

    async def close(self):
        await self.m.close()
        self.region.close(unlink=True)


async def test_store_and_load_in_the_gpu_tier(tmp_path):
    node = Node(tmp_path)
    node.put([1, 2, 3])
    assert [node.tier_of(h) for h in (1, 2, 3)] == [Tier.GPU] * 3
    got = await node.get([1, 2, 3, 4])
    assert same(got, [1, 2, 3])
    res = node.m.lookup(node.ns.namespace_id, [1, 2, 3])
    assert res.prefix_blocks == 3 and res.by_tier == {Tier.GPU: 3}
    assert node.sink.hashes("stored", "GPU") == [1, 2, 3]
    stats = {t.tier: t for t in node.m.stats().tiers}
    assert stats[Tier.GPU].blocks == 3 and stats[Tier.GPU].used_bytes == 3 * BLOCK
    assert stats[Tier.DRAM].blocks == 0
    node.check_accounting()
    await node.close()


async def test_full_gpu_demotes_to_dram_instead_of_dropping(tmp_path):
    node = Node(tmp_path)  # GPU 8 blocks, DRAM 16
    hashes = list(range(1, 21))
    for i in range(0, 20, 4):
        node.put(hashes[i : i + 4])
    # The coldest 12 moved down, the newest 8 stay in HBM; nothing was dropped.
    assert [node.tier_of(h) for h in hashes[:12]] == [Tier.DRAM] * 12
    assert [node.tier_of(h) for h in hashes[12:]] == [Tier.GPU] * 8
    counters = node.m.stats().counters
    assert counters.demoted_blocks == 12 and counters.evicted_blocks == 0
    assert set(node.sink.hashes("stored", "CPU")) == set(hashes[:12])
    assert set(node.sink.hashes("removed", "GPU")) == set(hashes[:12])
    res = node.m.lookup(node.ns.namespace_id, hashes)
    assert res.prefix_blocks == 20 and res.by_tier == {Tier.DRAM: 12, Tier.GPU: 8}
    # Bytes survived the move: read the demoted ones from DRAM.
    got = await node.get(hashes[:12], tier=Tier.DRAM)
    assert same(got, hashes[:12])
    node.check_accounting()
    await node.close()


async def test_load_moves_the_prefix_up_and_down(tmp_path):
    node = Node(tmp_path)
    node.put([1, 2, 3, 4], tier=Tier.DRAM)
    node.put([5, 6])  # GPU
    got = await node.get([1, 2, 3, 4, 5, 6])  # asks for GPU: 1-4 move up
    assert same(got, range(1, 7))
    assert all(node.tier_of(h) is Tier.GPU for h in range(1, 7))
    assert node.m.stats().counters.promoted_blocks == 4
    assert set(node.sink.hashes("removed", "CPU")) == {1, 2, 3, 4}
    # A DRAM reader (a CPU client, a peer pulling over NIXL) gets them moved down.
    got = await node.get([1, 2, 3, 4, 5, 6], tier=Tier.DRAM)
    assert same(got, range(1, 7))
    assert all(node.tier_of(h) is Tier.DRAM for h in range(1, 7))
    node.check_accounting()
    await node.close()


async def test_pinned_gpu_blocks_never_move_and_the_cap_is_hard(tmp_path):
    node = Node(tmp_path)
    m = node.m
    node.put(list(range(1, 9)))  # fills the 8 GPU slots
    plan = m.prepare_load(node.ns.namespace_id, list(range(1, 9)), tier=Tier.GPU)
    assert len(plan.blocks) == 8
    with pytest.raises(CapacityExhausted, match="GPU tier"):
        m.prepare_store(node.ns.namespace_id, [100], tier=Tier.GPU)
    assert all(node.tier_of(h) is Tier.GPU for h in range(1, 9))
    assert m.gpu.used_bytes <= m.gpu.capacity_bytes
    m.release([plan.lease_id])
    node.put([100])
    assert node.tier_of(100) is Tier.GPU and node.tier_of(1) is Tier.DRAM
    node.check_accounting()
    await node.close()


async def test_a_promotion_that_finds_no_room_ends_the_prefix(tmp_path):
    node = Node(tmp_path)
    m = node.m
    node.put(list(range(1, 9)))
    pin = m.prepare_load(node.ns.namespace_id, list(range(1, 9)), tier=Tier.GPU)
    node.put([20, 21], tier=Tier.DRAM)
    plan = await m.prepare_load_async(node.ns.namespace_id, [20, 21], tier=Tier.GPU)
    assert plan.lease_id == 0 and plan.blocks == []  # no GPU room: nothing pinned
    assert node.tier_of(20) is Tier.DRAM
    m.release([pin.lease_id])
    node.check_accounting()
    await node.close()


async def test_aborted_and_expired_gpu_stores_free_their_slots(tmp_path):
    node = Node(tmp_path)
    m = node.m
    plan = m.prepare_store(node.ns.namespace_id, [1, 2, 3], tier=Tier.GPU)
    assert m.gpu.used_bytes == 3 * BLOCK
    m.release([plan.lease_id])
    assert m.gpu.used_bytes == 0 and not m.gpu.owner
    plan = m.prepare_store(node.ns.namespace_id, [1, 2, 3], ttl_s=0.001, tier=Tier.GPU)
    m.commit_store(plan.lease_id, [1])  # 2 and 3 given up
    assert m.gpu.used_bytes == BLOCK
    m.expire_leases()
    node.check_accounting()
    await node.close()


async def test_delete_and_clear_reach_the_gpu_tier(tmp_path):
    node = Node(tmp_path)
    m = node.m
    node.put([1, 2, 3])
    pin = m.prepare_load(node.ns.namespace_id, [3], tier=Tier.GPU)
    assert m.delete(node.ns.namespace_id, [1, 3]) == (1, 1)
    m.release([pin.lease_id])  # 3 goes at its last unpin
    assert set(node.sink.hashes("removed", "GPU")) == {1, 3}
    assert m.clear(node.ns.namespace_id) == 1
    assert not node.ns.blocks and m.gpu.used_bytes == 0
    node.check_accounting()
    await node.close()


async def test_gpu_blocks_reach_disk_through_dram(tmp_path):
    node = Node(tmp_path, disk="4MiB")  # GPU 8, DRAM 16, disk 256 blocks
    hashes = list(range(1, 61))
    for i in range(0, 60, 4):
        node.put(hashes[i : i + 4])
        await node.m.disk.drain(timeout_s=10)
    res = node.m.lookup(node.ns.namespace_id, hashes)
    assert res.prefix_blocks == 60
    assert res.by_tier[Tier.GPU] == 8 and res.by_tier[Tier.DISK] >= 30
    assert node.m.stats().counters.evicted_blocks == 0
    got = await node.get(hashes[:8])  # disk -> DRAM -> GPU
    assert same(got, hashes[:8])
    assert all(node.tier_of(h) is Tier.GPU for h in hashes[:8])
    # A GPU block that also has a disk copy keeps it while in HBM.
    assert any(node.ns.blocks[h].disk_slot >= 0 for h in hashes[:8])
    await node.close()


async def test_bad_tier_requests(tmp_path):
    node = Node(tmp_path)
    with pytest.raises(InvalidRequest, match="not DISK"):
        node.m.prepare_store(node.ns.namespace_id, [1], tier=Tier.DISK)
    await node.close()
    config = load_config(
        environ={},
        assignments=[
            f"dram.path={tmp_path}/plain",
            "dram.capacity_bytes=1MiB",
            "dram.chunk_bytes=64KiB",
        ],
    )
    region = Region(config.dram.path, config.dram.capacity_bytes, prefault=False, huge_pages="off")
    m = BlockManager(config, region)
    ns = m.declare_namespace(make_spec(BLOCK))
    with pytest.raises(StateConflict, match="no GPU tier"):
        m.prepare_store(ns.namespace_id, [1], tier=Tier.GPU)
    with pytest.raises(StateConflict, match="no GPU tier"):
        await m.prepare_load_async(ns.namespace_id, [1], tier=Tier.GPU)
    await m.close()
    region.close(unlink=True)


def test_gpu_config_errors(tmp_path):
    from kvstore.errors import ConfigError

    for device, match in [("tpu:0", "gpu.device must be"), ("cuda:0", None)]:
        config = load_config(
            environ={},
            assignments=[
                f"dram.path={tmp_path}/r-{device}",
                "dram.capacity_bytes=1MiB",
                "dram.chunk_bytes=64KiB",
                f"gpu.device={device}",
                "gpu.capacity_bytes=1MiB",
                "gpu.chunk_bytes=64KiB",
            ],
        )
        region = Region(
            config.dram.path, config.dram.capacity_bytes, prefault=False, huge_pages="off"
        )
        try:
            import torch

            if device.startswith("cuda") and torch.cuda.is_available():
                continue
            with pytest.raises(ConfigError, match=match or "CUDA is not available"):
                BlockManager(config, region)
        finally:
            region.close(unlink=True)


def test_no_room_status_for_the_tail(tmp_path):
    node = Node(tmp_path)
    m = node.m
    pin_plan = node.put(list(range(1, 7)))
    assert list(pin_plan.statuses) == [STORE_ALLOCATED] * 6
    pin = m.prepare_load(node.ns.namespace_id, list(range(1, 7)), tier=Tier.GPU)
    plan = m.prepare_store(node.ns.namespace_id, [10, 11, 12], tier=Tier.GPU)
    assert list(plan.statuses) == [STORE_ALLOCATED, STORE_ALLOCATED, STORE_NO_ROOM]
    m.release([pin.lease_id, plan.lease_id])
    node.check_accounting()


async def test_background_demoter_keeps_room_in_the_pool(tmp_path):
    import asyncio

    node = Node(tmp_path, **{"gpu.demote_free_fraction": 0.25})  # keep 2 of 8 slots free
    m = node.m
    node.put(list(range(1, 9)))  # fills the pool; the commit nudges the demoter
    for _ in range(2000):  # (up to 10 s: the copies run on a thread)
        await asyncio.sleep(0.005)
        if m.gpu.used_bytes <= 6 * BLOCK:
            break
    assert m.gpu.used_bytes == 6 * BLOCK
    assert [node.tier_of(h) for h in (1, 2)] == [Tier.DRAM, Tier.DRAM]  # the coldest moved
    got = await node.get([1, 2], tier=Tier.DRAM)
    assert same(got, [1, 2])
    # A pinned pool: the demoter waits instead of spinning, and nothing is lost.
    pin = m.prepare_load(node.ns.namespace_id, list(range(3, 9)), tier=Tier.GPU)
    node.put([20, 21])
    pin2 = m.prepare_load(node.ns.namespace_id, [20, 21], tier=Tier.GPU)  # before any await
    await asyncio.sleep(0.05)
    assert m.gpu.used_bytes == 8 * BLOCK and node.tier_of(20) is Tier.GPU
    m.release([pin.lease_id, pin2.lease_id])
    m.gpu.wake()
    for _ in range(2000):  # (up to 10 s: the copies run on a thread)
        await asyncio.sleep(0.005)
        if m.gpu.used_bytes <= 6 * BLOCK:
            break
    assert m.gpu.used_bytes == 6 * BLOCK
    assert m.stats().counters.evicted_blocks == 0
    node.check_accounting()
    await node.close()
