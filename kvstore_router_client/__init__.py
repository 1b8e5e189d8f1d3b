"""What a router imports: vLLM-compatible hashing (incremental), indexer scores, the policy."""

from kvstore_router_client.policy import (
    DEFAULT_POLICY,
    Decision,
    NodeHit,
    NodeLoad,
    Policy,
    RankHit,
    ScoreResult,
    best_rank,
    choose,
    node_value,
)
from kvstore_router_client.prefix_cache import Hashed, KnownPrefix, PrefixHashCache
from kvstore_router_client.scorer import RouterClient
from kvstore_router_client.strategies import STRATEGIES, Strategy, make_strategy

__all__ = [
    "DEFAULT_POLICY",
    "STRATEGIES",
    "Decision",
    "Hashed",
    "KnownPrefix",
    "NodeHit",
    "NodeLoad",
    "Policy",
    "PrefixHashCache",
    "RankHit",
    "RouterClient",
    "ScoreResult",
    "Strategy",
    "best_rank",
    "choose",
    "make_strategy",
    "node_value",
]
