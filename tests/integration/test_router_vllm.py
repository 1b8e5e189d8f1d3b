"""`kvstore router` end to end: two real vLLM CPU OpenAI servers, each with its own
daemon (KVStore connector), a real indexer following both daemons, the real
router process, real HTTP clients.

The servers are shared by every test of the module (starting one costs ~25 s of
a 2-core machine); the test that kills one runs last.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.hashing import BlockHasher
from kvstore.indexer.config import IndexerConfig
from kvstore.indexer.service import Indexer, serve
from kvstore.indexer.subscriber import SourceSpec
from kvstore_bench import router_bench as rb
from kvstore_router_client.prefix_cache import PrefixHashCache
from tests.integration import vllm_model as vm

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("aiohttp") is None, reason="aiohttp missing"),
    pytest.mark.timeout(900),
]

BS = vm.BLOCK_SIZE
HAVE_NIXL = any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu12"))
START_TIMEOUT_S = 240.0
# A chat template the word-level tokenizer turns into exactly the words written.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)
# (Role names are not words of the tiny vocabulary: each becomes its unknown token.)


def words(ids: list[int]) -> str:
    return " ".join(f"w{i - 2}" for i in ids)


# -------------------------------------------------------------------- plumbing


class Http:
    """A blocking HTTP/1.1 client over TCP or a Unix socket (no connection reuse)."""

    def __init__(self, address: str) -> None:
        self.address = address  # "unix:/path" or "host:port"

    def connect(self, timeout_s: float = 60.0) -> socket.socket:
        if self.address.startswith("unix:"):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(timeout_s)
            s.connect(self.address[5:])
        else:
            host, port = self.address.rsplit(":", 1)
            s = socket.create_connection((host, int(port)), timeout=timeout_s)
        return s

    def send(
        self,
        s: socket.socket,
        method: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str] | None = None,
    ) -> None:
        head = f"{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        s.sendall(head.encode() + b"\r\n" + (body or b""))

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        with contextlib.closing(self.connect()) as s:
            self.send(s, method, path, data, headers)
            buf = b""
            while chunk := s.recv(65536):
                buf += chunk
        head, _, rest = buf.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        if headers.get("transfer-encoding") == "chunked":
            rest = _dechunk(rest)
        return status, headers, rest

    def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], Any]:
        status, headers, data = self.request("POST", path, body, headers=headers)
        return status, headers, json.loads(data) if data else None

    def get(self, path: str) -> tuple[int, bytes]:
        status, _, data = self.request("GET", path)
        return status, data


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, data = data.partition(b"\r\n")
        n = int(size.split(b";")[0], 16)
        if n == 0:
            break
        out, data = out + data[:n], data[n + 2 :]
    return out


def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what}: not reached within {timeout_s:.0f} s")


def metric(http: Http, name: str) -> float:
    """Sum of one Prometheus metric's samples (all labels)."""
    status, text = http.get("/metrics")
    assert status == 200
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Engine:
    node: str
    sock: str
    proc: subprocess.Popen[bytes]
    log: Path
    daemon: Any

    @property
    def http(self) -> Http:
        return Http(f"unix:{self.sock}")

    def up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"vLLM {self.node} exited:\n{vm._tail(self.log)}")
        try:
            return self.http.get("/health")[0] == 200
        except OSError:
            return False


