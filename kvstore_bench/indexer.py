"""`kvstore-bench indexer`: event ingest rate and Score latency of the indexer.

Scenario (defaults): 100 nodes; each holds its own background blocks plus a
prefix of one shared 12,000-block request (a 195k-token prompt in blocks of
16), one in ten nodes the whole of it, tiers mixed (GPU/CPU/DISK).

Measured, in the same run:

- ingest: vLLM-format ``KVEventBatch`` payloads (BlockStored, 16 hashes and
  256 token ids per event, 64 events per batch) decoded and applied by the
  indexer's subscriber code, for the in-memory and Redis backends; the
  reference is the same decoding feeding a plain ``dict[int, set[(node,
  medium)]]``. Plus the in-memory path end to end over real ZMQ.
- Score of the 12,000-block request against every node: p50/p99, in-memory
  and Redis; reference: the same prefix scoring over the dict-of-sets.
- Hashing 195k tokens into vLLM block hashes: kvstore's fast path vs the
  generic path (``pickle.dumps`` per block, as vLLM does).
- Memory per indexed block replica (a (block, node, tier) entry).

Goals (issue 4): ingest >= 500,000 hashes/s in memory; Score p99 <= 5 ms in
memory; Redis within 5x of in-memory.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from typing import Any

import msgspec
import numpy as np
import zmq

from kvstore.events.wire import BlockStored, KVEventBatch, lean_decoder
from kvstore.hashing import BlockHasher, hash_fn
from kvstore.indexer.backend import IndexBackend, NodeScore
from kvstore.indexer.memory import MemoryIndex
from kvstore.indexer.subscriber import SourceSpec, Subscriber
from kvstore_bench._common import repeat, summarize
from kvstore_bench.ports import free_port

MEDIUMS = ("GPU", "CPU", "DISK")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--request-blocks", type=int, default=12_000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--background-blocks", type=int, default=10_000, help="per node")
    p.add_argument("--ingest-hashes", type=int, default=400_000, help="hashes per ingest run")
    p.add_argument("--events-per-batch", type=int, default=64)
    p.add_argument("--hashes-per-event", type=int, default=16)
    p.add_argument("--score-repeats", type=int, default=200)
    p.add_argument(
        "--redis",
        default="auto",
        help="'auto' (start a local redis-server), 'off', or a redis:// URL",
    )
    p.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    p.add_argument("--seed", type=int, default=1)


# --- workload ------------------------------------------------------------------------


def make_payloads(
    rng: np.random.Generator, total: int, per_event: int, per_batch: int, block_size: int
) -> list[bytes]:
    enc = msgspec.msgpack.Encoder()
    hashes = rng.integers(0, 2**64, total, dtype=np.uint64).tolist()
    tokens = rng.integers(0, 150_000, per_event * block_size).tolist()
    out = []
    per = per_event * per_batch
    for i in range(0, total, per):
        chunk = hashes[i : i + per]
        events = [
            BlockStored(chunk[j : j + per_event], None, tokens, block_size, None, "CPU", None)
            for j in range(0, len(chunk), per_event)
        ]
        out.append(enc.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)))
    return out


class DictIndex:
    """The reference: a plain dict of sets of (node, medium) tuples."""

    def __init__(self) -> None:
        self.d: dict[int, set[tuple[str, str]]] = {}

    def add(self, node: str, medium: str, hashes: list[int]) -> None:
        d, key = self.d, (node, medium)
        for h in hashes:
            s = d.get(h)
            if s is None:
                d[h] = {key}
            else:
                s.add(key)

    def score(self, hashes: list[int], nodes: list[str]) -> list[NodeScore]:
        alive = set(nodes)
        prefix: dict[str, int] = {}
        tiers: dict[str, list[int]] = {n: [0, 0, 0] for n in nodes}
        empty: set[tuple[str, str]] = set()
        for i, h in enumerate(hashes):
            held: dict[str, int] = {}
            for node, med in self.d.get(h, empty):
                m = MEDIUMS.index(med)
                if node in alive and m < held.get(node, 3):
                    held[node] = m
            for node in list(alive):
                m = held.get(node)
                if m is None:
                    alive.discard(node)
                    prefix[node] = i
                else:
                    tiers[node][m] += 1
            if not alive:
                break
        for node in alive:
            prefix[node] = len(hashes)
        return [NodeScore(n, p, *tiers[n]) for n, p in prefix.items() if p]


def populate(
    index: Any, rng: np.random.Generator, args: argparse.Namespace, request: np.ndarray
) -> int:
    """Fill an index (backend or DictIndex); returns replicas written."""
    replicas = 0
    for i in range(args.nodes):
        node = f"node{i:03d}"
        bg = rng.integers(0, 2**64, args.background_blocks, dtype=np.uint64)
        length = args.request_blocks if i % 10 == 0 else int(rng.integers(0, args.request_blocks))
        parts = [("CPU", bg), ("CPU", request[:length])]
        if i % 3 == 0:
            parts.append(("GPU", request[: length // 2]))
        if i % 4 == 1:
            parts.append(("DISK", request[: length // 3]))
        for med, hs in parts:
            for j in range(0, hs.size, 4096):
                chunk = hs[j : j + 4096]
                if isinstance(index, DictIndex):
                    index.add(node, med, chunk.tolist())
                else:
                    index.add("model", node, med, chunk)
                replicas += chunk.size
    return replicas


# --- measurements ---------------------------------------------------------------------


def ingest_backend(index: IndexBackend, payloads: list[bytes], per_batch_hashes: int) -> float:
    sub = Subscriber(index, threading.Lock())
    spec = SourceSpec(node="ingest-node", endpoint="tcp://127.0.0.1:1")
    t0 = time.perf_counter()
    for p in payloads:
        sub.apply_batch(spec, b"kv@ingest-node@model", p)
        sub.flush()  # one flush per batch: no help from coalescing across batches
    elapsed = time.perf_counter() - t0
    sub.close()
    return sum(1 for _ in payloads) * per_batch_hashes / elapsed


def ingest_reference(payloads: list[bytes], per_batch_hashes: int) -> float:
    dec = lean_decoder()
    ref = DictIndex()
    t0 = time.perf_counter()
    for p in payloads:
        for ev in dec.decode(p).events:
            ref.add("ingest-node", ev.medium or "GPU", ev.block_hashes)  # type: ignore[union-attr,arg-type]
    elapsed = time.perf_counter() - t0
    return len(payloads) * per_batch_hashes / elapsed


def ingest_zmq(payloads: list[bytes], per_batch_hashes: int) -> float:
    """Raw PUB -> the indexer's subscriber thread -> in-memory index."""
    from kvstore.indexer.config import IndexerConfig
    from kvstore.indexer.service import Indexer

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind("tcp://127.0.0.1:0")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    ix = Indexer(IndexerConfig(sources=[SourceSpec(node="z", endpoint=endpoint)]))
    ix.start()
    try:
        topic = b"kv@z@model"
        deadline = time.monotonic() + 10
        while ix.subscriber.stats.batches == 0:  # wait for the SUB to join
            if time.monotonic() > deadline:
                raise RuntimeError("subscriber did not connect")
            pub.send_multipart((topic, (0).to_bytes(8, "big"), payloads[0]))
            time.sleep(0.05)
        base = ix.subscriber.stats.batches
        t0 = time.perf_counter()
        for i, p in enumerate(payloads, start=1):
            pub.send_multipart((topic, i.to_bytes(8, "big"), p))
        # done = every hash is in the index (read under the index lock, so a
        # flush in progress is waited for)
        want = len({h for p in payloads for h in _hashes_of(p)})
        index = ix.index
        assert isinstance(index, MemoryIndex), type(index)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with ix.lock:
                if index.block_count("model") >= want:
                    break
            time.sleep(0.001)
        else:
            raise RuntimeError("ZMQ ingest did not finish within 120 s")
        elapsed = time.perf_counter() - t0
        del base
        return len(payloads) * per_batch_hashes / elapsed
    finally:
        ix.close()
        pub.close(linger=0)


