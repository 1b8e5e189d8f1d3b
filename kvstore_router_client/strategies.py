"""Routing strategies by name: the product's policy and the baselines it is measured against.

    random        a uniformly random candidate.
    round-robin   the next candidate.
    approximate   llm-d's estimated prefix scorer: remembers which blocks it
                  routed where (an LRU per node as large as one GPU cache),
                  knows nothing of evictions or tiers; scored with llm-d's
                  default weights (prefix 3, queue headroom 2).
    precise-only  the indexer's per-node, per-tier prefix score (the policy
                  with no load term): where the cache is, whatever the queue.
    cache+load    the product default (``kvstore_router_client.policy``): cached
                  prefix by tier and by what a pull saves, against live load,
                  session affinity.

The bench (`kvstore-bench agentic`) and `kvstore router` both build their
strategy here, so a figure the bench reports is the product's policy.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from kvstore.errors import InvalidRequest
from kvstore_router_client.policy import (
    DEFAULT_POLICY,
    PRECISE_ONLY_POLICY,
    Decision,
    NodeLoad,
    Policy,
    ScoreResult,
    choose,
)

STRATEGIES = ("random", "round-robin", "approximate", "precise-only", "cache+load")
DEFAULT_STRATEGY = "cache+load"
# llm-d's default scorer weights (estimated prefix scorer + queue scorer).
LLMD_PREFIX_WEIGHT = 3.0
LLMD_QUEUE_WEIGHT = 2.0


class Strategy(Protocol):
    name: str
    uses_index: bool
    """True: ``choose`` wants the indexer's scores (None = the indexer failed)."""

    def choose(
        self,
        hashes: np.ndarray,
        candidates: Sequence[str],
        load: Mapping[str, NodeLoad],
        scores: ScoreResult | None,
        affinity: str = "",
    ) -> Decision: ...

    def routed(self, node: str, hashes: np.ndarray) -> None:
        """The request with these block hashes (its output's too, if known) went to ``node``."""


class RandomStrategy:
    name = "random"
    uses_index = False

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(
        self,
        hashes: np.ndarray,
        candidates: Sequence[str],
        load: Mapping[str, NodeLoad],
        scores: ScoreResult | None,
        affinity: str = "",
    ) -> Decision:
        return Decision(node=candidates[self._rng.randrange(len(candidates))], reason="random")

    def routed(self, node: str, hashes: np.ndarray) -> None:
        pass


class RoundRobinStrategy:
    name = "round-robin"
    uses_index = False

    def __init__(self) -> None:
        self._next = 0

    def choose(
        self,
        hashes: np.ndarray,
        candidates: Sequence[str],
        load: Mapping[str, NodeLoad],
        scores: ScoreResult | None,
        affinity: str = "",
    ) -> Decision:
        node = candidates[self._next % len(candidates)]
        self._next = (self._next + 1) % len(candidates)
        return Decision(node=node, reason="round-robin")

    def routed(self, node: str, hashes: np.ndarray) -> None:
        pass


def llmd_pick(prefix_frac: Sequence[float], queues: Sequence[float]) -> int:
    """llm-d-style weighted scorers: prefix share and queue headroom relative to the
    longest queue; ties to the shorter queue, then the lower index."""
    worst = max(queues) or 1
    scores = [
        LLMD_PREFIX_WEIGHT * p + LLMD_QUEUE_WEIGHT * (1.0 - q / worst)
        for p, q in zip(prefix_frac, queues, strict=True)
    ]
    return max(range(len(scores)), key=lambda i: (scores[i], -queues[i], -i))


def _queued(ld: NodeLoad | None) -> float:
    if ld is None:
        return 0.0
    return max(ld.running + ld.waiting, ld.inflight)


class ApproximateStrategy:
    """What it routed where, per node, in an LRU as large as one GPU cache."""

    name = "approximate"
    uses_index = False

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise InvalidRequest(f"capacity_blocks must be > 0; got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._seen: dict[str, OrderedDict[int, None]] = {}

    def choose(
        self,
        hashes: np.ndarray,
        candidates: Sequence[str],
        load: Mapping[str, NodeLoad],
        scores: ScoreResult | None,
        affinity: str = "",
    ) -> Decision:
        total = max(1, len(hashes))
        hl = hashes.tolist()
        fracs = []
        for node in candidates:
            seen = self._seen.get(node)
            k = 0
            if seen is not None:
                for h in hl:
                    if h not in seen:
                        break
                    k += 1
            fracs.append(k / total)
        i = llmd_pick(fracs, [_queued(load.get(n)) for n in candidates])
        return Decision(node=candidates[i], reason="approximate", value=fracs[i])

    def routed(self, node: str, hashes: np.ndarray) -> None:
        seen = self._seen.setdefault(node, OrderedDict())
        for h in hashes.tolist():
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity_blocks:
            seen.popitem(last=False)


class PolicyStrategy:
    """``kvstore_router_client.policy.choose`` over the indexer's scores."""

    uses_index = True

    def __init__(self, policy: Policy = DEFAULT_POLICY, name: str = DEFAULT_STRATEGY) -> None:
        self.policy = policy
        self.name = name

    def choose(
        self,
        hashes: np.ndarray,
        candidates: Sequence[str],
        load: Mapping[str, NodeLoad],
        scores: ScoreResult | None,
        affinity: str = "",
    ) -> Decision:
        # Without the index (it failed or is late) the load alone still balances.
        if scores is None:
            return choose(
                ScoreResult(request_blocks=len(hashes), hits=[]),
                candidates,
                candidates[0],
                load,
                self.policy,
                affinity=affinity,
                reason_without_hit="fallback",
            )
        return choose(scores, candidates, candidates[0], load, self.policy, affinity=affinity)

    def routed(self, node: str, hashes: np.ndarray) -> None:
        pass


def make_strategy(
    name: str,
    *,
    policy: Policy | None = None,
    seed: int = 0,
    approximate_capacity_blocks: int = 1 << 20,
) -> Strategy:
    """A strategy by its name in ``STRATEGIES``; ``policy`` overrides cache+load's weights."""
    if name == "random":
        return RandomStrategy(seed)
    if name == "round-robin":
        return RoundRobinStrategy()
    if name == "approximate":
        return ApproximateStrategy(approximate_capacity_blocks)
    if name == "precise-only":
        return PolicyStrategy(PRECISE_ONLY_POLICY, "precise-only")
    if name == "cache+load":
        return PolicyStrategy(policy or DEFAULT_POLICY, "cache+load")
    raise InvalidRequest(f"unknown routing strategy {name!r}; one of {', '.join(STRATEGIES)}")