def start_engine(tmp: Path, node: str, model_dir: Path, daemon: Any, template: Path) -> Engine:
    sock = str(tmp / f"{node}.http.sock")
    log = tmp / f"{node}.vllm.log"
    kv = vm.kv_transfer_config(daemon.address)
    args = vm.api_server_command(
        model_dir,
        *("--served-model-name", "tiny", "--uds", sock, "--max-num-seqs", "4"),
        *("--enable-prompt-tokens-details", "--chat-template", str(template)),
        *("--kv-transfer-config", json.dumps(kv)),
    )
    with open(log, "wb") as out:
        # Its own process group: the API server runs the engine core as a child
        # process, which a kill of the server alone left running (found orphaned
        # after suite runs); stop() and kill_engine() signal the whole group.
        proc = subprocess.Popen(
            args,
            cwd=vm.REPO_ROOT,
            env=vm.engine_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Engine(node, sock, proc, log, daemon)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to the process's group when it leads one (the engines), else to it."""
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except ProcessLookupError:
        pass


def kill_engine(proc: subprocess.Popen) -> None:
    """SIGKILL of the whole engine (server and engine core), as a crashed host."""
    _signal(proc, signal.SIGKILL)
    proc.wait(30)


def start_router(
    tmp: Path, name: str, settings: dict[str, str], config: Path | None = None
) -> tuple[subprocess.Popen, Http]:
    args = [sys.executable, "-m", "kvstore", "router", "--set", "router.listen=127.0.0.1:0"]
    if config is not None:
        args += ["--config", str(config)]
    for k, v in settings.items():
        args += ["--set", f"router.{k}={v}"]
    log = tmp / f"{name}.log"
    env = dict(os.environ, PYTHONPATH=str(vm.REPO_ROOT))
    with open(log, "wb") as err:
        proc = subprocess.Popen(args, cwd=vm.REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=err)
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode()
        if not line and proc.poll() is not None:
            raise AssertionError(f"router exited {proc.returncode}: {log.read_text()}")
        m = re.search(r"listening on http://([\d.]+:\d+)", line)
        if m:
            return proc, Http(m.group(1))
    raise AssertionError("router did not start")


def log_tail(path: Path, lines: int = 40) -> str:
    """The end of a process's log, for an assertion's message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"({path}: {e})"


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        _signal(proc, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            _signal(proc, signal.SIGKILL)
            proc.wait(10)
    # What is left of an engine's group (its engine core) goes too.
    _signal(proc, signal.SIGKILL)


@dataclass
class Cluster:
    engines: dict[str, Engine]
    router: Http
    router_proc: subprocess.Popen
    indexer: Indexer
    indexer_address: str
    tmp: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    from kvstore.process import DaemonProcess

    tmp = tmp_path_factory.mktemp("router_vllm")
    model_dir = vm.make_tiny_llama(tmp / "model")
    template = tmp / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    daemons, engines, procs = [], {}, []
    ix = None
    server = None
    try:
        for node in ("node-a", "node-b"):
            # Peers: node-b's daemon can pull from node-a's (the prefill/decode test).
            peers = {f"peer.peers.{d.name}": d.tcp_address for d in daemons}
            d = DaemonProcess(
                tmp / node,
                name=node,
                dram_bytes=128 << 20,
                settings={
                    "events.enabled": True,
                    "events.publish_address": f"ipc://{tmp}/{node}.pub",
                    "events.replay_address": f"ipc://{tmp}/{node}.replay",
                    "peer.enabled": "true",
                    "peer.secret": "router-test-secret",
                    "peer.transport": "nixl" if HAVE_NIXL else "auto",
                    **peers,
                },
                env={"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"},
            )
            d.start()
            daemons.append(d)
        ix = Indexer(
            IndexerConfig(
                sources=[
                    SourceSpec(
                        node=d.name,
                        endpoint=f"ipc://{tmp}/{d.name}.pub",
                        replay_endpoint=f"ipc://{tmp}/{d.name}.replay",
                    )
                    for d in daemons
                ]
            )
        )
        ix.start()
        server, port = serve(ix, "127.0.0.1:0")
        for d in daemons:
            engines[d.name] = start_engine(tmp, d.name, model_dir, d, template)
        for e in engines.values():
            wait_for(e.up, START_TIMEOUT_S, f"vLLM {e.node} healthy")
        rproc, router = start_router(
            tmp,
            "router",
            {
                **{f"backends.{n}": f"unix:{e.sock}" for n, e in engines.items()},
                "indexer": f"127.0.0.1:{port}",
                # generous on a loaded 2-core box; the fallback test has its own
                "decision_deadline_s": "5",
                "scrape_interval_s": "0.5",
            },
        )
        procs.append(rproc)
        yield Cluster(engines, router, rproc, ix, f"127.0.0.1:{port}", tmp)
    finally:
        for p in procs:
            stop(p)
        for e in engines.values():
            stop(e.proc)
        if server is not None:
            server.stop(0)
        if ix is not None:
            ix.close()
        for d in daemons:
            d.stop()


def completion(ids: list[int], max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, **extra}


def index_prefix(c: Cluster, node: str, hashes: np.ndarray) -> int:
    model = str(c.tmp / "model")  # the connector's namespace model: vLLM's model path
    return next((s.prefix_blocks for s in c.indexer.score(model, hashes) if s.node == node), 0)


def router_hashes(ids: list[int], salt: str | None = None) -> np.ndarray:
    """What the router computes (its PrefixHashCache over vLLM's default sha256)."""
    return PrefixHashCache(BlockHasher(BS, "sha256")).hash(ids, cache_salt=salt).hashes


# ------------------------------------------------------------------------ tests


def test_router_hashes_equal_the_engines_block_hashes_and_route_there(cluster):
    """A prompt computed on node-b: the blocks its daemon published are exactly the
    router's hashes (salted and not), and the router then sends it to node-b."""
    b = cluster.engines["node-b"]
    ids = vm.prompt_ids(11, 6 * BS + 5)
    for salt in (None, "tenant-1"):
        extra = {"cache_salt": salt} if salt else {}
        status, _, direct = b.http.post("/v1/completions", completion(ids, **extra))
        assert status == 200, direct
        hashes = router_hashes(ids, salt)
        assert hashes.size == 6
        wait_for(lambda h=hashes: index_prefix(cluster, "node-b", h) == 6, 30, "index")
        status, headers, routed = cluster.router.post("/v1/completions", completion(ids, **extra))
        assert status == 200, routed
        # Ties (no cache) would go to node-a: node-b is the cache's choice.
        assert (headers["x-kvstore-backend"], headers["x-kvstore-route"]) == ("node-b", "prefix")
        assert routed["usage"]["prompt_tokens_details"]["cached_tokens"] >= 6 * BS
        assert routed["choices"][0]["text"] == direct["choices"][0]["text"]
    # Another tenant's salt matches nothing: no cache signal, load decides.
    status, headers, _ = cluster.router.post(
        "/v1/completions", completion(ids, cache_salt="tenant-2")
    )
    assert status == 200 and headers["x-kvstore-route"] in ("load", "no_hit")
    assert index_prefix(cluster, "node-b", router_hashes(ids, "tenant-2")) == 0


def test_second_turn_goes_to_the_node_holding_its_prefix(cluster):
    """A chat's first turn ran on node-b; its second turn (the whole conversation
    re-sent) goes to node-b through the router, gets cached tokens, and answers
    exactly what an engine without that cache answers."""
    a, b = cluster.engines["node-a"], cluster.engines["node-b"]
    first = [{"role": "user", "content": words(vm.prompt_ids(21, 7 * BS))}]
    chat = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    status, _, t1 = b.http.post("/v1/chat/completions", {**chat, "messages": first})
    assert status == 200, t1
    answer = t1["choices"][0]["message"]["content"]
    second = [
        *first,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": words(vm.prompt_ids(22, BS))},
    ]
    # The first turn's full blocks are in node-b's daemon, under the hashes the
    # router computes from the engine's /tokenize of the conversation.
    status, _, tok = b.http.post("/tokenize", {"model": "tiny", "messages": first})
    prefix_blocks = len(tok["tokens"]) // BS
    wait_for(
        lambda: index_prefix(cluster, "node-b", router_hashes(tok["tokens"])) >= prefix_blocks,
        30,
        "first turn indexed",
    )
    status, headers, t2 = cluster.router.post("/v1/chat/completions", {**chat, "messages": second})
    assert status == 200, t2
    assert headers["x-kvstore-backend"] == "node-b", headers
    assert headers["x-kvstore-route"] == "prefix"
    assert t2["usage"]["prompt_tokens_details"]["cached_tokens"] >= prefix_blocks * BS
    # The same second turn on node-a, which never saw this conversation.
    status, _, ref = a.http.post("/v1/chat/completions", {**chat, "messages": second})
    assert status == 200
    assert ref["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert t2["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]


def test_a_replayed_agentic_trace_gets_more_prefix_hits_than_round_robin(cluster):
    """The same agentic trace (3 agents sharing a system prompt, 4 turns each, every
    turn re-sending its context plus a new tail; `kvstore-bench router`'s replay)
    through the cluster's cache+load router and through a round-robin router on the
    same two engines, each replay under its own cache_salt (neither meets the
    other's KV). After each answer the test waits for the served node's blocks to
    reach the index, so no decision depends on how fast events travel.

    Cache-aware: every later turn goes where its conversation's previous turn went
    and finds that whole context in the engine's cache. Round robin (3 agents over
    2 engines, round by round) sends consecutive turns to alternate engines: only
    the system prompt and what that engine saw two turns back are cached."""
    rr_proc, rr = start_router(
        cluster.tmp,
        "router-round-robin",
        {
            **{f"backends.{n}": f"unix:{e.sock}" for n, e in cluster.engines.items()},
            "indexer": cluster.indexer_address,
            "strategy": "round-robin",
        },
    )
    trace = rb.agentic_trace(
        3, 4, system_tokens=64, first_tokens=40, turn_tokens=48, vocab=vm.VOCAB_SIZE, seed=5
    )
    got: dict[str, list[rb.Replayed]] = {}
    try:
        for name, http in (("cache+load", cluster.router), ("round-robin", rr)):
            salt = f"replay-test-{name}"
            settle = rb.index_settler(cluster.indexer, str(cluster.tmp / "model"), BS, salt)
            got[name] = rb.replay(http.address, trace, model="tiny", salt=salt, settle=settle)
    finally:
        stop(rr_proc)
    smart, rrs = rb.replay_summary(got["cache+load"]), rb.replay_summary(got["round-robin"])
    previous: dict[int, list[int]] = {}
    for req, r in zip(trace, got["cache+load"], strict=True):
        assert r.prompt_tokens == len(req.prompt)
        if req.turn:
            assert r.route in ("prefix", "affinity"), r
            # the previous turn's full blocks, from the engine's prefix cache
            assert r.cached_tokens >= len(previous[req.conversation]) // BS * BS, r
        previous[req.conversation] = req.prompt
    assert smart["followed_previous_turn"] == 1.0
    assert rrs["followed_previous_turn"] == 0.0
    assert {r.route for r in got["round-robin"]} == {"round-robin"}
    assert rrs["backends"] == ["node-a", "node-b"]
    # Round robin gets fewer hits on the same trace: by construction at least a
    # third of the cache-aware router's later-turn hits are out of its reach.
    assert smart["cached_tokens"] > rrs["cached_tokens"]
    assert smart["later_turn_hit_ratio"] >= rrs["later_turn_hit_ratio"] + 0.15, (smart, rrs)
    # Greedy answers do not depend on which engine or cache served them.
    assert [r.text for r in got["cache+load"]] == [r.text for r in got["round-robin"]]


def _sse_events(data: bytes) -> list[Any]:
    out = []
    for block in data.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[6:].strip()
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def test_streaming_passes_through_and_a_disconnect_aborts_upstream(cluster):
    ids = vm.prompt_ids(31, 3 * BS)
    body = completion(ids, max_tokens=12, stream=True)
    status, headers, data = cluster.router.request("POST", "/v1/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = _sse_events(data)
    # Events as the engine wrote them (about one per token; a busy engine may merge a few).
    assert events[-1] == "[DONE]" and len(events) >= 6
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    node = cluster.engines[headers["x-kvstore-backend"]]
    status, _, plain = node.http.post("/v1/completions", completion(ids, max_tokens=12))
    assert text == plain["choices"][0]["text"]

    # A long generation, abandoned after its first event: the router closes the
    # engine's connection, the engine aborts it (it never finishes, counted).
    long_ids = vm.prompt_ids(32, 2 * BS)
    long_body = json.dumps(
        completion(long_ids, max_tokens=vm.MAX_MODEL_LEN - 2 * BS - 8, stream=True, ignore_eos=True)
    ).encode()
    finished = {n: metric(e.http, "vllm:request_success_total") for n, e in cluster.engines.items()}
    s = cluster.router.connect()
    cluster.router.send(s, "POST", "/v1/completions", long_body)
    got = b""
    while b"data: " not in got:
        chunk = s.recv(4096)
        assert chunk, "stream ended before its first event"
        got += chunk
    m = re.search(rb"x-kvstore-backend: ([\w-]+)", got)
    assert m, got
    target = cluster.engines[m.group(1).decode()]
    s.close()
    wait_for(lambda: metric(target.http, "vllm:num_requests_running") == 0, 60, "upstream stopped")
    assert metric(target.http, "vllm:request_success_total") == finished[target.node], (
        "the abandoned request ran to completion: the upstream was not cancelled"
    )
    wait_for(
        lambda: metric(cluster.router, "kvstore_router_client_disconnects_total") >= 1,
        10,
        "disconnect counted",
    )


def test_bad_input_gets_openai_statuses(cluster):
    r = cluster.router
    status, _, data = r.request("POST", "/v1/completions", raw=b'{"model": "tiny", "prompt": ')
    assert status == 400 and json.loads(data)["error"]["type"] == "BadRequestError"
    status, _, err = r.post("/v1/completions", completion([5, 6, 7]) | {"model": "gpt-9"})
    assert status == 404 and err["error"]["param"] == "model" and "tiny" in err["error"]["message"]
    # Over the model's length: the engine's own 400, passed through.
    status, _, err = r.post("/v1/completions", completion(vm.prompt_ids(41, vm.MAX_MODEL_LEN + 10)))
    assert status == 400 and "maximum context length" in err["error"]["message"], err
    status, _, err = r.post("/v1/chat/completions", {"model": "tiny", "messages": "hi"})
    assert status == 400 and err["error"]["param"] == "messages"
    status, _, err = r.post("/v1/completions", completion(["x", 1]))  # type: ignore[list-item]
    assert status == 400
    status, models = r.get("/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(models)["data"]] == ["tiny"]
    status, health = r.get("/health")
    assert status == 200 and set(json.loads(health)["healthy_backends"]) == {"node-a", "node-b"}
    assert metric(r, "kvstore_router_requests_total") >= 5


def test_an_indexer_that_does_not_answer_falls_back_within_its_deadline(cluster):
    with socket.socket() as silent:  # accepts TCP, never speaks HTTP/2
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        proc, r = start_router(
            cluster.tmp,
            "router-silent-indexer",
            {
                **{f"backends.{n}": f"unix:{e.sock}" for n, e in cluster.engines.items()},
                "indexer": f"127.0.0.1:{silent.getsockname()[1]}",
                "decision_deadline_s": "0.3",
            },
        )
        try:
            t0 = time.monotonic()
            status, headers, out = r.post("/v1/completions", completion(vm.prompt_ids(51, 3 * BS)))
            elapsed = time.monotonic() - t0
            assert status == 200, out
            assert headers["x-kvstore-route"] == "fallback"
            assert metric(r, 'kvstore_router_decisions_total{reason="fallback"}') == 1
            # the decision took its deadline, not more (plus one generation of 8 tokens)
            assert metric(r, "kvstore_router_decision_seconds_sum") < 1.5
            assert elapsed < 30
        finally:
            stop(proc)


def test_tenants_get_their_own_cache_salt_never_the_clients(cluster):
    settings = {
        **{f"backends.{n}": f"unix:{e.sock}" for n, e in cluster.engines.items()},
        "indexer": cluster.indexer_address,
        "decision_deadline_s": "5",
        "tenants.key-a": "team-a",
        "tenants.key-b": "team-b",
    }
    proc, r = start_router(cluster.tmp, "router-tenants", settings)
    try:
        ids = vm.prompt_ids(91, 5 * BS + 3)
        as_a = {"Authorization": "Bearer key-a"}
        as_b = {"Authorization": "Bearer key-b"}
        status, headers, first = r.post("/v1/completions", completion(ids), as_a)
        assert status == 200, first
        node = headers["x-kvstore-backend"]
        salt_a = "kvstore-tenant:team-a"
        wait_for(
            lambda: index_prefix(cluster, node, router_hashes(ids, salt_a)) == 5, 30, "indexed"
        )
        # team-a again: its own KV (the prefix, on the node that computed it)
        status, headers, again = r.post("/v1/completions", completion(ids), as_a)
        assert (headers["x-kvstore-backend"], headers["x-kvstore-route"]) == (node, "prefix")
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 5 * BS
        # team-b, even claiming team-a's salt, shares nothing: no prefix, nothing cached
        status, headers, other = r.post("/v1/completions", completion(ids, cache_salt=salt_a), as_b)
        assert status == 200 and headers["x-kvstore-route"] != "prefix"
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert other["choices"][0]["text"] == first["choices"][0]["text"]
        for bad in ({}, {"Authorization": "Bearer nope"}):
            status, _, err = r.post("/v1/completions", completion(ids), bad)
            assert status == 401 and err["error"]["type"] == "AuthenticationError"
    finally:
        stop(proc)


def test_priorities_when_every_engine_is_saturated(cluster):
    """backend_capacity 1: two long generations fill both engines. A high request
    waits for the first free slot and is served; low requests queue, then are
    shed with 429 + Retry-After (one more than the queue holds at once)."""
    import threading

    settings = {
        **{f"backends.{n}": f"unix:{e.sock}" for n, e in cluster.engines.items()},
        "indexer": cluster.indexer_address,
        "decision_deadline_s": "5",
        "backend_capacity": "1",
        "queue_max": "2",
        "low_max_wait_s": "0.3",
    }
    proc, r = start_router(cluster.tmp, "router-priorities", settings)
    long_tokens = vm.MAX_MODEL_LEN - 2 * BS - 8
    results: dict[str, Any] = {}

    def send(name: str, ids: list[int], priority: str, max_tokens: int) -> None:
        t0 = time.monotonic()
        status, headers, out = r.post(
            "/v1/completions",
            completion(ids, max_tokens=max_tokens, ignore_eos=True),
            {"x-kvstore-priority": priority},
        )
        results[name] = (status, headers, out, time.monotonic() - t0)

    try:
        longs = [
            threading.Thread(
                target=send,
                args=(f"long{i}", vm.prompt_ids(100 + i, 2 * BS), "normal", long_tokens),
            )
            for i in range(2)
        ]
        for t in longs:
            t.start()
        wait_for(
            lambda: metric(r, "kvstore_router_backend_inflight_requests") == 2, 60, "saturated"
        )
        lows = [
            threading.Thread(target=send, args=(f"low{i}", vm.prompt_ids(110 + i, BS), "low", 4))
            for i in range(3)
        ]
        high = threading.Thread(target=send, args=("high", vm.prompt_ids(120, BS), "high", 4))
        for t in [*lows, high]:
            t.start()
        for t in [*longs, *lows, high]:
            t.join(300)
        statuses = {k: v[0] for k, v in results.items()}
        assert statuses["long0"] == statuses["long1"] == 200, results
        assert statuses["high"] == 200, results["high"]
        low = [results[f"low{i}"] for i in range(3)]
        assert [x[0] for x in low] == [429] * 3, low
        assert all(x[1].get("retry-after") for x in low)
        # the two the queue held waited their bound first; the third was refused at once
        waited = sorted(x[3] for x in low)
        assert waited[-2] >= 0.3 and waited[-1] >= 0.3
        # the high request waited for one long generation at most, not for the lows
        assert results["high"][3] <= max(results["long0"][3], results["long1"][3]) + 5
        assert metric(r, 'kvstore_router_queue_seconds_count{priority="high"}') == 1
        assert metric(r, "kvstore_router_shed_requests_total") == 3
        status, _, err = r.post(
            "/v1/completions", completion([5, 6, 7]), {"x-kvstore-priority": "urgent"}
        )
        assert status == 400 and "x-kvstore-priority" in err["error"]["message"]
    finally:
        stop(proc)


def test_two_router_replicas_decide_alike_and_one_killed_the_other_serves(cluster):
    """Replicas keep no state a decision needs that the other lacks: the index is
    shared (the indexer), load comes from the engines. Same requests, same
    choices; a client that retries on connection refused loses nothing."""
    b = cluster.engines["node-b"]
    settings = {
        **{f"backends.{n}": f"unix:{e.sock}" for n, e in cluster.engines.items()},
        "indexer": cluster.indexer_address,
        "decision_deadline_s": "5",
    }
    proc, replica = start_router(cluster.tmp, "router-replica", settings)
    try:
        held = vm.prompt_ids(81, 4 * BS + 1)
        assert b.http.post("/v1/completions", completion(held))[0] == 200
        hashes = router_hashes(held)
        wait_for(lambda: index_prefix(cluster, "node-b", hashes) == 4, 30, "indexed")
        for ids in (held, vm.prompt_ids(82, 3 * BS), held + vm.prompt_ids(83, BS)):
            # A request changes the state (its node stores the prompt): first let
            # one go and its blocks reach the index, then ask both replicas.
            status, headers, _ = cluster.router.post("/v1/completions", completion(ids))
            node, n = headers["x-kvstore-backend"], len(ids) // BS
            wait_for(
                lambda i=ids, nd=node, k=n: index_prefix(cluster, nd, router_hashes(i)) == k,
                30,
                "indexed",
            )
            # "fallback" means a replica had no Score for the request (the indexer
            # late on a loaded CI box, the replica's first scrape of the engines'
            # block size not back yet), not a state the replicas differ in: ask both
            # again, for a bounded time (a channel in reconnect backoff needs
            # seconds, not an immediate retry); any other difference fails at once.
            deadline = time.monotonic() + 30
            while True:
                choices = []
                for r in (cluster.router, replica):
                    status, headers, out = r.post("/v1/completions", completion(ids))
                    assert status == 200, out
                    choices.append((headers["x-kvstore-backend"], headers["x-kvstore-route"]))
                if all(route != "fallback" for _, route in choices):
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(1.0)
            # A string, not a tuple: pytest shortens a non-string message to 240 chars.
            logs = "\n".join(
                f"--- {n}.log:\n{log_tail(cluster.tmp / f'{n}.log')}"
                for n in ("router", "router-replica")
            )
            assert choices[0] == choices[1], f"{choices}\n{logs}"
            assert choices[0][1] != "fallback", f"{choices}\n{logs}"
        proc.kill()  # mid-traffic: no graceful stop
        proc.wait(10)
        served = 0
        for ids in (held, vm.prompt_ids(84, 2 * BS)):
            for r in (replica, cluster.router):  # the client's list of router addresses
                try:
                    status, _, out = r.post("/v1/completions", completion(ids))
                except ConnectionRefusedError:
                    continue
                assert status == 200, out
                served += 1
                break
        assert served == 2
    finally:
        stop(proc)


@pytest.mark.nixl
@pytest.mark.skipif(not HAVE_NIXL, reason="NIXL (nixl-cu12) not installed")
def test_prefill_decode_split_pulls_the_kv_over_nixl_with_identical_tokens(cluster):
    """prefill = [node-a], decode = [node-b]: node-a computes the prompt (max_tokens
    1) and its daemon stores it; node-b gets the request with a kvstore_peer hint,
    its daemon pulls the blocks from node-a's over NIXL, and it answers exactly
    what a single engine answers. With the prefill engine down, decode computes."""
    from kvstore.client import Client

    a, b = cluster.engines["node-a"], cluster.engines["node-b"]
    backends = "\n".join(f'"{n}" = "unix:{e.sock}"' for n, e in cluster.engines.items())
    cfg = cluster.tmp / "pd.toml"
    cfg.write_text(
        f'[router]\nindexer = "{cluster.indexer_address}"\ndecision_deadline_s = 5\n'
        'prefill = ["node-a"]\ndecode = ["node-b"]\n'
        f"[router.backends]\n{backends}\n"
    )
    proc, pd = start_router(cluster.tmp, "router-pd", {}, config=cfg)
    try:
        ids = vm.prompt_ids(71, 5 * BS + 9)
        with Client(b.daemon.address, map_region=False) as c:
            stats = c.stats()
            before = stats.stored_blocks
            handed_before = sum(p.handed_over_pulls for p in stats.peer)
        status, headers, out = pd.post("/v1/completions", completion(ids, max_tokens=12))
        assert status == 200, out
        assert headers["x-kvstore-backend"] == "node-b"
        assert headers["x-kvstore-pd"] == "prefill=node-a"
        # node-b never saw this prompt: its cached tokens are the pulled blocks.
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // BS * BS
        with Client(b.daemon.address, map_region=False) as c:
            stats = c.stats()
            assert stats.stored_blocks - before >= (len(ids) - 1) // BS
            # Read from the pin node-a's connector handed over with its answer (the
            # ticket the router passed on): no pin round trip to node-a first.
            assert sum(p.handed_over_pulls for p in stats.peer) - handed_before == 1
        assert metric(pd, "kvstore_router_pd_tickets_total") == 1
        assert "FALLING BACK" not in b.daemon.log_path.read_text(errors="replace")
        status, _, single = a.http.post("/v1/completions", completion(ids, max_tokens=12))
        assert out["choices"][0]["text"] == single["choices"][0]["text"]
        # Streamed through the split: the stream comes from decode.
        status, headers, data = pd.request(
            "POST", "/v1/completions", completion(vm.prompt_ids(72, 4 * BS + 3), stream=True)
        )
        assert status == 200 and headers["x-kvstore-pd"] == "prefill=node-a"
        assert _sse_events(data)[-1] == "[DONE]"
    finally:
        stop(proc)
    # The prefill pool is down (its only engine unreachable): decode computes.
    cfg.write_text(
        f'[router]\nindexer = "{cluster.indexer_address}"\ndecision_deadline_s = 5\n'
        'prefill = ["node-x"]\ndecode = ["node-b"]\n'
        f'[router.backends]\n{backends}\n"node-x" = "unix:{cluster.tmp}/no-such-engine.sock"\n'
    )
    proc, pd = start_router(cluster.tmp, "router-pd-down", {}, config=cfg)
    try:
        ids = vm.prompt_ids(73, 5 * BS + 2)
        status, headers, out = pd.post("/v1/completions", completion(ids, max_tokens=12))
        assert status == 200, out
        assert headers["x-kvstore-backend"] == "node-b"
        assert headers["x-kvstore-pd"].startswith("fallback")
        assert metric(pd, "kvstore_router_pd_fallbacks_total") == 1
        status, _, single = a.http.post("/v1/completions", completion(ids, max_tokens=12))
        assert out["choices"][0]["text"] == single["choices"][0]["text"]
    finally:
        stop(proc)
    # A prefill slower than its deadline (1 ms: no engine answers that fast): decode computes.
    cfg.write_text(
        f'[router]\nindexer = "{cluster.indexer_address}"\ndecision_deadline_s = 5\n'
        'prefill = ["node-a"]\ndecode = ["node-b"]\nprefill_deadline_s = 0.001\n'
        f"[router.backends]\n{backends}\n"
    )
    proc, pd = start_router(cluster.tmp, "router-pd-late", {}, config=cfg)
    try:
        ids = vm.prompt_ids(74, 3 * BS + 2)
        status, headers, out = pd.post("/v1/completions", completion(ids, max_tokens=12))
        assert status == 200, out
        assert headers["x-kvstore-pd"].startswith("fallback: deadline"), headers
        assert metric(pd, 'kvstore_router_pd_fallbacks_total{reason="deadline"}') == 1
        status, _, single = a.http.post("/v1/completions", completion(ids, max_tokens=12))
        assert out["choices"][0]["text"] == single["choices"][0]["text"]
    finally:
        stop(proc)


@pytest.mark.nixl
@pytest.mark.skipif(not HAVE_NIXL, reason="NIXL (nixl-cu12) not installed")
def test_llm_d_sidecar_protocol_hands_the_prefill_over_to_decode(cluster):
    """llm-d's P/D split, with no router of ours: its routing sidecar's two requests
    (the nixlv2 protocol of llm-d-inference-scheduler's
    pkg/sidecar/proxy/connector_nixlv2.go; spoken here by the test, the sidecar
    being Go)
    go to the engines themselves. The prefill request asks do_remote_decode with
    max_tokens 1; node-a's connector answers a ticket in kv_transfer_params; the
    sidecar passes those on, unread, with the original max_tokens to node-b, whose
    daemon reads the handed-over pin (the ticket names node-a, a node of its
    [peer] peers) and answers what a single engine answers."""
    from kvstore.client import Client

    a, b = cluster.engines["node-a"], cluster.engines["node-b"]
    ids = vm.prompt_ids(75, 6 * BS + 5)
    pulled_blocks = (len(ids) - 1) // BS  # full blocks before the last token (recomputed)
    with Client(b.daemon.address, map_region=False) as c:
        stats = c.stats()
        stored_before = stats.stored_blocks
        handed_before = sum(p.handed_over_pulls for p in stats.peer)
    prefill_params = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    status, _, prefilled = a.http.post(
        "/v1/completions", completion(ids, max_tokens=1, kv_transfer_params=prefill_params)
    )
    assert status == 200, prefilled
    handed = prefilled["kv_transfer_params"]
    assert set(handed) == {"kvstore_ticket"}, handed
    status, _, out = b.http.post(
        "/v1/completions", completion(ids, max_tokens=12, kv_transfer_params=handed)
    )
    assert status == 200, out
    # node-b never saw this prompt: its cached tokens are the blocks it pulled.
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == pulled_blocks * BS
    with Client(b.daemon.address, map_region=False) as c:
        stats = c.stats()
        assert stats.stored_blocks - stored_before >= pulled_blocks
        assert sum(p.handed_over_pulls for p in stats.peer) - handed_before == 1
    status, _, single = a.http.post("/v1/completions", completion(ids, max_tokens=12))
    assert out["choices"][0]["text"] == single["choices"][0]["text"]


def test_a_daemon_restarting_is_drained_then_brought_back(cluster):
    """node-b's daemon restarts (SIGTERM: NOT_SERVING, drain, exit; then start
    again, warm): meanwhile the router sends everything to node-a, even a prompt
    whose prefix node-b holds, and every request is served; then node-b is back."""
    b = cluster.engines["node-b"]
    settings = {
        **{f"backends.{n}": f"unix:{e.sock}" for n, e in cluster.engines.items()},
        **{f"daemons.{n}": e.daemon.address for n, e in cluster.engines.items()},
        "indexer": cluster.indexer_address,
        "decision_deadline_s": "5",
        "scrape_interval_s": "0.3",
    }
    proc, r = start_router(cluster.tmp, "router-drain", settings)
    serving = 'kvstore_router_backend_daemon_serving{backend="node-b"}'
    try:
        held = vm.prompt_ids(131, 4 * BS + 2)
        assert b.http.post("/v1/completions", completion(held))[0] == 200
        wait_for(lambda: index_prefix(cluster, "node-b", router_hashes(held)) == 4, 30, "indexed")
        status, headers, _ = r.post("/v1/completions", completion(held))
        assert (status, headers["x-kvstore-backend"]) == (200, "node-b")
        b.daemon.stop()  # SIGTERM: the daemon drains and exits (warm restart kept)
        wait_for(lambda: metric(r, serving) == 0, 30, "node-b drained")
        assert json.loads(r.get("/health")[1])["drained"] == ["node-b"]
        for ids in (held, vm.prompt_ids(132, 2 * BS)):
            status, headers, out = r.post("/v1/completions", completion(ids))
            assert status == 200, out
            assert headers["x-kvstore-backend"] == "node-a"
        b.daemon.start()
        wait_for(lambda: metric(r, serving) == 1, 60, "node-b back")
        assert json.loads(r.get("/health")[1])["drained"] == []
    finally:
        stop(proc)


def test_a_backend_dying_mid_stream_ends_the_stream_with_an_error_then_others_serve(cluster):
    """Runs last: it kills node-b's engine."""
    b = cluster.engines["node-b"]
    proc, only_b = start_router(cluster.tmp, "router-only-b", {"backends.node-b": f"unix:{b.sock}"})
    try:
        body = json.dumps(
            completion(
                vm.prompt_ids(61, 2 * BS),
                max_tokens=vm.MAX_MODEL_LEN - 2 * BS - 8,
                stream=True,
                ignore_eos=True,
            )
        ).encode()
        s = only_b.connect(timeout_s=60)
        only_b.send(s, "POST", "/v1/completions", body)
        got = b""
        while b"data: " not in got:
            chunk = s.recv(4096)
            assert chunk
            got += chunk
        kill_engine(b.proc)
        while chunk := s.recv(65536):  # must end (the socket timeout bounds a hang)
            got += chunk
        s.close()
        head, _, chunked = got.partition(b"\r\n\r\n")
        assert b"transfer-encoding: chunked" in head.lower()
        tail = _dechunk(chunked)[-2000:].decode(errors="replace")
        assert '"error"' in tail and "node-b" in tail and tail.rstrip().endswith("[DONE]"), tail
        assert metric(only_b, "kvstore_router_upstream_errors_total") >= 1
        # With its only engine gone, the router answers 503, at once.
        status, _, err = only_b.post("/v1/completions", completion([5, 6, 7]))
        assert status == 503 and err["error"]["type"] == "ServiceUnavailableError"
    finally:
        stop(proc)
    # The main router: node-b is unreachable, every request is served by node-a,
    # even one whose prefix only node-b held.
    ids = vm.prompt_ids(11, 6 * BS + 5)  # the first test's prompt, cached on node-b
    for _ in range(2):
        status, headers, out = cluster.router.post("/v1/completions", completion(ids))
        assert status == 200, out
        assert headers["x-kvstore-backend"] == "node-a"
