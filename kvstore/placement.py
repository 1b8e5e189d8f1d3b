"""The one owner of block placement: where each block lives and what pins it.

Every change to a block's copies or pins goes through ``Placement``: reserve a
slot (admission and eviction), commit a store, place a copy in a tier, vacate
a tier, remove, pin/unpin/hold, set a checksum. Each transition updates the
block, the pools (``kvstore.tiers.pool.SlabPool`` for DRAM and the GPU pool;
for the disk, its ``DiskEvictionOrders`` beside the DiskTier's own slots), the
counters, and emits its KV events, so no other
module writes a block's offsets, a pool's owner map or a namespace's used
bytes, and the 19 ways of getting one of them wrong are one.

Who calls it (see docs/architecture.md): ``kvstore.manager`` (the API: stores,
loads, deletes), and the movers under it, ``kvstore.movers.disk`` (disk
demotion and promotion), ``kvstore.movers.gpu`` (GPU <-> DRAM moves) and
``kvstore.movers.warm`` (warm restart). A mover pins or holds through the
placement, does its I/O, then reports ``place``/``vacate``; it never imports
the manager. ``Placement`` itself does no I/O and never awaits: each call is
atomic on the daemon's event loop.

Tenants (docs/tenants.md): each transition that takes or gives back a slot
also keeps the tenant's bytes in that tier (``TenantAccount``, one per tenant,
shared by its namespaces), and a tenant past its cap in a tier finds victims
among its own blocks only (its own coldest-first order there).

Pins and holds (docs/slot-lifetimes.md): a *pin* says "something reads or
writes this block's bytes where they are"; a *hold* (counted in ``pins`` too)
only "keep this block in the store": a held block may change tiers. A slot is
reused only when nothing can still touch it: a pinned block is never evicted,
freed or moved; a doomed block's slots go at its last unpin.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from kvstore.errors import ConfigError
from kvstore.events.sink import EventSink
from kvstore.eviction.base import EvictionPolicy
from kvstore.namespace import Block, BlockState, Namespace, TenantAccount, Tier
from kvstore.presence import PresenceRecorder
from kvstore.quotas import QuotaTable, TenantStats
from kvstore.tiers.disk import DiskEntry, DiskTier, align_up
from kvstore.tiers.dram import PART_KEY_STRIDE, SlabAllocator
from kvstore.tiers.pool import DiskEvictionOrders, GpuSlabPool, SlabPool

log = logging.getLogger(__name__)

# DRAM victims looked at for a clean one (also on disk) before a dirty block
# is dropped instead.
CLEAN_VICTIM_WINDOW = 64
# Unpinned disk victims looked at per slot a demotion needs (past every pinned one).
DISK_VICTIM_WINDOW = 64
# Unpinned GPU victims looked at per slot a store needs before giving up (past
# every pinned one).
GPU_VICTIM_WINDOW = 64
# Tier indexes of a TenantAccount's lists, as plain ints (the hot paths index them
# once or twice per block: an IntEnum member costs an attribute lookup and __index__).
_GPU, _DRAM, _DISK = int(Tier.GPU), int(Tier.DRAM), int(Tier.DISK)
_NO_ORDERS: tuple[None, ...] = (None, None, None, None)  # a namespace with no account yet
# A tenant at its cap (docs/tenants.md): its own blocks looked at, coldest first, for
# a victim, and among the first of them for a clean one (DRAM with a disk tier).
TENANT_VICTIM_SCAN = 4096
# Copy-aware eviction: unpinned DRAM victims looked at for a redundant copy (one
# a lower-id node is believed to hold) before a sole copy goes (docs/eviction.md),
# by default and at most (eviction.copy_window).
COPY_VICTIM_WINDOW = 64
MAX_COPY_VICTIM_WINDOW = 4096

# One event batch of a commit: hashes, parent hash, token ids (see kvstore.events).
StoredBatch = tuple[Sequence[int], int | None, Sequence[int] | None]


@dataclass(slots=True)
class Counters:
    lookup_hit_blocks: int = 0
    lookup_miss_blocks: int = 0
    stored_blocks: int = 0
    loaded_blocks: int = 0
    # Of loaded_blocks: read by local clients without a lease (presence table).
    direct_loaded_blocks: int = 0
    evicted_blocks: int = 0
    expired_leases: int = 0
    demoted_blocks: int = 0
    promoted_blocks: int = 0
    # Of evicted_blocks: copies dropped because a lower-id node was believed to hold
    # the block too (copy-aware eviction).
    evicted_redundant_blocks: int = 0
    # Admission of pulled copies (eviction.pulled_admission = "replica"): pulled
    # copies admitted as low-priority replicas, of them promoted to normal blocks
    # by local loads, and evicted while still replicas.
    admitted_replicas: int = 0
    promoted_replicas: int = 0
    evicted_replica_blocks: int = 0


class Placement:
    """Blocks' copies in DRAM, the GPU pool and on disk; pins; counters; KV events."""

    def __init__(
        self,
        dram_allocator: SlabAllocator,
        sink: EventSink,
        *,
        eviction_policy: str,
        quota_bytes: int = 0,
        node_id: str = "",
        copy_aware: bool = False,
        copy_ttl_s: float = 300.0,
        copy_window: int = COPY_VICTIM_WINDOW,
        copy_learn: str = "served",
        quotas: QuotaTable | None = None,
        copy_order: str = "window",
        pulled_admission: str = "replica",
        replica_promote_loads: int = 2,
        dram_parts: Mapping[str, int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not copy_ttl_s > 0:
            raise ConfigError(f"eviction.copy_ttl_s must be > 0, not {copy_ttl_s}")
        if not 1 <= copy_window <= MAX_COPY_VICTIM_WINDOW:
            raise ConfigError(
                f"eviction.copy_window must be in 1..{MAX_COPY_VICTIM_WINDOW}, not {copy_window}"
            )
        self.sink = sink
        # Copy-aware eviction (docs/eviction.md): this node's id orders the
        # tie-break, the clock ages what pulls taught us about peers' copies.
        self.node_id = node_id
        self.copy_aware = copy_aware
        self.copy_ttl_s = copy_ttl_s
        self.copy_window = copy_window
        if copy_learn not in ("pulled", "served", "both"):
            raise ConfigError(
                f"eviction.copy_learn must be pulled, served or both, not {copy_learn!r}"
            )
        self.learn_pulled = copy_learn in ("pulled", "both")
        self.learn_served = copy_learn in ("served", "both")
        if copy_order not in ("window", "fifo"):
            raise ConfigError(f"eviction.copy_order must be window or fifo, not {copy_order!r}")
        # fifo: a redundant copy goes into the low-priority FIFO (O(1) per eviction
        # whatever the distance from the cold end) instead of being looked for
        # among the coldest copy_window.
        self.copy_fifo = copy_aware and copy_order == "fifo"
        if pulled_admission not in ("full", "replica"):
            raise ConfigError(
                f"eviction.pulled_admission must be full or replica, not {pulled_admission!r}"
            )
        if replica_promote_loads < 1:
            raise ConfigError(
                f"eviction.replica_promote_loads must be >= 1, not {replica_promote_loads}"
            )
        self.replicas = pulled_admission == "replica"
        self.replica_promote_loads = replica_promote_loads
        self._clock = clock
        self.quota_bytes = quota_bytes  # per namespace in DRAM; 0 = none
        # Per-tenant caps and usage (docs/tenants.md): one account per tenant, by
        # tenant, shared by its namespaces; bounded by the declared namespaces
        # (forget_namespace drops an account with none).
        self.quotas = quotas or QuotaTable()
        self.accounts: dict[str, TenantAccount] = {}
        # Tenant regions (dram.tenant_regions): tenant -> its range of the DRAM
        # region (a PartitionedAllocator's part); the others share range 0. With
        # none, nothing changes: every namespace's dram_key is its slot size.
        self.dram_parts = dict(dram_parts or {})
        self.eviction_policy = eviction_policy
        self.dram = SlabPool(dram_allocator, eviction_policy)
        self.gpu: GpuSlabPool | None = None
        self.counters = Counters()
        self.pinned_blocks = 0
        # --- the disk tier's slots, when there is one (attach_disk)
        self.disk: DiskTier | None = None
        # The disk's eviction orders (the DiskTier owns its slots; see tiers/pool.py).
        self.disk_orders = DiskEvictionOrders(eviction_policy)
        # Recovered disk blocks no namespace declared yet, by namespace id.
        self.parked: dict[str, dict[int, DiskEntry]] = {}
        # DRAM blocks with no disk copy, oldest commit first: what the demoter
        # copies down (kvstore.movers.disk).
        self.dirty: dict[Block, None] = {}
        self.clean_bytes = 0  # DRAM bytes of blocks that also have a disk copy
        # While the disk cannot take writes and disk.when_full is "reject", DRAM
        # must not drop a block that is not on disk yet (set by the disk mover).
        self.keep_dirty = False
        # Told of new dirty blocks (the disk mover's demoter wakes) and of blocks
        # that left the store (a mover forgets what it remembered of them).
        self.on_dirty: Callable[[], None] | None = None
        self.on_leave: Callable[[Block], None] | None = None
        # The presence table local clients probe (kvstore.presence), told of every
        # change to an index entry or its tier; None: none published.
        self.presence: PresenceRecorder | None = None

    def attach_presence(self, recorder: PresenceRecorder, namespaces: Iterable[Namespace]) -> None:
        """Publish the index of ``namespaces`` in a presence table, and keep it so."""
        recorder.table.rebuild(namespaces)
        self.presence = recorder

    def presence_batch(self) -> contextlib.AbstractContextManager[None]:
        """Blocks that leave the index inside leave the presence table together at
        its end (PresenceRecorder.batch); wraps a call that may remove many."""
        return self.presence.batch() if self.presence is not None else contextlib.nullcontext()

    def attach_gpu(self, allocator: SlabAllocator) -> GpuSlabPool:
        self.gpu = GpuSlabPool(allocator, self.eviction_policy)
        return self.gpu

    def attach_disk(self, tier: DiskTier, eviction_policy: str) -> None:
        self.disk = tier
        self.disk_orders = DiskEvictionOrders(eviction_policy)
        for entry in tier.recover():
            self.parked.setdefault(entry.namespace_id, {})[entry.block_hash] = entry

    def pool(self, tier: Tier) -> SlabPool:
        if tier is Tier.GPU:
            assert self.gpu is not None, "no GPU tier"
            return self.gpu
        return self.dram

    # --------------------------------------------------------- tenants

    def account(self, ns: Namespace) -> TenantAccount:
        """The tenant account of ns (created, with its caps, on first use)."""
        account = ns.account
        if account is None:
            account = self.accounts.get(ns.tenant)
            if account is None:
                account = self.accounts[ns.tenant] = self.quotas.account(ns.tenant)
                account.dram_part = self.dram_parts.get(ns.tenant, 0)
            account.namespaces += 1
            ns.account = account
            ns.dram_key = ns.slot_bytes + account.dram_part * PART_KEY_STRIDE
        return account

    def forget_namespace(self, ns: Namespace) -> None:
        """A namespace was dropped: its tenant's account counts one namespace fewer,
        and accounts with no namespace and no bytes left go.

        ``ns.account`` stays: a Clear drops a namespace whose pinned blocks are
        only doomed, and their slots, freed at the last unpin, are still its
        tenant's bytes until then. Sweeping here (rare: a drop) rather than at
        each free keeps the per-block paths free of it; the map stays bounded by
        the tenants of live namespaces plus those with doomed blocks."""
        account = ns.account
        if account is None:
            return
        account.namespaces -= 1
        for tenant in [t for t, a in self.accounts.items() if not a.namespaces]:
            if not any(self.accounts[tenant].used_bytes):
                del self.accounts[tenant]

    def tenant_stats(self) -> list[TenantStats]:
        """Bytes and caps by tenant (configured names; the others summed)."""
        # A snapshot: /metrics reads this from its own thread.
        return self.quotas.report(list(self.accounts.values()))

    def _resident(self, block: Block, tier: Tier) -> None:
        """The block's copy in ``tier`` entered that tier's eviction order: its
        tenant's own order too, when the tenant has a cap there."""
        order = self.account(block.namespace).order[tier]
        if order is not None:
            order[block] = None

    def _gone(self, block: Block, tier: Tier) -> None:
        """The block's copy in ``tier`` left that tier's eviction order."""
        account = block.namespace.account
        if account is not None and (order := account.order[tier]) is not None:
            order.pop(block, None)

    def _charge(self, ns: Namespace, tier: Tier, nbytes: int) -> None:
        """A slot of ns in ``tier`` was taken (nbytes > 0) or given back (< 0)."""
        self.account(ns).used_bytes[tier] += nbytes

    # ------------------------------------------------------------ pins

    def pin(self, block: Block) -> None:
        """Pin a block's bytes where they are (see the module notes)."""
        if block.pins == 0:
            self.pinned_blocks += 1
        block.pins += 1

    def pin_many(self, blocks: Sequence[Block]) -> None:
        """pin() of each block (a load's), in one pass."""
        newly = 0
        for block in blocks:
            if not block.pins:
                newly += 1
            block.pins += 1
        self.pinned_blocks += newly

    def unpin(self, block: Block) -> None:
        assert block.pins > 0, "unpin of an unpinned block"
        block.pins -= 1
        if block.pins == 0:
            self.pinned_blocks -= 1
            if block.doomed:
                self._free_copies(block)

    def hold(self, block: Block) -> None:
        """Keep a block in the store while a tier move works; it may still move."""
        block.holds += 1
        self.pin(block)

    def unhold(self, block: Block) -> None:
        assert block.holds > 0, "unhold of a block not held"
        block.holds -= 1
        self.unpin(block)

    @staticmethod
    def movable(block: Block) -> bool:
        """True when a tier move may take the block from its slot: it is still in the
        store and nothing reads or writes its bytes where they are (only holds)."""
        return block.pins == block.holds and not block.doomed

    def touch(self, block: Block, *, load: bool = True) -> None:
        """A hit: a load (``load``) or a store that found the block present.

        A replica is not moved by hits; its ``replica_promote_loads``-th local load
        makes it a normal block (a store finding it present is the same request
        that pulled or computed it, not a reuse)."""
        if block.state is not BlockState.COMMITTED:
            return
        if block.replica_loads >= 0:
            if load:
                block.replica_loads += 1
                if block.replica_loads >= self.replica_promote_loads:
                    self._promote_replica(block)
            return
        self.dram.policy(block.namespace.dram_key).touch(block)
        self._touch_tenant(block)

    def touch_loaded(self, ns: Namespace, blocks: Sequence[Block]) -> None:
        """touch() of each of ``ns``'s ``blocks`` (a load's hits), in order: the
        eviction order's moves in one call (with pin_many and the prefix found
        in C, a 16,384-block prepare_load takes 4.5 ms in process where a walk,
        a pin() and a touch() per block took 10.8).
        Replicas and a tenant's own order take the per-block path."""
        if ns.account is not None and ns.account.order[_DRAM] is not None:
            for block in blocks:
                self.touch(block)
            return
        policy = self.dram.policy(ns.dram_key)
        hits: list[Block] = []
        committed = BlockState.COMMITTED
        for block in blocks:
            if block.state is not committed:
                continue
            if block.replica_loads >= 0:
                # (the hits before it first: the order stays what touch() gives)
                policy.touch_many(hits)
                hits.clear()
                self.touch(block)
                continue
            hits.append(block)
        policy.touch_many(hits)

    def _touch_tenant(self, block: Block) -> None:
        account = block.namespace.account
        order = account.order[_DRAM] if account is not None else None
        # Resident in the tenant's order (pop finds it): back in as the hottest.
        if order is not None and order.pop(block, 0) is None:
            order[block] = None

    def _promote_replica(self, block: Block) -> None:
        block.replica_loads = -1
        self.dram.policy(block.namespace.dram_key).promote(block)
        self._touch_tenant(block)
        self.counters.promoted_replicas += 1
        if self.disk is not None and block.disk_slot < 0 and block not in self.dirty:
            self._dirty([block])

    def replica_blocks(self) -> int:
        """DRAM copies resident as low-priority replicas now (O(slot sizes))."""
        return sum(p.cold_len() for p in self.dram.policies.values())

    def set_checksum(self, block: Block, checksum: int) -> None:
        """Record a committed block's verified xxh3-64 (its bytes never change)."""
        block.checksum = checksum
        if self.presence is not None:
            self.presence.checksummed(block)

    def set_checksums(self, blocks: Sequence[Block], checksums: Sequence[int]) -> None:
        """set_checksum for each block (a pin's, a pull's), the presence table's
        entries in one write."""
        for block, checksum in zip(blocks, checksums, strict=True):
            block.checksum = checksum
        if self.presence is not None:
            self.presence.checksummed_many(blocks)

    # ------------------------------------------- copies on other nodes

    def note_held_elsewhere(
        self, blocks: Sequence[Block], holder_node_id: str, *, served: bool = False
    ) -> int:
        """Node ``holder_node_id`` holds these blocks too: we just pulled them from it,
        or (``served``) it pinned them here to pull them. With copy-aware eviction,
        and when ``copy_learn`` takes that kind of pull, each counts as a redundant
        copy here for ``copy_ttl_s``. Returns how many were marked.

        With ``pulled_admission = "replica"`` the pulled blocks also enter as
        low-priority replicas (``_admit_replicas``), and a replica served to a
        peer that will hold its copy as a replica becomes a normal block here.

        The tie-break that keeps the last copy: only a holder with a *lower* node id
        makes a copy redundant. Beliefs then point from higher ids to lower ones, so
        among the nodes holding a block the lowest-id one never counts its copy as
        redundant, however stale every node's view is: two nodes can never each drop
        their copy believing the other keeps one.
        """
        if self.replicas:
            if served:
                self._serve_replicas(blocks, holder_node_id)
            else:
                self._admit_replicas(blocks, holder_node_id)
        if not (self.copy_aware and holder_node_id and holder_node_id < self.node_id):
            return 0
        if not (self.learn_served if served else self.learn_pulled):
            return 0
        until_s = self._clock() + self.copy_ttl_s  # one float shared by the batch
        marked = 0
        for block in blocks:
            if block.state is BlockState.COMMITTED and not block.doomed:
                block.redundant_until_s = until_s
                marked += 1
                if self.copy_fifo and block.offset >= 0:
                    # Into the low-priority FIFO (its tail: the FIFO stays in mark
                    # order, so the marks expire from its head); one local load
                    # makes it a normal block again: it is wanted here.
                    if block.replica_loads < 0:
                        block.replica_loads = self.replica_promote_loads - 1
                    self.dram.policy(block.namespace.dram_key).insert_cold(block)
        return marked

    def _expire_cold(self, slot_bytes: int, now_s: float) -> None:
        """copy_order = fifo: copies at the head of the low-priority FIFO whose
        belief has expired count as sole copies again (the copy_ttl_s bound): back
        into the normal order. Marks expire in FIFO order, so a few looks suffice."""
        policy = self.dram.policy(slot_bytes)
        expired = [
            b
            for b in cast("Iterator[Block]", itertools.islice(policy.cold_keys(), 16))
            if 0.0 < b.redundant_until_s <= now_s
        ]
        for block in expired:
            block.replica_loads = -1
            policy.promote(block)

    def _replica_from(self, source_node_id: str) -> bool:
        """Whether a copy pulled from ``source_node_id`` enters as a replica. A replica
        is a belief ("the source keeps its copy"), so with copy-aware eviction it
        follows the tie-break: only a lower-id source makes one (the owner then
        never marks its copy redundant for this pull: the puller's id is higher)."""
        return self.replicas and (not self.copy_aware or source_node_id < self.node_id)

    def _admit_replicas(self, blocks: Sequence[Block], source_node_id: str) -> None:
        if not self._replica_from(source_node_id):
            return
        admitted: dict[int, list[Block]] = {}  # by eviction order (a pull's: one)
        dirty_pop = self.dirty.pop
        committed = BlockState.COMMITTED
        for block in blocks:
            if block.state is committed and not block.doomed and block.offset >= 0:
                block.replica_loads = 0
                admitted.setdefault(block.namespace.dram_key, []).append(block)
                # Not for the demoter: a copy the source keeps is not worth a disk
                # write (it came first in the demoter's cold-end walk, ahead of the
                # sole copies DRAM drops next). Promoted, it is dirty again.
                dirty_pop(block, None)
        for key, group in admitted.items():
            self.dram.policy(key).insert_cold_many(group)
            self.counters.admitted_replicas += len(group)

    def _serve_replicas(self, blocks: Sequence[Block], requester_node_id: str) -> None:
        """The requester will hold these as replicas, believing we keep ours: our
        replicas among them become normal blocks, so two replicas never each
        count on the other (a pull chain A -> B -> A)."""
        if not (self.copy_aware and requester_node_id < self.node_id):
            # (else the requester's copy is a full one and ours may go first)
            for block in blocks:
                if block.replica_loads >= 0 and block.offset >= 0:
                    self._promote_replica(block)

    def redundant(self, block: Block) -> bool:
        """True while a lower-id node is believed to hold this block too."""
        return block.redundant_until_s > self._clock()

    # ------------------------------------------------------- admission

    def reserve_dram(self, block: Block, *, evict: bool = True) -> int | None:
        """A DRAM slot for ``block`` (a new store, a promotion or a move landing there),
        evicting cold unpinned blocks if ``evict``; None when there is no room.

        The slot counts against the namespace at once; ``occupy``/``place`` put
        the block in it, ``unreserve`` gives it back."""
        ns = block.namespace
        account = ns.account or self.account(ns)
        if evict:
            offset = self._allocate(ns, account)
        elif (self.quota_bytes and ns.used_bytes + ns.slot_bytes > self.quota_bytes) or (
            account.quota_bytes[_DRAM] and account.over(Tier.DRAM, ns.slot_bytes)
        ):
            offset = None
        else:
            offset = self.dram.allocator.alloc(ns.slot_bytes, account.dram_part)  # free room only
        if offset is None:
            return None
        self.dram.owner[offset] = block
        ns.used_bytes += ns.slot_bytes
        account.used_bytes[_DRAM] += ns.slot_bytes
        return offset

    def reserve_dram_free(self, ns: Namespace, blocks: Sequence[Block]) -> list[int]:
        """DRAM slots for ``blocks``, in order, from free room only: what
        ``reserve_dram`` would give them one by one while no eviction is needed
        (fewer when room runs out: the caller goes on with ``reserve_dram``).
        None at all while a namespace quota or a tenant cap is in play (those
        decide per block)."""
        account = ns.account or self.account(ns)
        if self.quota_bytes or account.quota_bytes[_DRAM] or not blocks:
            return []
        offsets = self.dram.allocator.alloc_many(ns.slot_bytes, len(blocks), account.dram_part)
        owner = self.dram.owner
        for block, offset in zip(blocks, offsets, strict=False):
            owner[offset] = block
        taken = len(offsets) * ns.slot_bytes
        ns.used_bytes += taken
        account.used_bytes[_DRAM] += taken
        return offsets

    def evict_for(self, ns: Namespace, count: int) -> int:
        """Evict up to ``count`` DRAM blocks of ns's slot size in one pass: the very
        victims ``reserve_dram`` would take one by one for ``count`` new blocks of
        ns, where that choice depends on nothing but the order: LRU, no disk tier,
        no copy-aware eviction, no namespace quota, no tenant cap or range (0
        otherwise: ``reserve_dram`` decides per block). There each search takes
        the coldest unpinned block, looking past every pinned one (``_evict_one``),
        so these are the ``count`` coldest unpinned blocks. Returns how many went
        (fewer when the order runs out: the rest goes through ``reserve_dram``).
        Each its own BlockRemoved, as one by one; their presence entries in one
        write."""
        account = ns.account or self.account(ns)
        if (
            count <= 0
            # LRU's victims() only reads its order; S3-FIFO's walk moves keys as it
            # goes, so a longer walk is not the same as several short ones
            or self.eviction_policy != "lru"
            or self.disk is not None
            or self.copy_aware
            or self.quota_bytes
            or account.quota_bytes[_DRAM]
            or account.dram_part
        ):
            return 0
        victims: list[Block] = []
        for block in self.dram.policy(ns.slot_bytes).victims():
            assert isinstance(block, Block)
            if block.pins:
                continue
            victims.append(block)
            if len(victims) == count:
                break
        with self.presence_batch():
            self._remove_dram_only(victims)
        self.counters.evicted_blocks += len(victims)
        return len(victims)

    def _remove_dram_only(self, victims: Sequence[Block]) -> None:
        """remove(block, emit=True) of each of evict_for's victims, inlined: committed,
        unpinned blocks whose only copy is a DRAM slot (no disk tier; a block in
        DRAM is not in the GPU pool), each its own BlockRemoved as _evict's; the
        slot freed by _free_dram_slot, as remove() frees it. The per-block calls
        of remove() were ~0.6 us of a victim's ~2.4 us (in process, a store of
        16,384 new blocks evicting as many: 39 ms before, 26 ms with this and
        the one-pass slots after it)."""
        presence = self.presence
        medium = Tier.DRAM.medium
        removed = self.sink.blocks_removed
        free_slot = self._free_dram_slot
        for block in victims:
            assert block.pins == 0 and block.gpu_offset < 0, "evicting a pinned or GPU block"
            ns = block.namespace
            h = block.block_hash
            if ns.blocks.get(h) is block:
                del ns.blocks[h]
                if presence is not None:
                    presence.left(block)
            self.dram.policy(ns.dram_key).remove(block)
            if ns.account is not None and (order := ns.account.order[_DRAM]) is not None:
                order.pop(block, None)
            if block.replica_loads >= 0:
                self.counters.evicted_replica_blocks += 1
            free_slot(block)
            removed(ns, [h], medium)

    def reserve_gpu(self, block: Block) -> int | None:
        """A free GPU pool slot for ``block`` (making room is the GPU mover's: it must copy)."""
        assert self.gpu is not None, "no GPU tier"
        ns = block.namespace
        if self.account(ns).over(Tier.GPU, ns.slot_bytes):
            return None  # at its cap: gpu_room_victims names its own blocks to move
        offset = self.gpu.alloc(block)
        if offset is not None:
            self._charge(ns, Tier.GPU, ns.slot_bytes)
        return offset

    def unreserve(self, block: Block, tier: Tier, offset: int) -> None:
        """Give back a slot reserved for a block that never moved into it."""
        owner = self.pool(tier).free(offset)
        assert owner is block, "unreserving another block's slot"
        if tier is Tier.DRAM:
            block.namespace.used_bytes -= block.namespace.slot_bytes
        self._charge(block.namespace, tier, -block.namespace.slot_bytes)

    def occupy(self, block: Block, tier: Tier, offset: int, *, ahead: bool = False) -> None:
        """A new store's block takes its reserved slot (pending until commit).
        ``ahead``: a slot reserved ahead under a placeholder hash (``bind`` at commit)."""
        if tier is Tier.GPU:
            block.gpu_offset = offset
        else:
            block.offset = offset
        if ahead:
            block.namespace.reserved[block.block_hash] = block
        else:
            block.namespace.pending[block.block_hash] = block

    def occupy_new(self, blocks: Sequence[Block], offsets: Sequence[int], *, ahead: bool) -> None:
        """``occupy`` for new DRAM blocks of one namespace, each at its offset, in one
        pass (blocks that ``reserve_dram_free`` just gave those slots)."""
        if not blocks:
            return
        for block, offset in zip(blocks, offsets, strict=True):
            block.offset = offset
        ns = blocks[0].namespace
        (ns.reserved if ahead else ns.pending).update({b.block_hash: b for b in blocks})

    def bind(self, blocks: Sequence[Block], real_hashes: Sequence[int | None]) -> None:
        """Slots reserved ahead meet their blocks at commit: each block leaves the
        placeholders and, where its real hash is given, takes it (pending, for
        ``commit``); a None hash gives the slot back."""
        ns = blocks[0].namespace if blocks else None
        for block, real in zip(blocks, real_hashes, strict=True):
            assert ns is not None
            del ns.reserved[block.block_hash]
            if real is None:
                self.abort(block)
                continue
            assert real not in ns.pending and real not in ns.blocks, "binding a hash in use"
            block.block_hash = real
            ns.pending[real] = block

    # ---------------------------------------------------------- stores

    def commit(
        self,
        blocks: Sequence[Block],
        committed: Sequence[Block],
        tier: Tier,
        batches: Iterable[StoredBatch],
    ) -> None:
        """A store lease ends in a commit: ``committed`` (of the lease's ``blocks``)
        become loadable in ``tier``, the others' slots are freed; one BlockStored
        per batch."""
        if not blocks:
            return
        ns = blocks[0].namespace
        order = (ns.account or self.account(ns)).order[tier]  # the tenant's, if capped there
        policy = self.pool(tier).policy(ns.dram_key if tier is Tier.DRAM else ns.slot_bytes)
        if len(committed) == len(blocks):  # all of them (a subset's blocks are the lease's)
            self._commit_all(ns, blocks, policy, order)
        else:
            self._commit_some(ns, blocks, committed, policy, order)
        self.counters.stored_blocks += len(committed)
        if self.presence is not None and committed:
            self.presence.stored(ns, committed, tier, new=True)
        for hashes, parent, token_ids in batches:
            self.sink.blocks_stored(ns, hashes, tier.medium, parent, token_ids)
        if self.disk is not None and committed and tier is Tier.DRAM:
            self._dirty(committed)  # GPU blocks reach disk through DRAM

    def _commit_all(
        self,
        ns: Namespace,
        blocks: Sequence[Block],
        policy: EvictionPolicy,
        order: dict[Block, None] | None,
    ) -> None:
        """_commit_some with every block chosen, in passes (a 64-block commit's
        per-block calls were ~20 of its ~50 us)."""
        pending, index = ns.pending, ns.blocks
        for block in blocks:
            del pending[block.block_hash]
            block.state = BlockState.COMMITTED
            index[block.block_hash] = block
        policy.insert_many(blocks)
        if order is not None:
            order.update(dict.fromkeys(blocks))

    def _commit_some(
        self,
        ns: Namespace,
        blocks: Sequence[Block],
        committed: Sequence[Block],
        policy: EvictionPolicy,
        order: dict[Block, None] | None,
    ) -> None:
        """The blocks of ``committed`` leave the pending ones for the index and the
        eviction order, in the lease's order; the others' slots are freed."""
        chosen = set(map(id, committed))
        for block in blocks:
            del ns.pending[block.block_hash]
            if id(block) in chosen:
                block.state = BlockState.COMMITTED
                ns.blocks[block.block_hash] = block
                policy.insert(block)
                if order is not None:
                    order[block] = None
            else:
                self.abort(block)

    def abort(self, block: Block) -> None:
        """Give back the slot of a block whose store was aborted (or expired)."""
        if block.gpu_offset >= 0:
            self._free_gpu_slot(block)
        else:
            self._free_dram_slot(block)

    def _free_dram_slot(self, block: Block) -> None:
        ns = block.namespace
        self.dram.free(block.offset)
        ns.used_bytes -= ns.slot_bytes
        (ns.account or self.account(ns)).used_bytes[_DRAM] -= ns.slot_bytes
        block.dram_generation += 1
        block.offset = -1

    def _free_gpu_slot(self, block: Block) -> None:
        assert self.gpu is not None
        self.gpu.free(block.gpu_offset)
        self._charge(block.namespace, Tier.GPU, -block.namespace.slot_bytes)
        block.gpu_offset = -1

    def _dirty(self, blocks: Iterable[Block]) -> None:
        self.dirty.update(dict.fromkeys(blocks))
        if self.on_dirty is not None:
            self.on_dirty()

    # -------------------------------------------------------- removal

    def remove(self, block: Block, *, emit: bool) -> list[str]:
        """Drop a committed, unpinned block from the index and free its slots.

        Returns the media it left (for the caller's events when ``emit`` is False).
        """
        assert block.pins == 0, "removing a pinned block"
        media = self._unindex(block)
        self._free_copies(block)
        if emit:
            for medium in media:
                self.sink.blocks_removed(block.namespace, [block.block_hash], medium)
        return media

    def doom(self, block: Block) -> list[str]:
        """Delete of a pinned block: out of the index now, slots at the last unpin.
        Returns the media it left."""
        block.doomed = True
        return self._unindex(block)

    def delete(self, ns: Namespace, blocks: Iterable[Block]) -> tuple[int, int]:
        """Delete committed blocks (pinned ones are doomed); one BlockRemoved per medium.
        Returns (removed now, doomed)."""
        deleted = busy = 0
        removed: dict[str, list[int]] = {}
        with self.presence_batch():
            for block in blocks:
                if block.pins:
                    media = self.doom(block)
                    busy += 1
                else:
                    media = self.remove(block, emit=False)
                    deleted += 1
                for medium in media:
                    removed.setdefault(medium, []).append(block.block_hash)
        for medium, hashes in removed.items():
            self.sink.blocks_removed(ns, hashes, medium)
        return deleted, busy

    def drop(self, block: Block) -> None:
        """The block must leave the store (its only copy failed verification, say):
        removed now if nothing pins it, else doomed; BlockRemoved for each medium."""
        if block.doomed:
            return
        if block.pins:
            self.doom(block)
        else:
            self.remove(block, emit=True)

    def _unindex(self, block: Block) -> list[str]:
        """Take a committed block out of the index and every eviction order (its
        slots stay its own). Returns the media it was in, for BlockRemoved."""
        ns = block.namespace
        if ns.blocks.get(block.block_hash) is block:
            del ns.blocks[block.block_hash]
            if self.presence is not None:
                self.presence.left(block)
        media = []
        # The tenant's own orders, where it has caps (inline: every removal passes here).
        orders = ns.account.order if ns.account is not None else _NO_ORDERS
        if self.disk is not None:
            self.dirty.pop(block, None)
            if self.on_leave is not None:
                self.on_leave(block)
            if block.disk_slot >= 0:
                self.disk_policy(ns).remove(block)
                if (order := orders[_DISK]) is not None:
                    order.pop(block, None)
                media.append(Tier.DISK.medium)
        if block.offset >= 0:
            self.dram.policy(ns.dram_key).remove(block)
            if (order := orders[_DRAM]) is not None:
                order.pop(block, None)
            media.append(Tier.DRAM.medium)
        if block.gpu_offset >= 0 and self.gpu is not None:
            self.gpu.policy(ns.slot_bytes).remove(block)
            if (order := orders[_GPU]) is not None:
                order.pop(block, None)
            media.append(Tier.GPU.medium)
        return media

    def _free_copies(self, block: Block) -> None:
        """Free every slot of a block that left the index and that nothing pins."""
        assert block.pins == 0, "freeing the slots of a pinned block"
        if block.disk_slot >= 0 and self.disk is not None:
            self.drop_disk_copy(block, emit=False)
        if block.offset >= 0:
            self._free_dram_slot(block)
        if block.gpu_offset >= 0 and self.gpu is not None:
            self._free_gpu_slot(block)

    # -------------------------------------------------------- DRAM eviction

    def _evict(self, block: Block) -> None:
        if self.disk is not None and block.disk_slot >= 0:
            self.vacate_dram(block)  # demoted: it lives on, on disk
            return
        if self.copy_aware and self.redundant(block):
            self.counters.evicted_redundant_blocks += 1
        if block.replica_loads >= 0:
            self.counters.evicted_replica_blocks += 1
        self.remove(block, emit=True)
        self.counters.evicted_blocks += 1

    def _allocate(self, ns: Namespace, account: TenantAccount) -> int | None:
        """A DRAM slot for one block of ns, evicting cold unpinned blocks if needed."""
        quota = self.quota_bytes
        # A disk that cannot take writes (disk.when_full = "reject"): never drop
        # a block that is not on disk yet; the store fails instead.
        keep_dirty = self.disk is not None and self.keep_dirty
        if (
            quota
            and ns.used_bytes + ns.slot_bytes > quota
            and not self._evict_one(ns.dram_key, only=ns, clean_only=keep_dirty)
        ):
            return None
        # A tenant at its DRAM cap makes room from its own blocks only (never
        # another tenant's), or gets the answer of a full tier. Under its cap it
        # shares the rest of the tier like any tenant: caps, not reservations.
        cap = account.quota_bytes[_DRAM]
        if (
            cap
            and account.used_bytes[_DRAM] + ns.slot_bytes > cap
            and not self._evict_own(account, Tier.DRAM, ns.slot_bytes, clean_only=keep_dirty)
        ):
            return None
        if account.dram_part:
            return self._allocate_own(ns, account, keep_dirty=keep_dirty)
        alloc = self.dram.allocator
        offset = alloc.alloc(ns.slot_bytes)
        if offset is not None:
            return offset
        # With a disk tier a dirty block is dropped only as a last resort: first
        # a clean one of this size, then a chunk of another size. With tenant
        # regions, victims come from the shared range only (its own orders).
        if self.disk is not None and (
            self._evict_one(ns.slot_bytes, clean_only=True)
            or self._steal_chunk(ns.slot_bytes, clean_only=keep_dirty)
        ):
            return alloc.alloc(ns.slot_bytes)
        if keep_dirty:
            return None
        if self._evict_one(ns.slot_bytes) or self._steal_chunk(ns.slot_bytes):
            return alloc.alloc(ns.slot_bytes)
        return None

    def _allocate_own(
        self, ns: Namespace, account: TenantAccount, *, keep_dirty: bool
    ) -> int | None:
        """A slot in the tenant's own DRAM range (tenant regions): room there comes
        from its own blocks only, which all live in that range; None if it cannot
        be made (all pinned or in flight: the answer of a full tier)."""
        alloc, part, slot_bytes = self.dram.allocator, account.dram_part, ns.slot_bytes
        offset = alloc.alloc(slot_bytes, part)
        if offset is not None:
            return offset
        victim = self._own_victim(account, Tier.DRAM, slot_bytes, clean_only=keep_dirty)
        if victim is not None and victim.namespace.slot_bytes == slot_bytes:
            self._evict(victim)  # frees a slot of this size in this range
            return alloc.alloc(slot_bytes, part)
        if self._steal_chunk(slot_bytes, clean_only=keep_dirty, part=part):
            return alloc.alloc(slot_bytes, part)
        return None

    @staticmethod
    def _clean(block: Block) -> bool:
        return block.disk_slot >= 0

    def _evict_one(
        self,
        slot_bytes: int,
        only: Namespace | None = None,
        *,
        clean_only: bool = False,
    ) -> bool:
        """Evict the coldest unpinned block of this slot size (of one namespace if given).

        ``slot_bytes`` is the key of the DRAM order (Namespace.dram_key): with
        tenant regions, a shared tenant's size is the shared range's order."""
        # With a disk tier, prefer a clean victim (its DRAM copy goes, the block
        # stays on disk) among the coldest few before dropping a dirty one.
        # Copy-aware, a redundant copy (another node keeps the block: a pull, not
        # a recompute) is as good a victim as a clean one; a sole dirty copy
        # goes last, and only from DRAM-only nodes it is dropped rather than demoted.
        # A replica (a pulled copy not reused yet) comes first in the order and is
        # as good a victim as a clean or a redundant one.
        now_s = self._clock()
        if self.copy_fifo:
            self._expire_cold(slot_bytes, now_s)
        # Replicas do not move on hits, so the ones a store has just pinned (the
        # prefix it pulled) can fill the head of the order: look past all of them.
        # And past every pinned block: a load lease held while newer blocks come in
        # leaves its blocks at the cold end, and a search that saw only them failed
        # (a store was refused room with unpinned blocks right behind them).
        cold = self.dram.policy(slot_bytes).cold_len() + self.pinned_blocks
        if self.disk is not None:
            prefer: Callable[[Block], bool] = self._clean
            if clean_only and self.replicas:
                # A replica is never demoted (_admit_replicas) and is as good a
                # victim as a clean block (its source keeps it): also in the
                # clean-only search, which comes first, and under
                # disk.when_full = "reject".
                prefer = lambda b: b.disk_slot >= 0 or b.replica_loads >= 0  # noqa: E731
            elif self.copy_aware and not clean_only:
                prefer = lambda b: (  # noqa: E731
                    b.disk_slot >= 0 or b.replica_loads >= 0 or b.redundant_until_s > now_s
                )
            elif (self.replicas or self.copy_fifo) and not clean_only:
                prefer = lambda b: b.disk_slot >= 0 or b.replica_loads >= 0  # noqa: E731

            victim = self.dram.victim(
                slot_bytes,
                4 * CLEAN_VICTIM_WINDOW + cold,
                only=only,
                prefer=prefer,
                window=CLEAN_VICTIM_WINDOW,
                prefer_only=clean_only,
            )
        elif self.copy_aware and not self.copy_fifo:
            victim = self.dram.victim(
                slot_bytes,
                4 * self.copy_window + cold,
                only=only,
                prefer=lambda b: b.replica_loads >= 0 or b.redundant_until_s > now_s,
                window=self.copy_window,
            )
        else:
            victim = self.dram.victim(slot_bytes, 4 + cold, only=only)
        if victim is None:
            return False
        self._evict(victim)
        return True

    def _own_victim(
        self, account: TenantAccount, tier: Tier, slot_bytes: int, *, clean_only: bool = False
    ) -> Block | None:
        """The coldest unpinned block of the tenant in ``tier`` among its
        TENANT_VICTIM_SCAN coldest: one of ``slot_bytes`` first (its slot is the one
        the caller needs), clean ones (also on disk) preferred in DRAM with a disk
        tier; else one of another size (the tenant's bytes go down all the same)."""
        order = account.order[tier]
        assert order is not None, "victims of a tier without a cap"
        prefer_clean = tier is Tier.DRAM and self.disk is not None
        same: Block | None = None
        other: Block | None = None
        window = CLEAN_VICTIM_WINDOW
        for block in itertools.islice(order, TENANT_VICTIM_SCAN):
            if block.pins or (clean_only and block.disk_slot < 0):
                continue
            if block.namespace.slot_bytes != slot_bytes:
                other = other or block
                continue
            if not prefer_clean or block.disk_slot >= 0:
                return block
            same = same or block
            window -= 1
            if window <= 0:
                break
        return same or other

    def _evict_own(
        self, account: TenantAccount, tier: Tier, slot_bytes: int, *, clean_only: bool = False
    ) -> bool:
        """Evict the tenant's own coldest unpinned blocks from DRAM (or the GPU pool's
        caller moves them: see gpu_room_victims) until ``slot_bytes`` more fit its cap.
        False when they cannot (all pinned)."""
        while account.over(tier, slot_bytes):
            victim = self._own_victim(account, tier, slot_bytes, clean_only=clean_only)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _steal_chunk(self, slot_bytes: int, *, clean_only: bool = False, part: int = 0) -> bool:
        """Free a whole chunk held by another slot size whose blocks are all evictable
        (in range ``part`` of a partitioned region)."""
        victims = self.dram.chunk_victims(slot_bytes, self._clean if clean_only else None, part)
        if victims is None:
            return False
        for block in victims:
            self._evict(block)
        return True

    # ------------------------------------------------------ DRAM <-> disk

    def disk_policy(self, ns: Namespace) -> EvictionPolicy:
        return self.disk_orders.policy_of(ns)

    def adopt_disk(self, ns: Namespace) -> list[int]:
        """Adopt the recovered disk blocks of a namespace just declared (or restored
        by a warm restart); BlockStored DISK for them. Returns their hashes."""
        entries = self.parked.pop(ns.namespace_id, None)
        if not entries:
            return []
        assert self.disk is not None
        adopted = []
        fresh: list[Block] = []  # in no tier before (the others keep a faster copy)
        for h, entry in entries.items():
            if entry.nbytes != ns.block_bytes:
                self.disk.free(entry.slot)  # a block of another layout: stale
                continue
            block = ns.blocks.get(h)
            if block is not None:
                if block.disk_slot >= 0:
                    self.disk.free(entry.slot)
                    continue
                block.disk_slot = entry.slot  # in DRAM already (warm restart): now clean
                self.dirty.pop(block, None)
                block.checksum = entry.checksum
                self.clean_bytes += ns.slot_bytes
            else:
                block = Block(ns, h, state=BlockState.COMMITTED, checksum=entry.checksum)
                block.disk_slot = entry.slot
                ns.blocks[h] = block
                fresh.append(block)
            self.disk_policy(ns).insert(block)
            self._resident(block, Tier.DISK)
            self._charge(ns, Tier.DISK, align_up(ns.block_bytes))
            adopted.append(h)
        if self.presence is not None and fresh:
            self.presence.stored(ns, fresh, Tier.DISK, new=True)
        if adopted:
            self.sink.blocks_stored(ns, adopted, Tier.DISK.medium, None, None)
        return adopted

    def vacate_dram(self, block: Block) -> None:
        """DRAM eviction of a clean block: it stays, on disk only."""
        ns = block.namespace
        self.dram.policy(ns.dram_key).remove(block)
        self._gone(block, Tier.DRAM)
        block.replica_loads = -1  # its next DRAM copy (a promotion) is a normal one
        self._free_dram_slot(block)
        self.clean_bytes -= ns.slot_bytes
        self.counters.demoted_blocks += 1
        if self.presence is not None:
            self.presence.moved(block)  # on disk only now
        self.sink.blocks_removed(ns, [block.block_hash], Tier.DRAM.medium)

    def drop_disk_copy(self, block: Block, *, emit: bool) -> None:
        """Forget a block's disk copy (it must not be pinned by a disk read)."""
        assert self.disk is not None
        self.disk_policy(block.namespace).remove(block)
        self._gone(block, Tier.DISK)
        self.disk.free(block.disk_slot)
        self._charge(block.namespace, Tier.DISK, -align_up(block.namespace.block_bytes))
        block.disk_slot = -1
        if block.offset >= 0:
            self.clean_bytes -= block.namespace.slot_bytes
        if emit:
            self.sink.blocks_removed(block.namespace, [block.block_hash], Tier.DISK.medium)

    def reserve_disk(self, ns: Namespace) -> int | None:
        """A disk slot for one block of ns, dropping the disk's coldest copies if needed."""
        slot = self._disk_slot(ns)
        if slot is not None:
            self._charge(ns, Tier.DISK, align_up(ns.block_bytes))
        return slot

    def tenant_disk_room(self, ns: Namespace) -> bool:
        """Whether one more block of ns fits its tenant's disk cap, dropping the
        tenant's own coldest unpinned disk copies to make it fit. False when it
        cannot (they are all pinned): the block is not demoted, and no other
        tenant's copy goes (the demoter skips it; the disk is not full)."""
        account = self.account(ns)
        nbytes = align_up(ns.block_bytes)
        while account.over(Tier.DISK, nbytes):
            victim = self._own_victim(account, Tier.DISK, ns.slot_bytes)
            if victim is None:
                return False
            self._drop_disk_victim(victim)
        return True

    def _drop_disk_victim(self, victim: Block) -> None:
        if victim.offset >= 0 or victim.gpu_offset >= 0:
            self.drop_disk_copy(victim, emit=True)  # still in DRAM/GPU: only the disk copy goes
        else:
            self.remove(victim, emit=True)  # its only copy: the block leaves the store
            self.counters.evicted_blocks += 1

    def _disk_slot(self, ns: Namespace) -> int | None:
        disk = self.disk
        assert disk is not None
        slot = disk.allocate(ns.block_bytes)
        if slot is not None:
            return slot
        # The coldest unpinned disk copy of this size goes (the victim search DRAM
        # and the GPU pool use); its slot is of this size, so one is enough.
        # Past every pinned block, as in DRAM (_evict_one): a load lease's blocks at
        # the cold end stopped a search of the coldest 64 with unpinned copies behind.
        victim = self.disk_orders.victim(
            self.disk_orders.slot_bytes_of(ns), DISK_VICTIM_WINDOW + self.pinned_blocks
        )
        if victim is not None:
            self._drop_disk_victim(victim)
            slot = disk.allocate(ns.block_bytes)
            if slot is not None:
                return slot
        # Recovered blocks nobody declared yet are the coldest of all.
        for ns_id in list(self.parked):
            entries = self.parked[ns_id]
            while entries:
                _, entry = entries.popitem()
                disk.free(entry.slot)
                slot = disk.allocate(ns.block_bytes)
                if slot is not None:
                    return slot
            del self.parked[ns_id]
        return None

    def unreserve_disk(self, ns: Namespace, slot: int) -> None:
        """Give back a disk slot of ns whose write did not become a block's copy."""
        assert self.disk is not None
        self.disk.free(slot)
        self._charge(ns, Tier.DISK, -align_up(ns.block_bytes))

    def disk_write_failed(self, ns: Namespace) -> None:
        """A write into a disk slot reserved for ns failed or was cancelled: the disk
        tier gave the slot back itself (DiskTier.write); its tenant's bytes too."""
        self._charge(ns, Tier.DISK, -align_up(ns.block_bytes))

    def place_disk(
        self, block: Block, slot: int, checksum: int, *, dram_offset: int, dram_generation: int
    ) -> bool:
        """A demotion's write of the DRAM copy at ``dram_offset`` (of that generation)
        landed in disk ``slot``: the block is clean now; BlockStored DISK.

        False (nothing changes: the caller frees the slot) when that DRAM copy is
        no longer the block's, or the block left the store meanwhile."""
        ns = block.namespace
        if not (
            ns.blocks.get(block.block_hash) is block
            and block.offset == dram_offset
            and block.dram_generation == dram_generation
            and block.disk_slot < 0
        ):
            return False
        self.dirty.pop(block, None)
        block.disk_slot = slot
        self.set_checksum(block, checksum)
        self.clean_bytes += ns.slot_bytes
        self.disk_policy(ns).insert(block)
        self._resident(block, Tier.DISK)
        self.sink.blocks_stored(ns, [block.block_hash], Tier.DISK.medium, None, None)
        return True

    def promoted(
        self,
        ns: Namespace,
        landed: Sequence[tuple[Block, int]],
        missed: Sequence[tuple[Block, int, bool]],
    ) -> list[Block]:
        """A promotion batch's reads ended. Each ``landed`` block (read into its
        reserved DRAM slot) is placed there unless it was deleted meanwhile; each
        ``missed`` one's slot goes back, and when its flag says its disk copy
        failed verification (the disk dropped it) the block, with no other copy,
        leaves the store. One BlockStored DRAM and one BlockRemoved DISK per
        batch. Returns the blocks placed. The reads' pins are the caller's to
        drop after."""
        promoted: list[Block] = []
        dropped: list[int] = []
        for block, offset in landed:
            if block.doomed:
                self.unreserve(block, Tier.DRAM, offset)  # deleted while it was read
                continue
            block.offset = offset
            self.clean_bytes += ns.slot_bytes
            self.dram.policy(ns.dram_key).insert(block)
            self._resident(block, Tier.DRAM)
            promoted.append(block)
        for block, offset, corrupt in missed:
            self.unreserve(block, Tier.DRAM, offset)
            if corrupt:
                self.disk_policy(ns).remove(block)
                self._gone(block, Tier.DISK)
                self._charge(ns, Tier.DISK, -align_up(ns.block_bytes))  # the tier freed it
                block.disk_slot = -1
                if not block.doomed:
                    # It leaves the index now, its slots at its last unpin (the read's).
                    assert block.pins, "a promotion read's block is pinned by the read"
                    self.doom(block)
                    dropped.append(block.block_hash)
        if promoted:
            if self.presence is not None:
                self.presence.stored(ns, promoted, Tier.DRAM, new=False)
            self.counters.promoted_blocks += len(promoted)
            self.sink.blocks_stored(
                ns, [b.block_hash for b in promoted], Tier.DRAM.medium, None, None
            )
        if dropped:
            self.sink.blocks_removed(ns, dropped, Tier.DISK.medium)
        return promoted

    # ------------------------------------------------------ GPU <-> DRAM

    def gpu_victim(self, slot_bytes: int) -> Block | None:
        """The coldest unpinned GPU block of a size (to demote for room)."""
        assert self.gpu is not None
        # Past every pinned block, as in DRAM (_evict_one): a load lease's blocks at
        # the cold end stopped a search of the coldest 64 with unpinned blocks behind.
        return self.gpu.victim(slot_bytes, GPU_VICTIM_WINDOW + self.pinned_blocks)

    def gpu_chunk_victims(self, slot_bytes: int) -> list[Block] | None:
        """The GPU blocks of the coldest chunk of another size that can all move."""
        assert self.gpu is not None
        return self.gpu.chunk_victims(slot_bytes)

    def gpu_room_victims(self, block: Block) -> list[Block] | None:
        """The GPU blocks to move out so ``block`` gets a pool slot: for a tenant at
        its GPU cap, its own coldest unpinned ones (enough to fit; None when they
        are pinned: no other tenant's block moves for it); else the coldest
        unpinned block of its size, or the blocks of the coldest chunk of another
        size."""
        assert self.gpu is not None
        ns = block.namespace
        account = self.account(ns)
        if account.over(Tier.GPU, ns.slot_bytes):
            victims: list[Block] = []
            order = account.order[Tier.GPU]
            assert order is not None
            freed = 0
            for b in itertools.islice(order, TENANT_VICTIM_SCAN):
                if b.pins:
                    continue
                victims.append(b)
                freed += b.namespace.slot_bytes
                if not account.over(Tier.GPU, ns.slot_bytes - freed):
                    return victims
            return None
        victim = self.gpu_victim(ns.slot_bytes)
        return [victim] if victim is not None else self.gpu_chunk_victims(ns.slot_bytes)

    def vacate_gpu(self, block: Block, dram_offset: int | None) -> None:
        """A committed GPU block leaves the pool: into its reserved DRAM slot
        ``dram_offset`` (its bytes copied there), else onto its disk copy, else out
        of the store. Its KV events; a demotion or an eviction counted."""
        assert self.gpu is not None
        ns = block.namespace
        self.gpu.policy(ns.slot_bytes).remove(block)
        self._gone(block, Tier.GPU)
        if dram_offset is None and block.disk_slot < 0:
            self.remove(block, emit=True)
            self.counters.evicted_blocks += 1
            return
        self._free_gpu_slot(block)
        if dram_offset is not None:
            self._into_dram(block, dram_offset)
            self.sink.blocks_stored(ns, [block.block_hash], Tier.DRAM.medium, None, None)
        # else: DRAM full of pinned blocks: the disk copy remains
        if self.presence is not None:
            self.presence.moved(block)
        self.counters.demoted_blocks += 1
        self.sink.blocks_removed(ns, [block.block_hash], Tier.GPU.medium)

    def place_gpu(self, block: Block, gpu_offset: int) -> None:
        """A DRAM block's bytes were copied into its reserved pool slot: it leaves
        DRAM (a disk copy stays) and enters the pool."""
        assert self.gpu is not None
        ns = block.namespace
        self.dram.policy(ns.dram_key).remove(block)
        self._gone(block, Tier.DRAM)
        block.replica_loads = -1
        self._free_dram_slot(block)
        if self.disk is not None:
            if block.disk_slot >= 0:
                self.clean_bytes -= ns.slot_bytes
            else:
                self.dirty.pop(block, None)
                if self.on_leave is not None:
                    self.on_leave(block)
        block.gpu_offset = gpu_offset
        self.gpu.policy(ns.slot_bytes).insert(block)
        self._resident(block, Tier.GPU)
        if self.presence is not None:
            self.presence.moved(block)
        self.counters.promoted_blocks += 1
        self.sink.blocks_stored(ns, [block.block_hash], Tier.GPU.medium, None, None)
        self.sink.blocks_removed(ns, [block.block_hash], Tier.DRAM.medium)

    def _into_dram(self, block: Block, offset: int) -> None:
        ns = block.namespace
        block.offset = offset
        self.dram.policy(ns.dram_key).insert(block)
        self._resident(block, Tier.DRAM)
        if self.disk is not None:
            if block.disk_slot >= 0:
                self.clean_bytes += ns.slot_bytes
            else:
                self._dirty([block])

    # ------------------------------------------------------- warm restart

    def restore_dram(
        self, blocks: Sequence[tuple[Namespace, int, int, int]]
    ) -> tuple[list[Block], int]:
        """Rebuild the DRAM index from a warm-restart manifest's ``(namespace, hash,
        offset, checksum)``, on an empty pool. Returns the blocks restored (no
        events: the caller announces each namespace's) and how many were refused."""
        alloc = self.dram.allocator
        given = len(blocks)
        if self.dram_parts:
            # A slot outside its tenant's range (the tenant regions changed since
            # the manifest was written) would put its bytes in another tenant's
            # file: refused, like any slot that does not fit.
            misplaced = {
                (offset, ns.slot_bytes)
                for ns, _, offset, _ in blocks
                if alloc.part_of(offset) != self.dram_parts.get(ns.tenant, 0)
            }
            blocks = [b for b in blocks if (b[2], b[0].slot_bytes) not in misplaced]
        rejected = set(alloc.rebuild((offset, ns.slot_bytes) for ns, _, offset, _ in blocks))
        restored: list[Block] = []
        dropped = given - len(blocks)
        for ns, block_hash, offset, checksum in blocks:
            if (offset, ns.slot_bytes) in rejected or block_hash in ns.blocks:
                dropped += 1
                if block_hash in ns.blocks and (offset, ns.slot_bytes) not in rejected:
                    alloc.free(offset)  # a duplicate key: keep the first
                continue
            block = Block(ns, block_hash, offset, BlockState.COMMITTED, checksum=checksum)
            self.dram.owner[offset] = block
            ns.blocks[block_hash] = block
            ns.used_bytes += ns.slot_bytes
            self._charge(ns, Tier.DRAM, ns.slot_bytes)
            self.dram.policy(ns.dram_key).insert(block)
            self._resident(block, Tier.DRAM)
            restored.append(block)
            if self.disk is not None:
                self.dirty[block] = None
        if self.presence is not None:
            for block in restored:
                self.presence.moved(block)  # at start: before a table is attached, as a rule
        return restored, dropped

    def announce(self, ns: Namespace, blocks: Sequence[int], tier: Tier) -> None:
        """Tell the cluster what this node holds (after a restart)."""
        if blocks:
            self.sink.blocks_stored(ns, blocks, tier.medium, None, None)


def drop_tenant_orders(accounts: dict[str, TenantAccount]) -> None:
    """The tenants' eviction orders let go of their blocks, when the index that
    holds them is dropped (kvstore.manager): an order is reached from its blocks
    through their namespace, a cycle the collector does not see."""
    for account in accounts.values():
        for order in account.order:
            if order is not None:
                order.clear()
