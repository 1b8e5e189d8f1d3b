"""`kvstore-bench agentic`'s replay engine: the trace run in modelled time (a
discrete-event simulation) against a real cluster, one routing strategy at a time."""

from __future__ import annotations

import argparse
import heapq
import sys
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

import numpy as np

from kvstore_bench import _common
from kvstore_bench import trace as T
from kvstore_bench.agentic_cluster import MODEL, NodeProcs
from kvstore_bench.agentic_diagnosis import Diagnosis, RemovalLedger, Tally
from kvstore_bench.agentic_engine import GpuCacheModel
from kvstore_bench.agentic_routing import (
    GPU_ONLY,
    EventIndex,
    IndexerService,
    Scorer,
    index_scores,
    policy_from_args,
)
from kvstore_bench.costmodel import CostModel
from kvstore_router_client.policy import NodeLoad
from kvstore_router_client.strategies import Strategy, make_strategy

DAEMON_COUNTERS = (
    "stored_blocks",
    "evicted_blocks",
    "demoted_blocks",
    "promoted_blocks",
    "expired_leases",
    # copies (docs/eviction.md): pulled replicas and copy-aware evictions
    "admitted_replicas",
    "promoted_replicas",
    "evicted_replica_blocks",
    "evicted_redundant_blocks",
)


def block_payload(hashes: np.ndarray, block_bytes: int) -> np.ndarray:
    """Real bytes of each block: its hash repeated (so a load can be verified)."""
    words = block_bytes // 8
    return np.repeat(hashes.astype("<u8")[:, None], words, axis=1).view(np.uint8)


def verify(data: np.ndarray, hashes: np.ndarray) -> int:
    """Blocks whose bytes are not their hash repeated."""
    if len(hashes) == 0:
        return 0
    words = data.view("<u8")
    return int(np.count_nonzero((words != hashes[:, None]).any(axis=1)))


