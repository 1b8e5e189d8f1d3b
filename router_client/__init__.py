"""What a router imports: vLLM-compatible hashing, indexer scores, a node choice."""

from router_client.scorer import (
    Decision,
    NodeHit,
    Policy,
    RouterClient,
    ScoreResult,
    choose,
    node_value,
)

__all__ = ["Decision", "NodeHit", "Policy", "RouterClient", "ScoreResult", "choose", "node_value"]
