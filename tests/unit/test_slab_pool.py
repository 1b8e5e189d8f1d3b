"""One behaviour suite for the slab pools and eviction orders under every tier.

No manager is built: each test runs over a ``SlabPool`` (DRAM), a
``GpuSlabPool`` over a real ``GpuTier`` in host mode (device "cpu") and, for
the eviction orders and the victim search, the disk tier's
``DiskEvictionOrders`` over a real ``DiskTier`` in a temp dir; then the
placement owner's admission and eviction over each, as vLLM's offloading tiers
and llm-d's index backends are each checked by one suite.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.eviction.lru import LRUPolicy
from kvstore.namespace import Block, BlockState, Namespace, Tier
from kvstore.placement import Placement
from kvstore.tiers.disk import DiskTier, align_up
from kvstore.tiers.dram import SlabAllocator, slot_bytes_for
from kvstore.tiers.pool import DiskEvictionOrders, EvictionOrders, GpuSlabPool, SlabPool
from tests.conftest import make_spec
from tests.sinks import RecordingSink

KiB = 1024
CHUNK = 64 * KiB
CAPACITY = 4 * CHUNK


def _ns(block_bytes: int, model: str = "m") -> Namespace:
    spec = make_spec(block_bytes, model=model)
    return Namespace(spec, spec.namespace_id(), block_bytes, slot_bytes_for(block_bytes))


class Medium:
    """One storage medium under test: its pool (or, for the disk, its eviction
    orders over the DiskTier's own slots) and which Block field holds its offsets."""

    def __init__(self, tier: Tier, pool: EvictionOrders, keep: object = None) -> None:
        self.tier = tier
        self.pool = pool
        self.keep = keep  # what owns the bytes (the host-mode GPU tier, the DiskTier)

    def commit(self, ns: Namespace, h: int) -> Block:
        """A committed block of ns in a fresh slot of this medium (what a store leaves)."""
        block = Block(ns, h, state=BlockState.COMMITTED)
        if self.tier is Tier.DISK:
            assert isinstance(self.keep, DiskTier)
            slot = self.keep.allocate(ns.block_bytes)  # the disk owns its slots
            assert slot is not None, "disk full"
            block.disk_slot = slot
        else:
            assert isinstance(self.pool, SlabPool)
            offset = self.pool.alloc(block)
            assert offset is not None, "pool full"
            if self.tier is Tier.GPU:
                block.gpu_offset = offset
            else:
                block.offset = offset
        ns.blocks[h] = block
        self.pool.policy_of(ns).insert(block)
        return block


def _medium(kind: str, tmp_path) -> Medium:
    if kind == "dram":
        return Medium(Tier.DRAM, SlabPool(SlabAllocator(CAPACITY, CHUNK), "lru"))
    if kind == "disk":
        tier = DiskTier(str(tmp_path), CAPACITY, slab_bytes=CHUNK, io_threads=1)
        return Medium(Tier.DISK, DiskEvictionOrders("lru"), keep=tier)
    pytest.importorskip("torch")
    from kvstore.tiers.gpu import GpuTier

    tier = GpuTier(CAPACITY, CHUNK, "cpu")
    assert tier.device.type == "cpu"
    return Medium(Tier.GPU, GpuSlabPool(tier.allocator, "lru"), keep=tier)


@pytest.fixture(params=["dram", "gpu-host", "disk"])
def medium(request, tmp_path):
    """Every tier's eviction orders: the victim search is one."""
    m = _medium(request.param, tmp_path)
    yield m
    if isinstance(m.keep, DiskTier):
        m.keep.close_sync()


@pytest.fixture(params=["dram", "gpu-host"])
def slab(request, tmp_path):
    """The media whose slots a SlabPool owns (the disk tier owns its own)."""
    return _medium(request.param, tmp_path)


def test_a_slot_is_owned_by_its_block_until_freed(slab):
    medium = slab
    ns = _ns(4 * KiB)
    a, b = medium.commit(ns, 1), medium.commit(ns, 2)
    offsets = {medium.pool.offset_of(a), medium.pool.offset_of(b)}
    assert len(offsets) == 2
    assert {medium.pool.owner[o] for o in offsets} == {a, b}
    assert medium.pool.used_bytes == 2 * ns.slot_bytes
    assert medium.pool.free(medium.pool.offset_of(a)) is a
    assert medium.pool.used_bytes == ns.slot_bytes and a not in medium.pool.owner.values()
    assert medium.tier is b.tier  # Block.tier is derived from the offset field


def test_the_victim_is_the_coldest_unpinned_block_of_its_size(medium):
    ns, other = _ns(4 * KiB), _ns(4 * KiB, model="other")
    blocks = [medium.commit(ns, h) for h in range(4)]
    theirs = medium.commit(other, 99)
    pool = medium.pool
    size = pool.slot_bytes_of(ns)
    assert isinstance(pool.policy(size), LRUPolicy) and pool.policy_of(other) is pool.policy(size)
    assert pool.committed_blocks() == 5
    assert pool.victim(size, 64) is blocks[0]
    blocks[0].pins = 1  # pinned: never a victim
    assert pool.victim(size, 64) is blocks[1]
    pool.policy(size).touch(blocks[1])  # hot again
    assert pool.victim(size, 64) is blocks[2]
    assert pool.victim(size, 64, only=other) is theirs
    # Only the `scan` coldest are looked at (cold to hot now: 0, 2, 3, theirs, 1).
    for b in blocks:
        b.pins = 1
    assert pool.victim(size, 3) is None
    assert pool.victim(size, 4) is theirs
    assert list(pool.coldest()) == [blocks[0], blocks[2], blocks[3], theirs, blocks[1]]


def test_a_preferred_victim_is_taken_within_the_window_else_the_coldest(medium):
    ns = _ns(4 * KiB)
    blocks = [medium.commit(ns, h) for h in range(6)]
    pool = medium.pool
    size = pool.slot_bytes_of(ns)
    clean = {id(blocks[3])}

    def prefer(b):
        return id(b) in clean

    assert pool.victim(size, 64, prefer=prefer, window=8) is blocks[3]
    # Three dirty ones before it: a window of 3 gives up, the coldest goes.
    assert pool.victim(size, 64, prefer=prefer, window=3) is blocks[0]
    assert pool.victim(size, 64, prefer=prefer, window=3, prefer_only=True) is None


def test_a_chunk_of_another_size_goes_whole_and_coldest_first(slab):
    medium = slab
    small, large = _ns(4 * KiB), _ns(16 * KiB, model="large")
    pool = medium.pool
    first = [medium.commit(small, h) for h in range(CHUNK // small.slot_bytes)]  # chunk 0
    second = [medium.commit(small, 100 + h) for h in range(CHUNK // small.slot_bytes)]
    assert pool.chunk_victims(small.slot_bytes) is None  # its own size: not a chunk to steal
    victims = pool.chunk_victims(large.slot_bytes)
    assert victims is not None and set(map(id, victims)) == set(map(id, first))
    first[5].pins = 1  # one pinned block keeps its whole chunk
    victims = pool.chunk_victims(large.slot_bytes)
    assert victims is not None and set(map(id, victims)) == set(map(id, second))
    assert pool.chunk_victims(large.slot_bytes, accept=lambda b: False) is None


def test_placement_admits_evicts_and_reports_over_the_pool(slab):
    """The placement owner's reserve/commit/evict/remove over one medium, no manager."""
    medium = slab
    sink = RecordingSink()
    ns = _ns(CHUNK // 2)  # two slots per chunk: the pool holds 8 blocks
    placement = Placement(SlabAllocator(CAPACITY, CHUNK), sink, eviction_policy="lru")
    if medium.tier is Tier.GPU:
        placement.gpu = medium.pool  # the host-mode GPU pool under test
    else:
        placement.dram = medium.pool

    def store(h: int) -> Block | None:
        block = Block(ns, h)
        if medium.tier is Tier.GPU:
            offset = placement.reserve_gpu(block)
        else:
            offset = placement.reserve_dram(block)
        if offset is None:
            return None
        placement.occupy(block, medium.tier, offset)
        placement.commit([block], [block], medium.tier, [([h], None, None)])
        return block

    blocks = [store(h) for h in range(8)]
    assert all(b is not None and b.tier is medium.tier for b in blocks)
    assert medium.pool.used_bytes == CAPACITY
    assert sink.hashes("stored", medium.tier.medium) == list(range(8))
    if medium.tier is Tier.DRAM:
        # Full: a new store evicts the coldest unpinned block (0 is pinned).
        placement.pin(blocks[0])
        assert store(8) is not None
        assert 1 not in ns.blocks and 0 in ns.blocks
        assert sink.hashes("removed", Tier.DRAM.medium) == [1]
        assert placement.counters.evicted_blocks == 1
    else:
        # The GPU pool itself never evicts: its mover demotes (it must copy).
        assert store(8) is None
        placement.pin(blocks[0])
    # A pinned block's delete frees its slot at the last unpin only.
    used = medium.pool.used_bytes
    assert placement.delete(ns, [blocks[0]]) == (0, 1)
    assert 0 not in ns.blocks and medium.pool.used_bytes == used
    placement.unpin(blocks[0])
    assert medium.pool.used_bytes == used - ns.slot_bytes
    assert placement.pinned_blocks == 0
    assert sink.hashes("removed", medium.tier.medium)[-1] == 0


def test_disk_orders_key_by_the_disk_slot_size():
    """The disk's eviction order of a size is the one its slots are allocated in:
    a block's bytes rounded up to the 4 KiB the disk aligns to (DRAM: 64 bytes)."""
    ns = _ns(5000)
    assert DiskEvictionOrders("lru").slot_bytes_of(ns) == align_up(5000) == 8192
    assert SlabPool(SlabAllocator(CAPACITY, CHUNK), "lru").slot_bytes_of(ns) == ns.slot_bytes
    assert ns.slot_bytes == slot_bytes_for(5000) != 8192


async def test_placement_makes_disk_room_from_the_coldest_unpinned_copy(tmp_path):
    """The placement owner over a real DiskTier, no manager: a full disk gives the
    slot of its coldest unpinned copy (one victim search, the pools' own); a copy
    that was the block's last takes the block out of the store, one that was not
    leaves the block in DRAM."""
    sink = RecordingSink()
    ns = _ns(CHUNK // 2)  # two disk slots per 64 KiB slab: the disk holds 4 blocks
    placement = Placement(SlabAllocator(2 * CAPACITY, CHUNK), sink, eviction_policy="lru")
    tier = DiskTier(str(tmp_path), CAPACITY // 2, slab_bytes=CHUNK, io_threads=1)
    placement.attach_disk(tier, "lru")
    try:
        blocks = []
        for h in range(5):
            block = Block(ns, h)
            offset = placement.reserve_dram(block)
            assert offset is not None
            placement.occupy(block, Tier.DRAM, offset)
            placement.commit([block], [block], Tier.DRAM, [([h], None, None)])
            blocks.append(block)

        async def demote(block: Block) -> None:
            slot = placement.reserve_disk(ns)
            assert slot is not None
            data = np.full(ns.block_bytes, block.block_hash, dtype=np.uint8)
            checksum = await tier.write(slot, data, (ns.namespace_id, block.block_hash))
            assert placement.place_disk(
                block,
                slot,
                checksum,
                dram_offset=block.offset,
                dram_generation=block.dram_generation,
            )

        for block in blocks[:4]:
            await demote(block)
        assert len(tier) == 4 and not tier.can_allocate(ns.block_bytes)
        assert placement.disk_orders.committed_blocks() == 4
        placement.pin(blocks[0])  # a promotion read, say: its disk copy stays
        placement.vacate_dram(blocks[1])  # now on disk only
        assert blocks[1].tier is Tier.DISK

        await demote(blocks[4])  # full: block 1's slot (its last copy) is taken
        assert 1 not in ns.blocks and sink.hashes("removed", Tier.DISK.medium) == [1]
        assert placement.counters.evicted_blocks == 1
        placement.unpin(blocks[0])
        slot = placement.reserve_disk(ns)  # full again: block 0's disk copy goes, DRAM keeps it
        assert slot is not None
        tier.abandon(slot)
        assert blocks[0].disk_slot < 0 and blocks[0].tier is Tier.DRAM and 0 in ns.blocks
        assert sink.hashes("removed", Tier.DISK.medium) == [1, 0]
        assert [b.block_hash for b in placement.disk_orders.coldest()] == [2, 3, 4]
    finally:
        await tier.close()
