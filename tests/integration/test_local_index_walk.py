"""The router's local index (compiled prefix walk) scores as a real indexer does.

Real components: ZMQ KV-event publishers (the daemons' publisher class) for
three nodes, a `kvstore indexer` process following them with the numpy walk
(``KVSTORE_NATIVE_WALK=0``), and a ``LocalIndex`` in this process following
what the indexer lists, scoring with the compiled walk
(``kvstore.indexer.walk``). Both ingest the same events (stored in every tier,
removed, re-stored); after each round the same requests (prefixes of several
lengths, absent tails, candidates or all nodes) must get the same
``ScoreResult`` from both: the indexer's over gRPC, the local one in process.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from kvstore.events.publisher import ZmqEventPublisher
from kvstore.indexer import walk
from kvstore.router.local_index import LocalIndex
from kvstore_router_client.scorer import AsyncIndexClient
from tests.integration.test_router_ha import start_indexer

pytestmark = pytest.mark.timeout(180)

MODEL = "walk-model"
NODES = ("node-a", "node-b", "node-c")


class _NS:
    namespace_id, model, tenant, block_size_tokens = "walk", MODEL, "", 16


def test_local_index_walk_scores_as_the_real_indexer(tmp_path, monkeypatch):
    local = LocalIndex(max_bytes=1 << 30)
    assert walk.available(), "the compiled walk is not available here (numba?)"
    assert local.memory.native
    pubs = {n: ZmqEventPublisher(n, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0") for n in NODES}
    args: list[str] = []
    for n, p in pubs.items():
        args += ["--source", f"node={n},endpoint={p.endpoint},replay_endpoint={p.replay_endpoint}"]
    monkeypatch.setenv("KVSTORE_NATIVE_WALK", "0")  # the indexer process walks in numpy
    ix, addr = start_indexer(tmp_path, "indexer", args)
    local.start()
    rng = np.random.default_rng(5)
    chain = rng.integers(1, 2**63, 3000, dtype=np.uint64)
    markers = iter(range(1, 1_000_000))

    async def run() -> int:
        client = AsyncIndexClient(addr, deadline_s=5.0)
        try:
            await local.refresh(client, 5.0)
            deadline = time.monotonic() + 60
            while not local.ready()[0]:
                assert time.monotonic() < deadline, local.ready()[1]
                await asyncio.sleep(0.05)

            async def settled() -> None:
                # every node's marker block, published after its round's events,
                # held by both indexes: each stream is ordered, so the rest is too
                mark = np.array([2**63 + next(markers)], dtype=np.uint64)
                for p in pubs.values():
                    p.blocks_stored(_NS(), mark.tolist(), "CPU", None, None)
                deadline = time.monotonic() + 30
                while True:
                    there = {
                        s.node for s in local.score(MODEL, mark, NODES).hits if s.prefix_blocks
                    }
                    remote = await client.scores(MODEL, mark, NODES)
                    there &= {s.node for s in remote.hits if s.prefix_blocks}
                    if there == set(NODES):
                        return
                    assert time.monotonic() < deadline, "events not ingested by both"
                    await asyncio.sleep(0.02)

            compared = 0
            for rnd in range(4):
                for p in pubs.values():
                    for medium in ("CPU", "GPU", "DISK"):
                        if rng.random() < 0.7:
                            k = int(rng.integers(1, chain.size))
                            p.blocks_stored(_NS(), chain[:k].tolist(), medium, None, None)
                    if rnd:  # holes in a prefix, in one tier or all
                        lo = int(rng.integers(0, chain.size - 50))
                        for medium in ("CPU", "GPU", "DISK")[: int(rng.integers(1, 4))]:
                            p.blocks_removed(_NS(), chain[lo : lo + 40].tolist(), medium)
                await settled()
                for _ in range(25):
                    k = int(rng.integers(1, chain.size + 200))
                    q = np.concatenate([chain, rng.integers(1, 2**63, 200, dtype=np.uint64)])[:k]
                    cand = list(NODES) if rng.random() < 0.5 else [NODES[int(rng.integers(0, 3))]]
                    want = await client.scores(MODEL, q, cand)
                    got = local.score(MODEL, q, cand)
                    assert got == want, (rnd, k, cand)
                    compared += any(h.prefix_blocks for h in want.hits)
            return compared

        finally:
            await client.close()

    try:
        assert asyncio.run(run()) > 50
        assert "the Score walks in numpy" in (tmp_path / "indexer.log").read_text()
    finally:
        local.close()
        ix.terminate()
        ix.wait(20)
        for p in pubs.values():
            p.close()
