"""The GPU tier above DRAM: a mover of blocks between the GPU pool and DRAM.

It decides what moves and copies the bytes; every change of where a block
lives (slots, eviction orders, offsets, events) goes through
``kvstore.placement.Placement``: it holds the blocks through it, copies, then
reports the copy placed. It never imports the manager.

A block lives in at most one of GPU and DRAM (the pool is small and precious:
an inclusive copy would waste it); it may also have a disk copy. So:

- A store that asks for the GPU tier gets a slot in the pool. When the pool is
  full, its coldest unpinned blocks are *moved* to DRAM (``reserve_dram``,
  which may itself demote DRAM blocks to disk) before anything is dropped. A
  block that finds no DRAM room either keeps its disk copy or leaves the store.
- A load that asks for the GPU tier moves the prefix's DRAM blocks up (disk
  blocks were promoted to DRAM first); a load that asks for DRAM (CPU clients,
  peers pulling over NIXL from the DRAM region) moves GPU blocks down. Either
  way the lease's offsets all point into the tier the client asked for.

Bytes move with one ``copy_`` per block between the pool and the region
(pinned with ``cudaHostRegister`` on CUDA, so the copies are DMA). Moves that a
load asks for run in a worker thread with the blocks held, off the event
loop, in a task that always finishes (a cancelled load only stops waiting);
demotions to make room for a store run inline, because prepare_store is
one atomic step (a 2 MiB block costs ~0.1 ms over PCIe; ~0.3 ms as a host
memcpy here). A block pinned where it is (a lease, a peer's pin, a disk
write reading it) is never moved: a load asking for the other tier misses on
it until the pin goes (see docs/slot-lifetimes.md).

The ``cpu`` device runs exactly this logic over a shared-memory file instead of
HBM, so the whole path (daemon, client, demotion, promotion) is tested on
machines without CUDA; it gives no speed-up in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, cast

from kvstore.errors import ConfigError
from kvstore.placement import Placement
from kvstore.tiers import Tier
from kvstore.tiers.dram import Region
from kvstore.tiers.gpu import GpuPoolHandle, GpuTier, pin_host_memory

if TYPE_CHECKING:
    from kvstore.config import GpuConfig
    from kvstore.namespace import Block, Namespace
    from kvstore.tiers.pool import GpuSlabPool

log = logging.getLogger(__name__)

# Blocks the background demoter moves per copy (bounds how long they stay pinned).
DEMOTE_BATCH = 32


class GpuLayer:
    """The GPU pool's medium and the moves to and from DRAM."""

    def __init__(
        self,
        placement: Placement,
        region: Region,
        config: GpuConfig,
        *,
        dram_chunk_bytes: int,
        warm_restart: bool = False,
    ) -> None:
        import torch

        self.placement = placement
        self.region = region
        self.config = config
        self.warm_restart = warm_restart  # move the pool's blocks down at close
        if config.capacity_bytes <= 0:
            raise ConfigError(f"gpu tier on {config.device}: gpu.capacity_bytes must be > 0")
        if config.chunk_bytes < dram_chunk_bytes:
            raise ConfigError(
                "gpu.chunk_bytes must be at least dram.chunk_bytes (the largest block)"
            )
        # Host mode: the pool is a shared-memory file clients map like the DRAM region.
        self.host_region: Region | None = None
        pool = None
        if config.device == "cpu":
            self.host_region = Region(
                region.path + ".gpu",
                config.capacity_bytes,
                prefault=True,
                huge_pages="off",
            )
            pool = torch.from_numpy(self.host_region.array)
        elif not config.device.startswith("cuda"):
            raise ConfigError(f'gpu.device must be "cuda:N", "cpu" or "", got {config.device!r}')
        self.tier = GpuTier(config.capacity_bytes, config.chunk_bytes, config.device, pool=pool)
        self.region_t = torch.from_numpy(region.array)
        self.pinned = pin_host_memory(region.array) if self.tier.device.type == "cuda" else False
        # The pool's slots, owners and eviction orders: the placement's.
        self.pool: GpuSlabPool = placement.attach_gpu(self.tier.allocator)
        self._moving: dict[int, asyncio.Task[int]] = {}  # id(block) -> its move
        # Called in the copy thread before each copy: tests force timing with it.
        self.copy_hook: Callable[[], None] | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # ---------------------------------------------------------------- slots

    @property
    def handle(self) -> GpuPoolHandle | None:
        """The CUDA IPC handle engines map (None in host mode: they map host_region)."""
        return self.tier.export_handle() if self.host_region is None else None

    @property
    def owner(self) -> dict[int, Block]:
        """Pool offset -> block (pending, committed, or a move's target)."""
        return self.pool.owner

    def reserve(self, block: Block) -> int | None:
        """A pool slot for ``block``, demoting cold unpinned blocks to DRAM if needed."""
        p = self.placement
        offset = p.reserve_gpu(block)
        if offset is not None:
            return offset
        victims = p.gpu_room_victims(block)  # a tenant at its cap: its own only
        if not victims:
            return None
        for victim in victims:
            self.demote(victim)
        return p.reserve_gpu(block)

    # ------------------------------------------------------------- demotion

    def demote(self, block: Block) -> None:
        """Move a committed, unpinned block down to DRAM now (or drop its GPU copy)."""
        p = self.placement
        offset = p.reserve_dram(block)
        if offset is not None:
            self._copy([(block.gpu_offset, offset)], block.namespace.block_bytes, up=False)
        p.vacate_gpu(block, offset)

    # ---------------------------------------------------------------- moves

    async def move(self, ns: Namespace, hashes: list[int], tier: Tier) -> None:
        """Bring the present prefix of hashes into `tier` (GPU or DRAM), as far as room allows."""
        await self._move_blocks(ns, ns.present_prefix(hashes), tier)
        if tier is Tier.GPU:
            self.wake()

    async def _move_blocks(self, ns: Namespace, prefix: list[Block], tier: Tier) -> int:
        """Move committed blocks of ns into `tier`, in order, until one finds no room
        or is pinned where it is (a lease or a disk write reads it there).

        Returns how many this call moved. The copy runs in a task that owns its
        blocks' holds and reserved slots and always finishes (a cancelled load
        stops waiting for it, nothing more), so no slot is lost or freed early."""
        p = self.placement
        source = Tier.DRAM if tier is Tier.GPU else Tier.GPU
        if all(b.tier is not source for b in prefix) and not any(
            id(b) in self._moving for b in prefix
        ):
            return 0
        for block in prefix:
            p.hold(block)  # nothing in the prefix is evicted meanwhile
        try:
            waits: list[asyncio.Task[int]] = []
            planned: list[tuple[Block, int]] = []
            for block in prefix:
                running = self._moving.get(id(block))
                if running is not None:
                    waits.append(running)
                    continue
                if block.tier is not source:
                    continue
                if not p.movable(block):
                    break  # pinned where it is: it stays, and the prefix in `tier` ends
                offset = self.reserve(block) if tier is Tier.GPU else p.reserve_dram(block)
                if offset is None:
                    break  # the tier is full of pinned blocks: the prefix ends here
                planned.append((block, offset))
            mine: asyncio.Task[int] | None = None
            if planned:
                for block, _ in planned:
                    p.hold(block)  # the move's own hold, released when it is done
                mine = asyncio.get_running_loop().create_task(self._run_move(ns, planned, tier))
                for block, _ in planned:
                    self._moving[id(block)] = mine
                waits.append(mine)
            if waits:
                await asyncio.gather(*(asyncio.shield(w) for w in waits), return_exceptions=True)
            if mine is None or mine.cancelled() or mine.exception() is not None:
                return 0
            return mine.result()
        finally:
            for block in prefix:
                p.unhold(block)

    async def _run_move(self, ns: Namespace, planned: list[tuple[Block, int]], tier: Tier) -> int:
        """Copy planned blocks into their reserved slots in `tier`, then switch each
        block over if nothing pinned it at the source meanwhile; every slot of a
        block that does not switch goes back. Returns how many switched."""
        p = self.placement
        moved = 0
        copied = False
        try:
            pairs = [
                (b.offset, off) if tier is Tier.GPU else (b.gpu_offset, off) for b, off in planned
            ]
            await asyncio.to_thread(self._copy_off_loop, pairs, ns.block_bytes, tier is Tier.GPU)
            copied = True
        except Exception as exc:
            log.error("moving %d blocks to %s failed: %s", len(planned), tier.name, exc)
        finally:
            source = Tier.DRAM if tier is Tier.GPU else Tier.GPU
            for block, offset in planned:
                self._moving.pop(id(block), None)
                # A reader that pinned the block at its source during the copy
                # still reads there: the source stays, the copy is dropped.
                if copied and block.tier is source and p.movable(block):
                    if tier is Tier.GPU:
                        p.place_gpu(block, offset)
                    else:
                        p.vacate_gpu(block, offset)
                    moved += 1
                else:
                    p.unreserve(block, tier, offset)
            for block, _ in planned:
                p.unhold(block)
        return moved

    def _copy_off_loop(self, pairs: list[tuple[int, int]], nbytes: int, up: bool) -> None:
        """_copy in a worker thread (the moves a load asks for)."""
        if self.copy_hook is not None:
            self.copy_hook()
        self._copy(pairs, nbytes, up=up)

    def _copy(self, pairs: list[tuple[int, int]], nbytes: int, *, up: bool) -> None:
        """Copy blocks DRAM -> pool (up) or pool -> DRAM; pairs are (source, destination)."""
        pool, region = self.tier.pool, self.region_t
        src, dst = (region, pool) if up else (pool, region)
        for s, d in pairs:
            dst[d : d + nbytes].copy_(src[s : s + nbytes], non_blocking=self.pinned)
        self.tier.synchronize()

    # ------------------------------------------------- background demotion

    def wake(self) -> None:
        """Start or nudge the background demoter (after blocks entered the pool)."""
        if self._closed or self.config.demote_free_fraction <= 0:
            return
        if self._wake is None:
            self._wake = asyncio.Event()
        self._wake.set()
        if self._task is None or self._task.done():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # not serving yet
            self._task = loop.create_task(self._run(), name="kvstore-gpu-demoter")

    def _need_bytes(self) -> int:
        """Pool bytes to free to reach gpu.demote_free_fraction."""
        target = int(self.config.demote_free_fraction * self.capacity_bytes)
        return target - (self.capacity_bytes - self.used_bytes)

    async def _run(self) -> None:
        """Keep a share of the pool free, so a store into the GPU tier rarely waits
        for a demotion: the coldest blocks move to DRAM off the event loop."""
        assert self._wake is not None
        while not self._closed:
            self._wake.clear()
            moved = 0
            while not self._closed and self._need_bytes() > 0:
                batch = self._cold_batch()
                if not batch:
                    break  # all pinned or moving: look again at the next nudge
                step = 0
                for ns, blocks in batch.items():
                    step += await self._move_blocks(ns, blocks, Tier.DRAM)
                if step == 0:
                    break  # DRAM refused (full of pinned blocks): wait for a nudge
                moved += step
            if moved == 0 or self._need_bytes() <= 0:
                await self._wake.wait()

    def _cold_batch(self) -> dict[Namespace, list[Block]]:
        """Up to DEMOTE_BATCH coldest movable blocks, by namespace (one copy size each)."""
        need = self._need_bytes()
        batch: dict[Namespace, list[Block]] = {}
        for slot_bytes, policy in self.pool.policies.items():
            for block in cast("Iterator[Block]", policy.victims()):
                if need <= 0 or sum(map(len, batch.values())) >= DEMOTE_BATCH:
                    return batch
                if block.pins or id(block) in self._moving:
                    continue
                batch.setdefault(block.namespace, []).append(block)
                need -= slot_bytes
        return batch

    # ---------------------------------------------------------------- stats

    @property
    def capacity_bytes(self) -> int:
        return self.tier.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.tier.used_bytes

    def committed_blocks(self) -> int:
        return self.pool.committed_blocks()

    async def aclose(self) -> None:
        """Stop the background demoter and let running moves finish; with warm restart,
        move the pool's blocks down to DRAM first (the pool dies with the process)."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for running in list(self._moving.values()):
            with contextlib.suppress(BaseException):
                await running
        if self.warm_restart:
            self.demote_all()
        self.close()

    def demote_all(self) -> int:
        """Move every unpinned pool block down, coldest first (so DRAM's own eviction,
        if it must make room, drops colder blocks before hotter ones). Returns the count."""
        blocks = [b for b in self.pool.coldest() if b.pins == 0]
        for block in blocks:
            self.demote(block)
        if blocks:
            log.info("moved %d GPU-tier blocks to DRAM before exit", len(blocks))
        return len(blocks)

    def close(self) -> None:
        if self.pinned:
            import torch

            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self.region.array.ctypes.data)
        if self.host_region is not None:
            self.host_region.close(unlink=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.host_region.path)
