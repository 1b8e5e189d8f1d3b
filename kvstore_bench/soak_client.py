"""One client process of `kvstore-bench soak`: an agentic trace replayed through
the real ``kvstore.client`` at a target rate, every loaded byte verified.

Payloads are content-derived (``payload``): a block's bytes are a function of
its hash alone, so a load is checked against nothing but the hashes it asked
for, with no side table of what was stored. A wrong byte anywhere (a slot
reused under a reader, a stale region, a torn peer pull) shows as a mismatch.

Routing goes through ``kvstore_router_client``: the indexer's scores (RouterClient)
choose the node holding the longest prefix; on no hit, the indexer being down
or the chosen node being down, the agent's home node (or the next live one).
When the index shows another node with a longer prefix than the chosen one,
the chosen daemon pulls it from that peer first (FetchFromPeer), as a router's
peer hint makes it do.

Results go to the parent as small batches on a bounded queue (``Sample`` rows
and counters), never one message per block.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore import errors
from kvstore.client import Client, Namespace, gather, scatter
from kvstore.namespace import NamespaceSpec
from kvstore_bench import trace as T

MODEL = "kvstore-bench/soak"
_MIX = np.uint64(0x9E3779B97F4A7C15)
# Acknowledged blocks each client remembers (for the end-of-run audit): bounded.
ACK_SAMPLE_CHAINS = 64
# A client call is allowed this much past its own timeout before it counts as a hang.
HANG_SLACK_S = 2.0


def spec_for(block_bytes: int, block_tokens: int) -> NamespaceSpec:
    return NamespaceSpec(
        model=MODEL,
        dtype="uint8",
        block_size_tokens=block_tokens,
        num_layers=1,
        num_kv_heads=1,
        head_dim=block_bytes,
        block_bytes=block_bytes,
    )


def payload(hashes: np.ndarray, block_bytes: int) -> np.ndarray:
    """(n, block_bytes) uint8: word i of a block is hash ^ (i * golden ratio), so
    two blocks never share bytes and a block shifted by a word is caught too."""
    words = block_bytes // 8
    idx = np.arange(words, dtype=np.uint64) * _MIX
    h = np.asarray(hashes, dtype=np.uint64)[:, None]
    return (h ^ idx[None, :]).astype("<u8").view(np.uint8).reshape(len(hashes), block_bytes)


def wrong_bytes(data: np.ndarray, hashes: np.ndarray, block_bytes: int) -> tuple[int, int]:
    """(wrong blocks, wrong bytes) of loaded ``data`` against the hashes' payloads."""
    if len(hashes) == 0:
        return 0, 0
    diff = np.asarray(data).reshape(len(hashes), block_bytes) != payload(hashes, block_bytes)
    per_block = diff.sum(axis=1)
    return int(np.count_nonzero(per_block)), int(per_block.sum())


@dataclass(slots=True)
class Sample:
    """One client operation, as the parent aggregates it."""

    t_s: float  # wall clock (time.time), comparable across processes
    op: str  # "load" | "store" | "pull" | "route"
    node: str
    latency_s: float
    blocks: int
    nbytes: int
    error: str = ""  # the kvstore error class, "" when it succeeded


@dataclass
class Report:
    worker: int
    samples: list[Sample] = field(default_factory=list)
    wrong_blocks: int = 0
    wrong_bytes: int = 0
    hangs: int = 0
    late_copies: int = 0  # two-phase loads whose copy ended past the lease: discarded
    late_stores: int = 0  # two-phase stores whose copy ended past the lease: released
    acked_blocks: int = 0
    # (node, time.time() of the ack, chain)
    acked: list[tuple[str, float, list[int]]] = field(default_factory=list)


