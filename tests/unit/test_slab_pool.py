"""One behaviour suite for the slab pools under the DRAM tier and the GPU pool.

No manager is built: each test runs over a ``SlabPool`` (DRAM) and a
``GpuSlabPool`` over a real ``GpuTier`` in host mode (device "cpu"), and the
placement owner's admission and eviction over that pool, as vLLM's offloading
tiers and llm-d's index backends are each checked by one suite.
"""

from __future__ import annotations

import pytest

from kvstore.eviction.lru import LRUPolicy
from kvstore.namespace import Block, BlockState, Namespace, Tier
from kvstore.placement import Placement
from kvstore.tiers.dram import SlabAllocator, slot_bytes_for
from kvstore.tiers.pool import GpuSlabPool, SlabPool
from tests.conftest import make_spec
from tests.sinks import RecordingSink

KiB = 1024
CHUNK = 64 * KiB
CAPACITY = 4 * CHUNK


def _ns(block_bytes: int, model: str = "m") -> Namespace:
    spec = make_spec(block_bytes, model=model)
    return Namespace(spec, spec.namespace_id(), block_bytes, slot_bytes_for(block_bytes))


class Medium:
    """One storage medium under test: its pool and which Block field holds its offsets."""

    def __init__(self, tier: Tier, pool: SlabPool, keep: object = None) -> None:
        self.tier = tier
        self.pool = pool
        self.keep = keep  # what owns the bytes (the host-mode GPU tier)

    def commit(self, ns: Namespace, h: int) -> Block:
        """A committed block of ns in a fresh slot of this pool (what a store leaves)."""
        block = Block(ns, h, state=BlockState.COMMITTED)
        offset = self.pool.alloc(block)
        assert offset is not None, "pool full"
        if self.tier is Tier.GPU:
            block.gpu_offset = offset
        else:
            block.offset = offset
        ns.blocks[h] = block
        self.pool.policy(ns.slot_bytes).insert(block)
        return block


@pytest.fixture(params=["dram", "gpu-host"])
def medium(request):
    if request.param == "dram":
        return Medium(Tier.DRAM, SlabPool(SlabAllocator(CAPACITY, CHUNK), "lru"))
    pytest.importorskip("torch")
    from kvstore.tiers.gpu import GpuTier

    tier = GpuTier(CAPACITY, CHUNK, "cpu")
    assert tier.device.type == "cpu"
    return Medium(Tier.GPU, GpuSlabPool(tier.allocator, "lru"), keep=tier)


def test_a_slot_is_owned_by_its_block_until_freed(medium):
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
    assert isinstance(pool.policy(ns.slot_bytes), LRUPolicy)
    assert pool.victim(ns.slot_bytes, 64) is blocks[0]
    blocks[0].pins = 1  # pinned: never a victim
    assert pool.victim(ns.slot_bytes, 64) is blocks[1]
    pool.policy(ns.slot_bytes).touch(blocks[1])  # hot again
    assert pool.victim(ns.slot_bytes, 64) is blocks[2]
    assert pool.victim(ns.slot_bytes, 64, only=other) is theirs
    # Only the `scan` coldest are looked at (cold to hot now: 0, 2, 3, theirs, 1).
    for b in blocks:
        b.pins = 1
    assert pool.victim(ns.slot_bytes, 3) is None
    assert pool.victim(ns.slot_bytes, 4) is theirs


def test_a_preferred_victim_is_taken_within_the_window_else_the_coldest(medium):
    ns = _ns(4 * KiB)
    blocks = [medium.commit(ns, h) for h in range(6)]
    pool, size = medium.pool, ns.slot_bytes
    clean = {id(blocks[3])}

    def prefer(b):
        return id(b) in clean

    assert pool.victim(size, 64, prefer=prefer, window=8) is blocks[3]
    # Three dirty ones before it: a window of 3 gives up, the coldest goes.
    assert pool.victim(size, 64, prefer=prefer, window=3) is blocks[0]
    assert pool.victim(size, 64, prefer=prefer, window=3, prefer_only=True) is None


def test_a_chunk_of_another_size_goes_whole_and_coldest_first(medium):
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


def test_placement_admits_evicts_and_reports_over_the_pool(medium):
    """The placement owner's reserve/commit/evict/remove over one medium, no manager."""
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
