"""vLLM's OpenAI server at --data-parallel-size 2 through one kvstore daemon.

The ranks share the node's daemon (one namespace: a block stored by one rank
is valid for every rank) and each has its own GPU cache and KV-event stream,
listed by ``GET /kv_event_sources``. The indexer (in-memory and Redis) follows
both rank streams and the daemon's, and scores the GPU tier per rank and DRAM
per node; ``kvstore_router_client`` then picks the node and the rank. Requests are
pinned to a rank with vLLM's ``X-data-parallel-rank`` header, which `kvstore
router` sends with the rank it chose (on one engine and on a prefill/decode
split); where a request landed is read from the server's per-rank ``engine``
labels on /metrics.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.hashing import BlockHasher
from kvstore.indexer.backend import RankScore
from kvstore.indexer.config import IndexerConfig
from kvstore.indexer.service import Indexer, serve
from kvstore.indexer.subscriber import SourceSpec
from kvstore.indexer.vllm_sources import VllmServer, engine_sources, fetch_kv_event_sources
from kvstore_router_client import RouterClient
from tests.integration import vllm_model as vm
from tests.integration._redis import RedisProcess
from tests.integration.test_router_vllm import start_router, stop

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.redis,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.timeout(1200),
]

BS = vm.BLOCK_SIZE
# Two engine cores on a shared 2-core machine: ~60 s measured, far more under load.
START_TIMEOUT_S = 600.0
EVENT_TIMEOUT_S = 60.0


def wait_for(cond: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{what}: not reached within {timeout_s:.0f} s")


class UnixHttp(http.client.HTTPConnection):
    def __init__(self, path: str, timeout_s: float = 120.0) -> None:
        super().__init__("localhost", timeout=timeout_s)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def call(sock: str, method: str, path: str, body: Any = None, **headers: str) -> tuple[int, Any]:
    conn = UnixHttp(sock)
    try:
        data = json.dumps(body).encode() if body is not None else None
        hdrs = {"Content-Type": "application/json", **headers} if data else headers
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw) if raw and raw[:1] in b"{[" else raw
    except OSError as e:
        return -1, str(e)
    finally:
        conn.close()


def complete(sock: str, ids: list[int], rank: int) -> dict[str, Any]:
    status, out = call(
        sock,
        "POST",
        "/v1/completions",
        {"model": "tiny", "prompt": ids, "max_tokens": 4, "temperature": 0},
        **{"X-data-parallel-rank": str(rank)},
    )
    assert status == 200, out
    return out


_SAMPLE_RE = re.compile(r"^([\w:]+)\{(.*)\} ([0-9.eE+-]+)$")
_LABEL_RE = re.compile(r'(\w+)="([^"]*)"')


def per_rank(sock: str, name: str) -> dict[str, float]:
    """One metric of the server's /metrics summed per ``engine`` label (the DP rank)."""
    status, text = call(sock, "GET", "/metrics")
    assert status == 200 and isinstance(text, bytes), text
    out: dict[str, float] = {}
    for line in text.decode().splitlines():
        m = _SAMPLE_RE.match(line)
        if m and m.group(1) == name:
            engine = dict(_LABEL_RE.findall(m.group(2))).get("engine", "")
            out[engine] = out.get(engine, 0.0) + float(m.group(3))
    return out


# Each finished request adds its max_tokens to its rank's histogram sum: requests
# with distinct max_tokens show which rank served which.
MAX_TOKENS_SUM = "vllm:request_params_max_tokens_sum"


def routed_max_tokens(sock: str, before: dict[str, float], total: float) -> dict[str, float]:
    """Per rank, the max_tokens of requests finished since ``before`` (once they add
    up to ``total``: the server records a request as it finishes it)."""

    def delta() -> dict[str, float]:
        now = per_rank(sock, MAX_TOKENS_SUM)
        return {r: now.get(r, 0.0) - before.get(r, 0.0) for r in ("0", "1")}

    wait_for(lambda: sum(delta().values()) == total, EVENT_TIMEOUT_S, f"{total} max_tokens served")
    return delta()