@dataclass(frozen=True)
class WorkerArgs:
    worker: int
    workers: int
    nodes: dict[str, str]  # node id -> daemon address (unix socket)
    indexer: str  # host:port of the indexer
    seed: int
    rate_per_s: float  # requests per second of this worker (open loop, Poisson)
    end_s: float  # time.time() to stop at
    block_bytes: int
    block_tokens: int
    max_blocks: int  # longest request, in blocks (bounds one call's bytes)
    timeout_s: float
    peer_timeout_s: float
    flush_s: float = 0.5
    two_phase_share: float = 0.25  # requests served as a connector does (prepare/copy/commit)
    slow_copy_share: float = 0.05  # of those, loads that copy only after the lease ran out
    slow_copy_s: float = 0.0  # how late (0: never)


def _requests(args: WorkerArgs, cycle: int) -> list[T.Request]:
    """This worker's share of the trace of one cycle (each cycle has its own seed,
    so a long soak keeps storing new contexts rather than re-reading one pass)."""
    params = T.preset_params("cybergym", quick=True)
    trace = T.generate(params, seed=args.seed * 1_000_003 + cycle)
    mine = [r for r in trace.requests if hash_agent(r.agent) % args.workers == args.worker]
    return mine or trace.requests


def hash_agent(agent: str) -> int:
    import xxhash

    return xxhash.xxh64_intdigest(agent.encode())