def reference_hashes(hasher: BlockHasher, tokens: np.ndarray, n_blocks: int) -> list[bytes]:
    """The reference the fast path is measured against: vLLM's way, the hash
    function (pickle.dumps + digest) over (parent, block tokens, extra keys), one
    block at a time, from the hasher's public settings."""
    fn, bs = hash_fn(hasher.algo), hasher.block_size
    ids = tokens.tolist()
    prev = hasher.none_hash
    out: list[bytes] = []
    for i in range(n_blocks):
        prev = fn((prev, tuple(ids[i * bs : (i + 1) * bs]), None))
        out.append(prev)
    return out


def _hashes_of(payload: bytes) -> list[int]:
    return [h for ev in lean_decoder().decode(payload).events for h in ev.block_hashes]  # type: ignore[union-attr]


class LocalRedis:
    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found (apt-get install -y redis-server)")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvbench-redis-")
        self.proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", self.dir,
             "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        self.url = f"redis://127.0.0.1:{self.port}/0"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.close()
        raise RuntimeError("redis-server did not start")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def fmt_ms(s) -> str:
    return f"p50 {s.median_s * 1e3:7.2f} ms  p99 {s.p99_s * 1e3:7.2f} ms  (p10..p90 {s.p10_s * 1e3:.2f}..{s.p90_s * 1e3:.2f})"


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.nodes, args.request_blocks, args.background_blocks = 10, 1_000, 1_000
        args.ingest_hashes, args.score_repeats = 40_000, 20
    rng = np.random.default_rng(args.seed)
    request = rng.integers(0, 2**64, args.request_blocks, dtype=np.uint64)
    req_list = request.tolist()
    nodes = [f"node{i:03d}" for i in range(args.nodes)]
    per_batch = args.events_per_batch * args.hashes_per_event
    payloads = make_payloads(
        rng, args.ingest_hashes, args.hashes_per_event, args.events_per_batch, args.block_size
    )
    print(
        f"indexer bench: {args.nodes} nodes, request {args.request_blocks} blocks, "
        f"{args.background_blocks} background blocks/node, ingest {args.ingest_hashes} hashes "
        f"in batches of {args.events_per_batch} events x {args.hashes_per_event} hashes"
    )
    ok = True

    # hashing ------------------------------------------------------------------------
    tokens = rng.integers(0, 150_000, args.request_blocks * args.block_size)
    hasher = BlockHasher(args.block_size)
    n_blocks = tokens.size // args.block_size
    fast = summarize(repeat(lambda: hasher.hash_tokens(tokens), 7))
    generic = summarize(repeat(lambda: reference_hashes(hasher, tokens, n_blocks), 7))
    print(f"\nhash {tokens.size} tokens (sha256/pickle): fast {fmt_ms(fast)}")
    print(f"  reference (pickle.dumps per block, as vLLM): {fmt_ms(generic)}")
    print(f"  ratio reference/fast: {generic.median_s / fast.median_s:.2f}x")

    # ingest -------------------------------------------------------------------------
    ref_rates = [ingest_reference(payloads, per_batch) for _ in range(3)]
    mem_rates = [ingest_backend(MemoryIndex(), payloads, per_batch) for _ in range(3)]
    zmq_rates = [ingest_zmq(payloads, per_batch) for _ in range(2)]
    ref_rate, mem_rate = float(np.median(ref_rates)), float(np.median(mem_rates))
    print("\ningest (decode + apply, hashes/s; median of runs, [min..max]):")
    print(
        f"  reference dict-of-sets: {ref_rate:12,.0f}  [{min(ref_rates):,.0f}..{max(ref_rates):,.0f}]"
    )
    print(
        f"  in-memory:              {mem_rate:12,.0f}  [{min(mem_rates):,.0f}..{max(mem_rates):,.0f}]  {mem_rate / ref_rate:.2f}x ref  (goal >= 500,000)"
    )
    print(
        f"  in-memory via ZMQ:      {float(np.median(zmq_rates)):12,.0f}  [{min(zmq_rates):,.0f}..{max(zmq_rates):,.0f}]"
    )
    ok &= mem_rate >= 500_000

    # score: in-memory + reference --------------------------------------------------
    mem = MemoryIndex()
    t0 = time.perf_counter()
    replicas = populate(mem, np.random.default_rng(args.seed + 1), args, request)
    fill_s = time.perf_counter() - t0
    stats = mem.stats()
    mem_scores = mem.score("model", request)
    mem_s = summarize(repeat(lambda: mem.score("model", request), args.score_repeats))
    ref = DictIndex()
    populate(ref, np.random.default_rng(args.seed + 1), args, request)
    ref_scores = ref.score(req_list, nodes)
    ref_s = summarize(repeat(lambda: ref.score(req_list, nodes), max(3, args.score_repeats // 20)))
    same = sorted(mem_scores, key=lambda s: s.node) == sorted(ref_scores, key=lambda s: s.node)
    print(
        f"\nscore {args.request_blocks} blocks vs {args.nodes} nodes ({stats['blocks']:,} blocks indexed, {replicas:,} replicas):"
    )
    print(f"  reference dict-of-sets: {fmt_ms(ref_s)}")
    print(
        f"  in-memory:              {fmt_ms(mem_s)}  {ref_s.median_s / mem_s.median_s:.1f}x faster than ref  (goal p99 <= 5 ms)"
    )
    print(f"  results equal to reference: {same}")
    print(
        f"  memory: {stats['bytes'] / stats['replicas']:.1f} bytes per block replica ({stats['bytes'] / 2**20:.0f} MiB for {stats['replicas']:,} replicas; in-memory fill {replicas / fill_s:,.0f}/s)"
    )
    ok &= same and mem_s.p99_s <= 0.005

    # redis ------------------------------------------------------------------------------
    if args.redis != "off":
        import redis

        from kvstore.indexer.redis_index import RedisIndex

        local = LocalRedis() if args.redis == "auto" else None
        url = local.url if local else args.redis
        try:
            key_prefix = f"kvbench{int(time.time())}"
            max_nodes = max(128, (args.nodes + 63) // 64 * 64)
            r = RedisIndex(url, key_prefix=key_prefix, max_nodes=max_nodes)
            server = redis.Redis.from_url(url)  # the server's own memory figure
            before = int(server.info("memory")["used_memory"])
            t0 = time.perf_counter()
            populate(r, np.random.default_rng(args.seed + 1), args, request)
            rfill = replicas / (time.perf_counter() - t0)
            after = int(server.info("memory")["used_memory"])
            r_scores = r.score("model", request)
            r_s = summarize(
                repeat(lambda: r.score("model", request), max(10, args.score_repeats // 4))
            )
            r_rates = [
                ingest_backend(
                    RedisIndex(url, key_prefix=f"kvbi{i}{int(time.time())}", max_nodes=128),
                    payloads,
                    per_batch,
                )
                for i in range(2)
            ]
            r_rate = float(np.median(r_rates))
            # mirror mode: the local copy loaded from Redis answers the Scores
            from kvstore.indexer.mirror import MirroredIndex

            t0 = time.perf_counter()
            mirror = MirroredIndex(RedisIndex(url, key_prefix=key_prefix, max_nodes=max_nodes))
            load_s = time.perf_counter() - t0
            m_scores = mirror.score("model", request)
            m_s = summarize(repeat(lambda: mirror.score("model", request), args.score_repeats))
            print(f"\nredis ({url}):")
            print(
                f"  ingest: {r_rate:12,.0f} hashes/s  [{min(r_rates):,.0f}..{max(r_rates):,.0f}]"
                f"  in-memory/redis {mem_rate / r_rate:.2f}x  (goal <= 5x)"
            )
            print(
                f"  score, direct: {fmt_ms(r_s)}  redis/in-memory p50 "
                f"{r_s.median_s / mem_s.median_s:.2f}x, p99 {r_s.p99_s / mem_s.p99_s:.2f}x  (goal <= 5x)"
            )
            print(
                f"  score, mirror: {fmt_ms(m_s)}  redis/in-memory p50 "
                f"{m_s.median_s / mem_s.median_s:.2f}x, p99 {m_s.p99_s / mem_s.p99_s:.2f}x"
                f"  (mirror loaded {mirror.loaded_blocks:,} blocks from Redis in {load_s:.1f} s)"
            )
            print(
                f"  results equal to in-memory: direct {r_scores == mem_scores}, "
                f"mirror {m_scores == mem_scores}"
            )
            print(
                f"  memory: {(after - before) / replicas:.1f} bytes per block replica "
                f"(Redis used_memory delta; fill {rfill:,.0f}/s)"
            )
            # The goal is judged on the direct read: the mirror is a local copy
            # (in-memory speed by construction), reported beside it, not instead.
            direct_ok = r_s.p99_s <= 5 * mem_s.p99_s
            mirror_ok = m_s.p99_s <= 5 * mem_s.p99_s
            print(
                "  score goal (p99 <= 5x in-memory): direct Redis read "
                f"{'met' if direct_ok else 'MISSED'}; mirror read (redis_read=mirror, the "
                f"default) {'met' if mirror_ok else 'MISSED'}"
            )
            ok &= r_scores == mem_scores and m_scores == mem_scores
            ok &= direct_ok and mem_rate <= 5 * r_rate
            mirror.close()
            r.close()
            server.close()
        finally:
            if local:
                local.close()
    print("\nall goals met" if ok else "\nsome goals NOT met (see above)")
    return 0
