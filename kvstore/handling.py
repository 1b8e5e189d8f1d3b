"""The store's request handling, shared by both front-ends.

``kvstore.service`` (gRPC) and ``kvstore.local_server`` (the lean local
channel) decode their own wire formats, then call the same methods here: the
same validation (packed-field sizes, the per-request block bound, tiers,
peer-hint rules), the same manager calls with the same lease owner and client
key, the same errors (``kvstore.errors`` classes, raised for the front-end to
send), the same authorization (with principals configured, ``kvstore.identity``:
each call's ``who`` may use only its tenants' namespaces, Clear and Snapshot
need the admin role; a refusal is PERMISSION_DENIED, audited, and touches
nothing). Packed fields stay packed (little-endian uint64/int32 bytes) and are
decoded with numpy in one call each, never element by element.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvstore import audit, errors
from kvstore.identity import Authorizer, Caller
from kvstore.manager import BlockManager, LookupResult, StoreChain, StorePlan
from kvstore.namespace import NamespaceSpec
from kvstore.tiers import Tier

log = logging.getLogger("kvstore.service")

# fill(namespace_id, hashes, peer_hint, timeout_s): pull what the local prefix lacks
PeerFill = Callable[[str, list[int], str, float], Awaitable[None]]

TIER_UNSPECIFIED = 0  # kvstore.v1.Tier's zero value (and the lean channel's)


def unpack_u64(data: bytes, what: str = "block_hashes", max_count: int | None = None) -> list[int]:
    """Packed uint64 -> list; the count is checked first, so an oversize request
    costs no unpacking (8 M hashes would be ~1.6 GB of Python ints)."""
    if len(data) % 8:
        raise errors.InvalidRequest(
            f"{what} must be packed uint64 (a multiple of 8 bytes), got {len(data)} bytes"
        )
    if max_count is not None and len(data) // 8 > max_count:
        raise errors.InvalidRequest(
            f"{len(data) // 8} blocks in one request exceeds "
            f"limits.max_blocks_per_request={max_count}"
        )
    return np.frombuffer(data, dtype="<u8").tolist()


def pack_u64(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<u8").tobytes()


def unpack_i32(data: bytes, what: str) -> list[int]:
    if len(data) % 4:
        raise errors.InvalidRequest(
            f"{what} must be packed int32 (a multiple of 4 bytes), got {len(data)} bytes"
        )
    return np.frombuffer(data, dtype="<i4").tolist()


def unpack_u32(data: bytes, what: str) -> list[int]:
    if len(data) % 4:
        raise errors.InvalidRequest(
            f"{what} must be packed uint32 (a multiple of 4 bytes), got {len(data)} bytes"
        )
    return np.frombuffer(data, dtype="<u4").tolist()


# (a dict: calling the enum runs EnumType.__call__'s Python, ~10 us cold per request)
_TIER_OF_VALUE = {TIER_UNSPECIFIED: Tier.DRAM, **{int(t): t for t in Tier}}


def tier_of(value: int) -> Tier:
    """The tier a store or load asks for: UNSPECIFIED (0) means DRAM."""
    tier = _TIER_OF_VALUE.get(value)
    if tier is None:
        raise errors.InvalidRequest(f"unknown tier {value}")
    return tier


def sibling_layouts(manager: BlockManager, spec: NamespaceSpec) -> list[str]:
    """Layouts of the other namespaces declared on ``manager`` whose spec equals
    ``spec`` but for the layout: engines that should share blocks and cannot (a
    different hash seed or page format). One walk of the namespaces, at declare time."""
    same = msgspec.structs.replace(spec, layout="")
    return sorted(
        {
            ns.spec.layout
            for ns in manager.namespaces.values()
            if ns.spec.layout != spec.layout and msgspec.structs.replace(ns.spec, layout="") == same
        }
    )


@dataclass(frozen=True, slots=True)
class Declared:
    namespace_id: str
    block_bytes: int
    sibling_layouts: list[str]


@dataclass(frozen=True, slots=True)
class PreparedStore:
    lease_id: int
    statuses: bytes  # one StoreStatus per requested block
    offsets: bytes  # packed uint64
    tier: int
    lease_ttl_s: float
    region_id: int


@dataclass(frozen=True, slots=True)
class PreparedLoad:
    lease_id: int
    found_blocks: int
    offsets: bytes  # packed uint64
    checksums: bytes  # packed uint64
    tier: int
    lease_ttl_s: float
    region_id: int


@dataclass(frozen=True, slots=True)
class Chain:
    """One sequence of a multi-request commit (see BlockManager.commit_store)."""

    blocks: int
    parent_block_hash: int | None
    token_ids: bytes  # packed int32; b"" = none


class StoreRequests:
    """What each store call does, given its decoded fields and its caller's identity.

    ``owner``: who may commit or release the leases a call takes ("unix" for
    local clients of either front-end, so a lease taken over one channel can be
    ended over the other; ``owner_of`` adds the principal's name). ``client``:
    whose lease count it is charged to. ``who``: the caller's identity
    (``kvstore.identity.Caller``), checked when ``auth`` is set (principals
    configured); without ``auth`` every caller may do everything, as before.
    """

    def __init__(
        self,
        manager: BlockManager,
        peer_fill: PeerFill | None = None,
        auth: Authorizer | None = None,
    ) -> None:
        self.manager = manager
        self.peer_fill = peer_fill
        self.auth = auth
        self.max_blocks = manager.config.limits.max_blocks_per_request

    # ------------------------------------------------------------ authorization

    def owner_of(self, base: str, who: Caller | None) -> str:
        """The lease owner of a call: its channel's owner, and its principal's name
        (so one tenant cannot end another's lease, over either channel)."""
        if self.auth is None or who is None or who.principal is None:
            return base
        return f"{base}/{who.principal.name}"

    def _deny(self, who: Caller | None, what: str, reason: str, text: str) -> None:
        if who is None:
            audit.denied("unknown", what, reason)
        else:
            audit.denied(who.label, what, reason, who.key)
        raise errors.PermissionDenied(text)

    def _identified(self, who: Caller | None, what: str) -> Any:
        principal = who.principal if who is not None else None
        if principal is None:
            self._deny(
                who,
                what,
                audit.NO_IDENTITY,
                f"{what} needs an identity: this daemon maps callers to tenants "
                "(auth.principals); send a token (x-kvstore-token, KVSTORE_TOKEN), a "
                "mapped client certificate, or connect the lean channel as a mapped uid",
            )
        return principal

    def allow_namespace(self, who: Caller | None, namespace_id: str, what: str) -> None:
        """PERMISSION_DENIED unless ``who`` may use ``namespace_id`` (no-op without auth).
        An unknown id passes: the call then gets NOT_FOUND, as for anyone."""
        if self.auth is None:
            return
        principal = self._identified(who, what)
        ns = self.manager.namespaces.get(namespace_id)
        if ns is None or principal.may_use(namespace_id, ns.spec.tenant, ns.spec.model):
            return
        self._deny(
            who,
            f"{what} {errors.clip(namespace_id)}",
            audit.TENANT_DENIED,
            f"{principal.name} may not use namespace {errors.clip(namespace_id)} "
            f"(tenant {errors.clip(ns.spec.tenant)}, model {errors.clip(ns.spec.model)})",
        )

    def allow_role(self, who: Caller | None, what: str, *roles: str) -> None:
        """PERMISSION_DENIED unless ``who`` has one of ``roles`` or admin (no-op without auth)."""
        if self.auth is None:
            return
        principal = self._identified(who, what)
        if not principal.has_role(*roles):
            self._deny(
                who,
                what,
                audit.ROLE_DENIED,
                f"{what} needs the role {' or '.join(('admin', *roles))}; "
                f"{principal.name} has {', '.join(sorted(principal.roles)) or 'none'}",
            )

    def allow_leases(self, who: Caller | None, what: str) -> None:
        """Commit/Release: an identity is needed; ownership (owner_of) does the rest."""
        if self.auth is not None:
            self._identified(who, what)

    def hashes(self, data: bytes) -> list[int]:
        return unpack_u64(data, "block_hashes", self.max_blocks)

    async def fill_from_hint(
        self, namespace_id: str, hashes: list[int], peer_hint: str, peer_timeout_s: float
    ) -> None:
        if not peer_hint:
            return
        if self.peer_fill is None:
            raise errors.StateConflict("peer_hint needs peer transfer: peer.enabled is off here")
        if peer_timeout_s < 0:
            raise errors.InvalidRequest("peer_timeout_s must be >= 0")
        await self.peer_fill(namespace_id, hashes, peer_hint, peer_timeout_s)

    def map_tenant(
        self, namespace_id: str, who: Caller | None = None
    ) -> tuple[int, int, int | None]:
        """(offset, bytes, descriptor) of the region range holding the namespace's
        blocks: the descriptor of its tenant's own file (the daemon's, locked; the lean
        server hands a new open of that file, which shares no lock), or (0, 0, None)
        when the tenant shares the region file."""
        # Who may be handed which tenant's file: whoever may use its namespaces
        # (auth.principals; without them, every caller the channel admitted).
        self.allow_namespace(who, namespace_id, "MapTenant")
        name, offset, nbytes = self.manager.tenant_range(namespace_id)  # NOT_FOUND if unknown
        if not nbytes:
            return 0, 0, None
        return offset, nbytes, self.manager.region.fd_of(name)

    def declare_namespace(self, spec: NamespaceSpec, who: Caller | None = None) -> Declared:
        if self.auth is not None:
            principal = self._identified(who, "DeclareNamespace")
            ns_id = spec.namespace_id()
            if not principal.may_use(ns_id, spec.tenant, spec.model):
                self._deny(
                    who,
                    f"DeclareNamespace tenant {errors.clip(spec.tenant)} "
                    f"model {errors.clip(spec.model)}",
                    audit.TENANT_DENIED,
                    f"{principal.name} may not use tenant {errors.clip(spec.tenant)} "
                    f"with model {errors.clip(spec.model)}",
                )
        known = len(self.manager.namespaces)
        ns = self.manager.declare_namespace(spec)
        siblings = sibling_layouts(self.manager, ns.spec)
        if siblings and len(self.manager.namespaces) > known:
            log.warning(
                "namespace %s of model %r differs from %d other namespace(s) only in its "
                "layout (%r vs %s): their clients never share a block (hash seed or page format)",
                ns.namespace_id,
                ns.spec.model,
                len(siblings),
                ns.spec.layout,
                ", ".join(repr(x) for x in siblings),
            )
        return Declared(ns.namespace_id, ns.block_bytes, siblings)

    def prepare_store(
        self,
        namespace_id: str,
        block_hashes: bytes,
        lease_ttl_s: float,
        tier: int,
        owner: str,
        client: str,
        who: Caller | None = None,
    ) -> PreparedStore:
        self.allow_namespace(who, namespace_id, "PrepareStore")
        hashes = self.hashes(block_hashes)
        want = tier_of(tier)
        plan = self.manager.prepare_store(
            namespace_id, hashes, lease_ttl_s, want, owner, client=client
        )
        return self._prepared(plan, want)

    def _prepared(self, plan: StorePlan, tier: Tier) -> PreparedStore:
        return PreparedStore(
            plan.lease_id,
            bytes(plan.statuses),
            pack_u64(plan.offsets),
            int(tier),
            plan.ttl_s,
            self.manager.region.region_id,
        )

    def reserve_store(
        self,
        namespace_id: str,
        blocks: int,
        lease_ttl_s: float,
        tier: int,
        owner: str,
        client: str,
        who: Caller | None = None,
    ) -> PreparedStore:
        """Slots reserved ahead (BlockManager.reserve_store): a PrepareStore's answer."""
        self.allow_namespace(who, namespace_id, "PrepareStore")
        want = tier_of(tier)
        plan = self.manager.reserve_store(
            namespace_id, blocks, lease_ttl_s, want, owner, client=client
        )
        return self._prepared(plan, want)

    def commit_store(
        self,
        lease_id: int,
        block_hashes: bytes,
        parent_block_hash: int | None,
        token_ids: bytes,
        chains: list[Chain],
        owner: str,
        who: Caller | None = None,
        positions: bytes | None = None,
        keep_rest: bool = False,
    ) -> int:
        """``positions``: packed uint32 lease indexes, one per hash (a reserve's commit);
        ``keep_rest``: the reserve's slots not named stay reserved (lean channel)."""
        self.allow_leases(who, "CommitStore")
        hashes = self.hashes(block_hashes) if block_hashes else None
        where = None if positions is None else unpack_u32(positions, "positions")
        tokens = unpack_i32(token_ids, "token_ids") if token_ids else None
        store_chains = [
            StoreChain(
                c.blocks,
                c.parent_block_hash,
                unpack_i32(c.token_ids, "chains.token_ids") if c.token_ids else None,
            )
            for c in chains
        ]
        return self.manager.commit_store(
            lease_id,
            hashes,
            parent_block_hash=parent_block_hash,
            token_ids=tokens,
            chains=store_chains or None,
            positions=where,
            owner=owner,
            keep_rest=keep_rest,
        )

    def lookup(
        self, namespace_id: str, block_hashes: bytes, who: Caller | None = None
    ) -> LookupResult:
        """The hot path: no await."""
        if self.auth is not None:
            self.allow_namespace(who, namespace_id, "Lookup")
        return self.manager.lookup(namespace_id, self.hashes(block_hashes))

    async def lookup_hinted(
        self,
        namespace_id: str,
        block_hashes: bytes,
        peer_hint: str,
        peer_timeout_s: float,
        who: Caller | None = None,
    ) -> LookupResult:
        self.allow_namespace(who, namespace_id, "Lookup")
        hashes = self.hashes(block_hashes)
        await self.fill_from_hint(namespace_id, hashes, peer_hint, peer_timeout_s)
        return self.manager.lookup(namespace_id, hashes)

    async def prepare_load(
        self,
        namespace_id: str,
        block_hashes: bytes,
        lease_ttl_s: float,
        tier: int,
        peer_hint: str,
        peer_timeout_s: float,
        owner: str,
        client: str,
        who: Caller | None = None,
    ) -> PreparedLoad:
        self.allow_namespace(who, namespace_id, "PrepareLoad")
        hashes = self.hashes(block_hashes)
        await self.fill_from_hint(namespace_id, hashes, peer_hint, peer_timeout_s)
        plan = await self.manager.prepare_load_async(
            namespace_id, hashes, lease_ttl_s, tier_of(tier), owner, client=client
        )
        return self._prepared_load(plan)

    @property
    def loads_may_wait(self) -> bool:
        """Whether a load may have to move blocks between tiers first (a disk or a
        GPU tier: BlockManager.prepare_load_async awaits those moves); without
        either, prepare_load_async is prepare_load and load_now answers at once."""
        return self.manager.disk is not None or self.manager.gpu is not None

    def load_now(
        self,
        namespace_id: str,
        block_hashes: bytes,
        lease_ttl_s: float,
        tier: int,
        owner: str,
        client: str,
        who: Caller | None = None,
    ) -> PreparedLoad:
        """prepare_load without a peer hint, for a node where nothing has to move
        (not loads_may_wait): no await, no task."""
        assert not self.loads_may_wait
        if self.auth is not None:
            self.allow_namespace(who, namespace_id, "PrepareLoad")
        hashes = self.hashes(block_hashes)
        plan = self.manager.prepare_load(
            namespace_id, hashes, lease_ttl_s, tier_of(tier), owner, client=client
        )
        return self._prepared_load(plan)

    def _prepared_load(self, plan: Any) -> PreparedLoad:
        return PreparedLoad(
            plan.lease_id,
            len(plan.blocks),
            pack_u64(plan.offsets),
            pack_u64([b.checksum for b in plan.blocks]),
            int(plan.tier),
            plan.ttl_s,
            self.manager.region.region_id,
        )

    def loaded_direct(
        self, namespace_id: str, block_hashes: bytes, who: Caller | None = None
    ) -> int:
        """Blocks a local client read from the region without a lease (found in the
        presence table): counted as loads and as hits, as PrepareLoad would."""
        self.allow_namespace(who, namespace_id, "PrepareLoad")
        return self.manager.loaded_direct(namespace_id, self.hashes(block_hashes))

    def release(self, lease_ids: list[int], owner: str, who: Caller | None = None) -> int:
        self.allow_leases(who, "Release")
        if len(lease_ids) > self.max_blocks:
            raise errors.InvalidRequest(
                f"{len(lease_ids)} lease ids in one request exceeds "
                f"limits.max_blocks_per_request={self.max_blocks}"
            )
        return self.manager.release(lease_ids, owner)

    def delete(
        self, namespace_id: str, block_hashes: bytes, who: Caller | None = None
    ) -> tuple[int, int]:
        self.allow_namespace(who, namespace_id, "Delete")
        return self.manager.delete(namespace_id, self.hashes(block_hashes))

    def clear(self, namespace_id: str, who: Caller | None = None) -> int:
        self.allow_role(who, "Clear")  # every tenant's blocks of a namespace, or all
        return self.manager.clear(namespace_id)
