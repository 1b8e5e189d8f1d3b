"""The local index's Score reads exactly as the indexer's Score over gRPC does."""

from __future__ import annotations

from kvstore.indexer.backend import NodeScore, RankScore
from kvstore.router.local_index import score_result
from kvstore.v1 import indexer_pb2
from kvstore_router_client import scorer


def _pb(s: NodeScore) -> indexer_pb2.NodeScore:
    # as IndexerServicer.Score writes it
    return indexer_pb2.NodeScore(
        node=s.node,
        prefix_blocks=s.prefix_blocks,
        gpu_blocks=s.gpu_blocks,
        cpu_blocks=s.cpu_blocks,
        disk_blocks=s.disk_blocks,
        rank=s.rank,
        ranks=[
            indexer_pb2.RankScore(
                rank=r.rank,
                prefix_blocks=r.prefix_blocks,
                gpu_blocks=r.gpu_blocks,
                cpu_blocks=r.cpu_blocks,
                disk_blocks=r.disk_blocks,
            )
            for r in s.ranks
        ],
    )


def test_local_scores_equal_the_indexers_answer_read_by_the_router() -> None:
    scores = [
        NodeScore("a", 7, gpu_blocks=3, cpu_blocks=4),
        NodeScore("b", 0),
        NodeScore(
            "c",
            9,
            gpu_blocks=9,
            rank=1,
            ranks=(RankScore(-1, 2, cpu_blocks=2), RankScore(1, 9, gpu_blocks=7, cpu_blocks=2)),
        ),
    ]
    wire = indexer_pb2.ScoreResponse(scores=[_pb(s) for s in scores], request_blocks=12)
    parsed = indexer_pb2.ScoreResponse.FromString(wire.SerializeToString())
    assert score_result(scores, 12) == scorer.score_result(parsed)