class Worker:
    def __init__(self, args: WorkerArgs, out: Any) -> None:
        from kvstore_router_client.scorer import RouterClient

        self.args = args
        self.out = out
        self.names = sorted(args.nodes)
        self.spec = spec_for(args.block_bytes, args.block_tokens)
        self.clients: dict[str, tuple[Client, Namespace]] = {}
        self.router = RouterClient(
            args.indexer, block_size_tokens=args.block_tokens, deadline_s=0.1
        )
        self.report = Report(args.worker)
        self.slept_s = 0.0
        self.rng = random.Random(args.seed * 1000 + args.worker)
        self.tokens = T.TokenSource(args.seed * 1_000_003, max_cached_tokens=2_000_000)

    # -- plumbing ----------------------------------------------------------

    def client(self, node: str) -> tuple[Client, Namespace]:
        got = self.clients.get(node)
        if got is None:
            c = Client(self.args.nodes[node], timeout_s=self.args.timeout_s)
            try:
                got = (c, c.declare_namespace(self.spec))
            except BaseException:
                c.close()
                raise
            self.clients[node] = got
        return got

    def drop(self, node: str) -> None:
        got = self.clients.pop(node, None)
        if got is not None:
            with contextlib.suppress(Exception):
                got[0].close()

    def record(self, op: str, node: str, t0: float, blocks: int, error: str = "") -> None:
        # a deliberate stall (slow_copy_s) is not the system's latency
        lat, self.slept_s = time.monotonic() - t0 - self.slept_s, 0.0
        bound = self.args.timeout_s + (self.args.peer_timeout_s if op == "pull" else 0)
        if lat > bound + HANG_SLACK_S:
            self.report.hangs += 1
        self.report.samples.append(
            Sample(time.time(), op, node, lat, blocks, blocks * self.args.block_bytes, error)
        )

    def flush(self, final: bool = False) -> None:
        rep = self.report
        if not final:
            # the audit sample travels once, at the end
            acked, rep.acked = rep.acked, []
        self.out.put(rep)
        self.report = Report(self.args.worker)
        if not final:
            self.report.acked = acked

    # -- one request -------------------------------------------------------

    def route(self, hashes: np.ndarray, home: str) -> tuple[str, str, int]:
        """(node to serve on, peer holding a longer prefix or "", its prefix)."""
        t0 = time.monotonic()
        try:
            res = self.router.scores(MODEL, hashes, self.names)
        except errors.KVStoreError as e:
            self.record("route", "", t0, 0, type(e).__name__)
            return home, "", 0
        self.record("route", "", t0, 0)
        hits = sorted(res.hits, key=lambda h: (-h.prefix_blocks, h.node))
        best = hits[0] if hits and hits[0].prefix_blocks > 0 else None
        # Mostly the best holder; sometimes the home node, so peers pull.
        node = best.node if best is not None and self.rng.random() < 0.5 else home
        if best is not None and best.node != node:
            mine = next((h.prefix_blocks for h in hits if h.node == node), 0)
            if best.prefix_blocks > mine:
                return node, best.node, best.prefix_blocks
        return node, "", 0

    def serve(self, req: T.Request) -> None:
        a = self.args
        ids = self.tokens.token_ids(req)[: a.max_blocks * a.block_tokens]
        hashes = T.block_hashes(ids, a.block_tokens, a.seed)
        if len(hashes) == 0:
            return
        home = self.names[hash_agent(req.agent) % len(self.names)]
        node, peer, peer_prefix = self.route(hashes, home)
        for attempt in range(len(self.names)):
            target = self.names[(self.names.index(node) + attempt) % len(self.names)]
            try:
                self.serve_on(target, hashes, peer if attempt == 0 else "", peer_prefix)
                return
            except errors.KVStoreError:
                self.drop(target)  # next call makes a fresh client (daemon restarted?)

    def serve_on(self, node: str, hashes: np.ndarray, peer: str, peer_prefix: int) -> None:
        a = self.args
        t0 = time.monotonic()
        try:
            c, ns = self.client(node)
        except errors.KVStoreError as e:
            self.record("load", node, t0, 0, type(e).__name__)
            raise
        if peer:
            t0 = time.monotonic()
            try:
                r = c.fetch_from_peer(
                    ns, hashes[:peer_prefix], peer_node_id=peer, timeout_s=a.peer_timeout_s
                )
                self.record("pull", node, t0, int(r.fetched_blocks))
            except errors.KVStoreError as e:
                self.record("pull", node, t0, 0, type(e).__name__)  # the load goes on without
        two_phase = c.region is not None and self.rng.random() < a.two_phase_share
        t0 = time.monotonic()
        try:
            data = self.load_two_phase(c, ns, hashes) if two_phase else c.get(ns, hashes).data
        except errors.KVStoreError as e:
            self.record("load", node, t0, 0, type(e).__name__)
            raise
        found = len(data)
        wb, wbytes = wrong_bytes(data, hashes[:found], a.block_bytes)
        self.report.wrong_blocks += wb
        self.report.wrong_bytes += wbytes
        self.record("load", node, t0, found, "WrongBytes" if wb else "")
        t0 = time.monotonic()
        try:
            stored = (
                self.store_two_phase(c, ns, hashes)
                if two_phase
                else c.put(ns, hashes, payload(hashes, a.block_bytes)).stored
            )
        except errors.KVStoreError as e:
            self.record("store", node, t0, 0, type(e).__name__)
            raise
        self.record("store", node, t0, stored)
        if stored:
            self.report.acked_blocks += stored
            self.remember(node, hashes)

    def load_two_phase(self, c: Client, ns: Namespace, hashes: np.ndarray) -> np.ndarray:
        """As a connector loads: pin (PrepareLoad), copy from the region itself,
        keep only what was copied before the lease's deadline, release."""
        a = self.args
        h = c.prepare_load(ns, hashes)
        try:
            if a.slow_copy_s and self.rng.random() < a.slow_copy_share:
                # A stalled engine: half the time it wakes just inside its deadline
                # (the copy then runs across the daemon's expiry: the fence and the
                # quarantine must keep those bytes right), else well past it.
                now = time.monotonic()
                if self.rng.random() < 0.5 and h.deadline_s > now:
                    stall_s = max(0.0, h.deadline_s - now - self.rng.uniform(0.0, 0.05))
                else:
                    stall_s = a.slow_copy_s
                time.sleep(stall_s)
                self.slept_s += stall_s
            assert c.region is not None
            out = np.empty((h.found, a.block_bytes), dtype=np.uint8)
            done = gather(
                c.region, h.offsets[: h.found], out, a.block_bytes, deadline_s=h.deadline_s
            )
            if done < h.found:
                self.report.late_copies += 1
            return out[:done]
        finally:
            c.release(h, wait=False)

    def store_two_phase(self, c: Client, ns: Namespace, hashes: np.ndarray) -> int:
        """As a connector stores: reserve, write the allocated slots, commit (or
        release when the copy ran past the deadline)."""
        a = self.args
        h = c.prepare_store(ns, hashes)
        idx = h.allocated
        if not len(idx):
            c.release(h, wait=False)
            return 0
        assert c.region is not None
        written = scatter(
            c.region, h.offsets[idx], payload(hashes, a.block_bytes), idx, a.block_bytes,
            deadline_s=h.deadline_s,
        )  # fmt: skip
        if written < len(idx):
            self.report.late_stores += 1
            c.release(h, wait=False)
            return 0
        return c.commit_store(h)

    def remember(self, node: str, hashes: np.ndarray) -> None:
        """Reservoir of acknowledged chains (bounded), audited at the end."""
        acked = self.report.acked
        chain = (node, time.time(), [int(h) for h in hashes])
        if len(acked) < ACK_SAMPLE_CHAINS:
            acked.append(chain)
        else:
            acked[self.rng.randrange(len(acked))] = chain

    # -- the loop ----------------------------------------------------------

    def run(self) -> None:
        a = self.args
        cycle = 0
        reqs = _requests(a, cycle)
        i = 0
        next_s = time.time()
        last_flush = time.monotonic()
        while True:
            now = time.time()
            if now >= a.end_s:
                break
            if now < next_s:
                time.sleep(min(next_s - now, a.end_s - now, a.flush_s))
            else:
                if i == len(reqs):
                    cycle += 1
                    reqs, i = _requests(a, cycle), 0
                    self.tokens = T.TokenSource(a.seed * 1_000_003 + cycle, 2_000_000)
                self.serve(reqs[i])
                i += 1
                next_s += self.rng.expovariate(a.rate_per_s)
                # open loop, but a client far behind does not burst to catch up
                next_s = max(next_s, time.time() - 2.0)
            if time.monotonic() - last_flush >= a.flush_s:
                self.flush()
                last_flush = time.monotonic()
        self.flush(final=True)
        for node in list(self.clients):
            self.drop(node)
        self.router.close()