class Replay:
    def __init__(
        self,
        args: argparse.Namespace,
        trace: T.Trace,
        cost: CostModel,
        gpu_blocks: int,
        pool_blocks: int,
    ) -> None:
        self.args, self.trace, self.cost = args, trace, cost
        self.tokens = T.TokenSource(trace.seed)
        self.gpu_blocks = gpu_blocks
        self.pool_blocks = pool_blocks
        self.has_disk = args.disk_gb > 0
        self._hash_cache: OrderedDict[str, np.ndarray] = OrderedDict()

    def hashes_of(self, req: T.Request, with_output: bool) -> np.ndarray:
        key = f"{req.id}|{int(with_output)}"
        got = self._hash_cache.get(key)
        if got is not None:
            return got
        ids = self.tokens.token_ids(req)
        if with_output and req.output_segment and req.output_tokens:
            ids = np.concatenate(
                [ids, self.tokens.segment_token_ids(req.output_segment, req.output_tokens)]
            )
        h = T.block_hashes(ids, self.args.block_tokens, self.trace.seed)
        self._hash_cache[key] = h
        if len(self._hash_cache) > 256:
            self._hash_cache.popitem(last=False)
        return h

    def run(self, strategy: str, nodes: list[NodeProcs], progress: _common.Progress) -> dict:
        from kvstore.client import Client
        from kvstore.namespace import NamespaceSpec

        args, cost = self.args, self.cost
        n = len(nodes)
        B = args.block_tokens
        clients = [Client(f"unix:{nd.socket}") for nd in nodes]
        spec = NamespaceSpec(
            model=MODEL,
            dtype="bfloat16",
            block_size_tokens=B,
            num_layers=cost.layers,
            num_kv_heads=cost.kv_heads,
            head_dim=cost.head_dim,
            tp_rank=0,
            tp_world_size=1,
            tenant="",
            block_bytes=args.block_bytes,
        )
        nss = [c.declare_namespace(spec) for c in clients]
        engines = [GpuCacheModel(nd.name, self.gpu_blocks, nd.engine_events, B) for nd in nodes]
        index: Scorer
        if self.args.indexer == "service":
            index = IndexerService(nodes, B, Path(nodes[0].socket).parent / "indexer.log")
        else:
            index = EventIndex([nd.events for nd in nodes] + [nd.engine_events for nd in nodes])
        storage = strategy != GPU_ONLY
        ledger = RemovalLedger([nd.events for nd in nodes]) if storage else None
        time.sleep(0.3)  # ZMQ slow joiner: let subscriptions reach the publishers
        router: Strategy = make_strategy(
            "approximate" if strategy == GPU_ONLY else strategy,
            policy=policy_from_args(args.policy),
            seed=args.seed,
            approximate_capacity_blocks=self.gpu_blocks,
        )
        names = [nd.name for nd in nodes]
        node_of = {name: i for i, name in enumerate(names)}
        routed_to: dict[str, int] = {}
        tally = Tally()
        reqs = self.trace.requests
        if args.max_requests:
            reqs = reqs[: args.max_requests]
        by_id = {r.id: r for r in reqs}
        waiting = {r.id: len([d for d in r.after if d in by_id]) for r in reqs}
        dependents = T.iter_dependents(reqs)
        last_finish: dict[str, float] = {}
        arrival: dict[str, float] = {}
        events: list[tuple[float, int, str, str, int]] = []
        seq = 0
        for r in reqs:
            if waiting[r.id] == 0:
                heapq.heappush(events, (r.delay_s, seq, "arrive", r.id, -1))
                seq += 1
        queues: list[deque[str]] = [deque() for _ in range(n)]
        busy = [False] * n
        # For the diagnosis of recomputed tokens: blocks of finished requests (their
        # KV exists somewhere), of started unfinished ones (hash -> requests), and
        # blocks a daemon accepted (stored or already held) or refused (no room).
        diag = Diagnosis(clients, nss, engines, ledger, storage, args.peers == "on", B)
        diag.pool_capacity = n * (self.pool_blocks if storage else self.gpu_blocks)
        computed, inflight, offered, refused = (
            diag.computed,
            diag.inflight,
            diag.offered,
            diag.refused,
        )
        score_s: list[float] = []
        wall0 = time.perf_counter()
        now = 0.0

        def start(node: int, rid: str, t: float) -> None:
            nonlocal seq
            req = by_id[rid]
            hashes = self.hashes_of(req, False)
            ntok = req.input_tokens
            diag.pool_start(hashes, ntok)
            gpu = engines[node].prefix(hashes)
            rest = hashes[gpu:]
            dram = disk = peer = 0
            pulled_from = -1
            c, ns = clients[node], nss[node]
            if len(rest) and storage:
                # The local prefix and its tier split (Lookup does not touch the
                # eviction order; the load below does, as an engine's would).
                look = c.lookup(ns, rest)
                local = look.prefix_blocks
                if args.peers == "on" and local < len(rest):
                    peer, pulled_from = self._pull(
                        node, rest, local, clients, nss, index, nodes, tally
                    )
                if local + peer:
                    # One load of everything now here (the pulled blocks included):
                    # bytes verified against the hashes they were stored under.
                    got = c.get(ns, rest)
                    tally.blocks_loaded += got.found
                    tally.verified_blocks += got.found
                    tally.verify_failures += verify(got.data, rest[: got.found])
                    # Peer blocks sit right after the local prefix and count only as
                    # far as the load reached them; blocks that were already here
                    # after a gap, which the pull's prefix also spans, are local.
                    peer = min(peer, max(0, got.found - look.prefix_blocks))
                    local = got.found - peer
                    disk = min(local, look.by_tier.get("disk", 0))
                    dram = local - disk
            cap = max(0, ntok - 1)  # the last token is always computed

            def toks(b: int) -> int:
                return b * B

            parts = {"gpu": toks(gpu), "dram": toks(dram), "disk": toks(disk), "peer": toks(peer)}
            over = sum(parts.values()) - cap
            for k in ("peer", "disk", "dram", "gpu"):
                if over <= 0:
                    break
                cut = min(over, parts[k])
                parts[k] -= cut
                over -= cut
            recompute = ntok - sum(parts.values())
            for k, v in parts.items():
                tally.tokens[k] += v
            tally.tokens["recompute"] += recompute
            if recompute:
                served = gpu + dram + disk + peer
                diag.attribute(hashes, served, recompute, node, pulled_from, tally)
            for h in self.hashes_of(req, True).tolist():
                inflight[h] = inflight.get(h, 0) + 1
            tally.input_tokens += ntok
            tally.output_tokens += req.output_tokens
            ttft, occupancy, _ = cost.service(
                input_tokens=ntok,
                output_tokens=req.output_tokens,
                gpu_tokens=parts["gpu"],
                dram_tokens=parts["dram"],
                disk_tokens=parts["disk"],
                peer_tokens=parts["peer"],
            )
            tally.ttft_s.append(t - arrival[rid] + ttft)
            heapq.heappush(events, (t + occupancy, seq, "finish", rid, node))
            seq += 1
            busy[node] = True

        def finish(node: int, rid: str, t: float) -> None:
            nonlocal seq
            req = by_id[rid]
            full = self.hashes_of(req, True)
            engines[node].insert(full)
            fl = full.tolist()
            for h in fl:
                k = inflight[h] - 1
                if k:
                    inflight[h] = k
                else:
                    del inflight[h]
            computed.update(fl)
            diag.pool_finish(full)
            if storage:
                res = clients[node].put(nss[node], full, block_payload(full, args.block_bytes))
                tally.blocks_stored += res.stored
                tally.blocks_refused += res.no_room
                # NO_ROOM marks the tail from the first block that found no slot.
                kept = len(fl) - res.no_room
                offered.update(fl[:kept])
                refused.update(fl[kept:])
            tally.requests += 1
            if ledger is not None and tally.requests % 100 == 0:
                ledger.sample_copies()
            last_finish[rid] = t
            for dep in dependents.get(rid, []):
                if dep not in waiting:
                    continue
                waiting[dep] -= 1
                if waiting[dep] == 0:
                    d = by_id[dep]
                    ready = max(last_finish[a] for a in d.after if a in last_finish)
                    heapq.heappush(events, (ready + d.delay_s, seq, "arrive", dep, -1))
                    seq += 1
            busy[node] = False
            if queues[node]:
                start(node, queues[node].popleft(), t)
            progress.update(1, strategy)

        try:
            max_events = 4 * len(reqs) + 16  # each request arrives, starts, finishes once
            for _ in range(max_events):
                if not events:
                    break
                now, _, kind, rid, node = heapq.heappop(events)
                if kind == "arrive":
                    arrival[rid] = now
                    req = by_id[rid]
                    hashes = self.hashes_of(req, False)
                    load = {
                        names[i]: NodeLoad(running=float(busy[i]), waiting=float(len(queues[i])))
                        for i in range(n)
                    }
                    scores = None
                    if router.uses_index:
                        t0 = time.perf_counter()
                        index.catch_up()
                        scores = index_scores(index, hashes)
                        score_s.append(time.perf_counter() - t0)
                    # Affinity: where the turn this one continues went (what the
                    # router's PrefixHashCache reports for a re-sent context).
                    prev = next((routed_to[a] for a in reversed(req.after) if a in routed_to), -1)
                    decision = router.choose(
                        hashes, names, load, scores, names[prev] if prev >= 0 else ""
                    )
                    chosen = node_of[decision.node]
                    routed_to[rid] = chosen
                    router.routed(decision.node, self.hashes_of(req, True))
                    if busy[chosen]:
                        queues[chosen].append(rid)
                    else:
                        start(chosen, rid, now)
                else:
                    finish(node, rid, now)
            else:
                raise RuntimeError("replay did not drain its event queue (a bug)")
            if tally.requests != len(reqs):
                raise RuntimeError(f"replayed {tally.requests} of {len(reqs)} requests")
            tally.pool_served_tokens = diag.pool_served_tokens
            if ledger is not None and ledger.copies_samples:
                tally.copies_per_block = float(np.mean(ledger.copies_samples))
            if storage:
                # What the daemons themselves counted (evictions, demotions, ...).
                for c in clients:
                    st = c.stats()
                    for key in DAEMON_COUNTERS:
                        tally.daemon_counters[key] = tally.daemon_counters.get(key, 0) + int(
                            getattr(st, key)
                        )
        finally:
            for e in engines:
                e.close()
            if ledger is not None:
                ledger.close()
            index.close()
            for c in clients:
                c.close()
        tally.makespan_s = now
        return self._summary(tally, time.perf_counter() - wall0, score_s)

    def _pull(
        self,
        node: int,
        rest: np.ndarray,
        local: int,
        clients: list,
        nss: list,
        index: Scorer,
        nodes: list[NodeProcs],
        tally: Tally,
    ) -> tuple[int, int]:
        """Have this node's daemon pull what it lacks of `rest` (it holds `local`
        blocks of it) from the peer the index shows holding the longest run of the
        rest: the product's FetchFromPeer over NIXL (or its logged gRPC fallback).
        -> (blocks the daemon fetched that extend its prefix, peer index or -1)."""
        from kvstore.errors import KVStoreError

        index.catch_up()
        scores = index.score(rest[local:])
        # prefix_blocks counts blocks in any tier of the peer (its engine's GPU
        # too); its daemon holds what the engine computed unless it evicted them,
        # and the pull finds out.
        best, best_n = -1, 0
        for i, nd in enumerate(nodes):
            s = scores.get(nd.name)
            if i != node and s is not None and s.prefix_blocks > best_n:
                best, best_n = i, s.prefix_blocks
        if best < 0:
            return 0, -1
        tally.peer_fetches += 1
        t0 = time.perf_counter()
        try:
            reply = clients[node].fetch_from_peer(nss[node], rest, peer_node_id=nodes[best].name)
        except KVStoreError as exc:
            tally.peer_fetch_failures += 1
            if tally.peer_fetch_failures <= 3:
                print(
                    f"  peer pull {nodes[node].name} <- {nodes[best].name} failed: {exc}",
                    file=sys.stderr,
                )
            return 0, best
        tally.peer_fetch_s.append(time.perf_counter() - t0)
        tally.peer_transports[reply.transport] = tally.peer_transports.get(reply.transport, 0) + 1
        tally.peer_fetched_blocks += reply.fetched_blocks
        tally.peer_corrupt_blocks += reply.corrupt_blocks
        # Served from the peer: what the daemon fetched, as far as it extends the
        # prefix here (a block fetched past a hole in it cannot be used).
        extends = max(0, int(reply.prefix_blocks) - local)
        got = min(int(reply.fetched_blocks), extends)
        tally.blocks_pulled += got
        return got, best

    def _summary(self, t: Tally, wall_s: float, score_s: list[float]) -> dict[str, Any]:
        total = max(1, t.input_tokens)
        shares = {k: v / total for k, v in t.tokens.items()}
        ttft = np.asarray(t.ttft_s) if t.ttft_s else np.zeros(1)
        sc = np.asarray(score_s) if score_s else np.zeros(1)
        return {
            "requests": t.requests,
            "input_tokens": t.input_tokens,
            "output_tokens": t.output_tokens,
            "token_shares": shares,
            "tokens": t.tokens,
            "local_prefix_hit_rate": shares["gpu"] + shares["dram"] + shares["disk"],
            "cached_share": 1.0 - shares["recompute"],
            "tokens_recomputed": t.tokens["recompute"],
            "ttft_s": {
                "p50": float(np.percentile(ttft, 50)),
                "p90": float(np.percentile(ttft, 90)),
                "mean": float(ttft.mean()),
            },
            "ttft_samples_s": [float(x) for x in ttft[:: max(1, len(ttft) // 2000)]],
            "makespan_s": t.makespan_s,
            "throughput_tokens_per_s": (t.input_tokens + t.output_tokens) / t.makespan_s
            if t.makespan_s
            else 0.0,
            "blocks_loaded": t.blocks_loaded,
            "blocks_stored": t.blocks_stored,
            "blocks_pulled": t.blocks_pulled,
            "blocks_refused": t.blocks_refused,
            "daemon_counters": t.daemon_counters,
            "pooled_lru_cached_share": t.pool_served_tokens / total,
            "daemon_copies_per_block": t.copies_per_block,
            "recompute_causes": t.recompute_causes,
            "recompute_cause_shares": {k: v / total for k, v in t.recompute_causes.items()},
            "peer": {
                "fetches": t.peer_fetches,
                "failures": t.peer_fetch_failures,
                "fetched_blocks": t.peer_fetched_blocks,
                "fetched_bytes": t.peer_fetched_blocks * self.args.block_bytes,
                "corrupt_blocks": t.peer_corrupt_blocks,
                "transports": t.peer_transports,
                "fetch_s_p50": float(np.percentile(t.peer_fetch_s, 50)) if t.peer_fetch_s else 0.0,
                "fetch_s_p99": float(np.percentile(t.peer_fetch_s, 99)) if t.peer_fetch_s else 0.0,
            },
            "verified_blocks": t.verified_blocks,
            "verify_failures": t.verify_failures,
            "wall_s": wall_s,
            "score_latency_s": {
                "p50": float(np.percentile(sc, 50)),
                "p99": float(np.percentile(sc, 99)),
            },
        }
