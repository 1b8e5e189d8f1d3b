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
router_client.strategies (the product's code, no copy here):
  random        a uniformly random node.
  round-robin   the next node.
  approximate   llm-d's estimated prefix scorer: remembers which blocks it
                routed where (an LRU per node as large as a GPU cache),
                knows nothing of evictions or tiers; plus a queue score.
  precise-only  the indexer's per-node, per-tier prefix score, no load term.
  cache+load    the product default (router_client.policy): the indexer's
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
bench/costmodel.py (*modelled*).
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from bench import _common
from bench import trace as T
from bench.causes import CAUSES
from bench.costmodel import CostModel
from router_client.policy import NodeHit, NodeLoad, Policy, ScoreResult
from router_client.strategies import DEFAULT_STRATEGY, Strategy, make_strategy
from router_client.strategies import STRATEGIES as ROUTER_STRATEGIES

STRATEGIES = (*ROUTER_STRATEGIES, "approximate-gpu-only")
# Baseline without kvstore at all: approximate routing, engines with their GPU
# prefix cache only (no daemon loads, stores or peer pulls) — llm-d's estimated
# scorer in front of plain vLLM, the setting of the published +79% figure.
GPU_ONLY = "approximate-gpu-only"
MODEL = "kvstore-bench/agentic"
START_TIMEOUT_S = 60.0


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
        help="override a router_client.Policy weight for cache+load (e.g. load_weight=0.3)",
    )
    p.add_argument("--max-requests", type=int, default=0, help="stop after this many (0 = all)")
    p.add_argument("--results", default="results")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto")


# -- cluster processes -----------------------------------------------------------


@dataclass
class NodeProcs:
    name: str
    socket: Path
    events: str
    proc: subprocess.Popen
    engine_events: str = ""


@contextlib.contextmanager
def cluster(
    n: int,
    tmp: Path,
    dram_bytes: int,
    disk_bytes: int,
    chunk_bytes: int,
    events: bool = True,
    peer_transport: str = "",
) -> Iterator[list[NodeProcs]]:
    """Start n daemons; stop them (SIGTERM, then kill) and remove their files.

    peer_transport ("auto", "nixl", "grpc_stream"; "" = peer transfer off): every
    daemon serves and pulls blocks (`peer.enabled`), knows every other one by
    node id (`peer.peers`), and they share one secret made for this cluster.
    """
    nodes: list[NodeProcs] = []
    tag = f"{os.getpid()}-{int(time.monotonic() * 1000) % 100000}"
    names = [f"node{i}" for i in range(n)]
    ports = _common.free_ports(n) if peer_transport else [0] * n
    secret = secrets.token_hex(16)
    env = dict(os.environ)
    if peer_transport:
        # One host: UCX over loopback; NIXL's own logging at WARN (see README, Transports).
        env.setdefault("UCX_NET_DEVICES", "lo")
        env.setdefault("NIXL_LOG_LEVEL", "WARN")
        env["KVSTORE_PEER__SECRET"] = secret  # not on the command line (ps shows it)
    try:
        for i in range(n):
            name = names[i]
            sock = tmp / f"{name}.sock"
            pub = f"ipc://{tmp}/{name}.events"
            args = [
                sys.executable,
                "-m",
                "kvstore",
                "serve",
                "--set",
                f"node_id={name}",
                "--set",
                f"server.socket_path={sock}",
                "--set",
                f"server.tcp_address=127.0.0.1:{ports[i]}"
                if peer_transport
                else "server.tcp_address=",
                "--set",
                "metrics.address=",
                "--set",
                f"dram.path=/dev/shm/kvsbench-{tag}-{name}.dram",
                "--set",
                f"dram.capacity_bytes={dram_bytes}",
                "--set",
                f"dram.chunk_bytes={chunk_bytes}",
                "--set",
                f"events.enabled={str(events).lower()}",
                "--set",
                f"events.publish_address={pub}",
                "--set",
                "events.replay_address=",
                "--set",
                "log.level=warning",
            ]
            if peer_transport:
                args += [
                    "--set",
                    "peer.enabled=true",
                    "--set",
                    f"peer.transport={peer_transport}",
                ]
                for j, other in enumerate(names):
                    if j != i:
                        args += ["--set", f"peer.peers.{other}=127.0.0.1:{ports[j]}"]
            if disk_bytes:
                (tmp / f"{name}.disk").mkdir(exist_ok=True)
                args += [
                    "--set",
                    f"disk.path={tmp / f'{name}.disk'}",
                    "--set",
                    f"disk.capacity_bytes={disk_bytes}",
                    "--set",
                    f"disk.slab_bytes={chunk_bytes}",
                ]
            log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115 - owned by the process
            proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, cwd=_common.repo_root(), env=env
            )
            log.close()
            nodes.append(NodeProcs(name, sock, pub, proc, f"ipc://{tmp}/{name}.engine-events"))
        deadline = time.monotonic() + START_TIMEOUT_S
        for node in nodes:
            while not node.socket.exists():
                if node.proc.poll() is not None:
                    raise RuntimeError(
                        f"{node.name} exited with {node.proc.returncode}: "
                        + (tmp / f"{node.name}.log").read_text()[-1500:]
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{node.name} not ready after {START_TIMEOUT_S:.0f} s")
                time.sleep(0.05)
        yield nodes
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        for node in nodes:
            try:
                node.proc.wait(15)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait(5)
        for f in Path("/dev/shm").glob(f"kvsbench-{tag}-*"):
            with contextlib.suppress(OSError):
                f.unlink()


# -- the indexer -----------------------------------------------------------------


class Scorer(Protocol):
    def score(self, hashes: np.ndarray) -> dict[str, Any]: ...

    def catch_up(self) -> int: ...

    def close(self) -> None: ...


def policy_from_args(overrides: Sequence[str]) -> Policy:
    """router_client's default Policy with ``field=value`` overrides (--policy)."""
    import msgspec

    fields: dict[str, Any] = msgspec.structs.asdict(Policy())
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"--policy {item!r}: one of {', '.join(fields)} = a number")
        fields[key] = type(fields[key])(value)
    return Policy(**fields)


