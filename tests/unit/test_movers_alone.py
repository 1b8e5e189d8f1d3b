"""The movers with no manager: the disk mover over a ``Placement`` and a real
``Region`` and ``DiskTier`` (temp dir), as the store's API would drive it
(commit -> the demoter writes; DRAM drops the clean copy; a load promotes).

The movers report every move to the placement owner and never call back into
the manager (tests/unit/test_layers.py checks the imports; this checks that
nothing else is needed to run one).
"""

from __future__ import annotations

import numpy as np

from kvstore.config import DiskConfig
from kvstore.movers.disk import DiskLayer
from kvstore.namespace import Block, Namespace, Tier
from kvstore.placement import Placement
from kvstore.tiers.dram import Region, SlabAllocator, slot_bytes_for
from tests.conftest import make_spec
from tests.sinks import RecordingSink

KiB = 1024
CHUNK = 64 * KiB
DRAM_BYTES = 16 * CHUNK


def _ns(block_bytes: int) -> Namespace:
    spec = make_spec(block_bytes)
    return Namespace(spec, spec.namespace_id(), block_bytes, slot_bytes_for(block_bytes))


def _data(h: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(h).integers(0, 256, nbytes, dtype=np.uint8)


async def test_the_disk_mover_demotes_and_promotes_with_no_manager(tmp_path):
    sink = RecordingSink()
    region = Region(str(tmp_path / "region"), DRAM_BYTES, prefault=False, huge_pages="off")
    placement = Placement(SlabAllocator(DRAM_BYTES, CHUNK), sink, eviction_policy="lru")
    (tmp_path / "disk").mkdir()
    config = DiskConfig(
        path=str(tmp_path / "disk"),
        capacity_bytes=4 * CHUNK,
        slab_bytes=CHUNK,
        io_threads=1,
        demote_free_fraction=1.0,  # write every block down (write-behind)
    )
    mover = DiskLayer(placement, region, config)
    ns = _ns(16 * KiB)
    assert mover.attach(ns) == []
    hashes = list(range(1, 7))
    try:
        for h in hashes:  # what a store does: reserve, copy in, commit
            block = Block(ns, h)
            offset = placement.reserve_dram(block)
            assert offset is not None
            region.view(offset, ns.block_bytes)[:] = _data(h, ns.block_bytes)
            placement.occupy(block, Tier.DRAM, offset)
            placement.commit([block], [block], Tier.DRAM, [([h], None, None)])
        await mover.drain()  # the commits woke the demoter
        blocks = [ns.blocks[h] for h in hashes]
        assert all(b.disk_slot >= 0 for b in blocks) and not placement.dirty
        assert sink.hashes("stored", Tier.DISK.medium) == hashes
        assert mover.blocks() == len(hashes)

        for block in blocks[:4]:  # DRAM drops clean copies: they live on, on disk
            placement.vacate_dram(block)
        assert [b.tier for b in blocks] == [Tier.DISK] * 4 + [Tier.DRAM] * 2
        await mover.promote(ns, hashes)  # a load of the whole prefix
        assert all(b.tier is Tier.DRAM and b.disk_slot >= 0 for b in blocks)
        assert placement.counters.promoted_blocks == 4 and placement.pinned_blocks == 0
        for block in blocks:
            got = region.view(block.offset, ns.block_bytes)
            assert np.array_equal(got, _data(block.block_hash, ns.block_bytes))
    finally:
        await mover.close()
        region.close(unlink=True)
