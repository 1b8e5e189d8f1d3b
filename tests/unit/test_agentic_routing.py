"""Pieces of the cluster replay: routers, the GPU cache model and its events
reaching the indexer's index over real ZMQ, block payload verification."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from bench import agentic as A


def test_approximate_router_follows_what_it_routed_and_forgets_lru() -> None:
    r = A.ApproximateRouter(3, capacity_blocks=4)
    a = np.array([1, 2, 3], dtype=np.uint64)
    b = np.array([7, 8, 9], dtype=np.uint64)
    assert r.choose(a, [0, 0, 0]) == 0  # nothing known: ties go to the lowest index
    r.routed(2, a)
    assert r.choose(a, [0, 0, 0]) == 2
    r.routed(2, b)  # capacity 4: blocks 1 and 2 of `a` are forgotten
    assert r.choose(a, [0, 0, 0]) == 0
    assert r.choose(b, [0, 0, 0]) == 2


def test_load_score_moves_work_off_a_long_queue() -> None:
    # llm-d's weights: prefix 3, queue headroom 2. A full prefix (3) beats an
    # empty queue (2); a 20% prefix (0.6) does not.
    assert A._pick([1.0, 0.0], [5, 0]) == 0
    # a partial prefix does not outweigh a full queue
    assert A._pick([0.2, 0.0], [5, 0]) == 1
    assert A._pick([0.0, 0.0], [3, 1]) == 1


def test_round_robin_and_random_are_deterministic() -> None:
    rr = A.RoundRobinRouter(3)
    h = np.zeros(0, dtype=np.uint64)
    assert [rr.choose(h, [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    r1, r2 = A.RandomRouter(5, seed=3), A.RandomRouter(5, seed=3)
    assert [r1.choose(h, [0] * 5) for _ in range(20)] == [r2.choose(h, [0] * 5) for _ in range(20)]


def test_gpu_cache_events_reach_the_index_and_precise_router(tmp_path: Path) -> None:
    ep0, ep1 = f"ipc://{tmp_path}/e0", f"ipc://{tmp_path}/e1"
    g0 = A.GpuCacheModel("n0", 3, ep0, 16)
    g1 = A.GpuCacheModel("n1", 3, ep1, 16)
    index = A.EventIndex([ep0, ep1])
    try:
        time.sleep(0.3)  # ZMQ slow joiner
        hashes = np.array([11, 12, 13, 14], dtype=np.uint64)
        g1.insert(hashes)  # capacity 3: block 11 is evicted again
        assert g1.prefix(hashes) == 0 and g1.prefix(hashes[1:]) == 3
        router = A.PreciseRouter(["n0", "n1"], index)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            index.catch_up()
            s = index.score(hashes[1:]).get("n1")
            if s is not None and s.prefix_blocks == 3:
                break
            time.sleep(0.02)
        assert index.score(hashes[1:])["n1"].gpu_blocks == 3
        assert "n1" not in index.score(hashes)  # 11 was removed: no prefix from block 0
        assert router.choose(hashes[1:], [0, 0]) == 1
    finally:
        g0.close()
        g1.close()
        index.close()


def test_block_payload_verifies_and_detects_corruption() -> None:
    hashes = np.array([5, 2**64 - 1, 42], dtype=np.uint64)
    data = A.block_payload(hashes, 64)
    assert data.shape == (3, 64)
    assert A.verify(data, hashes) == 0
    data[1, 10] ^= 1
    assert A.verify(data, hashes) == 1
    assert A.verify(data[:0], hashes[:0]) == 0


def test_diagnosis_attributes_every_recomputed_token(tmp_path: Path) -> None:
    """The recomputed tail of a request splits, in chain order, into blocks some
    finished request computed (lost: the cause of the first one), blocks only a
    running request is computing (in flight), and new ones; the tokens past the
    last whole block are the partial block. Engines only (no daemons): a lost
    block is in another engine's cache or evicted from all of them."""
    B = 16
    g0 = A.GpuCacheModel("n0", 8, f"ipc://{tmp_path}/e0", B)
    g1 = A.GpuCacheModel("n1", 8, f"ipc://{tmp_path}/e1", B)
    try:
        diag = A.Diagnosis([], [], [g0, g1], None, False, False, B)
        hashes = np.array([1, 2, 3, 4, 5, 6], dtype=np.uint64)
        diag.computed.update([1, 2, 3])  # a finished request computed blocks 1..3
        diag.inflight[4] = 1  # a running one is computing block 4
        g1.insert(hashes[:3])  # and node 1's engine still holds 1..3
        tally = A.Tally()
        # Served block 1 on node 0; 5 blocks recomputed + 7 tokens past the last block.
        recompute = 5 * B + 7
        diag.attribute(hashes, 1, recompute, 0, -1, tally)
        c = tally.recompute_causes
        assert c["other_node_gpu_only"] == 2 * B  # blocks 2, 3: on node 1 only
        assert c["in_flight"] == B and c["new"] == 2 * B and c["partial_block"] == 7
        assert sum(c.values()) == recompute
        # Once node 1 forgets them too, the same blocks are evicted everywhere.
        g1.insert(np.arange(100, 108, dtype=np.uint64))
        tally = A.Tally()
        diag.attribute(hashes, 1, recompute, 0, -1, tally)
        assert tally.recompute_causes["evicted_gpu"] == 2 * B
    finally:
        g0.close()
        g1.close()
