"""`kvstore-bench agentic`'s accounting: the replay's tallies, and the attribution of
every recomputed token to a cause (kvstore_bench/causes.py) from the real daemons' answers
and their KV events."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore_bench.agentic_engine import GpuCacheModel
from kvstore_bench.agentic_routing import EventTap
from kvstore_bench.causes import CAUSES


@dataclass
class Tally:
    input_tokens: int = 0
    output_tokens: int = 0
    tokens: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("gpu", "dram", "disk", "peer", "recompute"), 0)
    )
    recompute_causes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    ttft_s: list[float] = field(default_factory=list)
    blocks_loaded: int = 0
    blocks_stored: int = 0
    blocks_refused: int = 0
    blocks_pulled: int = 0
    verified_blocks: int = 0
    verify_failures: int = 0
    # FetchFromPeer, as the daemons answered it.
    peer_fetches: int = 0
    peer_fetch_failures: int = 0
    peer_fetched_blocks: int = 0
    peer_corrupt_blocks: int = 0
    peer_transports: dict[str, int] = field(default_factory=dict)
    peer_fetch_s: list[float] = field(default_factory=list)
    pool_served_tokens: int = 0
    copies_per_block: float = 0.0
    daemon_counters: dict[str, int] = field(default_factory=dict)
    requests: int = 0
    makespan_s: float = 0.0


class RemovalLedger(EventTap):
    """What the daemons' own KV events say, for the diagnosis of recomputed tokens:
    the tier each block was last removed from (BlockRemoved, medium CPU or DISK),
    and which nodes hold each block now (BlockStored/BlockRemoved), hence how many
    copies of a block the cluster keeps."""

    MAX_BLOCKS = 4_000_000  # bounds memory of the removal map; older entries dropped

    def __init__(self, endpoints: Sequence[str]) -> None:
        super().__init__(endpoints)
        self.removed: OrderedDict[int, str] = OrderedDict()
        # (node, medium) per held block: bounded by what the daemons hold.
        self.held: dict[int, set[tuple[str, str]]] = {}
        self.copies_samples: list[float] = []

    def drain(self, max_messages: int = 100_000) -> None:
        wire = self.wire
        for _ in range(max_messages):
            frames = self.recv()
            if frames is None:
                break
            topic = wire.parse_topic(frames[0])
            node = topic[0] if topic else ""
            for ev in self.decoder.decode(frames[2]).events:
                if isinstance(ev, wire.LeanStored):
                    for h in ev.block_hashes:
                        key = wire.block_hash_to_int(h)
                        self.held.setdefault(key, set()).add((node, ev.medium or ""))
                elif isinstance(ev, wire.LeanRemoved):
                    for h in ev.block_hashes:
                        key = wire.block_hash_to_int(h)
                        self.removed[key] = ev.medium or ""
                        self.removed.move_to_end(key)
                        where = self.held.get(key)
                        if where is not None:
                            where.discard((node, ev.medium or ""))
                            if not where:
                                del self.held[key]
        while len(self.removed) > self.MAX_BLOCKS:
            self.removed.popitem(last=False)

    def sample_copies(self) -> None:
        """Nodes holding each distinct block (any tier), averaged over held blocks."""
        self.drain()
        if self.held:
            nodes = sum(len({n for n, _ in w}) for w in self.held.values())
            self.copies_samples.append(nodes / len(self.held))


class Diagnosis:
    """Attributes every recomputed input token to one cause (CAUSES).

    Block hashes are chained, so the blocks a request recomputes (those after the
    prefix it was served) fall in order into: blocks some finished request had
    computed ("lost": the cause is why the first of them was not found), then
    blocks only unfinished requests are computing ("in_flight"), then blocks
    nobody has computed ("new"); tokens past the last whole block are
    "partial_block". Why the first lost block was not found is asked of the real
    daemons (a Lookup of that one block on every node, which does not touch their
    eviction order) and of the engine models, then of what the replay offered
    (stored, refused) and of the daemons' BlockRemoved events (which tier).
    """

    def __init__(
        self,
        clients: list,
        nss: list,
        engines: list[GpuCacheModel],
        ledger: RemovalLedger | None,
        storage: bool,
        peers: bool,
        block_tokens: int,
    ) -> None:
        self.clients, self.nss, self.engines = clients, nss, engines
        self.ledger, self.storage, self.peers = ledger, storage, peers
        self.block_tokens = block_tokens
        # The capacity reference: one LRU as large as the whole cluster's daemon
        # tiers, fed the same requests in the same order, never holding a copy twice.
        self.pool: OrderedDict[int, None] = OrderedDict()
        self.pool_capacity = 0
        self.pool_served_tokens = 0
        self.computed: set[int] = set()
        self.inflight: dict[int, int] = {}
        self.offered: set[int] = set()
        self.refused: set[int] = set()

    def attribute(
        self,
        hashes: np.ndarray,
        served: int,
        recompute_tokens: int,
        node: int,
        pulled_from: int,
        tally: Tally,
    ) -> None:
        B = self.block_tokens
        tail = hashes[served:].tolist()
        lost = in_flight = 0
        for h in tail:
            if h in self.computed:
                lost += 1
            elif h in self.inflight:
                in_flight += 1
        new = len(tail) - lost - in_flight
        causes = tally.recompute_causes
        causes["partial_block"] += recompute_tokens - len(tail) * B
        causes["new"] += new * B
        causes["in_flight"] += in_flight * B
        if lost:
            causes[self._why_lost(tail[0], node, pulled_from)] += lost * B

    def pool_start(self, hashes: np.ndarray, ntok: int) -> None:
        """Serve a request's prefix from the pooled LRU (touching it)."""
        n = 0
        for h in hashes.tolist():
            if h not in self.pool:
                break
            self.pool.move_to_end(h)
            n += 1
        self.pool_served_tokens += min(n * self.block_tokens, max(0, ntok - 1))

    def pool_finish(self, hashes: np.ndarray) -> None:
        for h in hashes.tolist():
            self.pool[h] = None
            self.pool.move_to_end(h)
        while len(self.pool) > self.pool_capacity:
            self.pool.popitem(last=False)

    def _why_lost(self, h: int, node: int, pulled_from: int) -> str:
        if not self.storage:
            others = [i for i, e in enumerate(self.engines) if i != node and h in e.blocks]
            return "other_node_gpu_only" if others else "evicted_gpu"
        holders = [
            i
            for i, (c, ns) in enumerate(zip(self.clients, self.nss, strict=True))
            if c.lookup(ns, [h]).prefix_blocks
        ]
        if node in holders:
            return "local_not_loaded"
        if holders:
            if not self.peers:
                return "peers_off"
            if pulled_from in holders:
                return "peer_pull_short"
            return "split_across_nodes" if pulled_from >= 0 else "not_found_by_index"
        if h in self.offered:
            assert self.ledger is not None
            self.ledger.drain()
            medium = self.ledger.removed.get(h)
            return {"CPU": "evicted_dram", "DISK": "evicted_disk"}.get(
                medium or "", "evicted_unseen"
            )
        if h in self.refused:
            return "store_refused"
        return "never_stored"
