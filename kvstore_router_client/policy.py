"""The one routing policy: cached prefix by tier, against live load (pure; no I/O).

For each candidate node the policy estimates what sending the request there
saves and what it costs, both in units of "this request's full prefill":

    saved = (gpu_weight * gpu_blocks + cpu_weight * cpu_blocks
             + disk_weight * disk_blocks
             + peer_weight * pullable_blocks) / request_blocks
    cost  = load_weight * load
    value = saved - cost (+ affinity_bonus where the conversation's last turn went)

``*_blocks`` split the node's longest cached prefix by the fastest tier holding
each block (the indexer's Score); a tier's weight is the share of a block's
prefill that a hit there saves (a GPU hit copies nothing, a DRAM hit one
host-to-device copy, a disk hit a read first). ``pullable_blocks`` are the
blocks past the node's own prefix that another node holds (the longest prefix
anywhere minus this node's): its daemon pulls them over NIXL before the
forward, which saves less than a local hit and more than a recompute.

``load`` (see ``NodeLoad.load``) is the node's queue in units of its batch
capacity plus its KV-cache pressure: it is what makes the policy spread work
instead of piling every request that shares a hot prefix onto the node that
holds it (measured before this policy: precise-only routing gave -2% modelled
throughput and a worse TTFT than approximate routing). The router counts its
own in-flight requests per node, so a burst of subagents sharing a parent's
prefix sees the load it just created and spreads over the nodes that hold the
prefix or can pull it.

Session affinity: the node a conversation's previous turn went to gets
``affinity_bonus``, as long as its load is below ``affinity_max_load``; this
covers the window in which the previous turn's blocks are computed but their
KV events have not reached the index yet.

Ties go to the lower load, then the name (deterministic: two router replicas
given the same state choose the same node).

Data-parallel ranks: where a node's engine runs several DP ranks (each its own
GPU cache, all sharing the node's DRAM and disk tiers), the indexer scores each
rank, and the node's hit is its best rank's. ``Decision.rank`` is the chosen
node's rank with the highest cached value (ties: the lowest rank); -1 when the
node reports no ranks (send it anywhere, e.g. no ``X-data-parallel-rank``
header). A rank the indexer does not list holds only the node's shared blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec


class Policy(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Defaults tuned on `kvstore-bench agentic --preset cybergym` (8 nodes, the
    # same capacity as the published runs): there they beat approximate routing
    # on modelled throughput (+6.8%) and TTFT p90 (150.5 s vs 174.7 s, one run)
    # with an 82.3% local prefix hit; a larger load or peer weight spread work, made
    # copies and evictions, and lost (load 0.5 + peer 0.5: -45% throughput).
    gpu_weight: float = 1.0
    """Share of a block's prefill a hit in the engine's GPU cache saves (no copy at all)."""
    cpu_weight: float = 0.7
    """Share saved by a hit in the node's DRAM tier (a host-to-device copy; below the
    GPU's so a GPU-resident prefix wins: it also stays hot there)."""
    disk_weight: float = 0.5
    """Share saved by a hit on the node's disk tier (a read, then a copy)."""
    peer_weight: float = 0.0
    """Share credited to a block another node holds, pulled over NIXL first. Off by
    default: each pull leaves a copy, and copies evict other prefixes (measured)."""
    load_weight: float = 0.05
    """Cost of one ``NodeLoad.capacity`` of queued work (load 1), in prefill units."""
    kv_usage_weight: float = 0.5
    """How much KV-cache usage (0..1) adds to the load: a full cache preempts or waits."""
    affinity_bonus: float = 0.1
    """Added to the node the conversation's previous turn went to."""
    affinity_max_load: float = 1.0
    """Affinity holds only while that node's load is below this."""
    min_prefix_blocks: int = 1
    """Prefixes shorter than this are no cache signal: only load decides."""


DEFAULT_POLICY = Policy()
# The cache-only variant ("precise-only" in the bench): the same scores, no load term.
PRECISE_ONLY_POLICY = Policy(load_weight=0.0, kv_usage_weight=0.0, affinity_bonus=0.0)


