"""Demotion and promotion between the DRAM region and the disk tier.

A mover: it decides what to copy and does the I/O; every change of where a
block lives goes through ``kvstore.placement.Placement`` (it pins through it,
reads or writes, then reports the copy placed or vacated). It never imports
the manager. The placement stays synchronous (every call atomic on the event
loop); the disk moves bytes asynchronously. The two meet through *clean*
blocks:

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
from kvstore.namespace import Block, Namespace
from kvstore.placement import Placement
from kvstore.tiers import Tier
from kvstore.tiers.disk import DiskTier, align_up

if TYPE_CHECKING:
    from collections.abc import Iterator

    from kvstore.config import DiskConfig
    from kvstore.tiers.dram import Region

log = logging.getLogger(__name__)
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
# How often a demoter behind with nothing it could start looks again.
RELOOK_S = 0.05
# Readahead after a load that read from disk: the disk-only blocks in the next
# disk slots (demotion follows DRAM's cold order, where the blocks of a context
# stored or hit together stay in context order, so a long context mostly lies
# in neighbouring slots) are promoted into *free* DRAM while the client copies, as
# much as the load read, at most this much and half the free DRAM.
READAHEAD_MAX_BYTES = 256 * 1024 * 1024
# Readahead blocks no load used yet, remembered (by id) at most this many.
READAHEAD_MAX_BLOCKS = 65536


class DiskLayer:
    """The disk tier below DRAM: demoter, promoter, readahead, disk-full state."""

    def __init__(self, placement: Placement, region: Region, config: DiskConfig) -> None:
        if not 0.0 <= config.demote_free_fraction <= 1.0:
            raise ConfigError("disk.demote_free_fraction must be within [0, 1]")
        if config.capacity_bytes <= 0:
            raise ConfigError(f"disk tier path {config.path}: disk.capacity_bytes must be > 0")
        self.placement = placement
        self.region = region
        self.config = config
        self.tier = DiskTier(
            config.path,
            config.capacity_bytes,
            slab_bytes=config.slab_bytes,
            io_threads=config.io_threads,
            direct_io=config.direct_io,
        )
        # The placement owns the disk's slots, eviction order, recovered
        # entries and the dirty FIFO; this layer moves bytes.
        placement.attach_disk(self.tier, config.eviction_policy)
        placement.on_dirty = self.wake
        placement.on_leave = self.forget
        self.max_inflight = max(1, 2 * config.io_threads)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._paused_until_s = 0.0
        self._inflight: set[asyncio.Task[None]] = set()
        self._inflight_bytes = 0
        self._writes_started = 0  # ever: drain tells a demoter at work from a stuck one
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
        return sum(len(p) for p in self.placement.parked.values())

    @property
    def dirty(self) -> dict[Block, None]:
        """DRAM blocks with no disk copy, oldest commit first: what the demoter
        copies down. It takes them in the DRAM policy's cold order first (see
        _candidates), this FIFO after: a block committed long ago but hit since
        is not the one DRAM drops next."""
        return self.placement.dirty

    @property
    def clean_bytes(self) -> int:
        return self.placement.clean_bytes

    def attach(self, ns: Namespace) -> list[int]:
        """Adopt the recovered disk blocks of a namespace just declared (BlockStored
        DISK for them); their hashes."""
        return self.placement.adopt_disk(ns)

    def drop_dram_copy(self, block: Block) -> None:
        """DRAM eviction of a clean block: it stays, on disk only."""
        self.placement.vacate_dram(block)

    # ------------------------------------------------------------ disk full

    def _set_full(self, reason: str) -> None:
        if reason != self.full_reason:
            log.warning("%s; demotion paused", reason)
        self.full_reason = reason
        self._full_at_s = time.monotonic()

    @property
    def full_reason(self) -> str:
        """Why the disk cannot take writes now ("" = it can)."""
        return self._full_reason

    @full_reason.setter
    def full_reason(self, reason: str) -> None:
        self._full_reason = reason
        # What DRAM admission reads (kvstore.placement): see keeps_dirty.
        self.placement.keep_dirty = bool(reason) and self.config.when_full == "reject"

    def keeps_dirty(self) -> bool:
        """True while DRAM must not drop blocks that are not on disk yet to make room.

        That is while the disk cannot take writes and ``disk.when_full`` is
        "reject": such a drop would lose a block the disk could not save, so the
        store that needs the room fails instead (and is retried by its client).
        """
        return self.placement.keep_dirty

    def full_message(self) -> str:
        """Why a store found no room while keeps_dirty(): for its RESOURCE_EXHAUSTED."""
        return (
            f"the DRAM tier has no free or clean room and the disk tier at "
            f"{self.config.path} cannot take writes ({self.full_reason}); blocks not on "
            'disk yet are kept (disk.when_full = "reject"): retry once the disk has room'
        )

    # ------------------------------------------------------------ demotion

    def forget(self, block: Block) -> None:
        """The block left the store (or DRAM for the GPU pool): not a readahead block."""
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
        dram = self.placement.dram
        target = int(self.config.demote_free_fraction * dram.capacity_bytes)
        have = dram.free_bytes + self.placement.clean_bytes + self._inflight_bytes
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
                    await asyncio.wait_for(self._wake.wait(), timeout=RELOOK_S)
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
        for policy in self.placement.dram.policies.values():
            coldest = itertools.islice(policy.coldest(), COLD_SCAN_BLOCKS)
            found = filter(dirty.__contains__, coldest)  # the skip runs in C
            cold.append(list(cast("Iterator[Block]", itertools.islice(found, look))))
        # Size classes in turn: each has its own eviction and its own cold end.
        ordered = [b for row in itertools.zip_longest(*cold) for b in row if b is not None]
        # Bounded look-ahead past pinned blocks at the head of the queue.
        ordered += itertools.islice(dirty, look)
        return ordered

    def _start_writes(self) -> None:
        p = self.placement
        if time.monotonic() < self._paused_until_s:
            return
        if len(self._inflight) >= self.max_inflight or self._need_bytes() <= 0:
            return  # the common case (every commit wakes the demoter): no walk
        for block in self._candidates():
            if len(self._inflight) >= self.max_inflight or self._need_bytes() <= 0:
                return
            if block.pins or block.offset < 0:
                continue
            if not p.tenant_disk_room(block.namespace):
                continue  # its tenant is at its disk cap, its copies pinned: not demoted
            slot = p.reserve_disk(block.namespace)
            if slot is None:
                self._paused_until_s = time.monotonic() + DISK_FULL_BACKOFF_S
                self._set_full(
                    f"every slot of the disk tier at {self.config.path} is busy or pinned"
                )
                return
            p.pin(block)  # its DRAM bytes are read in place by the write: it stays put
            self._inflight_bytes += block.namespace.slot_bytes
            self._writes_started += 1
            task = asyncio.get_running_loop().create_task(
                self._demote(block, slot, block.offset, block.dram_generation)
            )
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    async def _demote(self, block: Block, slot: int, offset: int, generation: int) -> None:
        """Write the DRAM copy at ``offset`` (of ``generation``) to disk ``slot``."""
        p = self.placement
        ns = block.namespace
        settled = False  # the slot became the block's copy or was given back by us
        try:
            view = self.region.view(offset, ns.block_bytes)
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
            if not p.place_disk(
                block, slot, checksum, dram_offset=offset, dram_generation=generation
            ):
                p.unreserve_disk(ns, slot)  # deleted while it was written
            settled = True
            if self.full_reason and (
                not p.dirty or time.monotonic() - self._full_at_s >= DISK_FULL_CLEAR_S
            ):
                log.warning("disk tier %s takes writes again", self.config.path)
                self.full_reason = ""
        finally:
            if not settled:
                p.disk_write_failed(ns)  # the tier gave the slot back itself
            self._inflight_bytes -= ns.slot_bytes
            p.unpin(block)
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
        p = self.placement
        for block in prefix:
            p.hold(block)  # nothing in the prefix is evicted while the reads run
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
                offset = p.reserve_dram(block)
                if offset is None:
                    break  # DRAM full of pinned blocks: the prefix ends here
                # The read's own pin: the disk copy and the reserved slot stay the
                # block's until the read has landed, even if this load is cancelled.
                p.pin(block)
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
                p.unhold(block)

    def _read_ahead(self, ns: Namespace, last: Block, window_bytes: int) -> None:
        """Promote the disk-only blocks of ns in the disk slots after ``last``'s, into free DRAM."""
        p = self.placement
        budget = min(max(window_bytes, ns.block_bytes), READAHEAD_MAX_BYTES, p.dram.free_bytes // 2)
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
            # free room within the quota only: readahead never evicts
            offset = p.reserve_dram(block, evict=False)
            if offset is None:
                break
            p.pin(block)  # not dropped from disk or deleted under the read
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
        p = self.placement
        results: list[KVStoreError | None] | None = None
        try:
            results = await self.tier.read_many(
                [(b.disk_slot, self.region.view(offset, ns.block_bytes)) for b, offset in batch]
            )
        finally:
            landed: list[tuple[Block, int]] = []
            missed: list[tuple[Block, int, bool]] = []
            for i, (block, offset) in enumerate(batch):
                error = results[i] if results is not None else None
                self._promoting.pop(id(block), None)
                if results is not None and error is None:
                    landed.append((block, offset))
                    continue
                if isinstance(error, DataCorruption):
                    log.error("%s", error)  # the tier dropped its copy
                elif error is not None:
                    log.warning("promotion of a block failed: %s", error)
                missed.append((block, offset, isinstance(error, DataCorruption)))
            promoted = p.promoted(ns, landed, missed)
            if ahead:
                for block in promoted:
                    self._ahead[id(block)] = None
            for block, _ in batch:
                p.unpin(block)

    # --------------------------------------------------------------- stats

    def used_bytes(self) -> int:
        return self.tier.used_bytes

    def blocks(self) -> int:
        return len(self.tier)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) until no demotion is running or needed, or none can run:
        for tests and benches. None can run when the disk cannot take writes, or
        when the demoter, behind and not paused, started nothing for three of its
        looks (every dirty block pinned, say): nothing changes then until
        something else does, and waiting would only hold the caller to its
        timeout."""
        deadline = time.monotonic() + timeout_s
        seen, quiet_since_s = self._writes_started, time.monotonic()
        while (now := time.monotonic()) < deadline and (self._inflight or self._need_bytes() > 0):
            if not self._inflight:
                if self._task is None or self._task.done() or self.full_reason:
                    break
                if self._writes_started != seen:
                    seen, quiet_since_s = self._writes_started, now
                elif now >= self._paused_until_s and now - quiet_since_s >= 3 * RELOOK_S:
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
