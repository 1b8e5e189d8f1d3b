"""Namespaces: a model shard's KV layout plus a tenant, which fixes block size;
and the blocks a namespace holds (``Block``: where each one's copies are).

A namespace id is derived from its spec (a fingerprint), so the same engine
configuration gets the same id on every node and after every restart, and two
tenants (vLLM ``cache_salt``) never share an id, hence never share a block.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from kvstore.errors import InvalidRequest
from kvstore.hashing import HASH_ALGOS, HashScheme

if TYPE_CHECKING:
    from collections.abc import Sequence

MAX_NAME_CHARS = 256

# vLLM's KV-event `medium` strings for the tiers (kvstore.events.sink re-exports them).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"


class Tier(enum.IntEnum):
    """Memory tiers of the block store, fastest first (kvstore.tiers re-exports it).

    Values match ``kvstore.v1.Tier`` so the service converts with ``int()``.
    """

    GPU = 1
    DRAM = 2
    DISK = 3

    @property
    def medium(self) -> str:
        """vLLM's KV-event `medium` for this tier."""
        return _MEDIUM[self]


_MEDIUM = {Tier.GPU: MEDIUM_GPU, Tier.DRAM: MEDIUM_CPU, Tier.DISK: MEDIUM_DISK}
# A layout may end in ";hash=<fingerprint>": what the client's block hashes are
# seeded with (for vLLM, the hash algorithm and a one-way digest of the seed of
# NONE_HASH, kvstore_connectors.vllm.hashes). Engines whose fingerprints differ never
# compute one hash alike; the daemon reports such siblings at declare time.
HASH_SEED_MARK = ";hash="


# The hash scheme (vLLM 0.33's lookahead hashing): ";lookahead=<L>" before
# ";hash=" when the engine's block hashes also cover the L tokens after each
# block (EAGLE/MTP drafters, ``num_hash_lookahead_tokens``). Absent = the
# legacy scheme (L = 0), so every layout written before it reads as legacy and
# keeps its namespace id; placed before ";hash=", so a reader that knows only
# ";hash=" (``rpartition``) still reads the fingerprint right.
LOOKAHEAD_MARK = ";lookahead="


def layout_with_hash_seed(layout: str, fingerprint: str, lookahead_tokens: int = 0) -> str:
    """``layout`` + the hash scheme: ``[;lookahead=<L>];hash=<fingerprint>``."""
    if not isinstance(lookahead_tokens, int) or lookahead_tokens < 0:
        raise InvalidRequest(f"lookahead_tokens must be an int >= 0; got {lookahead_tokens!r}")
    if HASH_SEED_MARK in layout or LOOKAHEAD_MARK in layout:
        raise InvalidRequest(f"layout {layout!r} already carries a hash scheme")
    if lookahead_tokens:
        if not fingerprint:
            raise InvalidRequest("a lookahead hash scheme needs the hash-seed fingerprint")
        layout = f"{layout}{LOOKAHEAD_MARK}{lookahead_tokens}"
    return f"{layout}{HASH_SEED_MARK}{fingerprint}" if fingerprint else layout


def layout_hash_seed(layout: str) -> str | None:
    """The hash-seed fingerprint a layout carries, or None."""
    _, mark, fingerprint = layout.rpartition(HASH_SEED_MARK)
    return fingerprint if mark else None


def layout_hash_scheme(layout: str) -> HashScheme | None:
    """The hash scheme a layout records, or None where the client did not say.

    The algorithm is the fingerprint's ``<algo>:`` (kvstore_connectors.vllm.hashes);
    a layout without ``;lookahead=`` is the legacy scheme. A malformed record
    is an ``InvalidRequest`` naming it.
    """
    head, mark, fingerprint = layout.rpartition(HASH_SEED_MARK)
    if not mark:
        return None
    algo = fingerprint.partition(":")[0]
    if algo not in HASH_ALGOS:
        raise InvalidRequest(f"layout {layout!r}: unknown hash algorithm {algo!r}")
    _, la_mark, la = head.rpartition(LOOKAHEAD_MARK)
    lookahead = 0
    if la_mark:
        if not la.isdigit() or int(la) <= 0:
            raise InvalidRequest(f"layout {layout!r}: lookahead must be a positive int")
        lookahead = int(la)
    return HashScheme(algo, lookahead)


class NamespaceSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a client declares; mirrors kvstore.v1.NamespaceSpec."""

    model: str
    dtype: str
    block_size_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_bytes: int
    tp_rank: int = 0
    tp_world_size: int = 1
    pp_rank: int = 0
    pp_world_size: int = 1
    tenant: str = ""
    layout: str = ""

    def validate(self, max_block_bytes: int) -> None:
        problems = []
        if not self.model:
            problems.append("model is empty")
        for name in ("model", "dtype", "tenant", "layout"):
            if len(getattr(self, name)) > MAX_NAME_CHARS:
                problems.append(f"{name} longer than {MAX_NAME_CHARS} characters")
        for name in ("block_size_tokens", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0")
        if self.block_bytes <= 0:
            problems.append("block_bytes must be > 0")
        elif self.block_bytes > max_block_bytes:
            problems.append(
                f"block_bytes {self.block_bytes} exceeds the daemon's max {max_block_bytes}"
            )
        if self.tp_world_size <= 0 or not 0 <= self.tp_rank < self.tp_world_size:
            problems.append("need 0 <= tp_rank < tp_world_size")
        if self.pp_world_size <= 0 or not 0 <= self.pp_rank < self.pp_world_size:
            problems.append("need 0 <= pp_rank < pp_world_size")
        if LOOKAHEAD_MARK in self.layout:
            try:
                layout_hash_scheme(self.layout)
            except InvalidRequest as e:
                problems.append(str(e))
        if problems:
            raise InvalidRequest("bad namespace spec: " + "; ".join(problems))

    def fingerprint(self) -> str:
        encoded = msgspec.json.encode(self)  # field order is fixed: canonical
        return hashlib.sha256(encoded).hexdigest()[:16]

    def namespace_id(self) -> str:
        return f"ns-{self.fingerprint()}"


@dataclass(eq=False, slots=True)
class TenantAccount:
    """One tenant's bytes in each tier and its caps (docs/tenants.md), shared by the
    tenant's namespaces; kept by ``kvstore.placement`` at each transition.

    Lists are indexed by ``Tier`` (1..3; index 0 unused). ``label`` names the
    tenant in Stats and metrics: its configured name, never its cache_salt.
    """

    tenant: str
    label: str
    configured: bool
    quota_bytes: list[int]  # 0 = no cap in that tier
    used_bytes: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    # The tenant's resident blocks in each capped tier, coldest first (insert and
    # touch order): a tenant at its cap finds its own victims here without
    # walking the other tenants' blocks. None for a tier without a cap.
    order: list[dict[Block, None] | None] = field(default_factory=lambda: [None] * 4)
    namespaces: int = 0  # declared namespaces of this tenant the placement has seen
    # The DRAM range its slots come from: 0 = the shared one, i > 0 = the tenant's
    # own region file (dram.tenant_regions; kvstore.tiers.dram.PartitionedAllocator).
    dram_part: int = 0

    def over(self, tier: Tier, extra_bytes: int) -> bool:
        """True when ``extra_bytes`` more in ``tier`` would pass its cap."""
        cap = self.quota_bytes[tier]
        return bool(cap) and self.used_bytes[tier] + extra_bytes > cap


@dataclass(eq=False, slots=True)
class Namespace:
    """A declared namespace and the blocks held under it."""

    spec: NamespaceSpec
    namespace_id: str
    block_bytes: int
    slot_bytes: int
    # committed blocks (loadable) and blocks reserved by a store lease
    blocks: dict[int, Block] = field(default_factory=dict)
    pending: dict[int, Block] = field(default_factory=dict)
    # Slots reserved ahead (BlockManager.reserve_store) under placeholder hashes,
    # bound to real hashes only at commit: seen by no lookup, load, delete or event.
    reserved: dict[int, Block] = field(default_factory=dict)
    used_bytes: int = 0
    # Its tenant's usage and caps (set by kvstore.placement on first use).
    account: TenantAccount | None = None
    # The key of its DRAM eviction order: its slot size, plus its tenant's range
    # times kvstore.tiers.dram.PART_KEY_STRIDE with tenant regions (set with
    # ``account``), so a range's victims are never searched among another's.
    dram_key: int = 0

    def __post_init__(self) -> None:
        if not self.dram_key:
            self.dram_key = self.slot_bytes

    # EventSink's NamespaceRef view
    @property
    def model(self) -> str:
        return self.spec.model

    @property
    def tenant(self) -> str:
        return self.spec.tenant

    @property
    def block_size_tokens(self) -> int:
        return self.spec.block_size_tokens

    def present_prefix(self, hashes: Sequence[int]) -> list[Block]:
        """The committed blocks of the longest present prefix of hashes (in any tier),
        stopping at the first missing or doomed one: what the tier moves work on."""
        prefix = []
        for h in hashes:
            block = self.blocks.get(h)
            if block is None or block.doomed:
                break
            prefix.append(block)
        return prefix


class BlockState(enum.Enum):
    PENDING = 0
    COMMITTED = 1


class Block(msgspec.Struct, eq=False, gc=False):
    """One block's location and state. Identity-hashed: the policy key.

    Only ``kvstore.placement.Placement`` changes where a block lives (the
    offsets) or whether it is pinned; everyone else reads. ``tier`` is derived
    from the offsets.

    Not tracked by the cyclic garbage collector (``gc=False``): a daemon holds
    a Block per cached block, millions of them, and every full collection
    walked them all (1M blocks: a ~210 ms pause of the whole daemon, measured
    in docs/status.md); untracked, a full collection costs what the rest of the
    heap does, and a Block is made ~5x faster. A Block refers to nothing that
    can refer back to it but its namespace, whose dicts drop it when it goes,
    and a namespace is dropped only empty (``BlockManager._drop_namespace``),
    so no garbage cycle runs through one (a dropped manager's index lets go of
    its blocks: kvstore.manager).
    """

    namespace: Namespace
    block_hash: int
    # Offset of the block's DRAM copy in the region; -1 = none.
    offset: int = -1
    state: BlockState = BlockState.PENDING
    pins: int = 0
    # Holds among the pins: keep-alive only, the block may move between tiers.
    holds: int = 0
    checksum: int = 0  # xxh3-64 once computed (disk/peer paths); 0 = not yet
    # Deleted while pinned: out of the index already, its slots go at last unpin.
    doomed: bool = False
    # Bumped whenever the DRAM copy's slot changes, so work that read the DRAM
    # copy at one place can tell on completion that it is still the same copy.
    dram_generation: int = 0
    # Slot of the block's copy in the disk tier; -1 = none. A block may be in
    # DRAM only (offset >= 0), on disk only (tier DISK, offset -1), or both
    # ("clean": its DRAM copy can be dropped for free).
    disk_slot: int = -1
    # Offset of the block in the GPU pool; -1 = none. A block is in GPU or in
    # DRAM, never both (tier GPU: offset -1); it may have a disk copy too.
    gpu_offset: int = -1
    # Copy-aware eviction (docs/eviction.md): until this time (the placement's
    # clock) a node with a lower id is believed to hold this block too, so this
    # copy is redundant. 0.0 = a sole copy as far as this node knows.
    redundant_until_s: float = 0.0
    # Admission of pulled copies (eviction.pulled_admission = "replica"): >= 0 while
    # this DRAM copy is a low-priority replica (first to go), counting its local
    # loads until it is promoted; -1 = a full citizen of the eviction order.
    replica_loads: int = -1

    @property
    def tier(self) -> Tier:
        """The fastest tier holding the block's bytes (DISK also for a block with
        no copy left: one the store has let go of)."""
        if self.gpu_offset >= 0:
            return Tier.GPU
        return Tier.DRAM if self.offset >= 0 else Tier.DISK
