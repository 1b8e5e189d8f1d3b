"""The block manager: index, leases, admission and eviction for one node.

Primitives (all batched; one call per request-step, never one per block):

    declare_namespace(spec)               -> Namespace
    prepare_store(ns_id, hashes, ttl_s)   -> StorePlan   slots reserved, lease issued
    reserve_store(ns_id, blocks, ttl_s)   -> StorePlan   slots reserved ahead, hashes at commit
    commit_store(lease_id, hashes, ...)   -> int         reserved blocks become loadable
    lookup(ns_id, hashes)                 -> LookupResult longest present prefix, per tier
    prepare_load(ns_id, hashes, ttl_s)    -> LoadPlan    prefix pinned, lease issued
    release(lease_ids)                    -> int         unpin a load / abort a store
    delete(ns_id, hashes) / clear(ns_id) / stats() / expire_leases(now)

Concurrency: the manager is not thread-safe by design. Every call runs on the
daemon's event loop and none awaits, so each call is atomic with respect to
the others: no locks, no lost or duplicated block, no deadlock.

Invariants: a committed block's bytes never change (a hash is never rebound);
a pinned block (load lease) is never evicted or freed; a slot is owned by at
most one block; used bytes never exceed the tier's capacity.

Slot lifetime: a slot is reused only when nothing can still touch it. Two
kinds of hold keep a block alive:

- a *pin* (``pins``) says "something reads or writes this block's bytes where
  they are now": a load lease (a client's copy, a peer's NIXL read), a disk
  write reading the DRAM copy, a promotion read landing in a reserved slot. A
  pinned block is never evicted, freed, or moved to another tier.
- a *hold* (``holds``, counted in ``pins`` too) says only "keep this block in
  the store": a tier move or promotion keeps the rest of its prefix from being
  evicted while it works. A held block may change tiers; ``movable`` is true
  when every pin on it is a hold.

Delete of a pinned block takes it out of the index at once (Lookup, PrepareLoad
and PrepareStore all stop seeing it, so a new store of the same hash is a new
block) and frees its slots at the last unpin.

Who owns what (docs/architecture.md): the manager is the API (namespaces,
leases, limits, the per-request checks); ``kvstore.placement.Placement`` is
the only code that changes where a block lives or what pins it (and emits the
KV events); the movers (``movers.disk`` for disk, ``movers.gpu`` for
the GPU pool, ``movers.warm`` for warm restart) do the I/O and report to it.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter, is_
from typing import TYPE_CHECKING, cast

import numpy as np

from kvstore.config import Config
from kvstore.errors import (
    CapacityExhausted,
    ConfigError,
    InvalidRequest,
    LeaseExpired,
    LeaseNotFound,
    NamespaceNotFound,
    StateConflict,
    clip,
)
from kvstore.events.sink import EventSink, NullSink
from kvstore.leases import Lease, LeaseKind, LeaseTable
from kvstore.movers import warm
from kvstore.movers.disk import DiskLayer
from kvstore.namespace import Block, Namespace, NamespaceSpec, TenantAccount
from kvstore.placement import Counters, Placement, StoredBatch, drop_tenant_orders
from kvstore.presence import PresenceRecorder, PresenceTable
from kvstore.quotas import QuotaTable, TenantStats, tenant_regions
from kvstore.tiers import Tier
from kvstore.tiers.dram import PartitionedAllocator, Region, SlabAllocator, slot_bytes_for

if TYPE_CHECKING:
    from kvstore.movers.gpu import GpuLayer

log = logging.getLogger(__name__)

# Per-key outcome of prepare_store; values match kvstore.v1.StoreStatus.
STORE_ALLOCATED = 0
STORE_PRESENT = 1
STORE_IN_FLIGHT = 2
STORE_NO_ROOM = 3

_OFFSET = attrgetter("offset")
_GPU_OFFSET = attrgetter("gpu_offset")
_DOOMED = attrgetter("doomed")


def _loadable_prefix(ns: Namespace, hashes: Sequence[int], tier: Tier) -> list[Block]:
    """The blocks of ``hashes``' longest prefix whose bytes are in ``tier`` (GPU or
    DRAM) and not doomed: what a load can pin. Only blocks in the asked tier have
    bytes the client can reach there: prepare_load_async moves the others first.

    Checked in C (map over the index, attrgetters) when the whole prefix is
    loadable, the usual case (a per-block Python walk: ~0.1 us a block more,
    a quarter of a 16,384-block prepare_load's); the walk finds where it stops
    otherwise."""
    probed = list(map(ns.blocks.get, hashes))
    if None in probed:
        del probed[probed.index(None) :]
    found = cast("list[Block]", probed)
    if found and True not in map(_DOOMED, found):
        # Block.tier from the offsets, without its per-block property call.
        if tier is Tier.GPU:
            whole = min(map(_GPU_OFFSET, found)) >= 0
        else:
            whole = (
                tier is Tier.DRAM
                and min(map(_OFFSET, found)) >= 0
                and max(map(_GPU_OFFSET, found)) < 0
            )
        if whole:
            return found
    for i, block in enumerate(found):
        if block.doomed or block.tier is not tier:
            del found[i:]
            break
    return found


# Bound on the work one reaper pass does, so a burst of expiries cannot stall the loop.
MAX_EXPIRED_PER_PASS = 4096


@dataclass(frozen=True, slots=True)
class StoreChain:
    """Consecutive committed blocks that continue one another (one BlockStored event)."""

    blocks: int
    parent_block_hash: int | None = None
    token_ids: Sequence[int] | None = None  # block_size_tokens per block, or None


@dataclass(slots=True)
class StorePlan:
    lease_id: int
    statuses: bytearray
    offsets: list[int]
    ttl_s: float = 0.0  # the lease's lifetime as granted (0: no lease)


@dataclass(slots=True)
class LoadPlan:
    lease_id: int
    blocks: list[Block]
    tier: Tier = Tier.DRAM
    ttl_s: float = 0.0  # the lease's lifetime as granted (0: no lease)

    @property
    def offsets(self) -> list[int]:
        """Byte offsets into the tier the load asked for (the region or the GPU pool)."""
        if self.tier is Tier.GPU:
            return [b.gpu_offset for b in self.blocks]
        return [b.offset for b in self.blocks]


@dataclass(slots=True)
class LookupResult:
    prefix_blocks: int
    by_tier: dict[Tier, int]


@dataclass(slots=True)
class TierStats:
    tier: Tier
    capacity_bytes: int
    used_bytes: int
    blocks: int
    pinned_blocks: int
    huge_page_bytes: int = 0
    """Bytes of the tier's memory in pages of 2 MiB or more (DRAM: Region.huge_page_bytes)."""
    collapsing: bool = False
    """Still being collapsed into 2 MiB pages (DRAM: Region.collapsing)."""


@dataclass(slots=True)
class Stats:
    node_id: str
    uptime_s: float
    tiers: list[TierStats]
    namespaces: int
    active_leases: int
    counters: Counters = field(default_factory=Counters)
    # Bytes and caps by tenant: configured names, the others summed (kvstore.quotas).
    tenants: list[TenantStats] = field(default_factory=list)
    replica_blocks: int = 0  # DRAM copies resident as low-priority replicas now


class BlockManager:
    def __init__(
        self,
        config: Config,
        region: Region,
        sink: EventSink | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._clock = clock  # namespace idle times (see _reclaim_namespace)
        # Last call naming each namespace: an empty one idle long enough may be dropped.
        self._ns_used_s: dict[str, float] = {}
        self.node_id = config.node_id
        self.region = region
        self.sink: EventSink = sink or NullSink()
        # Tenant regions (dram.tenant_regions): a capped tenant's slots come from its
        # own range of the region, its own file; the other tenants share range 0.
        self.tenant_parts: dict[str, int] = {}
        self.allocator: SlabAllocator = SlabAllocator(
            config.dram.capacity_bytes, config.dram.chunk_bytes
        )
        if own := tenant_regions(config):
            try:
                self.tenant_parts = {
                    r.tenant: region.ranges.index(region.range_of(r.name)) for r in own
                }
            except KeyError as exc:
                raise ConfigError(f"dram.tenant_regions: the region has no range {exc}") from None
            self.allocator = PartitionedAllocator(
                [(g.offset, g.nbytes) for g in region.ranges], config.dram.chunk_bytes
            )
        self.namespaces: dict[str, Namespace] = {}
        self.leases = LeaseTable()
        # Where every block lives and what pins it: the one owner (kvstore.placement).
        self.placement = Placement(
            self.allocator,
            self.sink,
            eviction_policy=config.dram.eviction_policy,
            quota_bytes=config.limits.namespace_quota_bytes,
            node_id=config.node_id,
            copy_aware=config.eviction.copy_aware,
            copy_ttl_s=config.eviction.copy_ttl_s,
            copy_window=config.eviction.copy_window,
            copy_learn=config.eviction.copy_learn,
            quotas=QuotaTable(config.quotas),  # per-tenant caps (docs/tenants.md)
            copy_order=config.eviction.copy_order,
            pulled_admission=config.eviction.pulled_admission,
            replica_promote_loads=config.eviction.replica_promote_loads,
            dram_parts=self.tenant_parts,
            clock=clock,  # ages what pulls taught about peers' copies
        )
        # Blocks are invisible to the cyclic collector (kvstore.namespace.Block), so
        # a namespace and its blocks, which refer to each other, would outlive this
        # manager (tests and benches make many in one process): once it is gone,
        # its index lets go of them. Not at exit: the process frees everything.
        weakref.finalize(self, _let_go, self.namespaces, self.placement.accounts).atexit = False
        self.counters: Counters = self.placement.counters
        # The presence table local clients probe (publish_presence); None: not published.
        self.presence: PresenceTable | None = None
        self._started_s = time.monotonic()
        # The disk tier below DRAM (recovered from its journal), if configured.
        self.disk: DiskLayer | None = None
        if config.disk.path:
            if config.disk.slab_bytes < config.dram.chunk_bytes:
                raise ConfigError(
                    "disk.slab_bytes must be at least dram.chunk_bytes (the largest block)"
                )
            self.disk = DiskLayer(self.placement, region, config.disk)
        # The GPU tier above DRAM, if configured (imports torch only then).
        self.gpu: GpuLayer | None = None
        if config.gpu.device:
            from kvstore.movers.gpu import GpuLayer

            self.gpu = GpuLayer(
                self.placement,
                region,
                config.gpu,
                dram_chunk_bytes=config.dram.chunk_bytes,
                warm_restart=config.dram.warm_restart,
            )
        if config.dram.warm_restart:
            self._restore_warm()
            region.close_hooks.append(self._save_warm)

    # ----------------------------------------------------------- namespaces

    def declare_namespace(self, spec: NamespaceSpec) -> Namespace:
        spec.validate(max_block_bytes=self.config.dram.chunk_bytes)
        ns_id = spec.namespace_id()
        ns = self.namespaces.get(ns_id)
        if ns is not None:
            self._ns_used_s[ns_id] = self._clock()
            return ns
        if len(self.namespaces) >= self.config.limits.max_namespaces and not (
            self._reclaim_namespace()
        ):
            raise CapacityExhausted(
                f"namespace limit reached ({self.config.limits.max_namespaces}) and no "
                f"namespace is empty and idle for limits.namespace_idle_s="
                f"{self.config.limits.namespace_idle_s:g}; raise limits.max_namespaces"
            )
        ns = Namespace(spec, ns_id, spec.block_bytes, slot_bytes_for(spec.block_bytes))
        self.namespaces[ns_id] = ns
        self._ns_used_s[ns_id] = self._clock()
        self.placement.account(ns)  # its tenant's caps and usage (docs/tenants.md)
        if self.disk is not None:
            self.disk.attach(ns)  # its recovered disk blocks, announced
        return ns

    def tenant_range(self, ns_id: str) -> tuple[str, int, int]:
        """(name, offset, bytes) of the region range the namespace's blocks live in:
        its tenant's own with dram.tenant_regions, else ("", 0, 0) (the shared one)."""
        ns = self.namespace(ns_id)
        part = self.tenant_parts.get(ns.tenant, 0)
        if not part:
            return "", 0, 0
        rng = self.region.ranges[part]
        return rng.name, rng.offset, rng.nbytes

    def namespace(self, ns_id: str) -> Namespace:
        ns = self.namespaces.get(ns_id)
        if ns is None:
            raise NamespaceNotFound(f"unknown namespace {clip(ns_id)}: declare it first")
        self._ns_used_s[ns_id] = self._clock()
        return ns

    @staticmethod
    def _is_empty(ns: Namespace) -> bool:
        """No block in any tier and nothing reserved: no lease or pin can name it."""
        return not ns.blocks and not ns.pending and not ns.reserved

    def _drop_namespace(self, ns: Namespace) -> None:
        assert self._is_empty(ns), "dropping a namespace that holds blocks"
        del self.namespaces[ns.namespace_id]
        self._ns_used_s.pop(ns.namespace_id, None)
        self.placement.forget_namespace(ns)

    def _reclaim_namespace(self) -> bool:
        """Drop the least recently used empty namespace idle for namespace_idle_s; False if none.

        Bounded: one pass over at most max_namespaces entries, only when the
        table is full. Its clients re-declare it (same spec, same id) on their
        next call; kvstore.client.Client does so by itself.
        """
        idle_s = self.config.limits.namespace_idle_s
        now_s = self._clock()
        best: Namespace | None = None
        best_used_s = now_s
        for ns in self.namespaces.values():
            used_s = self._ns_used_s.get(ns.namespace_id, float("-inf"))
            if now_s - used_s >= idle_s and used_s <= best_used_s and self._is_empty(ns):
                best, best_used_s = ns, used_s
        if best is None:
            return False
        log.info(
            "dropped an empty, idle namespace to make room",
            extra={"fields": {"namespace_id": best.namespace_id, "idle_s": now_s - best_used_s}},
        )
        self._drop_namespace(best)
        return True

    def _check_lease_room(self, client: str | None) -> None:
        limits = self.config.limits
        if client is not None and self.leases.held_by(client) >= limits.max_leases_per_client:
            raise CapacityExhausted(
                f"this client holds {self.leases.held_by(client)} live leases "
                f"(limits.max_leases_per_client={limits.max_leases_per_client}): release or "
                "commit some first"
            )
        if len(self.leases) >= limits.max_leases:
            raise CapacityExhausted(
                f"the daemon holds {len(self.leases)} live leases (limits.max_leases="
                f"{limits.max_leases}): retry when some are released or expire"
            )

    def _check_count(self, n: int) -> None:
        limit = self.config.limits.max_blocks_per_request
        if n > limit:
            raise InvalidRequest(
                f"{n} blocks in one request exceeds limits.max_blocks_per_request={limit}"
            )

    def _ttl(self, ttl_s: float) -> float:
        if ttl_s < 0 or ttl_s != ttl_s:
            raise InvalidRequest(f"lease_ttl_s must be >= 0, got {ttl_s}")
        if ttl_s == 0:
            return self.config.leases.default_ttl_s
        return min(ttl_s, self.config.leases.max_ttl_s)

    # ---------------------------------------------------------------- store

    def _gpu_for(self, tier: Tier) -> GpuLayer | None:
        """The GPU layer when a call asks for the GPU tier; None for DRAM."""
        if tier is Tier.GPU:
            if self.gpu is None:
                raise StateConflict("no GPU tier on this node (gpu.device is not set)")
            return self.gpu
        if tier is not Tier.DRAM:
            raise InvalidRequest(f"clients store to and load from GPU or DRAM, not {tier.name}")
        return None

    def prepare_store(
        self,
        ns_id: str,
        hashes: Sequence[int],
        ttl_s: float = 0.0,
        tier: Tier = Tier.DRAM,
        owner: str = "",
        *,
        client: str | None = None,
    ) -> StorePlan:
        """Reserve slots in `tier` (DRAM, or GPU when this node has a GPU tier).

        ``owner``: who may commit or release the lease (the caller's identity, see
        kvstore.leases); "" for in-process callers. ``client``: the client the lease
        counts against (limits.max_leases_per_client).
        """
        ns = self.namespace(ns_id)
        self._check_count(len(hashes))
        gpu = self._gpu_for(tier)
        self._check_lease_room(client)
        ttl_s = self._ttl(ttl_s)
        expires_at_s = time.monotonic() + ttl_s
        statuses, offsets, reserved = self._reserve_slots(ns, hashes, tier, gpu, ahead=False)
        if not reserved:
            return StorePlan(0, statuses, offsets)
        lease = self.leases.add(LeaseKind.STORE, ns, reserved, expires_at_s, owner, client)
        return StorePlan(lease.lease_id, statuses, offsets, ttl_s)

    def reserve_store(
        self,
        ns_id: str,
        blocks: int,
        ttl_s: float = 0.0,
        tier: Tier = Tier.DRAM,
        owner: str = "",
        *,
        client: str | None = None,
    ) -> StorePlan:
        """A store lease of ``blocks`` slots reserved ahead, before the client knows
        which blocks go there: its commit names the real hashes and the lease
        positions they were written at (``commit_store(..., positions=)``).

        Same admission, eviction, quotas and lease limits as prepare_store (the
        same code); the slots are held under placeholder hashes (random 64-bit,
        drawn again if taken) that no lookup, load, delete, event or block count
        ever shows. Fewer slots than asked when the tier runs out (statuses say
        which: a tail of STORE_NO_ROOM); none at all: CapacityExhausted.
        """
        ns = self.namespace(ns_id)
        if blocks <= 0:
            raise InvalidRequest(f"a reserve needs >= 1 block; got {blocks}")
        self._check_count(blocks)
        gpu = self._gpu_for(tier)
        self._check_lease_room(client)
        ttl_s = self._ttl(ttl_s)
        expires_at_s = time.monotonic() + ttl_s
        placeholders: dict[int, None] = {}
        while len(placeholders) < blocks:  # (a draw that is taken: drawn again)
            need = blocks - len(placeholders)
            for h in np.frombuffer(secrets.token_bytes(8 * need), dtype="<u8").tolist():
                if h not in ns.blocks and h not in ns.pending and h not in ns.reserved:
                    placeholders[h] = None
        statuses, offsets, reserved = self._reserve_slots(
            ns, list(placeholders), tier, gpu, ahead=True
        )
        lease = self.leases.add(
            LeaseKind.STORE, ns, reserved, expires_at_s, owner, client, reserve=True
        )
        lease.slots = list(reserved)
        return StorePlan(lease.lease_id, statuses, offsets, ttl_s)

    def _reserve_slots(
        self,
        ns: Namespace,
        hashes: Sequence[int],
        tier: Tier,
        gpu: GpuLayer | None,
        *,
        ahead: bool,
    ) -> tuple[bytearray, list[int], list[Block]]:
        """Slots in ``tier`` for the blocks of ``hashes`` not present or in flight:
        (statuses, offsets, the new pending blocks); CapacityExhausted when none
        could be had and some were wanted. ``ahead``: placeholders (reserve_store)."""
        n = len(hashes)
        statuses = bytearray(n)
        offsets = [0] * n
        reserved: list[Block] = []
        seen: set[int] = set()
        # Blocks this request found present are pinned while it allocates, so
        # making room for the tail never evicts the head it just reported.
        held: list[Block] = []
        placement = self.placement
        # DRAM slots for the new blocks from free room in one go (the slots one
        # reserve_dram per block would give, in order); then, when that runs
        # short, from the victims reserve_dram would evict for them, evicted in
        # one pass (Placement.evict_for) once every block found present is pinned
        # (so none of them is evicted for a new one before it in the request);
        # past them, per block, evicting.
        made: list[Block] = []
        free_offsets: list[int] = []
        pinned_early = False
        # Blocks evicted for room leave the presence table together (one call).
        with placement.presence_batch():
            try:
                if gpu is None:
                    blocks, pending = ns.blocks, ns.pending
                    fresh = dict.fromkeys(h for h in hashes if h not in blocks and h not in pending)
                    made = [Block(ns, h) for h in fresh]
                    free_offsets = placement.reserve_dram_free(ns, made)
                    if len(free_offsets) == n:
                        # All new, all distinct, all in free room: the walk below
                        # would give each its slot in order and nothing else
                        # (~30 of a 64-block prepare's ~60 us, in one pass here).
                        placement.occupy_new(made, free_offsets, ahead=ahead)
                        return statuses, free_offsets, made
                    short = len(made) - len(free_offsets)
                    if short > 0:
                        pinned_early = True
                        for h in hashes:
                            present = blocks.get(h)
                            if present is not None:
                                placement.touch(present, load=False)
                                placement.pin(present)
                                held.append(present)
                        if placement.evict_for(ns, short):
                            free_offsets += placement.reserve_dram_free(
                                ns, made[len(free_offsets) :]
                            )
                            if len(free_offsets) == n:  # all new: as above, once evicted
                                placement.occupy_new(made, free_offsets, ahead=ahead)
                                return statuses, free_offsets, made
                for i, h in enumerate(hashes):
                    present = ns.blocks.get(h)
                    if present is not None:
                        statuses[i] = STORE_PRESENT
                        if not pinned_early:
                            placement.touch(present, load=False)
                            placement.pin(present)
                            held.append(present)
                        continue
                    if h in ns.pending or h in seen:
                        statuses[i] = STORE_IN_FLIGHT
                        continue
                    k = len(reserved)
                    offset: int | None
                    if k < len(free_offsets):
                        block, offset = made[k], free_offsets[k]
                        assert block.block_hash == h, "new blocks out of step with their slots"
                    else:
                        block = Block(ns, h)
                        offset = (
                            placement.reserve_dram(block) if gpu is None else gpu.reserve(block)
                        )
                    if offset is None:
                        statuses[i:] = bytes([STORE_NO_ROOM]) * (n - i)
                        break
                    placement.occupy(block, tier, offset, ahead=ahead)
                    reserved.append(block)
                    seen.add(h)
                    offsets[i] = offset
            finally:
                for block in held:
                    placement.unpin(block)
        if not reserved and STORE_NO_ROOM in statuses:
            if gpu is None and self.disk is not None and self.disk.keeps_dirty():
                raise CapacityExhausted(
                    f"no room for {n} blocks of {ns.block_bytes} bytes: " + self.disk.full_message()
                )
            capacity = self.allocator.capacity_bytes if gpu is None else gpu.capacity_bytes
            account = placement.account(ns)
            if account.over(tier, ns.slot_bytes):
                # The same answer as a full tier: the tenant's own share is full.
                raise CapacityExhausted(
                    f"no room for {n} blocks of {ns.block_bytes} bytes: tenant "
                    f"{account.label!r} is at its {tier.name} quota "
                    f"({account.quota_bytes[tier]} bytes) and its blocks there are "
                    "pinned or in flight"
                )
            raise CapacityExhausted(
                f"no room for {n} blocks of {ns.block_bytes} bytes: the {tier.name} tier "
                f"({capacity} bytes) is full of pinned or in-flight blocks"
                + (
                    " or the namespace quota is reached"
                    if self.config.limits.namespace_quota_bytes
                    else ""
                )
            )
        return statuses, offsets, reserved

    def commit_store(
        self,
        lease_id: int,
        hashes: Sequence[int] | None = None,
        *,
        parent_block_hash: int | None = None,
        token_ids: Sequence[int] | None = None,
        chains: Sequence[StoreChain] | None = None,
        positions: Sequence[int] | None = None,
        owner: str = "",
        keep_rest: bool = False,
    ) -> int:
        """Make a store lease's blocks loadable; what is not committed is freed.

        ``chains``: runs splitting the committed blocks (``hashes``' order, or
        the lease's when ``hashes`` is empty) into sequences, one BlockStored
        event each, in order, each with its own parent and tokens (then
        ``parent_block_hash``/``token_ids`` must be None): a step's saves from
        several requests committed in one call still reach consumers that
        re-hash tokens from the parent (llm-d) as chains.

        ``positions`` (a reserve_store lease, and only then): the lease index
        each of ``hashes`` was written at (see _commit_reserve). ``keep_rest``
        (a reserve only): the slots not named stay reserved under the same
        lease, positions unchanged, for later commits, instead of being freed.
        """
        lease = self._lease(lease_id, LeaseKind.STORE, owner)
        if lease.reserve or positions is not None:
            return self._commit_reserve(
                lease,
                hashes or [],
                positions,
                parent_block_hash,
                token_ids,
                chains,
                owner,
                keep_rest=keep_rest,
            )
        if keep_rest:
            raise InvalidRequest(
                f"lease {lease_id} is not a reserve (prepare_store): only a reserve's "
                "commit can keep the rest of its slots"
            )
        ns = lease.namespace
        if hashes:
            missing = [h for h in hashes if h not in lease.by_hash]
            if missing:
                raise StateConflict(
                    f"{len(missing)} block(s) were not prepared in lease {lease_id} "
                    f"(first: {missing[0]:#x}): prepare_store before commit_store"
                )
            chosen = set(hashes)
            to_commit = [b for b in lease.blocks if b.block_hash in chosen]
        else:
            to_commit = lease.blocks
        if token_ids is not None and len(token_ids) not in (
            0,
            len(to_commit) * ns.block_size_tokens,
        ):
            raise InvalidRequest(
                f"token_ids has {len(token_ids)} ids; expected {len(to_commit)} blocks x "
                f"{ns.block_size_tokens} tokens"
            )
        order: Sequence[int] = hashes if hashes else [b.block_hash for b in lease.blocks]
        if chains is not None:
            # checked before anything changes: a bad request loses nothing
            if parent_block_hash is not None or token_ids:
                raise InvalidRequest(
                    "a commit with chains carries parents and token ids per chain, not overall"
                )
            _check_chains(chains, order, len(to_commit), ns.block_size_tokens)
        self.leases.pop(lease_id, owner)
        # A lease's blocks are all in one tier: the one prepare_store was asked for.
        tier = lease.blocks[0].tier if lease.blocks else Tier.DRAM
        batches: list[StoredBatch] = []
        if to_commit and chains:
            start = 0
            for chain in chains:
                end = start + chain.blocks
                batches.append((order[start:end], chain.parent_block_hash, chain.token_ids))
                start = end
        elif to_commit:
            batches.append(
                ([b.block_hash for b in to_commit], parent_block_hash, token_ids or None)
            )
        # DRAM blocks join the demoter's queue there (it wakes).
        self.placement.commit(lease.blocks, to_commit, tier, batches)
        if self.gpu is not None and to_commit and tier is Tier.GPU:
            self.gpu.wake()  # keep room in the pool for the next store
        return len(to_commit)

    def _commit_reserve(
        self,
        lease: Lease,
        hashes: Sequence[int],
        positions: Sequence[int] | None,
        parent_block_hash: int | None,
        token_ids: Sequence[int] | None,
        chains: Sequence[StoreChain] | None,
        owner: str,
        *,
        keep_rest: bool = False,
    ) -> int:
        """Commit a reserve: ``hashes[i]`` was written at lease index ``positions[i]``.

        A hash already committed or in flight in the namespace is not committed
        (its slot is freed, no event: the "already there" of prepare_store);
        positions not named are freed, or, with ``keep_rest``, stay reserved
        under this lease at the same positions (a position is committed once:
        naming it again is refused). Every check runs before anything changes,
        so a refused commit loses nothing: the lease still stands.
        """
        lease_id = lease.lease_id
        if not lease.reserve:
            raise StateConflict(
                f"lease {lease_id} is not a reserve (prepare_store): commit it by its "
                "hashes, without positions"
            )
        if positions is None:
            raise StateConflict(
                f"lease {lease_id} is a reserve: its commit names the lease positions "
                "its blocks were written at"
            )
        if len(positions) != len(hashes):
            raise InvalidRequest(
                f"a reserve's commit has {len(positions)} positions for {len(hashes)} hashes"
            )
        slots = lease.slots
        size = len(slots)
        if len(set(positions)) != len(positions):
            raise InvalidRequest("a reserve's commit names a position twice")
        bad = [p for p in positions if not 0 <= p < size]
        if bad:
            raise InvalidRequest(f"position {bad[0]} is outside reserve {lease_id} of {size} slots")
        used = [p for p in positions if slots[p] is None]
        if used:
            raise InvalidRequest(
                f"position {used[0]} of reserve {lease_id} was committed already "
                "(an earlier commit kept the rest: name each position once)"
            )
        if len(set(hashes)) != len(hashes):
            raise InvalidRequest("a reserve's commit names a block hash twice")
        ns = lease.namespace
        block_size = ns.block_size_tokens
        if token_ids is not None and len(token_ids) not in (0, len(hashes) * block_size):
            raise InvalidRequest(
                f"token_ids has {len(token_ids)} ids; expected {len(hashes)} blocks x "
                f"{block_size} tokens"
            )
        if chains is not None:
            if parent_block_hash is not None or token_ids:
                raise InvalidRequest(
                    "a commit with chains carries parents and token ids per chain, not overall"
                )
            _check_chains(chains, hashes, len(hashes), block_size)
        else:
            chains = [StoreChain(len(hashes), parent_block_hash, token_ids or None)]
        named: list[Block] = []
        real: list[int | None] = []
        for h, p in zip(hashes, positions, strict=True):
            block = slots[p]
            assert block is not None
            there = ns.blocks.get(h)
            if there is not None:
                self.placement.touch(there, load=False)  # as prepare_store's PRESENT does
            named.append(block)
            real.append(h if there is None and h not in ns.pending else None)
        open_left = len(lease.blocks) - len(named)
        if keep_rest and open_left:
            # The lease stays, holding the slots not named, at their positions.
            chosen = set(map(id, named))
            lease.blocks = [b for b in lease.blocks if id(b) not in chosen]
            for p in positions:
                slots[p] = None
            for block in named:
                del lease.by_hash[block.block_hash]
            to_bind, to_real = named, real
        else:
            self.leases.pop(lease_id, owner)
            # every open slot: the named ones bound, the rest given back
            by_block = {id(b): h for b, h in zip(named, real, strict=True)}
            to_bind = lease.blocks
            to_real = [by_block.get(id(b)) for b in to_bind]
        tier = named[0].tier if named else (lease.blocks[0].tier if lease.blocks else Tier.DRAM)
        placement = self.placement
        placement.bind(to_bind, to_real)
        keep = [h is not None for h in real]
        to_commit = [b for b, k in zip(named, keep, strict=True) if k]
        placement.commit(
            to_commit, to_commit, tier, _kept_batches(hashes, keep, chains, block_size)
        )
        if self.gpu is not None and to_commit and tier is Tier.GPU:
            self.gpu.wake()
        return len(to_commit)

    # ----------------------------------------------------------------- load

    def lookup(self, ns_id: str, hashes: Sequence[int]) -> LookupResult:
        ns = self.namespace(ns_id)
        self._check_count(len(hashes))
        # The hot path of a 195k-token request (12k hashes). map/index/Counter
        # run in C: ~2x faster than a Python loop. Probing past the first miss
        # costs a little for short hits and nothing for the long ones that matter.
        found = list(map(ns.blocks.get, hashes))
        try:
            n = found.index(None)
            del found[n:]
        except ValueError:
            n = len(found)
        # Block.tier is derived from the offsets: count those (in C). A block in
        # the index is in GPU or DRAM (never both), else on disk only.
        gpu = n - list(map(_GPU_OFFSET, found)).count(-1) if self.gpu is not None else 0
        dram = n - list(map(_OFFSET, found)).count(-1)
        by_tier = {
            t: c for t, c in ((Tier.GPU, gpu), (Tier.DRAM, dram), (Tier.DISK, n - gpu - dram)) if c
        }
        self.counters.lookup_hit_blocks += n
        self.counters.lookup_miss_blocks += len(hashes) - n
        return LookupResult(n, by_tier)

    def prepare_load(
        self,
        ns_id: str,
        hashes: Sequence[int],
        ttl_s: float = 0.0,
        tier: Tier = Tier.DRAM,
        owner: str = "",
        *,
        client: str | None = None,
    ) -> LoadPlan:
        """Pin the longest prefix present in `tier` (see prepare_load_async for moves)."""
        ns = self.namespace(ns_id)
        self._check_count(len(hashes))
        self._gpu_for(tier)
        self._check_lease_room(client)
        ttl_s = self._ttl(ttl_s)
        expires_at_s = time.monotonic() + ttl_s
        found = _loadable_prefix(ns, hashes, tier)
        if not found:
            return LoadPlan(0, [], tier)
        self.placement.pin_many(found)
        self.placement.touch_loaded(ns, found)
        self.counters.loaded_blocks += len(found)
        lease = self.leases.add(LeaseKind.LOAD, ns, found, expires_at_s, owner, client)
        return LoadPlan(lease.lease_id, found, tier, ttl_s)

    def loaded_direct(self, ns_id: str, hashes: Sequence[int]) -> int:
        """Blocks a local client read straight from their DRAM slots, found in the
        presence table with no lease: each one still held in DRAM is a hit for its
        eviction order and counted as loaded (as prepare_load does). Returns how
        many; the rest left DRAM meanwhile (the client's check after its copy
        said so)."""
        ns = self.namespace(ns_id)
        self._check_count(len(hashes))
        held = [
            block
            for block in map(ns.blocks.get, hashes)
            if block is not None and not block.doomed and block.offset >= 0
        ]
        self.placement.touch_loaded(ns, held)
        n = len(held)
        self.counters.loaded_blocks += n
        self.counters.direct_loaded_blocks += n
        return n

    async def prepare_load_async(
        self,
        ns_id: str,
        hashes: Sequence[int],
        ttl_s: float = 0.0,
        tier: Tier = Tier.DRAM,
        owner: str = "",
        *,
        client: str | None = None,
    ) -> LoadPlan:
        """prepare_load after moving the prefix into `tier`: disk blocks are promoted
        into DRAM, then DRAM blocks up into the GPU pool (or GPU blocks down to DRAM)."""
        if self.disk is not None or self.gpu is not None:
            ns = self.namespace(ns_id)
            self._check_count(len(hashes))
            self._gpu_for(tier)
            self._check_lease_room(client)  # before any move: a refused load does no work
            if self.disk is not None:
                await self.disk.promote(ns, list(hashes))
            if self.gpu is not None:
                await self.gpu.move(ns, list(hashes), tier)
        return self.prepare_load(ns_id, hashes, ttl_s, tier, owner, client=client)

    def release(self, lease_ids: Sequence[int], owner: str = "") -> int:
        """End leases: unpin loads, abort stores. Unknown ids raise after the rest are released."""
        released = 0
        unknown = []
        for lease_id in lease_ids:
            lease = self.leases.pop(lease_id, owner)
            if lease is None:
                unknown.append(lease_id)
                continue
            self._end_lease(lease)
            released += 1
        if unknown:
            if any(self.leases.expired(lease_id, owner) for lease_id in unknown):
                raise LeaseExpired(
                    "lease expired before its release: its copies may not have been valid"
                )
            raise LeaseNotFound(
                f"lease(s) {', '.join(map(str, unknown[:8]))} expired, were released, or were never issued"
            )
        return released

    def expire_leases(self, now_s: float | None = None) -> int:
        """Quarantine leases past their time; end the quarantines that are over."""
        now_s = time.monotonic() if now_s is None else now_s
        expired = self.leases.pop_expired(now_s, MAX_EXPIRED_PER_PASS)
        until_s = now_s + self.config.leases.quarantine_s
        for lease in expired:
            if lease.kind is LeaseKind.STORE:
                # The hashes may be stored again by anyone at once; the slots stay
                # reserved: the late writer may still be copying into them.
                ns = lease.namespace
                for block in lease.blocks:
                    if ns.pending.get(block.block_hash) is block:
                        del ns.pending[block.block_hash]
            self.leases.quarantine(lease, until_s)
        for lease in self.leases.pop_released(now_s, MAX_EXPIRED_PER_PASS):
            self._end_lease(lease)
        self.counters.expired_leases += len(expired)
        return len(expired)

    def _end_lease(self, lease: Lease) -> None:
        if lease.kind is LeaseKind.LOAD:
            for block in lease.blocks:
                self.placement.unpin(block)
        elif lease.reserve:
            self.placement.bind(lease.blocks, [None] * len(lease.blocks))  # all given back
        else:
            ns = lease.namespace
            for block in lease.blocks:
                if ns.pending.get(block.block_hash) is block:
                    del ns.pending[block.block_hash]
                self.placement.abort(block)

    def _lease(self, lease_id: int, kind: LeaseKind, owner: str = "") -> Lease:
        lease = self.leases.get(lease_id, owner)
        if lease is None:
            if self.leases.expired(lease_id, owner):
                raise LeaseExpired(
                    f"lease expired: {lease_id} ran out before this call; nothing it "
                    "reserved is valid (store again / load again)"
                )
            raise LeaseNotFound(f"lease {lease_id} expired, was released, or was never issued")
        if lease.kind is not kind:
            raise StateConflict(
                f"lease {lease_id} is a {lease.kind.value} lease, not a {kind.value} lease"
            )
        return lease

    # --------------------------------------------------------------- delete

    def delete(self, ns_id: str, hashes: Sequence[int]) -> tuple[int, int]:
        ns = self.namespace(ns_id)
        self._check_count(len(hashes))
        blocks = [b for h in hashes if (b := ns.blocks.get(h)) is not None]
        return self.placement.delete(ns, blocks)

    def clear(self, ns_id: str) -> int:
        """Remove every unpinned block of one namespace (pinned ones go at release).

        Reported as exact BlockRemoved events, not AllBlocksCleared: indexers
        key by model, so a clear would also forget the node's other tenants
        and ranks of that model. A namespace the clear leaves empty is dropped
        (its slot under limits.max_namespaces is free again); its clients
        re-declare it on their next call.
        """
        ns = self.namespace(ns_id)
        count, _ = self.placement.delete(ns, list(ns.blocks.values()))
        if self._is_empty(ns):
            self._drop_namespace(ns)
        return count

    # ------------------------------------------------------ placement hooks

    def pin(self, block: Block) -> None:
        """Pin a block's bytes where they are (see the module notes)."""
        self.placement.pin(block)

    def unpin(self, block: Block) -> None:
        self.placement.unpin(block)

    def hold(self, block: Block) -> None:
        """Keep a block in the store while a tier move works; it may still move."""
        self.placement.hold(block)

    def unhold(self, block: Block) -> None:
        self.placement.unhold(block)

    @staticmethod
    def movable(block: Block) -> bool:
        """True when a tier move may take the block from its slot: it is still in the
        store and nothing reads or writes its bytes where they are (only holds)."""
        return Placement.movable(block)

    def doom(self, block: Block) -> None:
        """The block must leave the store (its only copy failed verification, say);
        its slots go when its last pin does. For a tier that found it broken."""
        self.placement.drop(block)

    def set_checksums(self, blocks: Sequence[Block], checksums: Sequence[int]) -> None:
        """Record verified xxh3-64 checksums of committed blocks (peer paths: the
        next peer need not rehash)."""
        self.placement.set_checksums(blocks, checksums)

    def commit_pulled(
        self,
        lease_id: int,
        hashes: Sequence[int],
        checksums: Sequence[int],
        source_node_id: str,
    ) -> int:
        """commit_store of a peer pull's verified blocks (``hashes``, in the store
        lease's order), their verified xxh3-64 ``checksums`` recorded as they
        enter the index (the next peer need not rehash; the presence table gets
        them in the commit's own write) and the copies noted as held by
        ``source_node_id`` too (note_held_elsewhere). What a commit, a lookup of
        each block, set_checksums and note_held_elsewhere did in four passes
        (16,384 blocks, in process: 19.5 ms before, 11.3 ms in one)."""
        lease = self._lease(lease_id, LeaseKind.STORE)
        blocks = [b for h in hashes if (b := lease.by_hash.get(h)) is not None]
        if len(blocks) < len(hashes):
            return self.commit_store(lease_id, hashes)  # its StateConflict names them
        for block, checksum in zip(blocks, checksums, strict=True):
            block.checksum = checksum
        # All of the lease in its order: commit_store's fast path (no hashes to check).
        whole = len(blocks) == len(lease.blocks) and all(map(is_, blocks, lease.blocks))
        committed = self.commit_store(lease_id, None if whole else hashes)
        self.placement.note_held_elsewhere(blocks, source_node_id)
        return committed

    def note_held_elsewhere(
        self, blocks: Sequence[Block], holder_node_id: str, *, served: bool = False
    ) -> int:
        """Peer ``holder_node_id`` holds these committed blocks too (they were just
        pulled from it, or it is pulling them from here: ``served``): for copy-aware
        eviction and the admission of pulled copies as replicas (kvstore.placement)."""
        return self.placement.note_held_elsewhere(blocks, holder_node_id, served=served)

    # ---------------------------------------------------------------- stats

    def stats(self) -> Stats:
        placement = self.placement
        blocks = placement.dram.committed_blocks()  # committed, in DRAM
        pending = [b for ns in self.namespaces.values() for b in ns.pending.values()]
        gpu_pending = sum(1 for b in pending if b.gpu_offset >= 0)
        gpu_pinned = 0
        tiers = []
        if self.gpu is not None:
            gpu_pinned = sum(1 for b in self.gpu.owner.values() if b.pins)
            tiers.append(
                TierStats(
                    Tier.GPU,
                    self.gpu.capacity_bytes,
                    self.gpu.used_bytes,
                    self.gpu.committed_blocks() + gpu_pending,
                    gpu_pinned,
                )
            )
        tiers.append(
            TierStats(
                Tier.DRAM,
                self.allocator.capacity_bytes,
                self.allocator.used_bytes,
                blocks + len(pending) - gpu_pending,
                placement.pinned_blocks - gpu_pinned,
                self.region.huge_page_bytes,
                self.region.collapsing,
            )
        )
        if self.disk is not None:
            tiers.append(
                TierStats(
                    Tier.DISK,
                    self.disk.tier.capacity_bytes,
                    self.disk.used_bytes(),
                    self.disk.blocks(),
                    0,
                )
            )
        return Stats(
            node_id=self.node_id,
            uptime_s=time.monotonic() - self._started_s,
            tiers=tiers,
            namespaces=len(self.namespaces),
            # Quarantined leases still hold their slots and pins.
            active_leases=len(self.leases) + self.leases.quarantined,
            counters=dataclasses.replace(self.counters),
            tenants=placement.tenant_stats(),
            replica_blocks=placement.replica_blocks(),
        )

    # --------------------------------------------------------- warm restart

    def _save_warm(self) -> None:
        """On drain: describe the DRAM index beside the region so a restart serves it."""
        warm.save_dram(
            self.placement, self.namespaces.values(), self.region, self.config.dram.chunk_bytes
        )

    def _restore_warm(self) -> None:
        restored = warm.restore_dram(self.placement, self.region, self.config.dram.chunk_bytes)
        for ns in restored:
            self.namespaces[ns.namespace_id] = ns
            self._ns_used_s[ns.namespace_id] = self._clock()
            self.placement.account(ns)
        if restored and self.disk is not None:
            self.disk.wake()  # the restored blocks are dirty: copy them down

    def publish_presence(self, table: PresenceTable) -> None:
        """Keep ``table`` in step with the index from now on, for local clients to
        probe instead of calling Lookup (docs/presence.md); retired at close."""
        self.placement.attach_presence(PresenceRecorder(table), self.namespaces.values())
        self.presence = table

    async def close(self) -> None:
        """Stop background work and close the other tiers (the region is the daemon's)."""
        if self.presence is not None:
            self.placement.presence = None
            self.presence.close()  # retired first: no client probes a stopping daemon
            self.presence = None
        if self.disk is not None:
            await self.disk.close()
        if self.gpu is not None:
            await self.gpu.aclose()


def _let_go(namespaces: dict[str, Namespace], accounts: dict[str, TenantAccount]) -> None:
    """A dropped manager's index lets go of its blocks (see BlockManager.__init__)."""
    for ns in namespaces.values():
        ns.blocks.clear()
        ns.pending.clear()
        ns.reserved.clear()
    drop_tenant_orders(accounts)


def _check_chains(
    chains: Sequence[StoreChain], order: Sequence[int], committed: int, block_size: int
) -> None:
    total = 0
    for chain in chains:
        count = chain.blocks
        if count <= 0:
            raise InvalidRequest(f"every chain of a commit needs >= 1 block; got {count}")
        if chain.token_ids is not None and len(chain.token_ids) != count * block_size:
            raise InvalidRequest(
                f"a chain's token_ids has {len(chain.token_ids)} ids; expected {count} blocks x "
                f"{block_size} tokens"
            )
        total += count
    if total != len(order):
        raise InvalidRequest(f"the commit's chains hold {total} blocks; it commits {len(order)}")
    if committed != len(order):
        raise InvalidRequest(
            f"a commit with chains lists {len(order)} hashes but {committed} distinct "
            "blocks of the lease: each block once"
        )


def _kept_batches(
    hashes: Sequence[int], keep: Sequence[bool], chains: Sequence[StoreChain], block_size: int
) -> list[StoredBatch]:
    """The BlockStored batches of a reserve's commit: each chain's runs of kept
    blocks, a run after a skipped block (already stored) parented on it."""
    batches: list[StoredBatch] = []
    start = 0
    for chain in chains:
        end = start + chain.blocks
        i = start
        while i < end:
            if not keep[i]:
                i += 1
                continue
            j = i
            while j < end and keep[j]:
                j += 1
            parent = chain.parent_block_hash if i == start else hashes[i - 1]
            tokens = chain.token_ids
            if tokens is not None:
                tokens = tokens[(i - start) * block_size : (j - start) * block_size]
            batches.append((hashes[i:j], parent, tokens))
            i = j
        start = end
    return batches
