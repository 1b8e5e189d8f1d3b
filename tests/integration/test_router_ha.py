"""`kvstore router` high availability and backends registered at the indexer.

Real components: `kvstore serve` daemons publishing events (port 0, bound
addresses read from their ready line), a real `redis-server`, `kvstore indexer`
processes on it (`--backend redis`), `kvstore router` processes, HTTP clients.

The engines are the minimal real HTTP engine of ``_engine_http`` (``/metrics``,
``/v1/models``, ``/tokenize``, ``/v1/completions``), not vLLM: what is under test
is the router's decision, which comes from the indexers' Score over Redis and the
engines' load gauges, and its forwarding; no model is needed for either. The
engine path itself is tested on vLLM CPU servers in test_router_vllm.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis

from kvstore.client import Client
from kvstore.hashing import BlockHasher
from kvstore.indexer.config import IndexerConfig
from kvstore.indexer.service import Indexer, serve
from kvstore.indexer.subscriber import SourceSpec
from kvstore.v1 import indexer_pb2, indexer_pb2_grpc
from tests.conftest import make_spec
from tests.integration._engine_http import Engine
from tests.integration._redis import redis_server  # noqa: F401  (pytest fixture)
from tests.integration.test_router_vllm import Http, start_router, stop

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("aiohttp") is None, reason="aiohttp missing"),
    pytest.mark.timeout(300),
]

REPO = Path(__file__).resolve().parents[2]
BS = 16


def wait_for(cond, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout_s:.0f} s")
        time.sleep(0.05)


def start_indexer(tmp: Path, name: str, args: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "kvstore", "indexer", "--address", "127.0.0.1:0", *args]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with open(tmp / f"{name}.log", "wb") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err)
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode()
        if not line and proc.poll() is not None:
            raise AssertionError(
                f"indexer exited {proc.returncode}: {(tmp / f'{name}.log').read_text()}"
            )
        m = re.search(r"listening on ([\d.]+:\d+)", line)
        if m:
            return proc, m.group(1)
    raise AssertionError("indexer did not start")


def completion(ids: list[int]) -> dict:
    return {"model": "tiny", "prompt": ids, "max_tokens": 1}


def healthy(r: Http) -> list[str]:
    _, data = r.get("/health")
    return sorted(json.loads(data)["healthy_backends"])


def test_two_routers_on_two_indexers_over_one_redis_decide_alike_and_survive_a_kill(
    daemon_factory,
    redis_server,  # noqa: F811
    tmp_path,
):
    """Two indexers follow the same two daemons into one Redis (one answers Score
    from its mirror of Redis, the other reads Redis directly); a router on each,
    taking its backends from its own indexer. Given the same state (the daemons'
    blocks, the engines' load gauges), both choose the same engine for the same
    request, for the reason expected. One router killed (SIGKILL) between a
    client's requests: the client, retrying on connection refused, has every
    later request served by the other."""
    events = {
        "events.enabled": True,
        "events.publish_address": "tcp://127.0.0.1:0",
        "events.replay_address": "tcp://127.0.0.1:0",
    }
    daemons = {n: daemon_factory(n, tcp=True, settings=events) for n in ("node-a", "node-b")}
    engines = {n: Engine(n) for n in daemons}
    procs: list[subprocess.Popen] = []
    try:
        sources = []
        for n, d in daemons.items():
            pub, rep = d.info["events_publish_address"], d.info["events_replay_address"]
            assert not pub.endswith(":0") and not rep.endswith(":0")
            sources += [
                "--source",
                f"node={n},endpoint={pub},replay_endpoint={rep},engine_url={engines[n].url}",
            ]
        direct = tmp_path / "direct.toml"
        direct.write_text('[indexer]\nredis_read = "direct"\n')
        redis_args = ["--backend", "redis", "--redis-url", redis_server.url, *sources]
        ix1, addr1 = start_indexer(tmp_path, "indexer-1", redis_args)
        procs.append(ix1)
        ix2, addr2 = start_indexer(tmp_path, "indexer-2", ["--config", str(direct), *redis_args])
        procs.append(ix2)
        routers = []
        for i, addr in enumerate((addr1, addr2)):
            settings = {
                "indexer": addr,
                "backends_from_indexer": "true",
                "backends_refresh_s": "0.2",
                "scrape_interval_s": "0.1",
                "decision_deadline_s": "5",  # a loaded 2-core box; a fallback fails the test
            }
            proc, r = start_router(tmp_path, f"router-{i}", settings)
            procs.append(proc)
            routers.append(r)
        for r in routers:
            wait_for(lambda r=r: healthy(r) == ["node-a", "node-b"], 30, "backends from indexer")

        rng = np.random.default_rng(7)
        tokens = [int(t) for t in rng.integers(0, 30_000, 24 * BS)]
        hashes = BlockHasher(BS).hash_tokens_int(np.array(tokens))
        blocks = np.zeros((24, 4096), dtype=np.uint8)
        clients = {n: Client(d.address) for n, d in daemons.items()}
        ns = {n: c.declare_namespace(make_spec(4096, model="tiny")) for n, c in clients.items()}
        try:
            assert clients["node-a"].put(ns["node-a"], hashes[:20], blocks[:20]).stored == 20
            assert clients["node-b"].put(ns["node-b"], hashes[:8], blocks[:8]).stored == 8

            def decide(ids: list[int]) -> list[tuple[str, str]]:
                out = []
                for r in routers:
                    status, headers, body = r.post("/v1/completions", completion(ids))
                    assert status == 200, body
                    # forwarded where it says
                    assert body["choices"][0]["text"] == headers["x-kvstore-backend"]
                    out.append((headers["x-kvstore-backend"], headers["x-kvstore-route"]))
                return out

            # 1. node-a holds the longer prefix: both indexers see it in Redis.
            wait_for(
                lambda: decide(tokens) == [("node-a", "prefix")] * 2, 30, "both route by prefix"
            )
            # The index both read is Redis's: both nodes have ids there, and
            # indexer-2 (redis_read = "direct") answers every Score from it.
            r_ = redis.Redis.from_url(redis_server.url)
            assert sorted(r_.hkeys("kvidx:nodes")) == [b"node-a", b"node-b"]
            r_.close()
            # 2. node-a loses most of it; node-b gets more: both follow.
            clients["node-a"].delete(ns["node-a"], hashes[4:20])
            assert clients["node-b"].put(ns["node-b"], hashes[8:16], blocks[8:16]).stored == 8
            wait_for(lambda: decide(tokens) == [("node-b", "prefix")] * 2, 30, "both follow")
            # 3. a prompt nobody holds, node-a's engine loaded: load decides, alike
            # (node-a would win the tie on its name). Asked once, after both have
            # scraped the load: a first answer is remembered (affinity).
            engines["node-a"].running = 6.0
            for r in routers:
                wait_for(
                    lambda r=r: (
                        'engine_requests{backend="node-a"} 6.0' in r.get("/metrics")[1].decode()
                    ),
                    30,
                    "load scraped",
                )
            fresh = [int(t) for t in rng.integers(0, 30_000, 6 * BS)]
            assert decide(fresh) == [("node-b", "load")] * 2
        finally:
            for c in clients.values():
                c.close()

        # Failover: a client with both routers' addresses, retrying on refused.
        served_before = sum(e.served() for e in engines.values())
        paused, resume = threading.Event(), threading.Event()
        results: list[int] = []
        refused = [0]

        def client() -> None:
            for i in range(8):
                if i == 3:
                    paused.set()
                    resume.wait(30)
                ids = [int(t) for t in rng.integers(0, 30_000, 3 * BS)]
                for r in routers:
                    try:
                        status, _, _ = r.post("/v1/completions", completion(ids))
                    except ConnectionRefusedError:
                        refused[0] += 1
                        continue
                    results.append(status)
                    break
                else:
                    results.append(0)

        t = threading.Thread(target=client)
        t.start()
        assert paused.wait(60)
        procs[2].kill()  # router-0, no graceful stop
        procs[2].wait(10)
        resume.set()
        t.join(120)
        assert results == [200] * 8, results
        assert refused[0] == 5  # every request after the kill went to router-1 after one refusal
        assert sum(e.served() for e in engines.values()) - served_before == 8
    finally:
        for p in procs:
            stop(p)
        for e in engines.values():
            e.close()


def test_router_takes_backends_registered_at_the_indexer(tmp_path):
    """A node registered over the indexer's gRPC with an engine_url joins the
    router's backends within a refresh, is routed to, and leaves when it
    unregisters; a configured source's engine_url is listed too; the router's
    static list wins for a node in both; a bad engine_url is refused at
    registration."""
    engines = {n: Engine(n) for n in ("node-a", "node-b", "node-c")}
    ix = Indexer(
        IndexerConfig(
            sources=[
                SourceSpec(
                    node="node-a",
                    endpoint="tcp://127.0.0.1:9",  # nothing publishes: a catalog entry only
                    engine_url=engines["node-a"].url,
                ),
                SourceSpec(
                    node="node-c", endpoint="tcp://127.0.0.1:9", engine_url="http://127.0.0.1:9"
                ),
            ]
        )
    )
    ix.start()
    server, port = serve(ix, "127.0.0.1:0")
    proc = None
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = indexer_pb2_grpc.IndexerServiceStub(ch)
            listed = {
                i.source.node: i.source.engine_url
                for i in stub.ListNodes(indexer_pb2.ListNodesRequest()).sources
            }
            assert listed == {"node-a": engines["node-a"].url, "node-c": "http://127.0.0.1:9"}
            with pytest.raises(grpc.RpcError) as bad:
                stub.RegisterNode(
                    indexer_pb2.RegisterNodeRequest(
                        source=indexer_pb2.EventSource(
                            node="node-x", endpoint="tcp://127.0.0.1:9", engine_url="ftp://x"
                        )
                    )
                )
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "engine_url" in (bad.value.details() or "")

            settings = {
                "indexer": f"127.0.0.1:{port}",
                "backends_from_indexer": "true",
                "backends_refresh_s": "0.2",
                "scrape_interval_s": "0.1",
                # static wins over the indexer's (unreachable) URL for node-c
                "backends.node-c": engines["node-c"].url,
                "strategy": "round-robin",
            }
            proc, r = start_router(tmp_path, "router", settings)
            wait_for(lambda: healthy(r) == ["node-a", "node-c"], 30, "configured + static")

            src = indexer_pb2.EventSource(
                node="node-b", endpoint="tcp://127.0.0.1:9", engine_url=engines["node-b"].url
            )
            token = stub.RegisterNode(indexer_pb2.RegisterNodeRequest(source=src)).owner_token
            wait_for(lambda: healthy(r) == ["node-a", "node-b", "node-c"], 30, "registered joins")
            seen = set()
            for _ in range(6):
                status, headers, body = r.post("/v1/completions", completion([1, 2, 3]))
                assert status == 200, body
                assert body["choices"][0]["text"] == headers["x-kvstore-backend"]
                seen.add(headers["x-kvstore-backend"])
            assert seen == {"node-a", "node-b", "node-c"}
            assert engines["node-b"].served() == 2

            stub.UnregisterNode(indexer_pb2.UnregisterNodeRequest(node="node-b", owner_token=token))
            wait_for(lambda: healthy(r) == ["node-a", "node-c"], 30, "unregistered leaves")
            before = engines["node-b"].served()
            for _ in range(4):
                status, headers, _ = r.post("/v1/completions", completion([1, 2, 3]))
                assert status == 200 and headers["x-kvstore-backend"] != "node-b"
            assert engines["node-b"].served() == before
    finally:
        if proc is not None:
            stop(proc)
        server.stop(0)
        ix.close()
        for e in engines.values():
            e.close()


def _counter(r: Http, name: str, labels: str) -> float:
    _, text = r.get("/metrics")
    key = f"{name}{{{labels}}} " if labels else f"{name} "
    for line in text.decode().splitlines():
        if line.startswith(key):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_long_token_prompt_resent_is_read_past_its_previous_bytes_and_routed_by_prefix(
    daemon_factory, tmp_path
):
    """An agent's 12k-token context sent as token ids, then re-sent with a new tail:
    the router reads only the tail's ids from the body (the rest are the previous
    turn's bytes, unchanged), and every turn routes to the node whose daemon holds
    the prefix: also the same ids spaced otherwise (read in full), and a turn
    whose tail is not integers is a 400."""
    events = {
        "events.enabled": True,
        "events.publish_address": "tcp://127.0.0.1:0",
        "events.replay_address": "tcp://127.0.0.1:0",
    }
    daemons = {n: daemon_factory(n, tcp=True, settings=events) for n in ("node-a", "node-b")}
    engines = {n: Engine(n) for n in daemons}
    ix = Indexer(
        IndexerConfig(
            sources=[
                SourceSpec(
                    node=n,
                    endpoint=d.info["events_publish_address"],
                    replay_endpoint=d.info["events_replay_address"],
                )
                for n, d in daemons.items()
            ]
        )
    )
    ix.start()
    server, port = serve(ix, "127.0.0.1:0")
    proc = None
    try:
        rng = np.random.default_rng(11)
        tokens = [int(t) for t in rng.integers(0, 30_000, 750 * BS)]
        hashes = BlockHasher(BS).hash_tokens_int(np.array(tokens))
        with Client(daemons["node-b"].address) as c:
            ns = c.declare_namespace(make_spec(4096, model="tiny"))
            blocks = np.zeros((700, 4096), dtype=np.uint8)
            assert c.put(ns, hashes[:700], blocks).stored == 700
        wait_for(
            lambda: (
                [(s.node, s.prefix_blocks) for s in ix.score("tiny", hashes)] == [("node-b", 700)]
            ),
            30,
            "node-b's prefix indexed",
        )
        settings = {
            **{f"backends.{n}": e.url for n, e in engines.items()},
            "indexer": f"127.0.0.1:{port}",
            "decision_deadline_s": "5",  # a loaded 2-core box; a fallback fails the test
            "scrape_interval_s": "0.1",
        }
        proc, r = start_router(tmp_path, "router", settings)
        wait_for(lambda: healthy(r) == ["node-a", "node-b"], 30, "backends up")
        name = "kvstore_router_prompt_tokens_parsed_total"

        def route(raw: bytes) -> tuple[str, str]:
            status, headers, body = r.request("POST", "/v1/completions", raw=raw)
            assert status == 200, body
            return headers["x-kvstore-backend"], headers["x-kvstore-route"]

        turn1 = json.dumps(completion(tokens)).encode()
        assert route(turn1) == ("node-b", "prefix")
        assert _counter(r, name, 'how="parsed"') == len(tokens)
        turn2_ids = tokens + [int(t) for t in rng.integers(0, 30_000, 300)]
        assert route(json.dumps(completion(turn2_ids)).encode()) == ("node-b", "prefix")
        # only the new tail (and the previous turn's last id) was read from the body
        assert _counter(r, name, 'how="reused"') == len(tokens) - 1
        # and what the parser knew equal was not compared again by the hasher
        assert _counter(r, "kvstore_router_hash_compares_skipped_total", "") == 1
        assert _counter(r, name, 'how="parsed"') == len(tokens) + 301
        # the same ids without spaces: no stored bytes match, read in full, same route
        compact = json.dumps(completion(turn2_ids), separators=(",", ":")).encode()
        assert route(compact) == ("node-b", "prefix")
        assert _counter(r, name, 'how="parsed"') == len(tokens) + 301 + len(turn2_ids)
        # a re-sent turn whose tail holds a non-integer: refused, as a full read would
        bad = json.dumps(completion(turn2_ids)).encode().replace(b"]", b', "x"]', 1)
        status, _, body = r.request("POST", "/v1/completions", raw=bad)
        assert status == 400 and b"integers" in body, body
    finally:
        if proc is not None:
            stop(proc)
        server.stop(0)
        ix.close()
        for e in engines.values():
            e.close()


def test_replicas_share_the_engines_slots_through_their_gauges(tmp_path):
    """Two router replicas in front of the same two engines, each engine's capacity
    1. Replica A's two requests run on the engines (held there, so their running
    gauges say 1). Replica B reads that from the gauges: those requests are not its
    own, so it has no slot left. Its low request waits, then is shed (429) without
    reaching an engine; its high request waits until A's work ends, then is served.
    (Without this, each replica admitted its own 2 slots: 2 replicas, 2x the
    engines' capacity.)"""
    engines = {n: Engine(n) for n in ("node-a", "node-b")}
    for e in engines.values():
        e.gate.clear()
    procs: list[subprocess.Popen] = []
    results: dict[str, int] = {}
    threads: list[threading.Thread] = []

    def send(r: Http, key: str, headers: dict[str, str] | None = None) -> None:
        status, _, _ = r.request("POST", "/v1/completions", completion([1, 2, 3]), headers=headers)
        results[key] = status

    try:
        settings = {
            **{f"backends.{n}": e.url for n, e in engines.items()},
            "strategy": "round-robin",
            "backend_capacity": "1",
            "scrape_interval_s": "0.1",
            "low_max_wait_s": "1.5",
        }
        replica_a, replica_b = [], []
        for name, out in (("router-a", replica_a), ("router-b", replica_b)):
            proc, r = start_router(tmp_path, name, settings)
            procs.append(proc)
            out.append(r)
        a, b = replica_a[0], replica_b[0]
        for r in (a, b):
            wait_for(lambda r=r: healthy(r) == ["node-a", "node-b"], 30, "backends up")
        for i in range(2):  # A's own two slots: one on each engine
            t = threading.Thread(target=send, args=(a, f"a{i}"), daemon=True)
            t.start()
            threads.append(t)
        wait_for(lambda: [e.active for e in engines.values()] == [1, 1], 30, "A's requests run")
        name = "kvstore_router_backend_other_requests"
        wait_for(
            lambda: all(_counter(b, name, f'backend="{n}"') == 1.0 for n in engines),
            30,
            "replica B sees the engines' other requests",
        )
        high = threading.Thread(
            target=send, args=(b, "b-high", {"x-kvstore-priority": "high"}), daemon=True
        )
        high.start()
        threads.append(high)
        send(b, "b-low", {"x-kvstore-priority": "low"})
        assert results["b-low"] == 429
        # neither of B's requests reached an engine while A's filled them
        assert sum(e.served() for e in engines.values()) == 2
        assert "b-high" not in results
        for e in engines.values():
            e.gate.set()
        high.join(60)
        assert results.get("b-high") == 200
        assert results["a0"] == results["a1"] == 200
        assert sum(e.served() for e in engines.values()) == 3
    finally:
        for e in engines.values():
            e.gate.set()
        for p in procs:
            stop(p)
        for t in threads:
            t.join(10)
        for e in engines.values():
            e.close()


def test_a_prefill_decode_split_asks_the_indexer_once_per_request(tmp_path):
    """With prefill = [node-a] and decode = [node-b], one Score answers both
    choices (the decode engine's and the prefill engine's): one round trip per
    request, not two. The prefill goes to node-a (max_tokens 1), the answer
    comes from node-b with the peer hint naming node-a."""
    engines = {n: Engine(n) for n in ("node-a", "node-b")}
    ix = Indexer(IndexerConfig())
    ix.start()
    server, port = serve(ix, "127.0.0.1:0")
    proc = None
    try:
        cfg = tmp_path / "router.toml"
        cfg.write_text('[router]\nprefill = ["node-a"]\ndecode = ["node-b"]\n')
        settings = {
            **{f"backends.{n}": e.url for n, e in engines.items()},
            "indexer": f"127.0.0.1:{port}",
            "decision_deadline_s": "5",
        }
        proc, r = start_router(tmp_path, "router", settings, cfg)
        wait_for(lambda: healthy(r) == ["node-a", "node-b"], 30, "backends up")
        for i in range(1, 3):
            status, headers, body = r.post("/v1/completions", completion(list(range(3 * BS))))
            assert status == 200, body
            assert (headers["x-kvstore-backend"], headers["x-kvstore-pd"]) == (
                "node-b",
                "prefill=node-a",
            )
            assert _counter(r, "kvstore_router_score_seconds_count", "") == i
        assert engines["node-a"].completions[-1]["max_tokens"] == 1
        assert engines["node-b"].completions[-1]["kv_transfer_params"] == {"kvstore_peer": "node-a"}
    finally:
        if proc is not None:
            stop(proc)
        server.stop(0)
        ix.close()
        for e in engines.values():
            e.close()


def test_the_router_pins_a_dp_engine_to_the_rank_its_score_chose(tmp_path):
    """An engine serving several DP ranks (one ``engine`` label per rank on its
    /metrics) gets ``X-data-parallel-rank`` with the rank whose GPU cache holds the
    prompt (kvstore_router_client's ``Decision.rank``), even as the only backend; on a
    prefill/decode split the prefill and the decode each get their own engine's
    rank. A decision without a rank (nothing cached, or an engine without ranks)
    sends no header. (vLLM itself takes the header: test_vllm_dp.py.) The blocks
    are indexed under the connector's model_name, which ``index_models`` names."""
    engines = {
        "node-a": Engine("node-a", dp_ranks=2),
        "node-b": Engine("node-b"),
        "node-p": Engine("node-p", dp_ranks=2),
    }
    ix = Indexer(IndexerConfig())
    ix.start()
    server, port = serve(ix, "127.0.0.1:0")
    hasher = BlockHasher(BS, "sha256")
    held = list(range(3 * BS))
    hashes = np.asarray(hasher.hash_tokens_int(held), dtype=np.uint64)
    ix.index.add("tiny-ns", "node-a", "GPU", hashes, rank=1)
    ix.index.add("tiny-ns", "node-a", "CPU", hashes)  # the node's DRAM: every rank's
    ix.index.add("tiny-ns", "node-b", "GPU", hashes)
    ix.index.add("tiny-ns", "node-p", "GPU", hashes, rank=0)
    ix.index.add("tiny-ns", "node-p", "GPU", hashes[:2], rank=1)
    procs = []
    base = {
        "indexer": f"127.0.0.1:{port}",
        "decision_deadline_s": "5",
        "index_models.tiny": "tiny-ns",
    }
    rank_header = "x-data-parallel-rank"
    try:
        for node in ("node-a", "node-b"):  # each alone behind a router
            proc, r = start_router(
                tmp_path, f"router-{node}", {**base, f"backends.{node}": engines[node].url}
            )
            procs.append(proc)
            wait_for(lambda r=r, node=node: healthy(r) == [node], 30, "backend up")
            status, headers, body = r.post("/v1/completions", completion(held + [7]))
            assert status == 200, body
            status, headers2, body = r.post("/v1/completions", completion(list(range(100, 140))))
            assert status == 200, body
            sent = engines[node].headers
            if node == "node-a":
                assert (headers["x-kvstore-route"], headers["x-kvstore-rank"]) == ("prefix", "1")
                assert sent[-2][rank_header] == "1"
            else:  # one engine, no ranks: nothing to choose, no header
                assert headers["x-kvstore-route"] == "only" and "x-kvstore-rank" not in headers
                assert rank_header not in sent[-2]
            # nothing cached anywhere: no rank, no header
            assert "x-kvstore-rank" not in headers2 and rank_header not in sent[-1], sent
        cfg = tmp_path / "router.toml"
        cfg.write_text('[router]\nprefill = ["node-p"]\ndecode = ["node-a"]\n')
        settings = {**base, **{f"backends.{n}": engines[n].url for n in ("node-a", "node-p")}}
        proc, r = start_router(tmp_path, "router-pd", settings, cfg)
        procs.append(proc)
        wait_for(lambda: healthy(r) == ["node-a", "node-p"], 30, "backends up")
        status, headers, body = r.post("/v1/completions", completion(held))
        assert status == 200, body
        assert (headers["x-kvstore-pd"], headers["x-kvstore-rank"]) == ("prefill=node-p", "1")
        prefill, decode = engines["node-p"].headers[-1], engines["node-a"].headers[-1]
        assert (prefill[rank_header], decode[rank_header]) == ("0", "1")
        assert engines["node-p"].completions[-1]["max_tokens"] == 1
    finally:
        for proc in procs:
            stop(proc)
        server.stop(0)
        ix.close()
        for e in engines.values():
            e.close()
