"""Slab pools and eviction orders: the slot bookkeeping under every tier.

``EvictionOrders`` is one eviction order per slot size and the one victim
search every tier uses (the coldest unpinned block of a size, optionally a
preferred one within a window). ``SlabPool`` adds slots of several sizes over
one byte range (the DRAM region or the GPU pool) and the block that owns each
slot, and with them the search for the coldest chunk of another size whose
blocks can all go. Neither decides nor moves anything: ``kvstore.placement``
(the one owner of where a block lives) asks them, then evicts, demotes or
moves what they name.

The disk tier uses ``DiskEvictionOrders`` only, not a ``SlabPool``: its slots
are the ``DiskTier``'s own, durably (every allocation and free is a journal
record that a crash replays), and the tier itself frees slots the placement
never sees (a write that failed, a block that failed its checksum), so an
owner map here would be a second copy of the tier's journal index kept in
step by hand.

Pure bookkeeping, no bytes, no I/O: each can be tested without a region, a
device or a manager (tests/unit/test_slab_pool.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import cast

from kvstore.eviction import make_policy
from kvstore.eviction.base import EvictionPolicy
from kvstore.namespace import Block, BlockState, Namespace
from kvstore.tiers.disk import align_up
from kvstore.tiers.dram import PART_KEY_STRIDE, SlabAllocator


class EvictionOrders:
    """One eviction order per slot size (of the committed blocks whose bytes are
    in the tier), and the one victim search over them."""

    def __init__(self, eviction_policy: str) -> None:
        self.eviction_policy = eviction_policy
        # One policy per slot size: eviction for a size finds a victim of that
        # size in O(1) instead of walking every other size's blocks.
        self.policies: dict[int, EvictionPolicy] = {}

    def slot_bytes_of(self, ns: Namespace) -> int:
        """The slot size (the key of its eviction order) of ns's blocks in this tier."""
        return ns.slot_bytes

    def policy(self, slot_bytes: int) -> EvictionPolicy:
        policy = self.policies.get(slot_bytes)
        if policy is None:
            policy = self.policies[slot_bytes] = make_policy(self.eviction_policy)
        return policy

    def policy_of(self, ns: Namespace) -> EvictionPolicy:
        """The eviction order ns's blocks are in, in this tier."""
        return self.policy(self.slot_bytes_of(ns))

    def committed_blocks(self) -> int:
        """Committed blocks whose bytes are in this tier."""
        return sum(len(p) for p in self.policies.values())

    def coldest(self) -> Iterator[Block]:
        """Every committed block, size class by size class, coldest first (the order a
        warm restart saves them in)."""
        for policy in self.policies.values():
            yield from cast("Iterator[Block]", policy.victims())

    def victim(
        self,
        slot_bytes: int,
        scan: int,
        *,
        only: object = None,
        prefer: Callable[[Block], bool] | None = None,
        window: int = 1,
        prefer_only: bool = False,
    ) -> Block | None:
        """The coldest unpinned block of a slot size among the ``scan`` coldest, or None.

        ``only``: a namespace, to look at its blocks only. ``prefer``: take the
        coldest block it accepts among the first ``window`` unpinned ones, else
        the coldest unpinned one (None with ``prefer_only``). ``slot_bytes`` is
        the order's key: with tenant regions, a range's own (PART_KEY_STRIDE).
        """
        fallback = None
        for block in itertools.islice(self.policy(slot_bytes).victims(), scan):
            assert isinstance(block, Block)
            if block.pins or (only is not None and block.namespace is not only):
                continue
            if prefer is None or prefer(block):
                return block
            if fallback is None:
                fallback = block
            window -= 1
            if window <= 0:
                break
        return None if prefer_only else fallback


class DiskEvictionOrders(EvictionOrders):
    """The disk tier's eviction orders: by disk slot size (a block's bytes rounded
    up to the 4 KiB the disk's direct I/O aligns to). Its slots are the DiskTier's."""

    def slot_bytes_of(self, ns: Namespace) -> int:
        return align_up(ns.block_bytes)


class SlabPool(EvictionOrders):
    """Slots, their owners and per-size eviction orders over one byte range."""

    def __init__(self, allocator: SlabAllocator, eviction_policy: str) -> None:
        super().__init__(eviction_policy)
        self.allocator = allocator
        # slot offset -> the block it is reserved for or holds (pending, committed,
        # or the target of a move or promotion still running)
        self.owner: dict[int, Block] = {}

    # ------------------------------------------------------------ slots

    @property
    def capacity_bytes(self) -> int:
        return self.allocator.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    @property
    def free_bytes(self) -> int:
        return self.allocator.capacity_bytes - self.allocator.used_bytes

    def alloc(self, block: Block) -> int | None:
        """A free slot for ``block`` (never evicting), now owned by it; None if none is free."""
        offset = self.allocator.alloc(block.namespace.slot_bytes)
        if offset is not None:
            self.owner[offset] = block
        return offset

    def free(self, offset: int) -> Block:
        """Give a slot back; returns the block that owned it."""
        block = self.owner.pop(offset)
        self.allocator.free(offset)
        return block

    # --------------------------------------------------------- eviction

    def chunk_victims(
        self, slot_bytes: int, accept: Callable[[Block], bool] | None = None, part: int = 0
    ) -> list[Block] | None:
        """The blocks of the coldest whole chunk held by another slot size whose
        blocks can all go (committed, unpinned, and ``accept``-ed); None if none.
        Chunks of range ``part`` only (a one-range allocator has only range 0).

        Taken when a size has nothing to evict: the coldest chunk is judged by
        its size class's eviction order, so the chunk whose blocks come first in
        that order goes.
        """
        alloc = self.allocator
        best: tuple[int, int] | None = None  # (rank of first victim, chunk)
        for other in alloc.size_classes(part):
            if other == slot_bytes:
                continue
            evictable_chunks = {
                chunk
                for chunk in alloc.chunks_of(other, part)
                if all(
                    (b := self.owner.get(off)) is None
                    or (
                        b.pins == 0
                        and b.state is BlockState.COMMITTED
                        and (accept is None or accept(b))
                    )
                    for off in alloc.chunk_slots(chunk)
                )
            }
            if not evictable_chunks:
                continue
            for rank, block in enumerate(self.policy(other + part * PART_KEY_STRIDE).victims()):
                assert isinstance(block, Block)
                chunk = self.offset_of(block) // alloc.chunk_bytes
                if chunk in evictable_chunks:
                    if best is None or rank < best[0]:
                        best = (rank, chunk)
                    break
        if best is None:
            return None
        return [b for off in alloc.chunk_slots(best[1]) if (b := self.owner.get(off))]

    def offset_of(self, block: Block) -> int:
        """Where a committed block's bytes lie in this pool (subclasses say which field)."""
        return block.offset


class GpuSlabPool(SlabPool):
    """The GPU pool's slots: the same pool, its blocks' offsets in ``gpu_offset``."""

    def offset_of(self, block: Block) -> int:
        return block.gpu_offset
