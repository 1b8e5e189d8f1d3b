"""`router.index = "local"`: the router's own index, on real daemons and a real indexer.

Real components: `kvstore serve` daemons publishing KV events (port 0) with
their Snapshot RPC, a `kvstore indexer` process following them (configured
sources with the engines' URLs), `kvstore router` processes, HTTP clients. The
engines are ``_engine_http``'s minimal real HTTP engine (what is under test is
the decision, made from the index; the engine path is tested on vLLM in
test_router_vllm.py). Nothing stands in for the index: the local index is the
indexer's own code in the router, fed by the daemons' event streams.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.hashing import BlockHasher
from kvstore.router.local_index import LocalIndex
from kvstore_router_client.scorer import AsyncIndexClient
from tests.conftest import make_spec
from tests.integration._engine_http import Engine
from tests.integration.test_router_ha import completion, healthy, start_indexer, wait_for
from tests.integration.test_router_vllm import Http, log_tail, start_router, stop

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("aiohttp") is None, reason="aiohttp missing"),
    pytest.mark.timeout(300),
]

BS = 16
EVENTS = {
    "events.enabled": True,
    "events.publish_address": "tcp://127.0.0.1:0",
    "events.replay_address": "tcp://127.0.0.1:0",
}


def metric(r: Http, name: str, labels: str = "") -> float:
    """A sample of the router's /metrics (0 when absent)."""
    text = r.get("/metrics")[1].decode()
    pat = re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" ([0-9.e+-]+)"
    m = re.search(r"^" + pat + "$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def local_scores(r: Http) -> float:
    return metric(r, "kvstore_router_scores_total", 'source="local"')


def indexer_scores(r: Http) -> float:
    return metric(r, "kvstore_router_scores_total", 'source="indexer"')


def in_step(r: Http, sources: int) -> bool:
    return (
        metric(r, "kvstore_router_local_index_connected_sources") == sources
        and metric(r, "kvstore_router_local_index_stale_seconds") == 0.0
    )


def start_cluster(daemon_factory, tmp_path: Path, routers: dict[str, dict[str, str]]):  # type: ignore[no-untyped-def]
    daemons = {n: daemon_factory(n, tcp=True, settings=EVENTS) for n in ("node-a", "node-b")}
    engines = {n: Engine(n) for n in daemons}
    procs = []
    sources = []
    for n, d in daemons.items():
        pub, rep = d.info["events_publish_address"], d.info["events_replay_address"]
        sources += [
            "--source",
            f"node={n},endpoint={pub},replay_endpoint={rep},snapshot_address={d.address},"
            f"engine_url={engines[n].url}",
        ]
    ix, addr = start_indexer(tmp_path, "indexer", sources)
    procs.append(ix)
    out = {}
    for name, extra in routers.items():
        settings = {
            "indexer": addr,
            "backends_from_indexer": "true",
            "backends_refresh_s": "0.2",
            "local_index_refresh_s": "0.2",
            "scrape_interval_s": "0.1",
            "decision_deadline_s": "5",  # a loaded 2-core box; a load fallback fails the test
            **extra,
        }
        proc, r = start_router(tmp_path, name, settings)
        procs.append(proc)
        out[name] = r
    for r in out.values():
        wait_for(lambda r=r: healthy(r) == ["node-a", "node-b"], 60, "backends from indexer")
    return daemons, engines, procs, out


def test_local_index_decides_as_the_indexers_score_and_replicas_converge(daemon_factory, tmp_path):
    """Two routers with ``index = "local"`` and one on the indexer's Score, all
    following the same two daemons. For each state of the daemons' blocks (a
    longer prefix on node-a; then most of it deleted there and more stored on
    node-b; then a prompt nobody holds), the three choose the same engine for
    the same reason, the local ones scoring in process (their metric) and the
    reference at the indexer. The local indexes hold a daemon's new blocks
    within a bounded wait (staleness in step: the event stream's delivery).
    With the indexer stopped, the local routers still follow the daemons (a new
    longest prefix on node-a), scoring in process; the reference cannot."""
    local = {"index": "local"}
    daemons, engines, procs, routers = start_cluster(
        daemon_factory,
        tmp_path,
        {"local-1": local, "local-2": local, "reference": {"index": "indexer"}},
    )
    clients = {n: Client(d.address) for n, d in daemons.items()}
    try:
        for name in ("local-1", "local-2"):
            wait_for(lambda n=name: in_step(routers[n], 2), 60, f"{name} in step")
        rng = np.random.default_rng(11)
        tokens = [int(t) for t in rng.integers(0, 30_000, 24 * BS)]
        hashes = BlockHasher(BS).hash_tokens_int(np.array(tokens))
        blocks = np.zeros((24, 4096), dtype=np.uint8)
        ns = {n: c.declare_namespace(make_spec(4096, model="tiny")) for n, c in clients.items()}

        def decide(ids: list[int]) -> dict[str, tuple[str, str]]:
            out = {}
            for name, r in routers.items():
                status, headers, body = r.post("/v1/completions", completion(ids))
                assert status == 200, body
                assert body["choices"][0]["text"] == headers["x-kvstore-backend"]
                out[name] = (headers["x-kvstore-backend"], headers["x-kvstore-route"])
            return out

        def alike(ids: list[int], want: tuple[str, str]) -> bool:
            return set(decide(ids).values()) == {want}

        assert clients["node-a"].put(ns["node-a"], hashes[:20], blocks[:20]).stored == 20
        assert clients["node-b"].put(ns["node-b"], hashes[:8], blocks[:8]).stored == 8
        wait_for(lambda: alike(tokens, ("node-a", "prefix")), 30, "all route to node-a by prefix")
        clients["node-a"].delete(ns["node-a"], hashes[4:20])
        assert clients["node-b"].put(ns["node-b"], hashes[8:16], blocks[8:16]).stored == 8
        wait_for(lambda: alike(tokens, ("node-b", "prefix")), 30, "all follow to node-b")
        # Nobody holds it, node-a's engine loaded: load decides, alike.
        engines["node-a"].running = 6.0
        for r in routers.values():
            wait_for(
                lambda r=r: (
                    'engine_requests{backend="node-a"} 6.0' in r.get("/metrics")[1].decode()
                ),
                30,
                "load scraped",
            )
        fresh = [int(t) for t in rng.integers(0, 30_000, 6 * BS)]
        assert set(decide(fresh).values()) == {("node-b", "load")}
        # The local routers scored here, every time; the reference at the indexer.
        for name in ("local-1", "local-2"):
            assert local_scores(routers[name]) >= 3, name
            assert indexer_scores(routers[name]) == 0, name
        assert local_scores(routers["reference"]) == 0
        assert indexer_scores(routers["reference"]) >= 3

        # The indexer stops: the local copies follow the daemons, not it, so they
        # keep scoring (and follow a change) while the reference falls back to load.
        stop(procs[0])
        for name in ("local-1", "local-2"):
            wait_for(
                lambda n=name: (
                    metric(routers[n], "kvstore_router_local_index_list_age_seconds") > 1.0
                ),
                30,
                f"{name} has missed a source-list read",
            )
        clients["node-a"].delete(ns["node-a"], hashes[:4])
        assert clients["node-a"].put(ns["node-a"], hashes[:22], blocks[:22]).stored == 22

        def locals_follow() -> bool:
            got = decide(tokens)
            return got["local-1"] == got["local-2"] == ("node-a", "prefix")

        wait_for(locals_follow, 30, "the local routers follow the daemons without the indexer")
        assert decide(tokens)["reference"][1] in ("fallback", "affinity", "load")
        for name in ("local-1", "local-2"):
            assert indexer_scores(routers[name]) == 0, name
    finally:
        for c in clients.values():
            c.close()
        for p in procs:
            stop(p)
        for e in engines.values():
            e.close()


def test_an_event_stream_down_falls_back_to_the_indexer_and_memory_is_bounded(
    daemon_factory, tmp_path
):
    """A local router in step scores in process; node-b's daemon killed (its event
    stream gone), the router is out of step at once: its staleness gauge counts
    up, every decision is scored at the indexer (still by prefix, still served)
    and none in process. A router whose local index may hold only 1 KiB drops it
    at its first table and scores at the indexer from then on."""
    daemons, engines, procs, routers = start_cluster(
        daemon_factory,
        tmp_path,
        {
            "local": {"index": "local"},
            "tiny": {"index": "local", "local_index_max_bytes": "1024"},
        },
    )
    client = Client(daemons["node-a"].address)
    r, tiny = routers["local"], routers["tiny"]
    try:
        # Both in step before the store: a router that subscribes after it would see
        # no table to outgrow (under load the tiny one could still be connecting).
        wait_for(lambda: in_step(r, 2) and in_step(tiny, 2), 60, "in step")
        rng = np.random.default_rng(5)
        tokens = [int(t) for t in rng.integers(0, 30_000, 12 * BS)]
        hashes = BlockHasher(BS).hash_tokens_int(np.array(tokens))
        ns = client.declare_namespace(make_spec(4096, model="tiny"))
        assert client.put(ns, hashes, np.zeros((12, 4096), dtype=np.uint8)).stored == 12

        def routed() -> tuple[str, str]:
            status, headers, body = r.post("/v1/completions", completion(tokens))
            assert status == 200, body
            return headers["x-kvstore-backend"], headers["x-kvstore-route"]

        wait_for(lambda: routed() == ("node-a", "prefix"), 30, "routed by the local index")
        assert indexer_scores(r) == 0 and local_scores(r) >= 1
        # Its start-up heap frozen after one full collection (kvstore.heap), counted.
        assert metric(r, "kvstore_gc_pause_seconds_count", 'generation="2"') >= 1
        assert metric(r, "kvstore_gc_frozen_objects") > 10_000

        daemons["node-b"].kill()
        wait_for(lambda: metric(r, "kvstore_router_local_index_stale_seconds") > 0, 30, "stale")
        assert metric(r, "kvstore_router_local_index_connected_sources") == 1
        before = local_scores(r)
        for _ in range(3):
            assert routed() == ("node-a", "prefix")  # the indexer's Score, same answer
        assert local_scores(r) == before
        assert indexer_scores(r) >= 3
        # still out of step, and it says for how long
        assert metric(r, "kvstore_router_local_index_stale_seconds") > 0

        # The 1 KiB router: drops its index at the first table (no longer follows
        # anything), then scores at the indexer.
        try:
            wait_for(lambda: metric(tiny, "kvstore_router_local_index_sources") == 0, 60, "dropped")
        except AssertionError as e:  # seen once in CI (1 run in ~5): say what the router saw
            metrics = [
                line
                for line in tiny.get("/metrics")[1].decode().splitlines()
                if line.startswith("kvstore_router_local_index")
            ]
            raise AssertionError(f"{e}\n{metrics}\n{log_tail(tmp_path / 'tiny.log', 60)}") from None
        status, _, body = tiny.post("/v1/completions", completion(tokens))
        assert status == 200, body
        assert local_scores(tiny) == 0 and indexer_scores(tiny) >= 1
        assert metric(tiny, "kvstore_router_local_index_bytes") == 0
    finally:
        client.close()
        for p in procs:
            stop(p)
        for e in engines.values():
            e.close()


def test_a_copy_dropped_while_the_source_list_is_read_follows_nothing(tmp_path):
    """The cause of a CI failure of the test above (the 1 KiB router kept following
    its sources for 60 s): the router re-reads the indexer's source list (refresh)
    while its checker drops the copy; the list answered after the drop was followed
    again, and a dropped copy is never measured again, so its tables could grow
    without bound. Here the drop happens while a real indexer's ListNodes is in
    flight: the answer must not bring any source back."""
    ix, addr = start_indexer(
        tmp_path,
        "indexer",
        ["--source", "node=n1,endpoint=tcp://127.0.0.1:9,replay_endpoint=tcp://127.0.0.1:9"],
    )
    li = LocalIndex(max_bytes=1024)
    li.start()
    try:
        li.memory.add("tiny", "n0", "CPU", np.arange(1, 1001, dtype=np.uint64))

        async def run() -> None:
            catalog = AsyncIndexClient(addr)
            try:
                # the first read follows the list (the copy is not dropped yet)
                await li.refresh(catalog, 10.0)
                assert [s.node for s in li.indexer.subscriber.sources()] == ["n1"]
                li.listed_at = None
                reading = asyncio.create_task(li.refresh(catalog, 10.0))
                await asyncio.sleep(0)  # the refresh now waits for ListNodes' answer
                assert li.check()[0] is False and "outgrew" in li.dropped
                assert li.indexer.subscriber.sources() == []
                await reading  # the answer lists n1 again
            finally:
                await catalog.close()

        asyncio.run(run())
        assert li.indexer.subscriber.sources() == []
        assert li.check() == (False, li.dropped)
    finally:
        li.close()
        stop(ix)
