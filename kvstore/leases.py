"""Leases: what a client holds between the two phases of a store or a load.

A store lease owns reserved slots until commit; a load lease pins blocks until
release. Every lease expires, so a client that dies between the phases
strands nothing: the reaper aborts its store or unpins its load.

Expiry is fenced. A client copies block bytes through shared memory, where
nothing can revoke its access, so an expired lease is first *quarantined*:
it can no longer be committed or released (the owner is told it expired),
but its slots stay reserved (a store) or its blocks pinned (a load) for
``leases.quarantine_s`` more. Clients never start a copy past their own
deadline (their monotonic clock, from before the request, minus a margin) and
copy in bounded chunks, so a late writer is done before its slots can be
given to anyone else, and a late reader knows its bytes are not valid.

Lease ids are unguessable: a keyed 64-bit permutation of a counter, so they
are never reused within a daemon's life and the next id cannot be derived
from one's own. A lease also records its owner (the caller's identity as the
service knows it); anyone else naming it gets the same answer as for an id
that was never issued.
"""

from __future__ import annotations

import enum
import hashlib
import heapq
import itertools
import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore import audit

if TYPE_CHECKING:
    from kvstore.namespace import Block, Namespace

_MASK32 = 0xFFFFFFFF
# Rebuild the expiry heap once its stale entries (released leases) outnumber
# the live ones by this much: a bound on memory, amortised O(1) per release.
_HEAP_SLACK = 1024


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
    owner: str = ""
    client: str | None = None  # the client it counts against (None: the daemon's own)
    by_hash: dict[int, Block] = field(default_factory=dict)
    # A store lease of slots reserved ahead (placeholder hashes): its commit binds
    # real hashes to lease positions (BlockManager.reserve_store).
    reserve: bool = False
    # A reserve's slots by position, for its whole life: a commit that keeps the
    # rest (keep_rest) leaves the lease, with None where a slot was committed;
    # ``blocks`` holds the open ones only (what a release or expiry gives back).
    slots: list[Block | None] = field(default_factory=list)


class LeaseIds:
    """Unguessable, never-repeating 64-bit ids: a 4-round Feistel permutation of a
    counter under a random key (a bijection, so distinct counters give distinct ids)."""

    def __init__(self, key: bytes | None = None) -> None:
        key = key or secrets.token_bytes(16)
        # Each round's keyed hash state, made once: a copy of it costs less than
        # keying blake2b again (a block of key), and ids are on every lease's path.
        self._rounds = [hashlib.blake2b(digest_size=4, key=key, salt=bytes([i])) for i in range(4)]
        self._counter = itertools.count(1)

    def next(self) -> int:
        while True:
            n = next(self._counter)
            left, right = n >> 32, n & _MASK32
            for state in self._rounds:
                h = state.copy()
                h.update(right.to_bytes(4, "little"))
                left, right = right, left ^ int.from_bytes(h.digest(), "little")
            lease_id = (left << 32) | right
            if lease_id:  # 0 means "no lease" on the wire
                return lease_id


class LeaseTable:
    """Live leases by id, with an expiry heap (lazy deletion, bounded), and the
    quarantine of expired leases whose slots must not be reused yet."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._expiry: list[tuple[float, int]] = []
        self._ids = LeaseIds()
        # Expired leases, oldest first (one quarantine length for all: FIFO order
        # is release order): (release at, lease).
        self._quarantine: deque[tuple[float, Lease]] = deque()
        self._quarantined: dict[int, Lease] = {}
        # Live leases per client, so one client's leak is bounded (manager checks).
        self._by_client: dict[str, int] = {}

    def add(
        self,
        kind: LeaseKind,
        namespace: Namespace,
        blocks: list[Block],
        expires_at_s: float,
        owner: str = "",
        client: str | None = None,
        *,
        reserve: bool = False,
    ) -> Lease:
        lease = Lease(self._ids.next(), kind, namespace, blocks, expires_at_s, owner, client)
        lease.reserve = reserve
        if kind is LeaseKind.STORE:
            lease.by_hash = {b.block_hash: b for b in blocks}
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._expiry, (expires_at_s, lease.lease_id))
        if client is not None:
            self._by_client[client] = self._by_client.get(client, 0) + 1
        return lease

    def get(self, lease_id: int, owner: str = "") -> Lease | None:
        """The live lease, if ``owner`` holds it (anyone else: None, as if never issued)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return None
        if lease.owner != owner:
            # Another caller's lease: answered as never issued, and audited.
            audit.denied(owner or "(local)", f"lease {lease_id}", audit.LEASE_NOT_OWNER)
            return None
        return lease

    def expired(self, lease_id: int, owner: str = "") -> bool:
        """Whether ``owner``'s lease expired recently (it is in quarantine)."""
        lease = self._quarantined.get(lease_id)
        return lease is not None and lease.owner == owner

    def pop(self, lease_id: int, owner: str = "") -> Lease | None:
        lease = self.get(lease_id, owner)
        if lease is None:
            return None
        del self._leases[lease_id]
        self._forget_client(lease)
        if len(self._expiry) > 2 * len(self._leases) + _HEAP_SLACK:
            self._expiry = [(le.expires_at_s, le.lease_id) for le in self._leases.values()]
            heapq.heapify(self._expiry)
        return lease

    def held_by(self, client: str) -> int:
        """Live leases of one client."""
        return self._by_client.get(client, 0)

    def _forget_client(self, lease: Lease) -> None:
        if lease.client is None:
            return
        left = self._by_client[lease.client] - 1
        if left:
            self._by_client[lease.client] = left
        else:
            del self._by_client[lease.client]  # bounded by live clients, not every client ever

    def pop_expired(self, now_s: float, max_count: int) -> list[Lease]:
        """Remove and return up to max_count leases whose time has come."""
        out: list[Lease] = []
        while self._expiry and self._expiry[0][0] <= now_s and len(out) < max_count:
            _, lease_id = heapq.heappop(self._expiry)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires_at_s <= now_s:
                del self._leases[lease_id]
                self._forget_client(lease)
                out.append(lease)
        return out

    def quarantine(self, lease: Lease, until_s: float) -> None:
        """Hold an expired lease's slots until ``until_s`` (see pop_released)."""
        self._quarantine.append((until_s, lease))
        self._quarantined[lease.lease_id] = lease

    def pop_released(self, now_s: float, max_count: int) -> list[Lease]:
        """Remove and return up to max_count quarantined leases whose quarantine is over."""
        out: list[Lease] = []
        while self._quarantine and self._quarantine[0][0] <= now_s and len(out) < max_count:
            _, lease = self._quarantine.popleft()
            del self._quarantined[lease.lease_id]
            out.append(lease)
        return out

    @property
    def quarantined(self) -> int:
        return len(self._quarantined)

    @property
    def expiry_entries(self) -> int:
        """Entries in the expiry heap, stale ones included (bounded by the live count)."""
        return len(self._expiry)

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._leases.values()))