def index_scores(index: Scorer, hashes: np.ndarray) -> ScoreResult:
    """The index's answer in router_client's form (what RouterClient.scores returns)."""
    return ScoreResult(
        request_blocks=len(hashes),
        hits=[
            NodeHit(s.node, s.prefix_blocks, s.gpu_blocks, s.cpu_blocks, s.disk_blocks)
            for s in index.score(hashes).values()
        ],
    )


class _EventTap:
    """A ZMQ subscriber to every daemon's and engine model's KV-event stream, read
    in this process without blocking."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        import zmq

        from kvstore.events import wire

        self._zmq, self._wire = zmq, wire
        self._decoder = wire.lean_decoder()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self._sub.set_hwm(1_000_000)
        for ep in endpoints:
            self._sub.connect(ep)

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()


class EventIndex(_EventTap):
    """The indexer's index (kvstore.indexer.memory.MemoryIndex) fed from every
    daemon's and every engine model's ZMQ event stream, consumed in this
    process so the modelled clock can drain it before each routing decision."""

    description = "kvstore.indexer MemoryIndex fed by ZMQ KV events (consumed in-process)"

    def __init__(self, endpoints: Sequence[str]) -> None:
        from kvstore.indexer.memory import MemoryIndex

        super().__init__(endpoints)
        self.index = MemoryIndex()
        self.events = 0

    def catch_up(self, max_messages: int = 100_000) -> int:
        """Apply every event already delivered (bounded); return how many batches."""
        wire = self._wire
        n = 0
        while n < max_messages:
            try:
                frames = self._sub.recv_multipart(flags=self._zmq.NOBLOCK)
            except self._zmq.Again:
                break
            n += 1
            parsed = wire.parse_topic(frames[0])
            if parsed is None:
                continue
            node, model = parsed
            batch = self._decoder.decode(frames[2])
            for ev in batch.events:
                self.events += 1
                if not isinstance(ev, wire.LeanStored | wire.LeanRemoved):
                    self.index.clear(node, model or None)
                    continue
                hashes = np.fromiter(
                    (wire.block_hash_to_int(h) for h in ev.block_hashes),
                    dtype=np.uint64,
                    count=len(ev.block_hashes),
                )
                if isinstance(ev, wire.LeanStored):
                    self.index.add(model, node, ev.medium, hashes)
                else:
                    self.index.remove(model, node, ev.medium, hashes)
        return n

    def score(self, hashes: np.ndarray) -> dict[str, Any]:
        return {s.node: s for s in self.index.score(MODEL, hashes)}


class IndexerService:
    """The real indexer: a `python -m kvstore.indexer` process following every
    daemon's stream (kind daemon) and every engine model's (kind engine),
    queried over gRPC through router_client.RouterClient. It ingests on its own
    clock, as in a deployment, so a routing decision may miss the last few
    milliseconds of events."""

    description = "kvstore indexer process (ZMQ KV events -> gRPC Score via router_client)"

    def __init__(self, nodes: Sequence[NodeProcs], block_tokens: int, log_path: Path) -> None:
        from router_client.scorer import RouterClient

        args = [
            sys.executable,
            "-m",
            "kvstore.indexer",
            "--address",
            "127.0.0.1:0",
            "--log-level",
            "WARNING",
        ]
        for nd in nodes:
            args += [
                "--source",
                f"node={nd.name},endpoint={nd.events}",
                "--source",
                f"node={nd.name},endpoint={nd.engine_events},kind=engine,model={MODEL}",
            ]
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=self._log, cwd=_common.repo_root()
        )
        address = self._wait_listening()
        self.client = RouterClient(address, block_size_tokens=block_tokens, deadline_s=2.0)

    def _wait_listening(self) -> str:
        import selectors

        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"indexer exited with {self.proc.returncode}")
            if sel.select(timeout=0.2):
                line = self.proc.stdout.readline().decode()
                if "listening on" in line:
                    return line.rsplit(" ", 1)[-1].strip()
        raise RuntimeError(f"indexer not listening after {START_TIMEOUT_S:.0f} s")

    def catch_up(self) -> int:
        return 0

    def score(self, hashes: np.ndarray) -> dict[str, Any]:
        return {h.node: h for h in self.client.scores(MODEL, hashes).hits}

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout:
            self.proc.stdout.close()
        self._log.close()


# -- engine GPU cache model ------------------------------------------------------


class GpuCacheModel:
    """An engine's GPU prefix cache: LRU over block hashes, fixed capacity.
    Publishes BlockStored/BlockRemoved (medium GPU) like a vLLM engine."""

    def __init__(self, node: str, capacity_blocks: int, endpoint: str, block_tokens: int) -> None:
        from kvstore.events.publisher import ZmqEventPublisher

        self.capacity = capacity_blocks
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.pub = ZmqEventPublisher(node, endpoint, None)
        self._ns = _NsRef(block_tokens)

    def prefix(self, hashes: np.ndarray) -> int:
        n = 0
        for h in hashes.tolist():
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            n += 1
        return n

    def insert(self, hashes: np.ndarray) -> None:
        new = []
        for h in hashes.tolist():
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                self.blocks[h] = None
                new.append(h)
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        if new:
            self.pub.blocks_stored(self._ns, new, "GPU", None, None)
        if evicted:
            self.pub.blocks_removed(self._ns, evicted, "GPU")

    def close(self) -> None:
        self.pub.close()


@dataclass(frozen=True)
class _NsRef:
    block_size_tokens: int
    namespace_id: str = "agentic"
    model: str = MODEL
    tenant: str = ""


# -- replay ----------------------------------------------------------------------


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


@dataclass
class Tally:
    input_tokens: int = 0
    output_tokens: int = 0
    tokens: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("gpu", "dram", "disk", "peer", "recompute"), 0)
    )
    recompute_causes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    ttft_s: list[float] = field(default_factory=list)
    blocks_loaded: int = 0
    blocks_stored: int = 0
    blocks_refused: int = 0
    blocks_pulled: int = 0
    verified_blocks: int = 0
    verify_failures: int = 0
    # FetchFromPeer, as the daemons answered it.
    peer_fetches: int = 0
    peer_fetch_failures: int = 0
    peer_fetched_blocks: int = 0
    peer_corrupt_blocks: int = 0
    peer_transports: dict[str, int] = field(default_factory=dict)
    peer_fetch_s: list[float] = field(default_factory=list)
    pool_served_tokens: int = 0
    copies_per_block: float = 0.0
    daemon_counters: dict[str, int] = field(default_factory=dict)
    requests: int = 0
    makespan_s: float = 0.0


class RemovalLedger(_EventTap):
    """What the daemons' own KV events say, for the diagnosis of recomputed tokens:
    the tier each block was last removed from (BlockRemoved, medium CPU or DISK),
    and which nodes hold each block now (BlockStored/BlockRemoved), hence how many
    copies of a block the cluster keeps."""

    MAX_BLOCKS = 4_000_000  # bounds memory of the removal map; older entries dropped

    def __init__(self, endpoints: Sequence[str]) -> None:
        super().__init__(endpoints)
        self.removed: OrderedDict[int, str] = OrderedDict()
        # (node, medium) per held block: bounded by what the daemons hold.
        self.held: dict[int, set[tuple[str, str]]] = {}
        self.copies_samples: list[float] = []

    def drain(self, max_messages: int = 100_000) -> None:
        wire = self._wire
        for _ in range(max_messages):
            try:
                frames = self._sub.recv_multipart(flags=self._zmq.NOBLOCK)
            except self._zmq.Again:
                break
            topic = wire.parse_topic(frames[0])
            node = topic[0] if topic else ""
            for ev in self._decoder.decode(frames[2]).events:
                if isinstance(ev, wire.LeanStored):
                    for h in ev.block_hashes:
                        key = wire.block_hash_to_int(h)
                        self.held.setdefault(key, set()).add((node, ev.medium or ""))
                elif isinstance(ev, wire.LeanRemoved):
                    for h in ev.block_hashes:
                        key = wire.block_hash_to_int(h)
                        self.removed[key] = ev.medium or ""
                        self.removed.move_to_end(key)
                        where = self.held.get(key)
                        if where is not None:
                            where.discard((node, ev.medium or ""))
                            if not where:
                                del self.held[key]
        while len(self.removed) > self.MAX_BLOCKS:
            self.removed.popitem(last=False)

    def sample_copies(self) -> None:
        """Nodes holding each distinct block (any tier), averaged over held blocks."""
        self.drain()
        if self.held:
            nodes = sum(len({n for n, _ in w}) for w in self.held.values())
            self.copies_samples.append(nodes / len(self.held))


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


class Diagnosis:
    """Attributes every recomputed input token to one cause (CAUSES).

    Block hashes are chained, so the blocks a request recomputes (those after the
    prefix it was served) fall in order into: blocks some finished request had
    computed ("lost": the cause is why the first of them was not found), then
    blocks only unfinished requests are computing ("in_flight"), then blocks
    nobody has computed ("new"); tokens past the last whole block are
    "partial_block". Why the first lost block was not found is asked of the real
    daemons (a Lookup of that one block on every node, which does not touch their
    eviction order) and of the engine models, then of what the replay offered
    (stored, refused) and of the daemons' BlockRemoved events (which tier).
    """

    def __init__(
        self,
        clients: list,
        nss: list,
        engines: list[GpuCacheModel],
        ledger: RemovalLedger | None,
        storage: bool,
        peers: bool,
        block_tokens: int,
    ) -> None:
        self.clients, self.nss, self.engines = clients, nss, engines
        self.ledger, self.storage, self.peers = ledger, storage, peers
        self.block_tokens = block_tokens
        # The capacity reference: one LRU as large as the whole cluster's daemon
        # tiers, fed the same requests in the same order, never holding a copy twice.
        self.pool: OrderedDict[int, None] = OrderedDict()
        self.pool_capacity = 0
        self.pool_served_tokens = 0
        self.computed: set[int] = set()
        self.inflight: dict[int, int] = {}
        self.offered: set[int] = set()
        self.refused: set[int] = set()

    def attribute(
        self,
        hashes: np.ndarray,
        served: int,
        recompute_tokens: int,
        node: int,
        pulled_from: int,
        tally: Tally,
    ) -> None:
        B = self.block_tokens
        tail = hashes[served:].tolist()
        lost = in_flight = 0
        for h in tail:
            if h in self.computed:
                lost += 1
            elif h in self.inflight:
                in_flight += 1
        new = len(tail) - lost - in_flight
        causes = tally.recompute_causes
        causes["partial_block"] += recompute_tokens - len(tail) * B
        causes["new"] += new * B
        causes["in_flight"] += in_flight * B
        if lost:
            causes[self._why_lost(tail[0], node, pulled_from)] += lost * B

    def pool_start(self, hashes: np.ndarray, ntok: int) -> None:
        """Serve a request's prefix from the pooled LRU (touching it)."""
        n = 0
        for h in hashes.tolist():
            if h not in self.pool:
                break
            self.pool.move_to_end(h)
            n += 1
        self.pool_served_tokens += min(n * self.block_tokens, max(0, ntok - 1))

    def pool_finish(self, hashes: np.ndarray) -> None:
        for h in hashes.tolist():
            self.pool[h] = None
            self.pool.move_to_end(h)
        while len(self.pool) > self.pool_capacity:
            self.pool.popitem(last=False)

    def _why_lost(self, h: int, node: int, pulled_from: int) -> str:
        if not self.storage:
            others = [i for i, e in enumerate(self.engines) if i != node and h in e.blocks]
            return "other_node_gpu_only" if others else "evicted_gpu"
        holders = [
            i
            for i, (c, ns) in enumerate(zip(self.clients, self.nss, strict=True))
            if c.lookup(ns, [h]).prefix_blocks
        ]
        if node in holders:
            return "local_not_loaded"
        if holders:
            if not self.peers:
                return "peers_off"
            if pulled_from in holders:
                return "peer_pull_short"
            return "split_across_nodes" if pulled_from >= 0 else "not_found_by_index"
        if h in self.offered:
            assert self.ledger is not None
            self.ledger.drain()
            medium = self.ledger.removed.get(h)
            return {"CPU": "evicted_dram", "DISK": "evicted_disk"}.get(
                medium or "", "evicted_unseen"
            )
        if h in self.refused:
            return "store_refused"
        return "never_stored"


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


