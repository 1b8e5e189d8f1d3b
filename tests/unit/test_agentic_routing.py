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
