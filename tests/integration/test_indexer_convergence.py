"""Convergence: whatever the event streams lose, the index returns to the truth.

Two real daemons publish through a ZMQ proxy (per daemon) that drops and
reorders batches on command; the real indexer follows the proxies, replays
and snapshots straight from the daemons. Faults: drops, reorders, an indexer
restart, a daemon's warm restart, a daemon killed (-9) and started empty, and
all of them mixed. After each, once the faults stop, Score for every stored
chain must equal what the daemons' own Lookups say, within a bounded time;
the time it took is printed per fault kind (``-s`` shows it).

Periodic snapshots are off (``snapshot_interval_s = 0``): what converges here
is the gap replay, the tail check, the restart and reconnect snapshots.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from kvstore.client import Client
from kvstore.hashing import BlockHasher
from kvstore.indexer.config import IndexerConfig
from kvstore.indexer.service import Indexer
from kvstore.indexer.subscriber import SourceSpec
from kvstore.process import DaemonProcess
from kvstore_bench.ports import free_port
from tests.conftest import make_spec
from tests.integration._redis import redis_server  # noqa: F401

BLOCK_BYTES = 4096
CONVERGE_BOUND_S = 30.0


# The daemons' cluster secret: the indexer presents it on its Snapshot calls.
SECRET = "convergence-secret"


class FaultyProxy:
    """SUB from a daemon's PUB, PUB to the indexer; drops / reorders on command."""

    def __init__(self, upstream: str, seed: int) -> None:
        ctx = zmq.Context.instance()
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(upstream)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(self.endpoint)
        self.drop_p = 0.0
        self.reorder_p = 0.0
        self.dropped = 0
        self.reordered = 0
        self._rng = random.Random(seed)
        self._held: list[bytes] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def clean(self) -> None:
        self.drop_p = self.reorder_p = 0.0

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sub.poll(20):
                    if self._held is not None and self.reorder_p == 0.0:
                        self._pub.send_multipart(self._held)  # faults over: release it
                        self._held = None
                    continue
                frames = self._sub.recv_multipart()
                if self._rng.random() < self.drop_p:
                    self.dropped += 1
                    continue
                if self._held is None and self._rng.random() < self.reorder_p:
                    self._held = frames  # goes out after the next one
                    continue
                self._pub.send_multipart(frames)
                if self._held is not None:
                    self.reordered += 1
                    self._pub.send_multipart(self._held)
                    self._held = None
        finally:
            self._sub.close(linger=0)
            self._pub.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Node:
    def __init__(self, d: DaemonProcess, settings: dict[str, object], proxy: FaultyProxy) -> None:
        self.d, self.settings, self.proxy = d, settings, proxy
        self.chains: list[np.ndarray] = []

    @property
    def name(self) -> str:
        return self.d.name

    def source(self) -> SourceSpec:
        return SourceSpec(
            node=self.name,
            endpoint=self.proxy.endpoint,
            replay_endpoint=str(self.settings["events.replay_address"]),
            snapshot_address=str(self.settings["server.tcp_address"]),
        )

    def work(self, rng: np.random.Generator, rounds: int) -> None:
        """Store chains (one batch per block), extend some, delete tails of others."""
        with Client(self.d.address) as c:
            ns = c.declare_namespace(make_spec(BLOCK_BYTES))
            for _ in range(rounds):
                op = rng.integers(0, 3) if self.chains else 0
                if op == 0 or len(self.chains) < 3:
                    n = int(rng.integers(2, 10))
                    tokens = rng.integers(0, 32_000, 16 * n)
                    hashes = BlockHasher(16).hash_tokens_int(tokens)
                    self.chains.append(hashes)
                    for i in range(n):
                        c.put(ns, hashes[i : i + 1], np.zeros((1, BLOCK_BYTES), np.uint8))
                elif op == 1:
                    ch = self.chains[int(rng.integers(0, len(self.chains)))]
                    cut = int(rng.integers(0, len(ch)))
                    c.delete(ns, ch[cut:])
                else:
                    ch = self.chains[int(rng.integers(0, len(self.chains)))]
                    c.put(ns, ch, np.zeros((len(ch), BLOCK_BYTES), np.uint8))

    def truth(self) -> list[int]:
        with Client(self.d.address) as c:
            ns = c.declare_namespace(make_spec(BLOCK_BYTES))
            return [c.lookup(ns, ch).prefix_blocks for ch in self.chains]


def indexed(ix: Indexer, node: Node) -> list[int]:
    out = []
    for ch in node.chains:
        got = [s for s in ix.score("tiny", ch) if s.node == node.name]
        out.append(got[0].prefix_blocks if got else 0)
    return out


