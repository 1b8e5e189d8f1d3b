"""The in-memory index's own mechanics: growth, reclamation, limits, huge requests."""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

from kvstore.errors import InvalidRequest
from kvstore.indexer.backend import NodeScore, prefix_scores
from kvstore.indexer.memory import MemoryIndex


def test_grows_past_initial_capacity_and_keeps_everything():
    ix = MemoryIndex(initial_capacity=1024)
    rng = np.random.default_rng(1)
    hashes = rng.integers(0, 2**64, 50_000, dtype=np.uint64)
    for i in range(0, hashes.size, 997):
        ix.add("m", "a", "CPU", hashes[i : i + 997])
    assert ix.stats()["blocks"] == np.unique(hashes).size
    assert ix.score("m", hashes) == [NodeScore("a", hashes.size, 0, hashes.size, 0)]


def test_removals_reclaim_memory():
    ix = MemoryIndex(initial_capacity=1024)
    hashes = np.arange(1, 40_001, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    ix.add("m", "a", "CPU", hashes)
    big = ix.stats()["bytes"]
    ix.remove("m", "a", "CPU", hashes[:39_000])
    ix.add("m", "a", "CPU", hashes[:10])  # the next insert rehashes down
    assert ix.stats()["blocks"] == 1_010
    assert ix.stats()["bytes"] < big / 4
    assert ix.score("m", hashes[:10])[0].prefix_blocks == 10


def test_block_count_per_model_follows_adds_and_removes():
    """block_count (what kvstore-bench indexer polls for ingest completion) is the
    distinct blocks of one model, whatever the nodes and tiers holding them."""
    ix = MemoryIndex()
    assert ix.block_count("m") == 0
    ix.add("m", "a", "CPU", np.array([1, 2, 3], dtype=np.uint64))
    ix.add("m", "b", "GPU", np.array([2, 3, 4], dtype=np.uint64))
    ix.add("other", "a", "CPU", np.array([9], dtype=np.uint64))
    assert ix.block_count("m") == 4
    assert ix.block_count("other") == 1
    ix.remove("m", "a", "CPU", np.array([1, 2], dtype=np.uint64))
    assert ix.block_count("m") == 3  # 2 is still on b
    assert ix.block_count("m") + ix.block_count("other") == ix.stats()["blocks"]


def test_duplicate_hashes_in_one_batch_and_hash_zero():
    ix = MemoryIndex()
    ix.add("m", "a", "GPU", np.array([0, 0, 7, 7, 2**64 - 1], dtype=np.uint64))
    assert ix.stats()["blocks"] == 3
    req = np.array([0, 7, 2**64 - 1], dtype=np.uint64)
    assert ix.score("m", req) == [NodeScore("a", 3, 3, 0, 0)]


def test_node_limit_is_a_precise_error():
    ix = MemoryIndex(max_nodes=2)
    ix.add("m", "a", "CPU", np.array([1], dtype=np.uint64))
    ix.add("m", "b", "CPU", np.array([1], dtype=np.uint64))
    with pytest.raises(InvalidRequest, match="max_nodes"):
        ix.add("m", "c", "CPU", np.array([1], dtype=np.uint64))
    ix.drop_node("a")  # frees an id
    ix.add("m", "c", "CPU", np.array([1], dtype=np.uint64))
    assert ix.nodes() == ["b", "c"]


def test_more_than_64_nodes_and_ids_reused_after_drop():
    ix = MemoryIndex()
    req = np.arange(1, 11, dtype=np.uint64)
    for i in range(130):
        ix.add("m", f"n{i:03d}", "CPU", req[: 1 + i % 10])
    scores = {s.node: s.prefix_blocks for s in ix.score("m", req)}
    assert len(scores) == 130 and scores["n129"] == 10 and scores["n070"] == 1
    ix.drop_node("n005")
    ix.add("m", "new", "DISK", req[:2])
    s = {x.node: x for x in ix.score("m", req)}
    assert "n005" not in s and s["new"] == NodeScore("new", 2, 0, 0, 2)


def test_huge_request_is_bounded_in_time_and_memory():
    """1M tokens = 62,500 blocks: nobody holds it -> stops after the first chunk."""
    ix = MemoryIndex()
    rng = np.random.default_rng(2)
    held = rng.integers(0, 2**64, 70_000, dtype=np.uint64)
    ix.add("m", "a", "CPU", held)
    miss = rng.integers(0, 2**64, 62_500, dtype=np.uint64)
    t0 = time.perf_counter()
    assert ix.score("m", miss) == []
    assert time.perf_counter() - t0 < 0.5
    # fully held: all 70,000 blocks scored, memory bounded by a few arrays
    tracemalloc.start()
    t0 = time.perf_counter()
    s = ix.score("m", held)
    elapsed = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert s == [NodeScore("a", 70_000, 0, 70_000, 0)]
    assert elapsed < 5.0
    assert peak < 64 << 20


def test_prefix_scores_tier_split_with_many_mixed_nodes():
    # 40 nodes each with a different mix of GPU/CPU/DISK: exercises the
    # unpack path (more mixed nodes than the column-by-column limit)
    n, nodes = 50, 40
    rng = np.random.default_rng(3)
    tiers = rng.integers(0, 3, (n, nodes))
    rows = np.zeros((n, 3, 1), dtype=np.uint64)
    for r in range(n):
        for j in range(nodes):
            rows[r, tiers[r, j], 0] |= np.uint64(1 << j)
    alive = np.array([(1 << nodes) - 1], dtype=np.uint64)
    got = {s.node: s for s in prefix_scores(rows, alive, {j: f"n{j}" for j in range(nodes)})}
    for j in range(nodes):
        col = tiers[:, j]
        assert got[f"n{j}"] == NodeScore(
            f"n{j}", n, int((col == 0).sum()), int((col == 1).sum()), int((col == 2).sum())
        )