# -- entry point -------------------------------------------------------------------


GOALS = (
    (
        "cache+load local prefix hit rate",
        "local_prefix_hit_rate",
        0.80,
        "73.18%, approximate 44.46%",
    ),
    ("share of input tokens from some cache tier (cache+load)", "cached_share", 0.95, "85.2%"),
)


def goals(strategies: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    out: list[dict[str, Any]] = []
    p = strategies.get(DEFAULT_STRATEGY)
    if p:
        for what, key, goal, ref in GOALS:
            out.append(
                {
                    "what": what,
                    "value": f"{100 * p[key]:.1f}%",
                    "goal": f">= {100 * goal:.0f}%",
                    "met": p[key] >= goal,
                    "reference": ref,
                }
            )
    a = strategies.get("approximate")
    if p and a and a["throughput_tokens_per_s"]:
        gain = p["throughput_tokens_per_s"] / a["throughput_tokens_per_s"] - 1
        out.append(
            {
                "what": "modelled throughput, cache+load over approximate (both with kvstore)",
                "value": f"{100 * gain:+.1f}%",
                "goal": "> 0%",
                "met": gain > 0,
                "reference": "precise-only routing before this policy: -2%",
            }
        )
        p90, a90 = p["ttft_s"]["p90"], a["ttft_s"]["p90"]
        out.append(
            {
                "what": "modelled TTFT p90, cache+load vs approximate (both with kvstore)",
                "value": f"{p90:.1f} s vs {a90:.1f} s",
                "goal": "lower",
                "met": p90 < a90,
                "reference": "precise-only routing before this policy: worse",
            }
        )
    g = strategies.get(GPU_ONLY)
    if p and g and g["throughput_tokens_per_s"]:
        gain = p["throughput_tokens_per_s"] / g["throughput_tokens_per_s"] - 1
        out.append(
            {
                "what": "modelled throughput, cache+load (with kvstore) over approximate on "
                "GPU caches only (no kvstore)",
                "value": f"{100 * gain:+.0f}%",
                "goal": ">= +90%",
                "met": gain >= 0.9,
                "reference": "+79%",
            }
        )
    return out, []


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
    from bench import report

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


def explain_limits(
    results: dict[str, Any], stats: T.TraceStats, cluster: dict[str, Any]
) -> list[str]:
    compulsory = 1.0 - stats.prefix_reuse_bound
    out = [
        f"The trace itself: {100 * compulsory:.1f}% of input tokens are new (tool output, "
        "first sight of a task) and must be computed whatever the cache; a partial last "
        "block is never cached either."
    ]
    p = results.get(DEFAULT_STRATEGY)
    if p:
        sh = p["token_shares"]
        out.append(
            f"cache+load: {100 * sh['gpu']:.1f}% from the GPU cache model, {100 * sh['dram']:.1f}% "
            f"local DRAM, {100 * sh['disk']:.1f}% local disk, {100 * sh['peer']:.1f}% peers, "
            f"{100 * sh['recompute']:.1f}% recomputed."
        )
        causes = sorted(
            ((v, k) for k, v in p["recompute_cause_shares"].items() if v >= 0.0005), reverse=True
        )
        out.append(
            "cache+load's recomputed tokens by cause (measured, share of all input tokens): "
            + "; ".join(f"{CAUSES[k]}: {100 * v:.1f}%" for v, k in causes)
            + "."
        )
        tiers = f"{cluster['nodes']} x {cluster['dram_blocks']} DRAM blocks"
        if cluster["disk_blocks"]:
            tiers += f" + {cluster['nodes']} x {cluster['disk_blocks']} disk blocks"
        pool = 1.0 - p["pooled_lru_cached_share"]
        out.append(
            f"Capacity reference (same run): one LRU as large as the whole cluster's daemon "
            f"tiers ({tiers}), never holding a block twice, would have recomputed "
            f"{100 * pool:.1f}% of input tokens against cache+load's {100 * sh['recompute']:.1f}%; "
            "the difference is what placement (copies pulled to the chosen node, blocks on "
            "other nodes) and the tiers' own behaviour cost beyond capacity."
        )
        if p.get("daemon_copies_per_block"):
            out.append(
                f"Copies: each distinct block the daemons held was held by "
                f"{p['daemon_copies_per_block']:.2f} nodes on average over the run (daemon "
                "events), so the cluster's DRAM held that many times fewer distinct blocks "
                "than the pooled reference."
            )
        dc = p.get("daemon_counters") or {}
        if cluster["disk_blocks"] and dc.get("evicted_blocks"):
            out.append(
                f"With a disk tier the daemons dropped {dc['evicted_blocks']:,} blocks from DRAM "
                f"with no disk copy while demoting only {dc.get('demoted_blocks', 0):,} "
                "(daemon counters): a block evicted from DRAM before it was demoted is lost."
            )
    a = results.get("approximate")
    if p and a:
        out.append(
            "cache+load vs approximate with kvstore under both: the daemons' tiers and peer pulls "
            f"serve approximate routing too ({100 * a['cached_share']:.1f}% of tokens from "
            "cache), so routing alone changes little; the published +79% compared routers in "
            "front of GPU-only caches, which is the approximate-gpu-only baseline here."
        )
    return out
