"""Demotion and promotion between the DRAM region and the disk tier.

The manager stays synchronous (every call atomic on the event loop); the disk
moves bytes asynchronously. The two meet through *clean* blocks:

- A background demoter copies DRAM blocks to disk ahead of need, the ones
  DRAM would evict soonest first (then oldest commit first), keeping at least
  ``disk.demote_free_fraction`` of the DRAM tier free or clean (clean = also
  on disk). It reads the region in place: the block is pinned while its write
  runs, committed bytes never change.
- When DRAM needs room, the manager's eviction prefers a clean victim: its DRAM
  copy is dropped and the block lives on, on disk (``BlockRemoved`` CPU). Only
  when no clean victim is near the cold end is a dirty block dropped.
- A load whose prefix reaches disk-only blocks promotes them first: DRAM slots
  are reserved, the disk reads them in one batch (neighbouring slots in one
  read, each block verified by checksum), then the load lease is issued. A
  block that fails its checksum is dropped and the prefix ends before it.
  After such a load, readahead promotes the blocks in the following disk slots
  into free DRAM (never evicting), so the next load of a long context finds
  them there while this one's bytes are copied out.
- Disk at its capacity: the disk's own policy drops its coldest unpinned
  copies; a block with no other copy leaves the store (``BlockRemoved`` DISK).
- Disk that cannot take writes (the filesystem is out of space, or every slot
  is busy or pinned): demotion pauses and retries. With ``disk.when_full =
  "reject"`` (default) a store that could only make room by dropping a block
  not yet on disk fails (CapacityExhausted, RESOURCE_EXHAUSTED, naming the disk
  path) until demotions land again (DISK_FULL_CLEAR_S); with ``"drop"`` the coldest such block
  is dropped. Loads and lookups are served either way.

Disk blocks recovered at start wait, parked by namespace id, until a client
declares that namespace (ids are fingerprints of the spec, so they match).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from typing import TYPE_CHECKING, cast

from kvstore.errors import CapacityExhausted, ConfigError, DataCorruption, KVStoreError
from kvstore.eviction import make_policy
from kvstore.eviction.base import EvictionPolicy
from kvstore.namespace import Block, BlockState, Namespace
from kvstore.tiers import Tier
from kvstore.tiers.disk import DiskEntry, DiskTier, align_up

if TYPE_CHECKING:
    from collections.abc import Iterator

    from kvstore.config import DiskConfig
    from kvstore.manager import BlockManager

log = logging.getLogger(__name__)

# Victims looked at for a clean one before a dirty block is dropped instead.
CLEAN_VICTIM_WINDOW = 64
# Disk victims looked at per slot the demoter needs.
DISK_VICTIM_WINDOW = 64
# DRAM blocks the demoter looks at from the cold end of each DRAM eviction
# order per pass, for the dirty blocks DRAM would drop soonest. Bounded: once
# demoted, blocks stay at the cold end (clean) until evicted, so an unbounded
# walk would cost O(clean blocks) per finished write. Four times the window
# eviction itself looks at (4 * CLEAN_VICTIM_WINDOW): the next evictions'
# victims lie within it; past it, commit order stands in for the cold order.
COLD_SCAN_BLOCKS = 1024
# Pause after the disk refused a block (full of busy slots or out of space).
DISK_FULL_BACKOFF_S = 0.5
# A disk that refused a write counts as taking writes again only after a write
# lands this long after the last refusal (or once nothing is left to demote): a
# filesystem with a few crumbs of space takes one record and refuses the next.
DISK_FULL_CLEAR_S = 1.0
# Readahead after a load that read from disk: the disk-only blocks in the next
# disk slots (demotion follows DRAM's cold order, where the blocks of a context
# stored or hit together stay in context order, so a long context mostly lies
# in neighbouring slots) are promoted into *free* DRAM while the client copies, as
# much as the load read, at most this much and half the free DRAM.
READAHEAD_MAX_BYTES = 256 * 1024 * 1024
# Readahead blocks no load used yet, remembered (by id) at most this many.
READAHEAD_MAX_BLOCKS = 65536


class DiskLayer:
    """The disk tier as the manager's lower tier: demoter, promoter, recovery."""

    def __init__(self, manager: BlockManager, config: DiskConfig) -> None:
        if not 0.0 <= config.demote_free_fraction <= 1.0:
            raise ConfigError("disk.demote_free_fraction must be within [0, 1]")
        if config.capacity_bytes <= 0:
            raise ConfigError(f"disk tier path {config.path}: disk.capacity_bytes must be > 0")
        self.manager = manager
        self.config = config
        self.tier = DiskTier(
            config.path,
            config.capacity_bytes,
            slab_bytes=config.slab_bytes,
            io_threads=config.io_threads,
            direct_io=config.direct_io,
        )
        self.policies: dict[int, EvictionPolicy] = {}  # by disk slot size
        self.parked: dict[str, dict[int, DiskEntry]] = {}
        for entry in self.tier.recover():
            self.parked.setdefault(entry.namespace_id, {})[entry.block_hash] = entry
        self.clean_bytes = 0  # DRAM bytes of blocks that also have a disk copy
        # DRAM blocks with no disk copy, oldest commit first: what the demoter
        # copies down. It takes them in the DRAM policy's cold order first (see
        # _candidates), this FIFO after: a block committed long ago but hit
        # since is not the one DRAM drops next.
        self.dirty: dict[Block, None] = {}
        self.max_inflight = max(1, 2 * config.io_threads)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._paused_until_s = 0.0
        self._inflight: set[asyncio.Task[None]] = set()
        self._inflight_bytes = 0
        self._promoting: dict[int, asyncio.Task[None]] = {}  # id(block) -> its batch's read
        self._ahead: dict[int, None] = {}  # id(block) of readahead blocks no load used yet
        # Why the disk cannot take writes now ("" = it can): set when the demoter
        # finds no slot or a write fails for space, cleared by the next write
        # that lands.
        self.full_reason = ""
        self._full_at_s = 0.0  # when the disk last refused a write
        self._closed = False

    # ------------------------------------------------------------- recovery

    @property
    def parked_blocks(self) -> int:
        return sum(len(p) for p in self.parked.values())

    def attach(self, ns: Namespace) -> list[int]:
        """Adopt the recovered disk blocks of a namespace just declared; their hashes."""
        entries = self.parked.pop(ns.namespace_id, None)
        if not entries:
            return []
        adopted = []
        for h, entry in entries.items():
            if entry.nbytes != ns.block_bytes:
                self.tier.free(entry.slot)  # a block of another layout: stale
                continue
            block = ns.blocks.get(h)
            if block is not None:
                if block.disk_slot >= 0:
                    self.tier.free(entry.slot)
                    continue
                block.disk_slot = entry.slot  # in DRAM already (warm restart): now clean
                self.dirty.pop(block, None)
                block.checksum = entry.checksum
                self.clean_bytes += ns.slot_bytes
            else:
                block = Block(ns, h, Tier.DISK, -1, BlockState.COMMITTED, checksum=entry.checksum)
                block.disk_slot = entry.slot
                ns.blocks[h] = block
            self._policy(ns).insert(block)
            adopted.append(h)
        return adopted

    # ------------------------------------------------------------ eviction

    def _policy(self, ns: Namespace) -> EvictionPolicy:
        size = align_up(ns.block_bytes)
        policy = self.policies.get(size)
        if policy is None:
            policy = self.policies[size] = make_policy(self.config.eviction_policy)
        return policy

    def drop_dram_copy(self, block: Block) -> None:
        """DRAM eviction of a clean block: it stays, on disk only."""
        m = self.manager
        ns = block.namespace
        m._policy(ns.slot_bytes).remove(block)
        m._free_slot(block)
        self.clean_bytes -= ns.slot_bytes
        block.offset = -1
        block.tier = Tier.DISK
        m.counters.demoted_blocks += 1
        m.sink.blocks_removed(ns, [block.block_hash], Tier.DRAM.medium)

    def unlist(self, block: Block) -> None:
        """The block left the index: its disk copy is no eviction victim any more
        (its slot is freed with drop_disk_copy once nothing reads it)."""
        self._policy(block.namespace).remove(block)

    def drop_disk_copy(self, block: Block, *, emit: bool) -> None:
        """Forget a block's disk copy (it must not be pinned by a disk read)."""
        self._policy(block.namespace).remove(block)
        self.tier.free(block.disk_slot)
        block.disk_slot = -1
        if block.offset >= 0:
            self.clean_bytes -= block.namespace.slot_bytes
        if emit:
            self.manager.sink.blocks_removed(block.namespace, [block.block_hash], Tier.DISK.medium)

    def _disk_slot(self, ns: Namespace) -> int | None:
        """A disk slot for one block of ns, dropping the disk's coldest copies if needed."""
        slot = self.tier.allocate(ns.block_bytes)
        if slot is not None:
            return slot
        m = self.manager
        policy = self._policy(ns)
        coldest = itertools.islice(policy.victims(), DISK_VICTIM_WINDOW)
        victims = [b for b in cast("Iterator[Block]", coldest) if not b.pins]
        for victim in victims:
            if victim.offset >= 0 or victim.gpu_offset >= 0:
                self.drop_disk_copy(victim, emit=True)  # still in DRAM/GPU: only the disk copy goes
            else:
                m._remove(victim, emit=True)  # its only copy: the block leaves the store
                m.counters.evicted_blocks += 1
            slot = self.tier.allocate(ns.block_bytes)
            if slot is not None:
                return slot
        # Recovered blocks nobody declared yet are the coldest of all.
        for ns_id in list(self.parked):
            entries = self.parked[ns_id]
            while entries:
                _, entry = entries.popitem()
                self.tier.free(entry.slot)
                slot = self.tier.allocate(ns.block_bytes)
                if slot is not None:
                    return slot
            del self.parked[ns_id]
        return None

    # ------------------------------------------------------------ disk full

    def _set_full(self, reason: str) -> None:
        if reason != self.full_reason:
            log.warning("%s; demotion paused", reason)
        self.full_reason = reason
        self._full_at_s = time.monotonic()

    def keeps_dirty(self) -> bool:
        """True while DRAM must not drop blocks that are not on disk yet to make room.

        That is while the disk cannot take writes and ``disk.when_full`` is
        "reject": such a drop would lose a block the disk could not save, so the
        store that needs the room fails instead (and is retried by its client).
        """
        return bool(self.full_reason) and self.config.when_full == "reject"

    def full_message(self) -> str:
        """Why a store found no room while keeps_dirty(): for its RESOURCE_EXHAUSTED."""
        return (
            f"the DRAM tier has no free or clean room and the disk tier at "
            f"{self.config.path} cannot take writes ({self.full_reason}); blocks not on "
            'disk yet are kept (disk.when_full = "reject"): retry once the disk has room'
        )

    # ------------------------------------------------------------ demotion

    def committed(self, blocks: list[Block]) -> None:
        """New DRAM blocks: queue them for demotion and nudge the demoter."""
        self.dirty.update(dict.fromkeys(blocks))
        self.wake()

    def forget(self, block: Block) -> None:
        """The block left the store."""
        self.dirty.pop(block, None)
        self._ahead.pop(id(block), None)

    def wake(self) -> None:
        """Start or nudge the demoter."""
        if self._closed:
            return
        if self._wake is None:
            self._wake = asyncio.Event()
        self._wake.set()
        if self._task is None or self._task.done():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # not serving yet: the first commit starts it
            self._task = loop.create_task(self._run(), name="kvstore-demoter")

    def _need_bytes(self) -> int:
        """DRAM bytes still to make clean (free + clean + being written vs the target)."""
        alloc = self.manager.allocator
        target = int(self.config.demote_free_fraction * alloc.capacity_bytes)
        have = alloc.capacity_bytes - alloc.used_bytes + self.clean_bytes + self._inflight_bytes
        return target - have

    async def _run(self) -> None:
        """Keep up to ``max_inflight`` demotion writes running while DRAM needs them.

        A pipeline, not rounds: each finished write frees a place for the next,
        so the disk always has work queued and group commits overlap writes.
        """
        assert self._wake is not None
        while not self._closed:
            self._start_writes()
            if self._inflight or self._need_bytes() <= 0:
                await self._wake.wait()
            else:
                # Behind, yet nothing startable (all pinned, or the disk refused):
                # look again shortly rather than only at the next commit.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=0.05)
            self._wake.clear()

    def _candidates(self) -> list[Block]:
        """Dirty DRAM blocks to copy down, the ones DRAM drops soonest first.

        DRAM eviction takes its victims from the cold end of its policy and
        drops a dirty one when no clean one is near (CLEAN_VICTIM_WINDOW), so
        the demoter copies the dirty blocks nearest that end first: in commit
        order it would copy old blocks that were hit since (hot, evicted last)
        while the cold ones are dropped uncopied. The walk looks at
        COLD_SCAN_BLOCKS blocks per size class at most: the cold end fills up
        with blocks already clean, and a cursor cannot resume a walk of a
        policy that moves blocks between walks. The commit FIFO follows, for
        blocks past that bound (for blocks never hit it is the same order).

        The walk uses the policies' read-only ``coldest()`` order (an S3-FIFO
        ``victims()`` walk moves the keys it hands out, expecting them removed).
        A list, not an iterator: starting a write can drop disk copies and
        remove blocks, which a live walk of a dict must not see.
        """
        look = 16 * self.max_inflight
        dirty = self.dirty
        cold: list[list[Block]] = []
        for policy in self.manager._policies.values():
            coldest = itertools.islice(policy.coldest(), COLD_SCAN_BLOCKS)
            found = filter(dirty.__contains__, coldest)  # the skip runs in C
            cold.append(list(cast("Iterator[Block]", itertools.islice(found, look))))
        # Size classes in turn: each has its own eviction and its own cold end.
        ordered = [b for row in itertools.zip_longest(*cold) for b in row if b is not None]
        # Bounded look-ahead past pinned blocks at the head of the queue.
        ordered += itertools.islice(dirty, look)
        return ordered

    def _start_writes(self) -> None:
        m = self.manager
        if time.monotonic() < self._paused_until_s:
            return
        if len(self._inflight) >= self.max_inflight or self._need_bytes() <= 0:
            return  # the common case (every commit wakes the demoter): no walk
        for block in self._candidates():
            if len(self._inflight) >= self.max_inflight or self._need_bytes() <= 0:
                return
            if block.pins or block.offset < 0:
                continue
            slot = self._disk_slot(block.namespace)
            if slot is None:
                self._paused_until_s = time.monotonic() + DISK_FULL_BACKOFF_S
                self._set_full(
                    f"every slot of the disk tier at {self.config.path} is busy or pinned"
                )
                return
            m.pin(block)  # its DRAM bytes are read in place by the write: it stays put
            self._inflight_bytes += block.namespace.slot_bytes
            task = asyncio.get_running_loop().create_task(
                self._demote(block, slot, block.offset, block.dram_generation)
            )
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    async def _demote(self, block: Block, slot: int, offset: int, generation: int) -> None:
        """Write the DRAM copy at ``offset`` (of ``generation``) to disk ``slot``."""
        m = self.manager
        ns = block.namespace
        try:
            view = m.region.view(offset, ns.block_bytes)
            checksum = await self.tier.write(slot, view, (ns.namespace_id, block.block_hash))
        except Exception as exc:
            if isinstance(exc, CapacityExhausted):
                self._paused_until_s = time.monotonic() + DISK_FULL_BACKOFF_S
                self._set_full(str(exc))
            log.warning("demotion of a block failed: %s", exc)
        else:
            # The disk copy is the block's only if the DRAM copy it was read from
            # is still the block's (same slot, never freed meanwhile: the pin
            # keeps it there, the generation proves it).
            if (
                ns.blocks.get(block.block_hash) is block
                and block.offset == offset
                and block.dram_generation == generation
                and block.disk_slot < 0
            ):
                self.dirty.pop(block, None)
                block.disk_slot = slot
                block.checksum = checksum
                self.clean_bytes += ns.slot_bytes
                self._policy(ns).insert(block)
                m.sink.blocks_stored(ns, [block.block_hash], Tier.DISK.medium, None, None)
            else:
                self.tier.free(slot)  # deleted while it was written
            if self.full_reason and (
                not self.dirty or time.monotonic() - self._full_at_s >= DISK_FULL_CLEAR_S
            ):
                log.warning("disk tier %s takes writes again", self.config.path)
                self.full_reason = ""
        finally:
            self._inflight_bytes -= ns.slot_bytes
            m.unpin(block)
            # Leave the in-flight set before waking the loop (a done callback
            # would run only after the loop looked, and it would sleep forever).
            task = asyncio.current_task()
            if task is not None:
                self._inflight.discard(task)
            if self._wake is not None:
                self._wake.set()

    # ----------------------------------------------------------- promotion

    async def promote(self, ns: Namespace, hashes: list[int]) -> None:
        """Bring the disk-only blocks of the longest present prefix into DRAM."""
        prefix = ns.present_prefix(hashes)
        # Blocks that readahead brought in: this load used them, so read further.
        hits = sum(self._ahead.pop(id(b), 0) is None for b in prefix) if self._ahead else 0
        if all(b.tier is not Tier.DISK for b in prefix):
            if hits and prefix[-1].disk_slot >= 0:
                self._read_ahead(ns, prefix[-1], hits * ns.block_bytes)
            return
        m = self.manager
        for block in prefix:
            m.hold(block)  # nothing in the prefix is evicted while the reads run
        try:
            waits: dict[int, asyncio.Task[None]] = {}  # by id(task): each batch once
            batch: list[tuple[Block, int]] = []
            waited = 0
            for block in prefix:
                if block.tier is not Tier.DISK:
                    continue
                task = self._promoting.get(id(block))
                if task is not None:  # another load (or readahead) is reading it already
                    waits[id(task)] = task
                    waited += 1
                    continue
                offset = m._allocate(ns)
                if offset is None:
                    break  # DRAM full of pinned blocks: the prefix ends here
                m._slot_owner[offset] = block
                ns.used_bytes += ns.slot_bytes
                # The read's own pin: the disk copy and the reserved slot stay the
                # block's until the read has landed, even if this load is cancelled.
                m.pin(block)
                batch.append((block, offset))
            if batch:
                # One task reads the whole batch: neighbouring disk slots become
                # one read, and the loop wakes once per run, not once per block.
                # It owns its pins and slots and always finishes (shielded below).
                task = asyncio.get_running_loop().create_task(self._read_batch(ns, batch))
                for block, _ in batch:
                    self._promoting[id(block)] = task
                waits[id(task)] = task
            if waits:
                await asyncio.gather(
                    *(asyncio.shield(t) for t in waits.values()), return_exceptions=True
                )
            # Read ahead after a load that met the disk (or used readahead).
            if (batch or waits or hits) and prefix[-1].disk_slot >= 0:
                window = len(batch) + waited + hits
                self._read_ahead(ns, prefix[-1], window * ns.block_bytes)
        finally:
            for block in prefix:
                m.unhold(block)

    def _read_ahead(self, ns: Namespace, last: Block, window_bytes: int) -> None:
        """Promote the disk-only blocks of ns in the disk slots after ``last``'s, into free DRAM."""
        m = self.manager
        alloc = m.allocator
        free_bytes = alloc.capacity_bytes - alloc.used_bytes
        budget = min(max(window_bytes, ns.block_bytes), READAHEAD_MAX_BYTES, free_bytes // 2)
        quota = m.config.limits.namespace_quota_bytes
        step = align_up(ns.block_bytes)
        slot = last.disk_slot + step
        batch: list[tuple[Block, int]] = []
        if len(self._ahead) >= READAHEAD_MAX_BLOCKS:
            self._ahead.clear()  # mostly blocks evicted unread: forget them all
        while budget >= ns.block_bytes:
            entry = self.tier.entry(slot)
            if entry is None or entry.namespace_id != ns.namespace_id:
                break
            block = ns.blocks.get(entry.block_hash)
            if (
                block is None
                or block.tier is not Tier.DISK
                or block.disk_slot != slot
                or block.doomed
                or id(block) in self._promoting
            ):
                break
            if quota and ns.used_bytes + ns.slot_bytes > quota:
                break
            offset = alloc.alloc(ns.slot_bytes)  # free room only: readahead never evicts
            if offset is None:
                break
            m._slot_owner[offset] = block
            ns.used_bytes += ns.slot_bytes
            m.pin(block)  # not dropped from disk or deleted under the read
            batch.append((block, offset))
            budget -= ns.block_bytes
            slot += step
        if not batch:
            return
        task = asyncio.get_running_loop().create_task(self._read_batch(ns, batch, ahead=True))
        for block, _ in batch:
            self._promoting[id(block)] = task

    async def _read_batch(
        self, ns: Namespace, batch: list[tuple[Block, int]], *, ahead: bool = False
    ) -> None:
        """Read a batch of disk blocks into their reserved DRAM slots.

        The caller pinned each block and reserved its slot; this task owns both
        from then on and lands or gives back every slot, then unpins, whatever
        happens to the load that started it. ``ahead``: readahead blocks, to be
        remembered as such once they land."""
        m = self.manager
        results: list[KVStoreError | None] | None = None
        try:
            results = await self.tier.read_many(
                [(b.disk_slot, m.region.view(offset, ns.block_bytes)) for b, offset in batch]
            )
        finally:
            promoted: list[int] = []
            dropped: list[int] = []
            for i, (block, offset) in enumerate(batch):
                error = results[i] if results is not None else None
                self._promoting.pop(id(block), None)
                # Deleted while it was read: the slot goes back, the block is gone.
                if results is not None and error is None and not block.doomed:
                    block.offset = offset
                    block.tier = Tier.DRAM
                    self.clean_bytes += ns.slot_bytes
                    m._policy(ns.slot_bytes).insert(block)
                    promoted.append(block.block_hash)
                    if ahead:
                        self._ahead[id(block)] = None
                    continue
                del m._slot_owner[offset]
                m.allocator.free(offset)
                ns.used_bytes -= ns.slot_bytes
                if isinstance(error, DataCorruption):
                    # The tier dropped its copy. The block had no other: it leaves
                    # the index now, its slots at its last unpin (this read's).
                    log.error("%s", error)
                    self._policy(ns).remove(block)
                    block.disk_slot = -1
                    if not block.doomed:
                        m.doom(block)
                        dropped.append(block.block_hash)
                elif error is not None:
                    log.warning("promotion of a block failed: %s", error)
            for block, _ in batch:
                m.unpin(block)
            if promoted:
                m.counters.promoted_blocks += len(promoted)
                m.sink.blocks_stored(ns, promoted, Tier.DRAM.medium, None, None)
            if dropped:
                m.sink.blocks_removed(ns, dropped, Tier.DISK.medium)

    # --------------------------------------------------------------- stats

    def used_bytes(self) -> int:
        return self.tier.used_bytes

    def blocks(self) -> int:
        return len(self.tier)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) until no demotion is running or needed: for tests and benches."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (self._inflight or self._need_bytes() > 0):
            if not self._inflight and (self._task is None or self._task.done()):
                break
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for task in [*self._inflight, *self._promoting.values()]:
            with contextlib.suppress(BaseException):
                await task
        await self.tier.close()
