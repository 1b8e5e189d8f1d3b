"""Pieces of the cluster replay: the GPU cache model and its events reaching the
indexer's index over real ZMQ and the product's policy, block payload
verification. (The strategies themselves: tests/unit/test_router_policy.py.)"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from kvstore_bench.agentic_diagnosis import Diagnosis, Tally
from kvstore_bench.agentic_engine import GpuCacheModel
from kvstore_bench.agentic_replay import block_payload, verify
from kvstore_bench.agentic_routing import EventIndex, index_scores
from kvstore_router_client import NodeLoad, make_strategy


def test_gpu_cache_events_reach_the_index_and_precise_router(tmp_path: Path) -> None:
    ep0, ep1 = f"ipc://{tmp_path}/e0", f"ipc://{tmp_path}/e1"
    g0 = GpuCacheModel("n0", 3, ep0, 16)
    g1 = GpuCacheModel("n1", 3, ep1, 16)
    index = EventIndex([ep0, ep1])
    try:
        # ZMQ's slow joiner: what n1 publishes before the subscription reaches it
        # is dropped. A new probe block each turn until one is in the index (the
        # blocks below evict them all: capacity 3).
        deadline = time.monotonic() + 15
        for probe in range(1000, 100_000):
            g1.insert(np.array([probe], dtype=np.uint64))
            index.catch_up()
            if "n1" in index.score(np.array([probe], dtype=np.uint64)):
                break
            assert time.monotonic() < deadline, "no event of n1 reached the index"
            time.sleep(0.05)
        hashes = np.array([11, 12, 13, 14], dtype=np.uint64)
        g1.insert(hashes)  # capacity 3: block 11 is evicted again
        assert g1.prefix(hashes) == 0 and g1.prefix(hashes[1:]) == 3
        router = make_strategy("cache+load")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            index.catch_up()
            s = index.score(hashes[1:]).get("n1")
            if s is not None and s.prefix_blocks == 3:
                break
            time.sleep(0.02)
        assert index.score(hashes[1:])["n1"].gpu_blocks == 3
        assert "n1" not in index.score(hashes)  # 11 was removed: no prefix from block 0
        idle = {"n0": NodeLoad(), "n1": NodeLoad()}
        scores = index_scores(index, hashes[1:])
        assert router.choose(hashes[1:], ["n0", "n1"], idle, scores).node == "n1"
    finally:
        g0.close()
        g1.close()
        index.close()


def test_block_payload_verifies_and_detects_corruption() -> None:
    hashes = np.array([5, 2**64 - 1, 42], dtype=np.uint64)
    data = block_payload(hashes, 64)
    assert data.shape == (3, 64)
    assert verify(data, hashes) == 0
    data[1, 10] ^= 1
    assert verify(data, hashes) == 1
    assert verify(data[:0], hashes[:0]) == 0


def test_diagnosis_attributes_every_recomputed_token(tmp_path: Path) -> None:
    """The recomputed tail of a request splits, in chain order, into blocks some
    finished request computed (lost: the cause of the first one), blocks only a
    running request is computing (in flight), and new ones; the tokens past the
    last whole block are the partial block. Engines only (no daemons): a lost
    block is in another engine's cache or evicted from all of them."""
    B = 16
    g0 = GpuCacheModel("n0", 8, f"ipc://{tmp_path}/e0", B)
    g1 = GpuCacheModel("n1", 8, f"ipc://{tmp_path}/e1", B)
    try:
        diag = Diagnosis([], [], [g0, g1], None, False, False, B)
        hashes = np.array([1, 2, 3, 4, 5, 6], dtype=np.uint64)
        diag.computed.update([1, 2, 3])  # a finished request computed blocks 1..3
        diag.inflight[4] = 1  # a running one is computing block 4
        g1.insert(hashes[:3])  # and node 1's engine still holds 1..3
        tally = Tally()
        # Served block 1 on node 0; 5 blocks recomputed + 7 tokens past the last block.
        recompute = 5 * B + 7
        diag.attribute(hashes, 1, recompute, 0, -1, tally)
        c = tally.recompute_causes
        assert c["other_node_gpu_only"] == 2 * B  # blocks 2, 3: on node 1 only
        assert c["in_flight"] == B and c["new"] == 2 * B and c["partial_block"] == 7
        assert sum(c.values()) == recompute
        # Once node 1 forgets them too, the same blocks are evicted everywhere.
        g1.insert(np.arange(100, 108, dtype=np.uint64))
        tally = Tally()
        diag.attribute(hashes, 1, recompute, 0, -1, tally)
        assert tally.recompute_causes["evicted_gpu"] == 2 * B
    finally:
        g0.close()
        g1.close()
