"""DRAM <-> disk in-process: demotion, promotion, per-tier lookup, pins, caps, events, warm restart."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from kvstore.config import load_config
from kvstore.manager import BlockManager
from kvstore.tiers import Tier
from kvstore.tiers.disk import DATA_FILE
from kvstore.tiers.dram import Region
from tests.conftest import make_spec
from tests.sinks import RecordingSink

BLOCK = 16 * 1024


def data(h: int) -> np.ndarray:
    return np.random.default_rng(h).integers(0, 256, BLOCK, dtype=np.uint8)


class Node:
    """A manager over a real region file and a real disk tier, as the daemon builds it."""

    def __init__(self, tmp_path, *, dram="256KiB", disk="1MiB", fraction=1.0, **extra):
        (tmp_path / "disk").mkdir(exist_ok=True)
        settings = {
            "dram.capacity_bytes": dram,
            "dram.chunk_bytes": "64KiB",
            "dram.path": str(tmp_path / "region"),
            "disk.path": str(tmp_path / "disk"),
            "disk.capacity_bytes": disk,
            "disk.slab_bytes": "64KiB",
            "disk.io_threads": 2,
            "disk.demote_free_fraction": fraction,
            **extra,
        }
        config = load_config(environ={}, assignments=[f"{k}={v}" for k, v in settings.items()])
        self.region = Region(
            config.dram.path, config.dram.capacity_bytes, prefault=False, huge_pages="off"
        )
        self.sink = RecordingSink()
        self.m = BlockManager(config, self.region, self.sink)
        self.ns = self.m.declare_namespace(make_spec(BLOCK))

    def put(self, hashes):
        plan = self.m.prepare_store(self.ns.namespace_id, hashes)
        for h, off, status in zip(hashes, plan.offsets, plan.statuses, strict=True):
            if status == 0:
                self.region.array[off : off + BLOCK] = data(h)
        if plan.lease_id:
            self.m.commit_store(plan.lease_id)
        return plan

    async def get(self, hashes):
        plan = await self.m.prepare_load_async(self.ns.namespace_id, hashes)
        out = [self.region.array[o : o + BLOCK].copy() for o in plan.offsets]
        if plan.lease_id:
            self.m.release([plan.lease_id])
        return out

    async def settle(self):
        assert self.m.disk is not None
        await self.m.disk.drain(timeout_s=10)

    async def close(self, *, graceful=False):
        await self.m.close()
        self.region.close(unlink=not graceful)

    def tier_of(self, h):
        return self.ns.blocks[h].tier


async def test_blocks_beyond_dram_live_on_disk_and_come_back(tmp_path):
    node = Node(tmp_path)  # DRAM holds 16 blocks, disk 64
    hashes = list(range(1, 41))
    for i in range(0, 40, 8):
        node.put(hashes[i : i + 8])
        await node.settle()
    res = node.m.lookup(node.ns.namespace_id, hashes)
    assert res.prefix_blocks == 40
    assert res.by_tier[Tier.DISK] >= 24 and sum(res.by_tier.values()) == 40
    assert node.m.stats().counters.evicted_blocks == 0  # demoted, none dropped
    # The cold head of the context is on disk: a load promotes it first.
    assert node.tier_of(1) is Tier.DISK
    got = await node.get(hashes[:12])
    assert len(got) == 12
    for h, block in zip(hashes, got, strict=False):
        assert np.array_equal(block, data(h))
    assert node.tier_of(1) is Tier.DRAM
    assert node.m.stats().counters.promoted_blocks >= 12 - 0
    assert set(range(1, 13)) <= set(node.sink.hashes("stored", "DISK"))
    assert set(range(1, 13)) <= set(node.sink.hashes("removed", "CPU"))  # left DRAM, kept on disk
    await node.close()


async def test_a_load_without_moves_pins_the_dram_prefix_only(tmp_path):
    """prepare_load (no tier moves) stops at the first block whose bytes are not in
    DRAM, wherever it lies; a block on disk first: nothing pinned."""
    node = Node(tmp_path)  # DRAM holds 16 blocks, disk 64
    for i in range(1, 41, 8):
        node.put(list(range(i, i + 8)))
        await node.settle()
    in_dram = [h for h in range(1, 41) if node.tier_of(h) is Tier.DRAM]
    on_disk = [h for h in range(1, 41) if node.tier_of(h) is Tier.DISK]
    assert len(in_dram) >= 4 and on_disk
    ns_id = node.ns.namespace_id
    plan = node.m.prepare_load(ns_id, [*in_dram[:3], on_disk[0], in_dram[3]])
    assert [b.block_hash for b in plan.blocks] == in_dram[:3]
    assert all(node.ns.blocks[h].pins == 1 for h in in_dram[:3])
    assert node.ns.blocks[on_disk[0]].pins == 0 and node.ns.blocks[in_dram[3]].pins == 0
    node.m.release([plan.lease_id])
    assert node.m.prepare_load(ns_id, [on_disk[0], *in_dram[:3]]).blocks == []
    assert all(node.ns.blocks[h].pins == 0 for h in in_dram[:4])
    await node.close()


async def test_write_behind_puts_every_block_on_disk(tmp_path):
    node = Node(tmp_path, dram="1MiB", disk="16MiB")
    m = node.m
    ns = m.declare_namespace(make_spec(4096))  # 256 DRAM slots, 4 writes in flight at most
    for i in range(0, 1024, 64):
        plan = m.prepare_store(ns.namespace_id, list(range(i, i + 64)))
        m.commit_store(plan.lease_id)
        await node.settle()
        assert m.disk.blocks() == i + 64  # the demoter never stalls
        assert not m.disk.dirty
    assert m.stats().counters.evicted_blocks == 0
    await node.close()


async def test_pinned_blocks_never_move(tmp_path):
    node = Node(tmp_path, dram="128KiB")  # 8 blocks
    node.put([1, 2, 3, 4])
    await node.settle()
    plan = await node.m.prepare_load_async(node.ns.namespace_id, [1, 2, 3, 4])
    offsets = list(plan.offsets)
    for start in range(10, 60, 4):
        node.put(list(range(start, start + 4)))
        await node.settle()
    assert [node.ns.blocks[h].offset for h in [1, 2, 3, 4]] == offsets
    assert all(node.tier_of(h) is Tier.DRAM for h in [1, 2, 3, 4])
    node.m.release([plan.lease_id])
    await node.close()


async def test_disk_cap_is_hard_and_drops_the_coldest(tmp_path):
    node = Node(tmp_path, dram="128KiB", disk="256KiB")  # 8 in DRAM, 16 on disk
    for start in range(0, 64, 4):
        node.put(list(range(start, start + 4)))
        await node.settle()
        assert node.m.disk.used_bytes() <= 256 * 1024
    assert os.path.getsize(tmp_path / "disk" / DATA_FILE) == 256 * 1024
    res = node.m.lookup(node.ns.namespace_id, list(range(64)))
    assert res.prefix_blocks == 0  # the oldest blocks are gone
    present = [h for h in range(64) if h in node.ns.blocks]
    assert len(present) <= 24 and present == list(range(64 - len(present), 64))
    assert node.sink.hashes("removed", "DISK")
    assert node.m.stats().counters.evicted_blocks > 0
    for i in range(0, len(present), 4):  # a load must fit in DRAM: 4 at a time
        chunk = present[i : i + 4]
        for h, block in zip(chunk, await node.get(chunk), strict=True):
            assert np.array_equal(block, data(h))
    await node.close()


async def test_corrupt_disk_block_is_dropped_not_served(tmp_path):
    node = Node(tmp_path, dram="128KiB")
    node.put(list(range(1, 9)))
    await node.settle()
    for start in range(20, 44, 8):
        node.put(list(range(start, start + 8)))  # pushes 1..8 out of DRAM
        await node.settle()
    assert node.tier_of(3) is Tier.DISK
    slot = node.ns.blocks[3].disk_slot
    fd = os.open(tmp_path / "disk" / DATA_FILE, os.O_RDWR)
    os.pwrite(fd, b"\xff\xfe", slot + 5)
    os.close(fd)
    got = await node.get(list(range(1, 9)))
    assert len(got) == 2  # the prefix ends before the corrupt block
    assert 3 not in node.ns.blocks
    assert 3 in node.sink.hashes("removed", "DISK")
    assert node.m.lookup(node.ns.namespace_id, [1, 2, 3]).prefix_blocks == 2
    await node.close()


async def test_disk_blocks_recovered_after_a_crash(tmp_path):
    node = Node(tmp_path)
    node.put(list(range(1, 11)))
    await node.settle()
    # A crash: the DRAM index dies with the process; the disk journal does not.
    node.m.disk.tier.close_sync()
    node.region.close_hooks.clear()  # no drain, so no warm-restart manifest
    node.region.close(unlink=True)
    node2 = Node(tmp_path)
    res = node2.m.lookup(node2.ns.namespace_id, list(range(1, 11)))
    assert res.prefix_blocks == 10 and res.by_tier == {Tier.DISK: 10}
    assert sorted(node2.sink.hashes("stored", "DISK")) == list(range(1, 11))
    for h, block in zip(range(1, 11), await node2.get(list(range(1, 11))), strict=True):
        assert np.array_equal(block, data(h))
    await node2.close()


async def test_warm_restart_serves_dram_blocks(tmp_path):
    node = Node(tmp_path, fraction=0.0)  # nothing demoted: DRAM only
    node.put(list(range(1, 9)))
    await node.close(graceful=True)  # the daemon's drain: manifest beside the region
    assert os.path.exists(str(tmp_path / "region") + ".manifest")
    node2 = Node(tmp_path, fraction=0.0)
    assert not os.path.exists(str(tmp_path / "region") + ".manifest")  # used once
    res = node2.m.lookup(node2.ns.namespace_id, list(range(1, 9)))
    assert res.prefix_blocks == 8 and res.by_tier == {Tier.DRAM: 8}
    assert sorted(node2.sink.hashes("stored", "CPU")) == list(range(1, 9))  # re-announced
    for h, block in zip(range(1, 9), await node2.get(list(range(1, 9))), strict=True):
        assert np.array_equal(block, data(h))
    # A block scribbled on while no daemon owned the region is not served.
    await node2.close(graceful=True)
    region = np.memmap(tmp_path / "region", dtype=np.uint8, mode="r+")
    off = node2.ns.blocks[5].offset
    region[off] ^= 0xFF
    region.flush()
    del region
    node3 = Node(tmp_path, fraction=0.0)
    assert node3.m.lookup(node3.ns.namespace_id, list(range(1, 9))).prefix_blocks == 4
    await node3.close()


def test_disk_path_missing_is_a_config_error(tmp_path):
    from kvstore.errors import ConfigError

    config = load_config(
        environ={},
        assignments=[
            f"dram.path={tmp_path}/r",
            "dram.capacity_bytes=1MiB",
            "dram.chunk_bytes=64KiB",
            f"disk.path={tmp_path}/missing",
            "disk.capacity_bytes=1MiB",
        ],
    )
    region = Region(config.dram.path, config.dram.capacity_bytes, prefault=False, huge_pages="off")
    with pytest.raises(ConfigError, match=f"{tmp_path}/missing"):
        BlockManager(config, region)
    region.close(unlink=True)


def test_allocator_rebuild_keeps_good_slots_and_rejects_impossible_ones():
    from kvstore.tiers.dram import SlabAllocator

    alloc = SlabAllocator(4 * 65536, 65536)
    rejected = alloc.rebuild(
        [
            (0, 4096),
            (4096, 4096),
            (4096, 4096),  # duplicate
            (65536 + 100, 4096),  # misaligned
            (8192, 8192),  # another size in a chunk of 4 KiB slots
            (131072, 16384),
            (10 * 65536, 4096),  # outside the range
        ]
    )
    assert sorted(rejected) == [(4096, 4096), (8192, 8192), (65536 + 100, 4096), (655360, 4096)]
    assert alloc.used_bytes == 2 * 4096 + 16384
    taken = {0, 4096, 131072}
    fresh = [alloc.alloc(4096) for _ in range(14)]
    assert None not in fresh and not taken & set(fresh)  # never hands out a rebuilt slot
    alloc.free(4096)
    assert alloc.alloc(4096) == 4096


async def _leased_disk_fills(node: Node) -> int:
    """A disk of 4 slots, every one holding a block a load lease pins; DRAM (8) then fills.

    The demoter finds no disk slot it may take (all pinned), so the disk cannot
    take writes. Returns the lease.
    """
    node.put([1, 2, 3, 4])
    await node.settle()
    assert node.m.disk.blocks() == 4
    plan = await node.m.prepare_load_async(node.ns.namespace_id, [1, 2, 3, 4])
    assert len(plan.blocks) == 4
    node.put([5, 6, 7, 8])  # the last free DRAM slots: dirty, and the disk is full
    await node.settle()
    assert "busy or pinned" in node.m.disk.full_reason
    return plan.lease_id


def _no_leaks(node: Node, *, leases: int) -> None:
    stats = node.m.stats()
    dram, disk = stats.tiers[0], stats.tiers[1]
    assert stats.active_leases == leases
    assert dram.used_bytes == dram.blocks * node.ns.slot_bytes  # no slot without a block
    assert disk.used_bytes == disk.blocks * BLOCK
    assert not node.m.disk.tier._writing  # no disk slot held by a write that ended


async def test_disk_that_cannot_take_writes_rejects_stores_and_keeps_serving(tmp_path):
    from kvstore.errors import CapacityExhausted

    node = Node(tmp_path, dram="128KiB", disk="64KiB")  # 8 blocks in DRAM, 4 on disk
    lease = await _leased_disk_fills(node)
    with pytest.raises(CapacityExhausted) as info:
        node.put([9])  # only a block not on disk could make room: refused
    message = str(info.value)
    assert f"disk tier at {tmp_path / 'disk'} cannot take writes" in message
    assert "busy or pinned" in message
    assert all(h in node.ns.blocks for h in range(1, 9))  # nothing was dropped
    assert node.m.stats().counters.evicted_blocks == 0
    # Still serving: lookups, and loads of what is there, with the right bytes.
    assert node.m.lookup(node.ns.namespace_id, list(range(1, 9))).prefix_blocks == 8
    for h, block in zip(range(5, 9), await node.get([5, 6, 7, 8]), strict=True):
        assert np.array_equal(block, data(h))
    _no_leaks(node, leases=1)
    # The lease ends: the disk may drop its coldest copies again, a demotion
    # lands, and stores succeed.
    node.m.release([lease])
    for _ in range(200):
        await node.settle()
        if not node.m.disk.full_reason:
            break
        await asyncio.sleep(0.02)
    assert not node.m.disk.full_reason
    plan = node.put([9])
    assert plan.statuses[0] == 0
    _no_leaks(node, leases=0)
    await node.close()


async def test_disk_that_cannot_take_writes_drops_undemoted_blocks_if_configured(tmp_path):
    node = Node(tmp_path, dram="128KiB", disk="64KiB", **{"disk.when_full": "drop"})
    lease = await _leased_disk_fills(node)
    plan = node.put([9])  # room made by dropping a block that was not on disk
    assert plan.statuses[0] == 0
    assert node.m.stats().counters.evicted_blocks == 1
    assert sum(h in node.ns.blocks for h in range(5, 9)) == 3
    node.m.release([lease])
    _no_leaks(node, leases=0)
    await node.close()


async def test_readahead_promotes_the_next_disk_blocks_into_free_dram(tmp_path):
    node = Node(tmp_path)  # DRAM 16 blocks
    node.put(list(range(1, 11)))
    await node.settle()
    node.m.disk.tier.close_sync()  # a crash: the blocks are on disk only after it
    node.region.close_hooks.clear()
    node.region.close(unlink=True)
    node2 = Node(tmp_path)
    assert node2.m.lookup(node2.ns.namespace_id, list(range(1, 11))).by_tier == {Tier.DISK: 10}
    got = await node2.get([1, 2])  # reads 2 blocks from disk: 2 more follow them
    for h, b in zip([1, 2], got, strict=True):
        assert np.array_equal(b, data(h))
    for _ in range(1000):  # (up to 10 s: readahead runs on I/O threads)
        if node2.tier_of(4) is Tier.DRAM:
            break
        await asyncio.sleep(0.01)
    assert [node2.tier_of(h) for h in range(1, 6)] == [Tier.DRAM] * 4 + [Tier.DISK]
    # The next load finds them in DRAM, with the right bytes, and reads further ahead.
    got = await node2.get([1, 2, 3, 4])
    for h, b in zip([1, 2, 3, 4], got, strict=True):
        assert np.array_equal(b, data(h))
    for _ in range(1000):  # (up to 10 s: readahead runs on I/O threads)
        if node2.tier_of(6) is Tier.DRAM:
            break
        await asyncio.sleep(0.01)
    assert node2.tier_of(6) is Tier.DRAM
    stats = node2.m.stats()
    assert stats.counters.evicted_blocks == 0 and stats.tiers[0].pinned_blocks == 0
    await node2.close()


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
async def test_demoter_copies_the_blocks_dram_drops_next_not_the_oldest_commits(tmp_path, policy):
    # 1024 DRAM slots: more than eviction's clean-victim window, so a clean
    # block at the hot end cannot stand in for a dirty one at the cold end.
    node = Node(
        tmp_path, dram="4MiB", disk="16MiB", fraction=0.1, **{"dram.eviction_policy": policy}
    )
    m = node.m
    assert m.disk is not None
    ns = m.declare_namespace(make_spec(4096))
    target = int(0.1 * 1024)  # blocks the demoter keeps free or clean

    def put(hashes):
        m.commit_store(m.prepare_store(ns.namespace_id, hashes).lease_id)

    put(list(range(900)))  # free room above the target: nothing demoted
    await node.settle()
    assert m.disk.blocks() == 0
    # The oldest commits are hit: they are the hottest blocks now.
    plan = await m.prepare_load_async(ns.namespace_id, list(range(300)))
    m.release([plan.lease_id])
    put(list(range(900, 1024)))  # DRAM full: the demoter copies `target` blocks
    await node.settle()
    on_disk = {h for h, b in ns.blocks.items() if b.disk_slot >= 0}
    assert len(on_disk) >= target
    assert on_disk.isdisjoint(range(300))  # not the hot ones, for all their age
    assert set(range(300, 300 + target)) <= on_disk  # the coldest
    # The next stores evict the coldest blocks: each one's copy is on disk.
    put(list(range(1024, 1024 + target)))
    assert m.stats().counters.evicted_blocks == 0
    assert all(ns.blocks[h].tier is Tier.DISK for h in range(300, 300 + target))
    assert all(ns.blocks[h].tier is Tier.DRAM for h in range(300))
    await node.close()


async def test_a_disk_full_of_pinned_copies_at_its_cold_end_still_takes_demotions(tmp_path):
    """Seventy blocks written down, then pinned by a load lease (the disk order's
    coldest 70 copies); the disk fills: each new block's write drops the coldest
    unpinned copy behind the pinned ones (a block still in DRAM: only that copy
    goes). Before 2026-12-05 the search looked at the 64 coldest only, all
    pinned, and 81..90 stayed unwritten (dirty, their only copy in DRAM)."""
    node = Node(tmp_path, dram="2MiB", disk="1280KiB")  # 128 in DRAM, 80 on disk
    m = node.m
    for i in range(1, 71, 10):
        node.put(list(range(i, i + 10)))
        await node.settle()
    assert m.disk.blocks() == 70
    lease = await m.prepare_load_async(node.ns.namespace_id, list(range(1, 71)))
    assert len(lease.blocks) == 70
    node.put(list(range(71, 91)))  # 10 fit; 10 need a victim
    await node.settle()
    on_disk = {h for h, b in node.ns.blocks.items() if b.disk_slot >= 0}
    assert set(range(1, 71)) <= on_disk  # pinned: kept
    assert set(range(81, 91)) <= on_disk  # written, in the room of 71..80's copies
    assert not on_disk & set(range(71, 81))
    assert len(node.ns.blocks) == 90 and m.stats().counters.evicted_blocks == 0
    m.release([lease.lease_id])
    await node.close()


async def test_a_gpu_pool_full_of_pinned_blocks_at_its_cold_end_still_takes_stores(tmp_path):
    """Seventy pool blocks pinned by a load lease at the pool's cold end, the pool
    full: a store into the pool moves the coldest unpinned block behind them down
    to DRAM (host mode: gpu.device = cpu). Before 2026-12-05 the search looked at
    the 64 coldest only, all pinned, and the store was refused
    (CapacityExhausted: "full of pinned or in-flight blocks")."""
    pytest.importorskip("torch")
    node = Node(
        tmp_path,
        dram="2MiB",
        disk="4MiB",
        **{
            "gpu.device": "cpu",
            "gpu.capacity_bytes": "1280KiB",  # 80 blocks
            "gpu.chunk_bytes": "64KiB",
            "gpu.demote_free_fraction": 0,
        },
    )
    m, ns_id = node.m, node.ns.namespace_id

    def store_gpu(hashes):  # type: ignore[no-untyped-def]
        plan = m.prepare_store(ns_id, hashes, tier=Tier.GPU)
        m.commit_store(plan.lease_id)
        return plan

    store_gpu(list(range(1, 71)))
    lease = await m.prepare_load_async(ns_id, list(range(1, 71)), tier=Tier.GPU)
    assert len(lease.blocks) == 70
    store_gpu(list(range(71, 81)))
    assert [node.tier_of(h) for h in range(1, 81)] == [Tier.GPU] * 80
    store_gpu([81])
    assert node.tier_of(81) is Tier.GPU
    assert node.tier_of(71) is Tier.DRAM  # the coldest unpinned one moved down
    assert [node.tier_of(h) for h in range(1, 71)] == [Tier.GPU] * 70
    m.release([lease.lease_id])
    await node.close()
