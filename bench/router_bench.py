"""`kvstore-bench router`: what a routing decision costs, and what the proxy adds.

1. Decision cost (no engine needed): a real indexer (in this process, fed over
   ZMQ by KV-event publishers for ``--nodes`` nodes, the context's blocks
   spread over them in several tiers) and ``router_client.RouterClient``, the
   code `kvstore router` runs: token ids -> block hashes -> indexer Score ->
   policy choice, for ``--context-tokens`` (195k) contexts at
   ``--block-tokens`` (16). *Cold*: a context never seen (every block
   hashed). *Re-sent*: the same agent's next turn, its previous context plus
   ``--new-tokens`` (only the tail is hashed; the rest of the chain is reused).
   Goal: re-sent p99 <= 3 ms.
2. Proxy overhead (``--engine on``): one real vLLM CPU OpenAI server (the tiny
   random Llama of tests/integration/vllm_model.py) and the real `kvstore
   router` process in front of it (two backend entries on that one engine, so
   every request takes the full decision path with an indexer); streamed
   completions sent alternately to the engine directly and through the router;
   time to the first SSE event and to the end of the stream. Goal: the router
   adds <= 1 ms at p50. CPU figures: the engine is a 2-layer model on a CPU.

Markdown report + PNG (latency CDFs) + JSON under ``--results``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import _common

MODEL = "kvstore-bench/router"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context-tokens", type=int, default=195_000)
    p.add_argument("--new-tokens", type=int, default=2_000, help="tokens a re-sent turn adds")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--samples", type=int, default=40, help="contexts (each: cold, then re-sent)")
    p.add_argument("--engine", choices=("on", "off"), default="on", help="measure proxy overhead")
    p.add_argument("--requests", type=int, default=40, help="streamed requests per path")
    p.add_argument("--results", default="results")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto")


def _pct(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) if xs else np.zeros(1)
    return {
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
        "max": float(a.max()),
    }


class _NS:
    def __init__(self, block_tokens: int) -> None:
        self.namespace_id = "bench"
        self.model = MODEL
        self.tenant = ""
        self.block_size_tokens = block_tokens


def decision_cost(args: argparse.Namespace, progress: _common.Progress) -> dict[str, Any]:
    from kvstore.events.publisher import ZmqEventPublisher
    from kvstore.indexer.config import IndexerConfig
    from kvstore.indexer.service import Indexer, serve
    from kvstore.indexer.subscriber import SourceSpec
    from router_client import NodeLoad, RouterClient, choose

    names = [f"node-{i}" for i in range(args.nodes)]
    pubs = {n: ZmqEventPublisher(n, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0") for n in names}
    ix = Indexer(
        IndexerConfig(
            sources=[
                SourceSpec(node=n, endpoint=p.endpoint, replay_endpoint=p.replay_endpoint)
                for n, p in pubs.items()
            ],
            max_request_blocks=1 << 20,
            max_request_tokens=1 << 24,
        )
    )
    ix.start()
    server, port = serve(ix, "127.0.0.1:0")
    rng = np.random.default_rng(0)
    ns = _NS(args.block_tokens)
    out: dict[str, list[float]] = {k: [] for k in ("cold", "resent", "hash", "score", "choose")}
    reused: list[int] = []
    load = {n: NodeLoad(running=float(i % 4), capacity=8) for i, n in enumerate(names)}
    try:
        time.sleep(0.3)  # ZMQ slow joiner
        with RouterClient(
            f"127.0.0.1:{port}", block_size_tokens=args.block_tokens, deadline_s=2.0
        ) as rc:
            for _ in range(args.samples):
                ctx = rng.integers(0, 150_000, args.context_tokens - args.new_tokens)
                turn = np.concatenate([ctx, rng.integers(0, 150_000, args.new_tokens)])
                # The index holds this agent's context: a long prefix on three nodes
                # in different tiers (hashed here with the vLLM-compatible hasher).
                full = rc.hasher.hash_tokens_int(ctx)
                holders = rng.choice(len(names), 3, replace=False)
                for j, medium in zip(holders, ("CPU", "GPU", "DISK"), strict=True):
                    k = int(len(full) * rng.uniform(0.5, 1.0))
                    pubs[names[j]].blocks_stored(ns, full[:k], medium, None, None)
                _wait_indexed(ix, full[:1], 3)
                t0 = time.perf_counter()
                rc.pick(MODEL, ctx, names, default=names[0], load=load)
                out["cold"].append(time.perf_counter() - t0)
                # The next turn: everything again plus the new tail.
                t0 = time.perf_counter()
                hashed = rc.hash_incremental(turn)
                t1 = time.perf_counter()
                result = rc.scores(MODEL, hashed.hashes, names)
                t2 = time.perf_counter()
                choose(result, names, names[0], load, rc.policy, affinity=hashed.previous_node)
                t3 = time.perf_counter()
                out["resent"].append(t3 - t0)
                out["hash"].append(t1 - t0)
                out["score"].append(t2 - t1)
                out["choose"].append(t3 - t2)
                reused.append(hashed.reused_blocks)
                progress.update(1, "decisions")
    finally:
        server.stop(0)
        ix.close()
        for p in pubs.values():
            p.close()
    blocks = args.context_tokens // args.block_tokens
    return {
        "context_tokens": args.context_tokens,
        "request_blocks": blocks,
        "new_tokens": args.new_tokens,
        "nodes": args.nodes,
        "reused_blocks_mean": float(np.mean(reused)) if reused else 0.0,
        "cold_s": _pct(out["cold"]),
        "resent_s": _pct(out["resent"]),
        "resent_hash_s": _pct(out["hash"]),
        "resent_score_s": _pct(out["score"]),
        "resent_choose_s": _pct(out["choose"]),
        "samples_s": {k: v for k, v in out.items() if k in ("cold", "resent")},
    }


def _wait_indexed(ix: Any, hashes: np.ndarray, nodes: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(ix.score(MODEL, hashes)) >= nodes:
            return
        time.sleep(0.005)
    raise RuntimeError("the indexer did not ingest the bench's events in time")


# -- proxy overhead ------------------------------------------------------------------


def _connect(address: str) -> socket.socket:
    if address.startswith("unix:"):
        s = socket.socket(socket.AF_UNIX)
        s.connect(address[5:])
    else:
        host, port = address.rsplit(":", 1)
        s = socket.create_connection((host, int(port)))
    s.settimeout(120)
    return s


def _streamed(address: str, body: bytes) -> tuple[float, float]:
    """(seconds to the first SSE event, seconds to the end of the stream)."""
    t0 = time.perf_counter()
    with contextlib.closing(_connect(address)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: b\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        first = 0.0
        buf = b""
        while chunk := s.recv(65536):
            if not first:
                buf += chunk
                if b"data: " in buf:
                    first = time.perf_counter() - t0
        end = time.perf_counter() - t0
    if not first:
        raise RuntimeError(f"no SSE event from {address}: {buf[:300]!r}")
    return first, end


def _wait_http(address: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited: {log.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(OSError), contextlib.closing(_connect(address)) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n")
            if s.recv(64).startswith(b"HTTP/1.1 200"):
                return
        time.sleep(0.5)
    raise RuntimeError("vLLM did not become healthy")


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def proxy_overhead(args: argparse.Namespace, tmp: Path, progress: _common.Progress) -> dict:
    from kvstore.indexer.config import IndexerConfig
    from kvstore.indexer.service import Indexer, serve
    from tests.integration import vllm_model as vm

    model_dir = vm.make_tiny_llama(tmp / "model")
    sock = str(tmp / "engine.sock")
    log = tmp / "vllm.log"
    engine_args = vm.api_server_command(model_dir, "--served-model-name", "tiny", "--uds", sock)
    with open(log, "wb") as f:
        engine = subprocess.Popen(
            engine_args, cwd=vm.REPO_ROOT, env=vm.engine_env(), stdout=f, stderr=subprocess.STDOUT
        )
    ix = Indexer(IndexerConfig())
    ix.start()
    server, port = serve(ix, "127.0.0.1:0")
    router = None
    try:
        _wait_http(f"unix:{sock}", engine, log, 300)
        rargs = [
            sys.executable,
            "-m",
            "kvstore",
            "router",
            "--set",
            "router.listen=127.0.0.1:0",
            "--set",
            f"router.backends.node-a=unix:{sock}",
            "--set",
            f"router.backends.node-b=unix:{sock}",
            "--set",
            f"router.indexer=127.0.0.1:{port}",
            "--set",
            "router.decision_deadline_s=1",
        ]
        env = dict(os.environ, PYTHONPATH=str(vm.REPO_ROOT))
        router = subprocess.Popen(
            rargs, cwd=vm.REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        assert router.stdout is not None
        address = ""
        deadline = time.monotonic() + 60
        while not address and time.monotonic() < deadline:
            m = re.search(r"listening on http://([\d.]+:\d+)", router.stdout.readline().decode())
            address = m.group(1) if m else ""
        if not address:
            raise RuntimeError("the router did not start")
        direct: dict[str, list[float]] = {"first": [], "end": []}
        routed: dict[str, list[float]] = {"first": [], "end": []}
        rng = np.random.default_rng(1)
        for i in range(args.requests + 3):
            prompt = [int(t) for t in rng.integers(2, 500, 200)]
            body = json.dumps(
                {
                    "model": "tiny",
                    "prompt": prompt,
                    "max_tokens": 16,
                    "temperature": 0,
                    "stream": True,
                    "ignore_eos": True,
                }
            ).encode()
            # Alternate which path goes first, so neither always meets a warm cache.
            paths = [("direct", f"unix:{sock}"), ("routed", address)]
            if i % 2:
                paths.reverse()
            for name, addr in paths:
                first, end = _streamed(addr, body)
                if i >= 3:  # warm-up
                    d = direct if name == "direct" else routed
                    d["first"].append(first)
                    d["end"].append(end)
            progress.update(1, "streams")
        return {
            "requests": args.requests,
            "direct_first_s": _pct(direct["first"]),
            "routed_first_s": _pct(routed["first"]),
            "direct_end_s": _pct(direct["end"]),
            "routed_end_s": _pct(routed["end"]),
            "added_first_p50_s": float(np.median(routed["first"]) - np.median(direct["first"])),
            "added_end_p50_s": float(np.median(routed["end"]) - np.median(direct["end"])),
            "added_first_paired_p50_s": float(
                np.median(np.asarray(routed["first"]) - np.asarray(direct["first"]))
            ),
        }
    finally:
        if router is not None:
            _stop(router)
        _stop(engine)
        server.stop(0)
        ix.close()


def run(args: argparse.Namespace) -> int:
    progress_on = {"auto": None, "on": True, "off": False}[args.progress]
    total = args.samples + (args.requests + 3 if args.engine == "on" else 0)
    progress = _common.Progress(total, "router", progress_on)
    load_before = os.getloadavg()
    result: dict[str, Any] = {"decision": decision_cost(args, progress)}
    if args.engine == "on":
        with tempfile.TemporaryDirectory(prefix="kvsbench-router-") as tmp:
            result["proxy"] = proxy_overhead(args, Path(tmp), progress)
    progress.close()
    result["load_average"] = {"before": load_before, "after": os.getloadavg()}
    result["settings"] = {k: v for k, v in vars(args).items() if k != "func"}
    out = _common.results_dir(args.results, "router")
    _common.write_json(out / "router.json", result)
    md = report(result, out)
    (out / "report.md").write_text(md)
    print(md)
    print(f"results in {out}")
    return 0


def report(result: dict[str, Any], out: Path) -> str:
    d = result["decision"]
    ms = 1e3
    lines = [
        "# kvstore-bench router",
        "",
        f"Load average before/after: {result['load_average']['before'][0]:.1f} / "
        f"{result['load_average']['after'][0]:.1f} (1 min).",
        "",
        f"## Decision cost (measured): {d['context_tokens']:,}-token context, "
        f"{d['request_blocks']:,} blocks, {d['nodes']} nodes",
        "",
        "token ids -> block hashes -> indexer Score (gRPC, in-process indexer) -> policy choice",
        "",
        "| decision | p50 | p90 | p99 | max |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, label in (
        ("cold_s", "cold (never seen: every block hashed)"),
        ("resent_s", f"re-sent (+{d['new_tokens']:,} new tokens: only the tail hashed)"),
        ("resent_hash_s", "  of which hashing"),
        ("resent_score_s", "  of which indexer Score"),
        ("resent_choose_s", "  of which the policy"),
    ):
        s = d[key]
        lines.append(
            f"| {label} | {s['p50'] * ms:.2f} ms | {s['p90'] * ms:.2f} ms | "
            f"{s['p99'] * ms:.2f} ms | {s['max'] * ms:.2f} ms |"
        )
    met = d["resent_s"]["p99"] <= 0.003
    lines += [
        "",
        f"Goal re-sent p99 <= 3 ms: **{'met' if met else 'not met'}** "
        f"({d['resent_s']['p99'] * ms:.2f} ms; {d['reused_blocks_mean']:.0f} blocks reused per "
        "re-sent decision on average).",
    ]
    p = result.get("proxy")
    if p:
        lines += [
            "",
            f"## Proxy overhead (measured on CPU, tiny model): {p['requests']} streamed "
            "requests per path, 200-token prompts, 16 tokens each",
            "",
            "| path | first event p50 | first event p90 | end of stream p50 | end p90 |",
            "|---|---:|---:|---:|---:|",
        ]
        for name in ("direct", "routed"):
            f, e = p[f"{name}_first_s"], p[f"{name}_end_s"]
            lines.append(
                f"| {name} | {f['p50'] * ms:.2f} ms | {f['p90'] * ms:.2f} ms | "
                f"{e['p50'] * ms:.2f} ms | {e['p90'] * ms:.2f} ms |"
            )
        added = p["added_first_p50_s"]
        lines += [
            "",
            f"Router adds (p50 of routed minus p50 of direct): first event "
            f"{added * ms:+.2f} ms, end of stream {p['added_end_p50_s'] * ms:+.2f} ms "
            f"(paired p50 {p['added_first_paired_p50_s'] * ms:+.2f} ms). Goal <= 1 ms at p50: "
            f"**{'met' if added <= 0.001 else 'not met'}**.",
        ]
    _plot(result, out)
    lines += ["", "![decision latency](decision_cdf.png)"]
    return "\n".join(lines) + "\n"


def _plot(result: dict[str, Any], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (("cold", "cold"), ("resent", "re-sent")):
        xs = np.sort(np.asarray(result["decision"]["samples_s"][key]) * 1e3)
        ax.step(xs, np.arange(1, len(xs) + 1) / max(1, len(xs)), label=label, where="post")
    ax.axvline(3.0, color="grey", linestyle=":", label="goal 3 ms")
    ax.set_xscale("log")
    ax.set_xlabel("decision latency (ms)")
    ax.set_ylabel("CDF")
    ax.legend()
    ax.set_title("Router decision cost (measured)")
    fig.tight_layout()
    fig.savefig(out / "decision_cdf.png", dpi=120)
    plt.close(fig)
