"""kvstore_router_client against a real indexer (and against no indexer at all)."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from kvstore.errors import InvalidRequest
from kvstore.events.publisher import ZmqEventPublisher
from kvstore.indexer.config import IndexerConfig
from kvstore.indexer.service import Indexer, serve
from kvstore.indexer.subscriber import SourceSpec
from kvstore_bench.ports import dead_address
from kvstore_router_client import NodeHit, Policy, RouterClient, ScoreResult, choose


class NS:
    def __init__(self, model: str = "llama") -> None:
        self.namespace_id = "ns"
        self.model = model
        self.tenant = ""
        self.block_size_tokens = 16


def wait_for(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"condition not reached within {timeout_s:.1f}s")


def test_policy_weighs_tiers_and_load():
    r = ScoreResult(
        request_blocks=100,
        hits=[
            NodeHit("gpu-short", 50, 50, 0, 0),  # 0.50
            NodeHit("dram-long", 90, 0, 90, 0),  # 0.63
            NodeHit("disk-full", 100, 0, 0, 100),  # 0.50
        ],
    )
    assert choose(r, ["gpu-short", "dram-long", "disk-full"], "d").node == "dram-long"
    # a busy node loses its lead (0.63 - 0.05 * 4 < 0.50)
    busy = choose(
        r, ["gpu-short", "dram-long", "disk-full"], "d", load={"dram-long": 4.0, "disk-full": 0.1}
    )
    assert busy.node == "gpu-short" and busy.reason == "prefix"
    # the pull hint names the node holding the longest prefix
    assert (busy.peer, busy.peer_blocks) == ("disk-full", 50)
    # a pull credited: a GPU prefix plus pulling the rest (0.50 + 0.5 * 40/100) beats
    # the longer DRAM prefix (0.63 + 0.5 * 10/100)
    pulls = choose(r, ["gpu-short", "dram-long"], "d", policy=Policy(peer_weight=0.5))
    assert (pulls.node, pulls.value) == ("gpu-short", pytest.approx(0.7))
    # equal value: the less loaded wins (disk-full 1.00 - 0.05 * 10 = gpu-short 0.50)
    tie = choose(
        r, ["gpu-short", "disk-full"], "d", load={"disk-full": 10.0}, policy=Policy(disk_weight=1.0)
    )
    assert tie.node == "gpu-short" and tie.value == pytest.approx(0.5)
    # only candidates count; no hit -> the caller's default
    assert choose(r, ["elsewhere"], "d").node == "d"
    assert choose(r, ["elsewhere"], "d").reason == "no_hit"
    strict = choose(r, ["gpu-short"], "d", policy=Policy(min_prefix_blocks=60))
    assert strict.node == "d"
    gpu_first = choose(r, ["gpu-short", "dram-long"], "d", policy=Policy(cpu_weight=0.5))
    assert gpu_first.node == "gpu-short"


@pytest.fixture
def cluster():
    pubs = {
        n: ZmqEventPublisher(n, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0") for n in ("a", "b", "c")
    }
    ix = Indexer(
        IndexerConfig(
            sources=[
                SourceSpec(node=n, endpoint=p.endpoint, replay_endpoint=p.replay_endpoint)
                for n, p in pubs.items()
            ]
        )
    )
    ix.start()
    server, port = serve(ix, "127.0.0.1:0")
    try:
        yield pubs, ix, f"127.0.0.1:{port}"
    finally:
        server.stop(0)
        ix.close()
        for p in pubs.values():
            p.close()


def test_pick_routes_to_the_node_holding_the_prefix(cluster):
    pubs, ix, addr = cluster
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 120_000, 16 * 64)
    with RouterClient(addr, deadline_s=2.0) as rc:
        hashes = rc.hash(prompt)
        assert hashes.size == 64
        pubs["a"].blocks_stored(NS(), hashes[:10], "CPU", None, None)
        pubs["b"].blocks_stored(NS(), hashes[:48], "CPU", None, None)
        pubs["c"].blocks_stored(NS(), hashes[:30], "GPU", None, None)
        wait_for(lambda: len(ix.score("llama", hashes)) == 3)
        d = rc.pick("llama", prompt, ["a", "b", "c"], default="a")
        # b: 48*0.7/64 = 0.525 beats c: 30*1.0/64 = 0.47
        assert (d.node, d.reason, d.hit.prefix_blocks) == ("b", "prefix", 48)
        # b, the previous turn's node (+0.1 affinity), loaded: 0.525 + 0.1 - 0.05 * 4 < 0.47
        d = rc.pick("llama", prompt, ["a", "b", "c"], default="a", load={"b": 4.0})
        assert d.node == "c"
        # another tenant's salt: nothing cached -> default
        d = rc.pick("llama", prompt, ["a", "b", "c"], default="a", cache_salt="tenant-9")
        assert (d.node, d.reason) == ("a", "no_hit")
        with pytest.raises(InvalidRequest):
            rc.scores("llama", np.zeros(300_000, dtype=np.uint64))


def test_unreachable_indexer_falls_back_within_deadline():
    with RouterClient(dead_address(), deadline_s=0.2) as rc:
        t0 = time.monotonic()
        d = rc.pick("llama", list(range(64)), ["a", "b"], default="b")
        assert (d.node, d.reason) == ("b", "fallback")
        assert time.monotonic() - t0 < 2.0
        assert d.error


def test_silent_indexer_hits_the_deadline():
    # a listener that accepts TCP but never speaks HTTP/2: the call must not hang
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        port = srv.getsockname()[1]
        with RouterClient(f"127.0.0.1:{port}", deadline_s=0.3) as rc:
            t0 = time.monotonic()
            d = rc.pick("llama", list(range(64)), ["a"], default="a")
            elapsed = time.monotonic() - t0
        assert d.reason == "fallback" and "DeadlineExceeded" in d.error
        assert elapsed < 2.0