def main(args: WorkerArgs, out: Any) -> None:
    """Process entry point (multiprocessing)."""
    Worker(args, out).run()


def audit(
    nodes: dict[str, str],
    chains: Sequence[tuple[str, float, list[int]]],
    block_bytes: int,
    block_tokens: int,
    crashes: dict[str, list[float]],
) -> dict[str, int]:
    """Load each acknowledged chain from the node that acknowledged it, after
    the run: its blocks must be there and right, or missing, never wrong.

    Missing blocks are split by whether the node crashed (kill -9: its DRAM is
    gone, by design) after the ack; the others were evicted or demoted and then
    dropped (the daemons' counters say how many they evicted), or lost."""
    out = {
        "chains": 0,
        "blocks": 0,
        "present": 0,
        "missing": 0,
        "missing_after_crash": 0,
        "missing_no_crash": 0,
        "wrong_blocks": 0,
        "errors": 0,
    }
    spec = spec_for(block_bytes, block_tokens)
    by_node: dict[str, list[tuple[float, list[int]]]] = {}
    for node, t_ack, chain in chains:
        by_node.setdefault(node, []).append((t_ack, chain))
    for node, node_chains in by_node.items():
        try:
            c = Client(nodes[node])
        except errors.KVStoreError:
            out["errors"] += len(node_chains)
            continue
        with c:
            ns = c.declare_namespace(spec)
            for t_ack, chain in node_chains:
                hashes = np.asarray(chain, dtype=np.uint64)
                got = c.get(ns, hashes)
                wb, _ = wrong_bytes(got.data, hashes[: got.found], block_bytes)
                missing = len(hashes) - got.found
                crashed = any(t > t_ack for t in crashes.get(node, ()))
                out["chains"] += 1
                out["blocks"] += len(hashes)
                out["present"] += got.found
                out["missing"] += missing
                out["missing_after_crash" if crashed else "missing_no_crash"] += missing
                out["wrong_blocks"] += wb
    return out