def test_dp_ranks_gpu_per_rank_dram_per_node(tmp_path: Path) -> None:
    from kvstore.process import DaemonProcess

    model_dir = vm.make_tiny_llama(tmp_path / "model")
    daemon = DaemonProcess(
        tmp_path / "node-a",
        name="node-a",
        dram_bytes=128 << 20,
        settings={
            "events.enabled": True,
            "events.publish_address": f"ipc://{tmp_path}/node-a.pub",
            "events.replay_address": f"ipc://{tmp_path}/node-a.replay",
        },
    )
    redis = RedisProcess(tmp_path)
    proc: subprocess.Popen[bytes] | None = None
    indexers: list[Indexer] = []
    server = None
    sock = str(tmp_path / "vllm.sock")
    log = tmp_path / "vllm.log"
    try:
        daemon.start()
        # Port 0: each rank binds a port of its own on VLLM_HOST_IP and the
        # listing has it (a fixed port would be offset by the rank).
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:0",
            "replay_endpoint": "tcp://*:0",
        }
        args = vm.api_server_command(
            model_dir,
            *("--served-model-name", "tiny", "--uds", sock, "--max-num-seqs", "4"),
            *("--data-parallel-size", "2", "--enable-prompt-tokens-details"),
            # the daemon names blocks by the served name, as the engine sources do
            *(
                "--kv-transfer-config",
                json.dumps(vm.kv_transfer_config(daemon.address, model_name="tiny")),
            ),
            *("--kv-events-config", json.dumps(events)),
        )
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                args,
                cwd=vm.REPO_ROOT,
                env=vm.engine_env({"VLLM_HOST_IP": "127.0.0.1"}),
                stdout=out,
                stderr=subprocess.STDOUT,
                # Its own process group: at --data-parallel-size 2 the ranks' engine
                # cores are separate processes that outlived a stopped API server
                # (found orphaned after suite runs), so the clean-up signals the group.
                start_new_session=True,
            )

        def up() -> bool:
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"vLLM exited {proc.returncode}:\n{vm._tail(log)}")
            return call(sock, "GET", "/health")[0] == 200

        wait_for(up, START_TIMEOUT_S, "vLLM healthy")

        listed = fetch_kv_event_sources(f"unix:{sock}")
        assert sorted(listed) == ["0", "1"], listed
        ranks = engine_sources(listed, node="node-a", model="tiny", host="127.0.0.1")
        assert [s.data_parallel_rank for s in ranks] == [0, 1]
        assert len({s.endpoint for s in ranks}) == 2
        assert all(s.endpoint.startswith("tcp://127.0.0.1:") and s.replay_endpoint for s in ranks)
        daemon_src = SourceSpec(
            node="node-a",
            endpoint=f"ipc://{tmp_path}/node-a.pub",
            replay_endpoint=f"ipc://{tmp_path}/node-a.replay",
        )
        for cfg in (
            IndexerConfig(sources=[daemon_src, *ranks]),
            # the Redis one finds the ranks itself, from the server's listing
            IndexerConfig(
                sources=[daemon_src],
                vllm_servers=[
                    VllmServer(node="node-a", url=f"unix:{sock}", model="tiny", host="127.0.0.1")
                ],
                backend="redis",
                redis_url=redis.url,
                redis_read="direct",
            ),
        ):
            ix = Indexer(cfg)
            ix.start()
            indexers.append(ix)
        # every subscription is up before the first request (PUB drops what
        # is sent before; a missed first batch would only be replayed on the
        # next one)
        wait_for(
            lambda: all(
                len(st) == 3 and all(s.connected for s in st)
                for st in (ix.subscriber.source_status() for ix in indexers)
            ),
            EVENT_TIMEOUT_S,
            "indexers connected to the daemon and both ranks",
        )

        hasher = BlockHasher(BS, "sha256")
        shared = vm.prompt_ids(1, 3 * BS + 5)
        other = vm.prompt_ids(2, 2 * BS + 3)
        hs = hasher.hash_tokens_int(shared)
        ho = hasher.hash_tokens_int(other)
        first = complete(sock, shared, rank=0)
        complete(sock, other, rank=1)  # rank 1 holds a prefix of its own

        def settled(ix: Indexer) -> bool:
            a = {s.node: s for s in ix.score("tiny", hs)}.get("node-a")
            b = {s.node: s for s in ix.score("tiny", ho)}.get("node-a")
            return (
                a is not None
                and b is not None
                and {r.rank: r.gpu_blocks for r in a.ranks}.get(0) == 3
                and a.ranks[0].cpu_blocks == 3  # the daemon's DRAM copy
                and {r.rank: r.gpu_blocks for r in b.ranks}.get(1) == 2
            )

        for ix in indexers:
            try:
                wait_for(lambda ix=ix: settled(ix), EVENT_TIMEOUT_S, "blocks of both ranks indexed")
            except AssertionError as e:
                raise AssertionError(
                    f"{e}: {ix.cfg.backend} index has {ix.index.models()}: "
                    f"{ix.score('tiny', hs)} / {ix.score('tiny', ho)}; "
                    f"{ix.subscriber.stats}; {ix.subscriber.source_status()}"
                ) from None
        for ix in indexers:
            (a,) = ix.score("tiny", hs)
            # rank 0 computed the prefix: its GPU cache has it; rank 1 reads the
            # node's DRAM copy; -1 is what any rank gets from the node
            assert (a.node, a.prefix_blocks, a.gpu_blocks, a.rank) == ("node-a", 3, 3, 0)
            assert a.ranks == (
                RankScore(-1, 3, 0, 3, 0),
                RankScore(0, 3, 3, 0, 0),
                RankScore(1, 3, 0, 3, 0),
            ), ix.cfg.backend
            (b,) = ix.score("tiny", ho)
            assert (b.rank, b.gpu_blocks) == (1, 2)
            assert ix.index.nodes() == ["node-a"]

        # kvstore_router_client, over the indexer's gRPC: the node and the rank
        server, port = serve(indexers[1], "127.0.0.1:0")
        with RouterClient(f"127.0.0.1:{port}", block_size_tokens=BS, deadline_s=10.0) as rc:
            d = rc.pick("tiny", shared, ["node-a"], default="node-a")
            assert (d.node, d.reason, d.rank) == ("node-a", "prefix", 0)
            assert d.hit is not None and [r.rank for r in d.hit.ranks] == [-1, 0, 1]
            assert rc.pick("tiny", other, ["node-a"], default="node-a").rank == 1
        assert sorted(
            (s.data_parallel_rank, s.endpoint) for s in indexers[1].subscriber.sources()
        ) == sorted((s.data_parallel_rank, s.endpoint) for s in [daemon_src, *ranks])

        # `kvstore router` in front of the server: it pins each request to the rank
        # it chose (X-data-parallel-rank); a rank-less decision sends no header.
        settings = {
            "backends.node-a": f"unix:{sock}",
            "indexer": f"127.0.0.1:{port}",
            # the connector names the model "tiny" (model_name), not vLLM's model path
            "index_models.tiny": "tiny",
            "block_size_tokens": str(BS),
            "decision_deadline_s": "10",
            "scrape_interval_s": "0.5",
        }
        rproc, router = start_router(tmp_path, "router", settings)
        try:
            wait_for(
                lambda: router.get("/health")[0] == 200, START_TIMEOUT_S, "router sees the server"
            )
            for ids, max_tokens, rank in ((other, 2, "1"), (shared, 3, "0")):
                before = per_rank(sock, MAX_TOKENS_SUM)
                status, headers, out = router.post(
                    "/v1/completions",
                    {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0},
                )
                assert status == 200, out
                assert (headers["x-kvstore-route"], headers.get("x-kvstore-rank")) == (
                    "prefix",
                    rank,
                ), headers
                served = routed_max_tokens(sock, before, max_tokens)
                assert served[rank] == max_tokens, served  # it ran on the chosen rank
            # no block of it anywhere: no rank chosen, no header (vLLM's balancer picks)
            status, headers, out = router.post(
                "/v1/completions",
                {"model": "tiny", "prompt": vm.prompt_ids(3, 2 * BS + 1), "max_tokens": 1},
            )
            assert status == 200, out
            assert "x-kvstore-rank" not in headers and headers["x-kvstore-route"] != "prefix"
        finally:
            stop(rproc)

        # a prefill/decode split: the prefill goes to node-a's rank holding the
        # prompt; the decode node (the same server under another node id, of which
        # the indexer knows nothing) gets no rank
        pd = tmp_path / "pd.toml"
        pd.write_text('[router]\nprefill = ["node-a"]\ndecode = ["node-d"]\n')
        rproc, router = start_router(
            tmp_path, "router-pd", {**settings, "backends.node-d": f"unix:{sock}"}, pd
        )
        try:
            wait_for(
                lambda: router.get("/health")[0] == 200, START_TIMEOUT_S, "router sees the server"
            )
            before = per_rank(sock, MAX_TOKENS_SUM)
            status, headers, out = router.post(
                "/v1/completions",
                {"model": "tiny", "prompt": other, "max_tokens": 3, "temperature": 0},
            )
            assert status == 200, out
            assert headers["x-kvstore-pd"] == "prefill=node-a", headers
            assert "x-kvstore-rank" not in headers  # the decode choice has no rank
            served = routed_max_tokens(sock, before, 1 + 3)
            # the prefill (max_tokens 1) ran on rank 1; the decode (3) wherever vLLM put it
            assert served["1"] in (1, 1 + 3) and served["0"] in (0, 3), served
        finally:
            stop(rproc)

        # the block rank 0 stored is valid for rank 1: loaded from the daemon,
        # the same tokens; then rank 1's own GPU cache has it too
        again = complete(sock, shared, rank=1)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        details = again["usage"].get("prompt_tokens_details") or {}
        assert details.get("cached_tokens", 0) >= 3 * BS, again["usage"]

        def rank1_gpu(ix: Indexer) -> int:
            (a,) = ix.score("tiny", hs)
            return {r.rank: r.gpu_blocks for r in a.ranks}.get(1, 0)

        for ix in indexers:
            wait_for(lambda ix=ix: rank1_gpu(ix) == 3, EVENT_TIMEOUT_S, "rank 1 GPU entries")
        for ix in indexers:
            st = ix.subscriber.stats
            assert st.rank_mismatches == 0 and st.malformed == 0
    finally:
        if server is not None:
            server.stop(0)
        for ix in indexers:
            ix.close()
        if proc is not None:
            _stop_group(proc)
        daemon.stop()
        redis.stop()


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's whole process group (API server and every rank's engine
    core), then SIGKILL whatever is left of it after a bounded wait."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