def converged(ix: Indexer, nodes: list[Node]) -> bool:
    return all(indexed(ix, n) == n.truth() for n in nodes)


def wait_converged(ix: Indexer, nodes: list[Node], kind: str, times: dict[str, float]) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < CONVERGE_BOUND_S:
        if converged(ix, nodes):
            times[kind] = time.monotonic() - t0
            return
        time.sleep(0.05)
    diff = {n.name: (indexed(ix, n), n.truth()) for n in nodes}
    raise AssertionError(f"{kind}: not converged within {CONVERGE_BOUND_S}s: {diff}")


@pytest.fixture
def cluster(daemon_factory) -> Iterator[list[Node]]:
    nodes: list[Node] = []
    for i, name in enumerate(("node-a", "node-b")):
        s: dict[str, object] = {
            "events.enabled": True,
            "events.publish_address": f"tcp://127.0.0.1:{free_port()}",
            "events.replay_address": f"tcp://127.0.0.1:{free_port()}",
            "events.buffer_batches": 8,  # small: most gaps outlive the replay buffer
            "server.tcp_address": f"127.0.0.1:{free_port()}",
            # Snapshot is a data call over TCP: it needs the cluster secret.
            "peer.secret": SECRET,
        }
        d = daemon_factory(name, settings=s)
        nodes.append(Node(d, s, FaultyProxy(str(s["events.publish_address"]), seed=i)))
    yield nodes
    for n in nodes:
        n.proxy.close()


def _indexer_config(nodes: list[Node], **kw: object) -> IndexerConfig:
    return IndexerConfig(
        sources=[n.source() for n in nodes],
        tail_check_s=0.5,
        snapshot_interval_s=0.0,
        node_gone_s=3600.0,
        cluster_secret=SECRET,
        **kw,  # type: ignore[arg-type]
    )


def _run_faults(cluster: list[Node], cfg_kw: dict[str, object]) -> dict[str, float]:
    rng = np.random.default_rng(20)
    times: dict[str, float] = {}
    ix = Indexer(_indexer_config(cluster, **cfg_kw))
    ix.start()
    try:
        for n in cluster:
            n.work(rng, 4)
        wait_converged(ix, cluster, "start", times)

        for n in cluster:
            n.proxy.drop_p = 0.3
            n.work(rng, 12)
            n.proxy.clean()
        wait_converged(ix, cluster, "drops", times)

        for n in cluster:
            n.proxy.reorder_p = 0.3
            n.work(rng, 12)
            n.proxy.clean()
        wait_converged(ix, cluster, "reorders", times)

        ix.close()  # the indexer restarts; the daemons go on meanwhile
        for n in cluster:
            n.work(rng, 8)
        ix = Indexer(_indexer_config(cluster, **cfg_kw))
        ix.start()
        wait_converged(ix, cluster, "indexer restart", times)

        a = cluster[0]
        a.d.stop(keep_region=True)  # warm restart: it comes back with its blocks
        a.d.start()
        a.work(rng, 6)
        wait_converged(ix, cluster, "daemon warm restart", times)

        b = cluster[1]
        b.d.kill()  # crash: it comes back empty, on the same addresses
        b.d.start()
        b.work(rng, 6)
        wait_converged(ix, cluster, "daemon crash", times)

        # everything at once
        for n in cluster:
            n.proxy.drop_p, n.proxy.reorder_p = 0.2, 0.2
        cluster[0].work(rng, 6)
        ix.close()
        cluster[1].work(rng, 6)
        cluster[0].d.stop(keep_region=True)
        ix = Indexer(_indexer_config(cluster, **cfg_kw))
        ix.start()
        cluster[0].d.start()
        for n in cluster:
            n.work(rng, 6)
            n.proxy.clean()
        wait_converged(ix, cluster, "mixed", times)
        st = ix.subscriber.stats
        faults = {n.name: (n.proxy.dropped, n.proxy.reordered) for n in cluster}
        print(f"\nconvergence after faults stop (s): {times}")
        print(f"proxy (dropped, reordered): {faults}; last indexer: {st}")
        assert sum(d for d, _ in faults.values()) > 0 and sum(r for _, r in faults.values()) > 0
    finally:
        ix.close()
    return times


def test_index_converges_after_drops_reorders_and_restarts(cluster):
    times = _run_faults(cluster, {})
    assert set(times) >= {"drops", "reorders", "indexer restart", "daemon crash", "mixed"}


@pytest.mark.redis
def test_redis_index_converges_after_the_same_faults(cluster, redis_server):  # noqa: F811
    times = _run_faults(cluster, {"backend": "redis", "redis_url": redis_server.url})
    assert "mixed" in times
