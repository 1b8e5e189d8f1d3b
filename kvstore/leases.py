"""Leases: what a client holds between the two phases of a store or a load.

A store lease owns reserved slots until commit; a load lease pins blocks until
release. Every lease expires, so a client that dies between the phases
strands nothing: the reaper aborts its store or unpins its load.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.manager import Block
    from kvstore.namespace import Namespace


class LeaseKind(enum.Enum):
    STORE = "store"
    LOAD = "load"


@dataclass(eq=False, slots=True)
class Lease:
    lease_id: int
    kind: LeaseKind
    namespace: Namespace
    blocks: list[Block]
    expires_at_s: float
    by_hash: dict[int, Block] = field(default_factory=dict)
    owner: str | None = None  # the client it counts against (None: the daemon's own)


class LeaseTable:
    """Live leases by id, with an expiry heap (lazy deletion)."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._expiry: list[tuple[float, int]] = []
        # Ids are never reused within a daemon's life; start high and odd-looking
        # so a client's stale id from a previous daemon run is unlikely to match.
        self._ids = itertools.count(1 + (id(self) & 0xFFFF) * 1_000_000)
        # Live leases per owner, so one client's leak is bounded (manager checks).
        self._by_owner: dict[str, int] = {}

    def add(
        self,
        kind: LeaseKind,
        namespace: Namespace,
        blocks: list[Block],
        expires_at_s: float,
        owner: str | None = None,
    ) -> Lease:
        lease = Lease(next(self._ids), kind, namespace, blocks, expires_at_s, owner=owner)
        if kind is LeaseKind.STORE:
            lease.by_hash = {b.block_hash: b for b in blocks}
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._expiry, (expires_at_s, lease.lease_id))
        if owner is not None:
            self._by_owner[owner] = self._by_owner.get(owner, 0) + 1
        return lease

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def pop(self, lease_id: int) -> Lease | None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self._forget_owner(lease)
        return lease

    def held_by(self, owner: str) -> int:
        """Live leases of one owner."""
        return self._by_owner.get(owner, 0)

    def _forget_owner(self, lease: Lease) -> None:
        if lease.owner is None:
            return
        left = self._by_owner[lease.owner] - 1
        if left:
            self._by_owner[lease.owner] = left
        else:
            del self._by_owner[lease.owner]  # bounded by live owners, not every owner ever

    def pop_expired(self, now_s: float, max_count: int) -> list[Lease]:
        """Remove and return up to max_count leases whose time has come."""
        out: list[Lease] = []
        while self._expiry and self._expiry[0][0] <= now_s and len(out) < max_count:
            _, lease_id = heapq.heappop(self._expiry)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires_at_s <= now_s:
                del self._leases[lease_id]
                self._forget_owner(lease)
                out.append(lease)
        return out

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._leases.values()))
