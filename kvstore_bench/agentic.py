"""`kvstore-bench agentic`: an agentic trace replayed on a cluster, per routing strategy.

The cluster: N nodes on this machine, each
  - a real `kvstore serve` daemon (DRAM tier, and a disk tier when asked),
    publishing KV events over ZMQ, sized down to `--dram-blocks` /
    `--disk-blocks` of `--block-bytes` real bytes each;
  - a model of its engine's GPU prefix cache: an LRU of block hashes holding
    what fits in the GPU (from the cost model), publishing vLLM-format KV
    events (medium GPU) as a vLLM engine does;
and the indexer's index fed by all those event streams.

Routing strategies (one fresh cluster each, same trace), all built by
kvstore_router_client.strategies (the product's code, no copy here):
  random        a uniformly random node.
  round-robin   the next node.
  approximate   llm-d's estimated prefix scorer: remembers which blocks it
                routed where (an LRU per node as large as a GPU cache),
                knows nothing of evictions or tiers; plus a queue score.
  precise-only  the indexer's per-node, per-tier prefix score, no load term.
  cache+load    the product default (kvstore_router_client.policy): the indexer's
                prefix by tier and by what a peer pull saves, against each
                node's queue (running + waiting, capacity 1: a modelled node
                serves one request at a time); affinity to the node the
                request's predecessor went to.
  approximate-gpu-only  approximate routing over engines without kvstore.

The replay runs in modelled time (a discrete-event simulation): a request
arrives when the requests it waits for have finished plus its think time;
its node serves requests one at a time. When a request starts, the bench
*measures* its sources against the real system: the GPU-cache model's
prefix, then the local daemon's Lookup, then, with peers on, the product's
peer pull: the chosen node's daemon is asked (FetchFromPeer, by node id from
its `peer.peers`) to pull the rest of the prefix from the peer daemon the
index shows holding it, over NIXL (daemon to daemon; the bench moves no
bytes), and the tokens credited to peers are what that daemon reports it
fetched; then one real load of the local prefix, pulled blocks included
(bytes verified). Whatever is left is recomputed, and every recomputed token
is attributed to a cause (class Diagnosis). When it finishes, its blocks
(input and output) enter the GPU cache model and are stored into the local
daemon, as a connector does. TTFT and throughput come from
kvstore_bench/costmodel.py (*modelled*).

The code, by concern: agentic_cluster (the daemons), agentic_engine (the GPU
cache model), agentic_routing (strategies and the indexer), agentic_replay (the
replay engine), agentic_diagnosis (tallies and recompute causes),
agentic_limits (goals and limits); this module is the command line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvstore_bench import _common
from kvstore_bench import trace as T
from kvstore_bench.agentic_cluster import cluster
from kvstore_bench.agentic_limits import explain_limits, goals
from kvstore_bench.agentic_replay import Replay
from kvstore_bench.agentic_routing import GPU_ONLY, STRATEGIES, EventIndex, IndexerService
from kvstore_bench.costmodel import CostModel


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(T.PRESETS), default="cybergym")
    p.add_argument("--trace", help="replay this JSONL trace instead of generating one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="CI shape: fewer agents/turns, 4 nodes")
    p.add_argument("--agents", type=int)
    p.add_argument("--turns", type=int)
    p.add_argument("--tasks", type=int)
    p.add_argument("--nodes", type=int, help="default 8 (4 with --quick)")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--block-tokens", type=int, default=256)
    p.add_argument(
        "--block-bytes",
        type=int,
        default=4096,
        help="real bytes stored per block (a real block is block-tokens x KV bytes/token)",
    )
    p.add_argument(
        "--dram-gb",
        type=float,
        default=256.0,
        help="modelled host DRAM for KV per node (GB); sizes the daemon in blocks",
    )
    p.add_argument(
        "--disk-gb",
        type=float,
        default=0.0,
        help="modelled NVMe for KV per node (GB); 0 = no disk tier",
    )
    p.add_argument(
        "--peers",
        choices=("on", "off"),
        default="on",
        help="pull missing prefix blocks from the peer daemon that holds them",
    )
    p.add_argument(
        "--peer-transport",
        choices=("auto", "nixl", "grpc_stream"),
        default="auto",
        help="the daemons' peer.transport: auto = NIXL, or the daemon's gRPC stream "
        "fallback (logged loudly, and flagged in the report) when NIXL cannot load",
    )
    p.add_argument(
        "--daemon-events",
        choices=("on", "off"),
        default="on",
        help="daemons publish KV events to the indexer (off: it sees engine GPU events only)",
    )
    p.add_argument(
        "--indexer",
        choices=("service", "in-process"),
        default="service",
        help="service: the `kvstore.indexer` process over gRPC; in-process: its index "
        "fed in this process, drained before every decision (no ingest lag)",
    )
    p.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a kvstore_router_client.Policy weight for cache+load (e.g. load_weight=0.3)",
    )
    p.add_argument("--max-requests", type=int, default=0, help="stop after this many (0 = all)")
    p.add_argument("--results", default="results")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto")


def run(args: argparse.Namespace) -> int:
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = set(strategies) - set(STRATEGIES)
    if bad:
        print(f"unknown strategies {sorted(bad)}; choose from {STRATEGIES}", file=sys.stderr)
        return 2
    if args.block_bytes % 8 or args.block_bytes <= 0:
        print("--block-bytes must be a positive multiple of 8", file=sys.stderr)
        return 2
    if args.trace:
        trace = T.read(args.trace)
        preset = f"file:{args.trace}"
    else:
        params = T.preset_params(
            args.preset, args.quick, agents=args.agents, turns=args.turns, tasks=args.tasks
        )
        trace = T.generate(params, args.seed, args.preset)
        preset = args.preset
    nodes_n = args.nodes or (4 if args.quick else 8)
    cost = CostModel()
    B = args.block_tokens
    real_block_bytes = B * cost.kv_bytes_per_token
    gpu_blocks = max(1, cost.gpu_cache_tokens() // B)
    dram_blocks = max(1, int(args.dram_gb * 1e9 // real_block_bytes))
    disk_blocks = int(args.disk_gb * 1e9 // real_block_bytes)
    chunk_bytes = max(args.block_bytes, 1 << 20)
    # Region: the blocks plus one chunk of slack per size class in the slab allocator.
    dram_bytes = ((dram_blocks * args.block_bytes) // chunk_bytes + 2) * chunk_bytes
    disk_bytes = (
        -(-disk_blocks * args.block_bytes // chunk_bytes) * chunk_bytes if disk_blocks else 0
    )
    stats = T.stats(trace)
    n_reqs = min(len(trace.requests), args.max_requests or len(trace.requests))
    progress_enabled = {"auto": None, "on": True, "off": False}[args.progress]
    out_dir = _common.results_dir(
        args.results, f"agentic-{args.preset if not args.trace else 'file'}"
    )
    replay = Replay(args, trace, cost, gpu_blocks, dram_blocks + disk_blocks)
    results: dict[str, Any] = {}
    print(
        f"agentic: {n_reqs} requests, {nodes_n} nodes, strategies {strategies}; "
        f"GPU cache {gpu_blocks} blocks, DRAM {dram_blocks}, disk {disk_blocks} per node",
        file=sys.stderr,
    )
    for strategy in strategies:
        progress = _common.Progress(n_reqs, f"{strategy:>11}", progress_enabled)
        with (
            tempfile.TemporaryDirectory(prefix="kvsbench-agentic-") as tmp_name,
            cluster(
                nodes_n,
                Path(tmp_name),
                dram_bytes,
                disk_bytes,
                chunk_bytes,
                args.daemon_events == "on",
                args.peer_transport if args.peers == "on" and strategy != GPU_ONLY else "",
            ) as procs,
        ):
            results[strategy] = replay.run(strategy, procs, progress)
        progress.close()
        s = results[strategy]
        print(
            f"  {strategy:>11}: local hit {100 * s['local_prefix_hit_rate']:.1f}%  "
            f"cached {100 * s['cached_share']:.1f}%  throughput "
            f"{s['throughput_tokens_per_s']:,.0f} tok/s (modelled)  wall {s['wall_s']:.1f} s  "
            f"peer pulls {s['peer']['fetches']} ({s['peer']['fetched_blocks']} blocks, "
            f"{s['peer']['failures']} failed, via {s['peer']['transports'] or '-'})",
            file=sys.stderr,
        )
        fallback = {k: v for k, v in s["peer"]["transports"].items() if k != "nixl"}
        if fallback:
            print(
                f"  !!! {strategy}: {sum(fallback.values())} peer pulls went over {sorted(fallback)}, "
                "NOT NIXL (NIXL did not load in the daemons; see their logs)",
                file=sys.stderr,
            )
    cluster_info = {
        "nodes": nodes_n,
        "gpu_blocks": gpu_blocks,
        "dram_blocks": dram_blocks,
        "disk_blocks": disk_blocks,
        "block_tokens": B,
        "block_bytes": args.block_bytes,
        "real_block_bytes": real_block_bytes,
        "indexer": IndexerService.description
        if args.indexer == "service"
        else EventIndex.description,
        "peers": _peers_description(args, results),
    }
    goal_rows, limits = goals(results)
    if preset == "cybergym" and not all(g["met"] for g in goal_rows):
        limits = explain_limits(results, stats, cluster_info)
    result = {
        "preset": preset,
        "trace": _common_struct(stats),
        "cluster": cluster_info,
        "strategies": results,
        "goals": goal_rows if preset == "cybergym" else [],
        "limits": limits,
        "cost_model": cost.describe(),
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
    }
    _common.write_json(out_dir / "agentic.json", result)
    from kvstore_bench import report

    md = report.agentic_report(result, out_dir, command="kvstore-bench " + " ".join(sys.argv[1:]))
    print(md)
    print(f"results in {out_dir}")
    failures = sum(s["verify_failures"] for s in results.values())
    return 1 if failures else 0


def _peers_description(args: argparse.Namespace, results: dict[str, Any]) -> str:
    if args.peers != "on":
        return "off"
    transports: dict[str, int] = {}
    for s in results.values():
        for k, v in s["peer"]["transports"].items():
            transports[k] = transports.get(k, 0) + v
    used = ", ".join(f"{k} x {v}" for k, v in sorted(transports.items())) or "no pull made"
    warn = (
        " — WARNING: NOT NIXL: the daemons fell back to their gRPC stream (NIXL did not load)"
        if set(transports) - {"nixl"}
        else ""
    )
    return (
        "on: the chosen node's daemon pulls the missing prefix from the peer daemon the "
        f"index shows holding it (FetchFromPeer, peer.transport={args.peer_transport}; "
        f"transports used: {used}){warn}"
    )


def _common_struct(stats: T.TraceStats) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(stats)