class NodeLoad(msgspec.Struct, frozen=True, kw_only=True):
    """What is known of a node's load: the engine's own gauges (vLLM /metrics
    ``vllm:num_requests_running`` / ``_waiting`` / ``vllm:kv_cache_usage_perc``)
    and the router's count of requests it sent there that have not finished."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    inflight: float = 0.0
    capacity: float = 1.0
    """Requests the engine runs at once (``max_num_seqs``); scales the queue."""

    def load(self, policy: Policy = DEFAULT_POLICY) -> float:
        # The engine's gauges lag the router's own count (scraped every second),
        # so whichever is larger is the better estimate of what is there now.
        queued = max(self.running + self.waiting, self.inflight)
        cap = self.capacity if self.capacity > 0 else 1.0
        return queued / cap + policy.kv_usage_weight * min(1.0, max(0.0, self.kv_usage))


class RankHit(msgspec.Struct, frozen=True):
    """One DP rank of a node (the indexer's RankScore; rank -1: shared tiers only)."""

    rank: int
    prefix_blocks: int
    gpu_blocks: int
    cpu_blocks: int
    disk_blocks: int


class NodeHit(msgspec.Struct, frozen=True):
    node: str
    prefix_blocks: int
    gpu_blocks: int
    cpu_blocks: int
    disk_blocks: int
    rank: int = -1
    """The rank the figures are for (the node's best); -1: the node has no ranks."""
    ranks: tuple[RankHit, ...] = ()


class ScoreResult(msgspec.Struct, frozen=True):
    request_blocks: int
    hits: list[NodeHit]


NO_SCORES = ScoreResult(request_blocks=0, hits=[])


class Decision(msgspec.Struct, frozen=True):
    node: str
    reason: str
    """"prefix": a candidate holds a prefix (cache and load decided); "load": no
    cache signal, load decided; "fallback": the indexer failed or missed the
    deadline (see ``error``), load decided; "affinity": chosen for the previous
    turn; "no_hit": the caller's default, no signal at all."""
    value: float = 0.0
    hit: NodeHit | None = None
    error: str = ""
    peer: str = ""
    """A node holding a longer prefix than the chosen one (the pull hint), or ""."""
    peer_blocks: int = 0
    rank: int = -1
    """The chosen node's DP rank to send to (see the module doc); -1 = any."""


LoadArg = Mapping[str, "float | NodeLoad"]


def _load_of(load: LoadArg | None, node: str, policy: Policy) -> float:
    if not load:
        return 0.0
    v = load.get(node, 0.0)
    return v.load(policy) if isinstance(v, NodeLoad) else float(v)


def node_value(
    hit: NodeHit | None,
    request_blocks: int,
    load: float,
    policy: Policy = DEFAULT_POLICY,
    best_prefix_blocks: int = 0,
) -> float:
    """``saved - load_weight * load`` for one node (see the module docstring)."""
    cost = policy.load_weight * load
    if request_blocks <= 0:
        return -cost
    local = hit.prefix_blocks if hit is not None else 0
    cached = 0.0
    if hit is not None:
        cached = (
            policy.gpu_weight * hit.gpu_blocks
            + policy.cpu_weight * hit.cpu_blocks
            + policy.disk_weight * hit.disk_blocks
        )
    pullable = max(0, best_prefix_blocks - local)
    return (cached + policy.peer_weight * pullable) / request_blocks - cost


def best_rank(hit: NodeHit | None, policy: Policy = DEFAULT_POLICY) -> int:
    """The rank of ``hit``'s node a request saves most on (ties: lowest); -1: no ranks."""
    best, best_saved = -1, -1.0
    for r in hit.ranks if hit is not None else ():
        if r.rank < 0:
            continue
        saved = (
            policy.gpu_weight * r.gpu_blocks
            + policy.cpu_weight * r.cpu_blocks
            + policy.disk_weight * r.disk_blocks
        )
        if saved > best_saved or (saved == best_saved and r.rank < best):
            best, best_saved = r.rank, saved
    return best


def choose(
    result: ScoreResult,
    candidates: Sequence[str],
    default: str,
    load: LoadArg | None = None,
    policy: Policy = DEFAULT_POLICY,
    *,
    affinity: str = "",
    reason_without_hit: str = "no_hit",
) -> Decision:
    """The policy on an indexer answer. Without any cache signal (no candidate
    holds ``min_prefix_blocks``) the least loaded candidate wins when loads are
    given (reason "load"), else ``default`` (reason ``reason_without_hit``)."""
    hits = {
        h.node: h
        for h in result.hits
        if h.prefix_blocks >= policy.min_prefix_blocks and h.node in candidates
    }
    best_prefix, best_holder = 0, ""
    for node in sorted(hits):
        if hits[node].prefix_blocks > best_prefix:
            best_prefix, best_holder = hits[node].prefix_blocks, node
    if not hits and not load and not affinity:
        return Decision(node=default, reason=reason_without_hit)
    best: tuple[float, float, str] | None = None
    for node in candidates:
        ld = _load_of(load, node, policy)
        v = node_value(hits.get(node), result.request_blocks, ld, policy, best_prefix)
        if node == affinity and ld < policy.affinity_max_load:
            v += policy.affinity_bonus
        key = (-v, ld, node)
        if best is None or key < best:
            best = key
    if best is None:
        return Decision(node=default, reason=reason_without_hit)
    node = best[2]
    hit = hits.get(node)
    if hits:
        reason = "prefix"
    elif node == affinity and affinity:
        reason = "affinity"
    else:
        reason = "load" if reason_without_hit == "no_hit" else reason_without_hit
    # The pull hint does not depend on peer_weight: the chosen node's daemon can
    # pull what another holds whether or not the choice credited it.
    peer, peer_blocks = "", 0
    if best_holder and best_holder != node:
        peer, peer_blocks = best_holder, best_prefix - (hit.prefix_blocks if hit else 0)
    return Decision(
        node=node,
        reason=reason,
        value=-best[0],
        hit=hit,
        peer=peer,
        peer_blocks=peer_blocks,
        rank=best_rank(hit, policy),
    )
