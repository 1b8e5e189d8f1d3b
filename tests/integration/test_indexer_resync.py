"""The index is never silently stale: regressions of issue 20 (and 13, 16) against
real daemons, the real indexer and, where it matters, a real redis-server.

Each test states the old behaviour it guards against.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc
import msgspec
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.auth import SECRET_METADATA_KEY
from kvstore.client import Client
from kvstore.events.publisher import ZmqEventPublisher
from kvstore.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvstore.hashing import BlockHasher
from kvstore.indexer.backend import NodeScore
from kvstore.indexer.config import IndexerConfig
from kvstore.indexer.redis_index import RedisIndex
from kvstore.indexer.service import Indexer, serve
from kvstore.indexer.subscriber import SourceSpec
from kvstore.process import DaemonProcess
from kvstore.v1 import indexer_pb2, indexer_pb2_grpc
from kvstore_bench.ports import free_port
from kvstore_router_client import RouterClient
from tests.conftest import make_spec
from tests.integration._redis import redis_server  # noqa: F401
from tests.integration.test_indexer_events import RawPublisher

BLOCK_BYTES = 4096


def wait_for(cond: Callable[[], bool], timeout_s: float = 20.0, what: str = "") -> float:
    """Poll ``cond`` until true; returns the seconds it took (bounded)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"{what or 'condition'} not reached within {timeout_s:.1f}s")


# Snapshot is a data call over TCP, so it needs the cluster secret: the daemons
# here have this one, and the indexers present it unless a test says otherwise.
SECRET = "s3cret"


def daemon_settings(**extra: object) -> dict[str, object]:
    """Fixed ports, so a restart keeps them."""
    return {
        "events.enabled": True,
        "events.publish_address": f"tcp://127.0.0.1:{free_port()}",
        "events.replay_address": f"tcp://127.0.0.1:{free_port()}",
        "server.tcp_address": f"127.0.0.1:{free_port()}",
        "peer.secret": SECRET,
        **extra,
    }


def source_for(name: str, s: dict[str, object], snapshots: bool = True) -> SourceSpec:
    extra = {"snapshot_address": str(s["server.tcp_address"])} if snapshots else {}
    return SourceSpec(
        node=name,
        endpoint=str(s["events.publish_address"]),
        replay_endpoint=str(s["events.replay_address"]),
        **extra,
    )


def chain(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return BlockHasher(16).hash_tokens_int(rng.integers(0, 32_000, 16 * n))


def prefix(ix: Indexer, model: str, hashes: np.ndarray, node: str) -> int:
    for s in ix.score(model, np.asarray(hashes, dtype=np.uint64)):
        if s.node == node:
            return s.prefix_blocks
    return 0


@pytest.fixture
def indexers() -> Iterator[Callable[..., Indexer]]:
    made: list[Indexer] = []

    def make(sources: list[SourceSpec], **kw: object) -> Indexer:
        kw.setdefault("cluster_secret", SECRET)
        ix = Indexer(IndexerConfig(sources=sources, **kw))  # type: ignore[arg-type]
        ix.start()
        made.append(ix)
        return ix

    yield make
    for ix in made:
        ix.close()


def put_one_by_one(d: DaemonProcess, hashes: np.ndarray, model: str = "tiny") -> None:
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK_BYTES, model=model))
        for i in range(len(hashes)):
            assert c.put(ns, hashes[i : i + 1], np.zeros((1, BLOCK_BYTES), np.uint8)).stored == 1


def daemon_prefix(d: DaemonProcess, hashes: np.ndarray, model: str = "tiny") -> int:
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK_BYTES, model=model))
        return c.lookup(ns, hashes).prefix_blocks


# --- case 1: a gap longer than the replay buffer ------------------------------------


def test_fresh_indexer_rebuilds_a_chain_longer_than_the_replay_buffer(daemon_factory, indexers):
    """Old: 5 batches replayed, the chain's head gone for good, Score 0 (resyncs=1)."""
    # one event per batch: the daemon's sender coalesces what is queued, and a slow
    # machine could fit all 20 puts into the 5 batches replay keeps
    s = daemon_settings(**{"events.buffer_batches": 5, "events.max_events_per_batch": 1})
    d = daemon_factory("node-a", settings=s)
    hashes = chain(20)
    put_one_by_one(d, hashes)
    assert daemon_prefix(d, hashes) == 20
    ix = indexers([source_for("node-a", s)])
    wait_for(lambda: prefix(ix, "tiny", hashes, "node-a") == 20, what="Score 20")
    assert ix.score("tiny", hashes) == [NodeScore("node-a", 20, 0, 20, 0)]
    assert ix.subscriber.stats.snapshots >= 1
    # and the stream goes on from the snapshot's seq: more blocks, removals
    more = chain(24, seed=1)
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK_BYTES))
        c.delete(ns, hashes[10:])
    wait_for(lambda: prefix(ix, "tiny", hashes, "node-a") == 10, what="removal applied")
    put_one_by_one(d, more)
    wait_for(lambda: prefix(ix, "tiny", more, "node-a") == 24, what="new chain")


def test_node_returning_after_node_gone_is_rebuilt(daemon_factory, indexers):
    """Old: a node back after node_gone_s is replayed from what the buffer still has."""
    s = daemon_settings(**{"events.buffer_batches": 3})
    d = daemon_factory("node-a", settings=s)
    hashes = chain(12)
    put_one_by_one(d, hashes[:4])
    ix = indexers([source_for("node-a", s)], node_gone_s=0.5)
    wait_for(lambda: prefix(ix, "tiny", hashes, "node-a") == 4)
    d.stop(keep_region=True)  # warm restart: the daemon comes back holding its blocks
    wait_for(lambda: prefix(ix, "tiny", hashes, "node-a") == 0, what="node gone")
    d.start()
    assert daemon_prefix(d, hashes) == 4
    put_one_by_one(d, hashes[4:])  # 8 more batches: past the buffer
    wait_for(lambda: prefix(ix, "tiny", hashes, "node-a") == 12, what="node rebuilt")


# --- case 2: a Redis outage ---------------------------------------------------------


def health_status(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return (
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        )


@pytest.mark.redis
def test_redis_outage_pauses_ingestion_then_converges(daemon_factory, indexers, redis_server):  # noqa: F811
    """Old: the thread died on the first Redis error, health stayed SERVING, Score 0 forever."""
    s = daemon_settings()
    d = daemon_factory("node-a", settings=s)
    ix = indexers([source_for("node-a", s)], backend="redis", redis_url=redis_server.url)
    server, port = serve(ix, "127.0.0.1:0")
    try:
        hashes = chain(4)
        put_one_by_one(d, hashes[:1])
        wait_for(lambda: prefix(ix, "tiny", hashes, "node-a") == 1)
        assert health_status(port) == health_pb2.HealthCheckResponse.SERVING
        redis_server.stop()
        put_one_by_one(d, hashes[1:2])
        wait_for(
            lambda: health_status(port) == health_pb2.HealthCheckResponse.NOT_SERVING,
            what="NOT_SERVING while Redis is down",
        )
        assert not ix.healthy
        redis_server.start()  # empty: it kept nothing (no persistence)
        put_one_by_one(d, hashes[2:])
        took = wait_for(
            lambda: prefix(ix, "tiny", hashes, "node-a") == 4, what="Score = the daemon's 4"
        )
        assert daemon_prefix(d, hashes) == 4
        wait_for(lambda: health_status(port) == health_pb2.HealthCheckResponse.SERVING)
        assert ix.subscriber.alive and ix.subscriber.stats.backend_outages >= 1
        # the shared copy agrees with the mirror: a replica reading Redis directly
        direct = RedisIndex(redis_server.url)
        try:
            assert direct.score("tiny", hashes) == [NodeScore("node-a", 4, 0, 4, 0)]
        finally:
            direct.close()
        print(f"redis outage: converged {took:.2f}s after Redis came back")
    finally:
        server.stop(0)


# --- case 3: sources own their mediums ----------------------------------------------


def engine_batch(raw: RawPublisher, *events: object) -> bytes:
    return raw.batch(*events)


def test_daemon_restart_leaves_the_engines_gpu_entries(daemon_factory, indexers):
    """Old: the daemon's seq-0 AllBlocksCleared wiped the engine's GPU entries too."""
    s = daemon_settings()
    d = daemon_factory("node-a", settings=s)
    hashes = chain(3)
    engine = RawPublisher(topic=b"")  # a vLLM engine's own stream, the daemon's node id
    try:
        eng = SourceSpec(
            node="node-a",
            endpoint=engine.endpoint,
            replay_endpoint=engine.replay_endpoint,
            kind="engine",
            model="tiny",
        )
        ix = indexers([source_for("node-a", s), eng])
        stored = BlockStored([int(h) for h in hashes], None, [], 16, None, "GPU", None)
        payload = engine.batch(stored)
        engine.send(0, payload, publish=False)
        wait_for(
            lambda: (
                engine.pub.send_multipart((b"", (0).to_bytes(8, "big"), payload)) is None
                and prefix(ix, "tiny", hashes, "node-a") == 3
            ),
            what="engine GPU entries",
        )
        put_one_by_one(d, hashes)
        wait_for(lambda: ix.score("tiny", hashes) == [NodeScore("node-a", 3, 3, 0, 0)])
        d.stop()  # a restart without warm restart: the daemon's blocks are gone
        d.start()
        wait_for(lambda: ix.subscriber.stats.clears + ix.subscriber.stats.snapshots >= 2)
        put_one_by_one(d, hashes[:1])
        # the engine still holds all 3 on its GPU; the daemon now holds 1
        wait_for(lambda: ix.score("tiny", hashes) == [NodeScore("node-a", 3, 3, 0, 0)])
        assert daemon_prefix(d, hashes) == 1
        engine.send(1, engine.batch(BlockRemoved([int(hashes[1])], "GPU")))
        wait_for(lambda: prefix(ix, "tiny", hashes, "node-a") == 1, what="engine removal")
        engine.send(2, engine.batch(AllBlocksCleared()))
        # the engine's clear leaves the daemon's DRAM entry
        wait_for(lambda: ix.score("tiny", hashes) == [NodeScore("node-a", 1, 0, 1, 0)])
    finally:
        engine.close()


def test_daemon_gpu_tier_and_engine_cache_are_separate_entries(indexers):
    """Old: one (node, GPU) bit; a removal from either source cleared both."""
    # the daemon's own publisher, as its GPU tier uses it (no CUDA here)
    pub = ZmqEventPublisher("node-g", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    engine = RawPublisher(topic=b"")
    try:

        class NS:
            namespace_id, model, tenant, block_size_tokens = "ns", "m", "", 16

        ix = indexers(
            [
                SourceSpec(
                    node="node-g", endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint or ""
                ),
                SourceSpec(
                    node="node-g",
                    endpoint=engine.endpoint,
                    replay_endpoint=engine.replay_endpoint,
                    kind="engine",
                    model="m",
                ),
            ]
        )
        h = [11, 12]
        pub.blocks_stored(NS(), h, "GPU", None, None)
        payload = engine.batch(BlockStored(h, None, [], 16, None, "GPU", None))
        engine.send(0, payload, publish=False)
        wait_for(
            lambda: (
                engine.pub.send_multipart((b"", (0).to_bytes(8, "big"), payload)) is None
                and ix.subscriber.stats.hashes_stored >= 4
            )
        )
        hv = np.array(h, dtype=np.uint64)
        wait_for(lambda: ix.score("m", hv) == [NodeScore("node-g", 2, 2, 0, 0)])
        pub.blocks_removed(NS(), h, "GPU")  # the daemon's GPU tier let them go
        wait_for(lambda: ix.subscriber.stats.hashes_removed >= 2)
        assert ix.score("m", hv) == [NodeScore("node-g", 2, 2, 0, 0)]  # the engine still has them
        engine.send(1, engine.batch(BlockRemoved(h, "GPU")))
        wait_for(lambda: ix.score("m", hv) == [])
    finally:
        pub.close()
        engine.close()


# --- case 4: Redis keys and clears --------------------------------------------------


@pytest.mark.redis
def test_redis_clear_of_one_model_leaves_a_model_whose_name_extends_it(redis_server):  # noqa: F811
    """Old: clearing model 'a' scanned kvidx:m:a:*, which also matched model 'a:b'."""
    idx = RedisIndex(redis_server.url)
    try:
        hv = np.array([1, 2, 3], dtype=np.uint64)
        for model in ("a", "a:b", "a*", "a:"):
            idx.add(model, "n", "CPU", hv)
        idx.clear("n", "a")
        assert idx.score("a", hv) == []
        for model in ("a:b", "a*", "a:"):
            assert idx.score(model, hv) == [NodeScore("n", 3, 0, 3, 0)], model
        idx.clear("n", "a*")  # a glob character in a name is a literal
        assert idx.score("a:b", hv) == [NodeScore("n", 3, 0, 3, 0)]
        assert idx.score("a*", hv) == []
        # a reload sees every model under its own name
        from kvstore.indexer.memory import MemoryIndex

        local = MemoryIndex()
        idx.load_into(local)
        assert local.models() == ["a:", "a:b"]
    finally:
        idx.close()


# --- issue 13, defect 1: a malformed payload -----------------------------------------


def test_deeply_nested_payload_is_counted_and_skipped(daemon_factory, indexers):
    """Old: RecursionError ended the ingestion thread; new blocks scored {} for good."""
    raw = RawPublisher(topic=b"kv@bad@m")
    s = daemon_settings()
    d = daemon_factory("node-a", settings=s)
    try:
        bad = SourceSpec(node="bad", endpoint=raw.endpoint, replay_endpoint=raw.replay_endpoint)
        # no snapshots: this is about the decoder, and runs on the old code too
        ix = indexers([bad, source_for("node-a", s, snapshots=False)])
        nested = b"\x91" * 1000 + b"\x00"
        before = ix.subscriber.stats.malformed
        deadline = time.monotonic() + 10
        while ix.subscriber.stats.malformed == before:  # PUB/SUB join: resend until seen
            assert time.monotonic() < deadline, "bad payload never arrived"
            raw.pub.send_multipart((b"kv@bad@m", (0).to_bytes(8, "big"), nested))
            time.sleep(0.05)
        hashes = chain(3)
        put_one_by_one(d, hashes)
        wait_for(lambda: prefix(ix, "tiny", hashes, "node-a") == 3, what="ingestion goes on")
        assert ix.subscriber.stats.malformed == before + 1
        assert ix.subscriber.alive and ix.healthy
    finally:
        raw.close()


# --- issue 13, defect 2: registrations ----------------------------------------------


def test_register_node_is_bounded_owned_and_cannot_touch_configured_sources(indexers):
    """Old: unbounded, unauthenticated; a caller could replace and remove any node."""
    pub = ZmqEventPublisher("node-c", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    try:
        configured = SourceSpec(node="node-c", endpoint=pub.endpoint)
        ix = indexers([configured], max_registered_sources=3, cluster_secret="s3cret")
        server, port = serve(ix, "127.0.0.1:0")
        secret = (("x-kvstore-cluster-secret", "s3cret"),)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = indexer_pb2_grpc.IndexerServiceStub(ch)

                def reg(node: str, ep: str, token: str = "", md=secret):  # type: ignore[no-untyped-def]
                    src = indexer_pb2.EventSource(node=node, endpoint=ep)
                    return stub.RegisterNode(
                        indexer_pb2.RegisterNodeRequest(source=src, owner_token=token),
                        metadata=md,
                        timeout=5,
                    )

                def code(fn, *a, **kw) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
                    with pytest.raises(grpc.RpcError) as e:
                        fn(*a, **kw)
                    return e.value.code()

                assert (
                    code(reg, "x", "tcp://127.0.0.1:1", md=None)
                    == grpc.StatusCode.PERMISSION_DENIED
                )
                assert (
                    code(reg, "node-c", "tcp://127.0.0.1:2") == grpc.StatusCode.PERMISSION_DENIED
                )  # a configured node's name
                t1 = reg("r1", "tcp://127.0.0.1:3").owner_token
                assert reg("r1", "tcp://127.0.0.1:3", t1).owner_token == t1  # renewal
                # someone else's name: neither replaced nor extended without its token
                assert code(reg, "r1", "tcp://127.0.0.1:4") == grpc.StatusCode.PERMISSION_DENIED
                reg("r2", "tcp://127.0.0.1:5", "chosen-token")
                # its owner may move it: the new address replaces the old one
                reg("r2", "tcp://127.0.0.1:8", "chosen-token")
                r2 = [sp.endpoint for sp, _, _ in ix.sources() if sp.node == "r2"]
                assert r2 == ["tcp://127.0.0.1:8"]
                reg("r3", "tcp://127.0.0.1:6")
                assert code(reg, "r4", "tcp://127.0.0.1:7") == grpc.StatusCode.RESOURCE_EXHAUSTED

                def unreg(node: str, token: str = "", md=secret):  # type: ignore[no-untyped-def]
                    return stub.UnregisterNode(
                        indexer_pb2.UnregisterNodeRequest(node=node, owner_token=token),
                        metadata=md,
                        timeout=5,
                    )

                assert code(unreg, "node-c") == grpc.StatusCode.PERMISSION_DENIED
                assert code(unreg, "r1") == grpc.StatusCode.PERMISSION_DENIED
                assert code(unreg, "r1", t1, md=None) == grpc.StatusCode.PERMISSION_DENIED
                assert unreg("r1", t1).removed_sources == 1
                assert unreg("r2", "chosen-token").removed_sources == 1
                assert [s.node for s, _, _ in ix.sources()].count("node-c") == 1
        finally:
            server.stop(0)
    finally:
        pub.close()


# --- issue 16: block size learned from the events -----------------------------------


def test_score_and_router_client_use_the_block_size_the_daemons_publish(daemon_factory, indexers):
    """Old: token ids hashed at 16 against blocks of 32: Score {'node-a': 0}, silently."""
    s = daemon_settings()
    d = daemon_factory("node-a", settings=s)
    ix = indexers([source_for("node-a", s)])
    server, port = serve(ix, "127.0.0.1:0")
    try:
        tokens = np.random.default_rng(3).integers(0, 32_000, 32 * 6)
        hashes = BlockHasher(32).hash_tokens_int(tokens)
        with Client(d.address) as c:
            ns = c.declare_namespace(make_spec(BLOCK_BYTES, block_size_tokens=32))
            assert c.put(ns, hashes, np.zeros((6, BLOCK_BYTES), np.uint8)).stored == 6
        wait_for(lambda: prefix(ix, "tiny", hashes, "node-a") == 6)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = indexer_pb2_grpc.IndexerServiceStub(ch)
            req = indexer_pb2.ScoreRequest(model="tiny", token_ids=tokens.astype("<i4").tobytes())
            resp = stub.Score(req, timeout=5)
            assert [(x.node, x.prefix_blocks) for x in resp.scores] == [("node-a", 6)]
            req.block_size_tokens = 16
            with pytest.raises(grpc.RpcError) as e:
                stub.Score(req, timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "16" in e.value.details() and "32" in e.value.details()
            models = stub.Models(indexer_pb2.ModelsRequest(), timeout=5).models
            assert [(m.model, m.block_size_tokens) for m in models] == [("tiny", 32)]
        with RouterClient(f"127.0.0.1:{port}", deadline_s=2.0) as rc:
            dec = rc.pick("tiny", tokens, ["node-a", "node-b"], default="node-b")
            assert (dec.node, dec.reason) == ("node-a", "prefix")
            assert dec.hit is not None and dec.hit.prefix_blocks == 6
    finally:
        server.stop(0)


def test_snapshot_rpc_is_consistent_with_the_event_stream(daemon_factory):
    """The snapshot + the stream from next_seq is exactly what the daemon holds."""
    from kvstore.v1 import store_pb2, store_pb2_grpc

    s = daemon_settings()
    d = daemon_factory("node-a", settings=s)
    hashes = chain(6)
    put_one_by_one(d, hashes)
    with grpc.insecure_channel(str(s["server.tcp_address"])) as ch:
        chunks = list(
            store_pb2_grpc.StoreServiceStub(ch).Snapshot(
                store_pb2.SnapshotRequest(max_hashes_per_message=4),
                timeout=10,
                metadata=((SECRET_METADATA_KEY, SECRET),),
            )
        )
    assert chunks[-1].done and all(not c.done for c in chunks[:-1])
    assert len({c.next_seq for c in chunks}) == 1
    next_seq = chunks[0].next_seq
    got = np.concatenate(
        [np.frombuffer(c.block_hashes, "<u8") for c in chunks if c.tier == store_pb2.TIER_DRAM]
    )
    assert sorted(got.tolist()) == sorted(hashes.tolist())
    assert {c.block_size_tokens for c in chunks if not c.done} == {16}
    # The stream below next_seq holds every stored block and nothing at or above
    # it yet. How many batches that is depends on how the sender thread woke:
    # stores that queue up while it sleeps go out as one batch (CI once sent the
    # 6 puts as 1 batch; this test expected 6).
    before = replayed(str(s["events.replay_address"]), 0)
    assert [seq for seq, _ in before] == list(range(next_seq))
    assert isinstance(before[0][1][0], AllBlocksCleared)
    stored = [
        h for _, evs in before for e in evs if isinstance(e, BlockStored) for h in e.block_hashes
    ]
    assert sorted(stored) == sorted(hashes.tolist())
    # ... and the stream from next_seq on is what changed after the snapshot.
    later = chain(7, seed=1)[-1:]
    put_one_by_one(d, later)
    wait_for(
        lambda: bool(replayed(str(s["events.replay_address"]), next_seq)),
        what="the batch of the store after the snapshot",
    )
    after = replayed(str(s["events.replay_address"]), next_seq)
    assert [seq for seq, _ in after] == [next_seq]
    assert [h for e in after[0][1] for h in e.block_hashes] == later.tolist()


def replayed(endpoint: str, start_seq: int) -> list[tuple[int, list[object]]]:
    """(seq, events) of every batch the publisher's replay socket resends from start_seq."""
    import zmq

    from kvstore.events.wire import END_SEQ

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    got: list[tuple[int, list[object]]] = []
    try:
        dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, _topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return got
            got.append((int.from_bytes(seq, "big"), list(decoder.decode(payload).events)))
    finally:
        dealer.close()


# --- staleness on /metrics and in `kvstore status --indexer` ------------------------


def test_staleness_shows_on_metrics_and_kvstore_status(daemon_factory, tmp_path):
    import json
    import os
    import subprocess
    import sys
    import urllib.request

    s = daemon_settings()
    d = daemon_factory("node-a", settings=s)
    put_one_by_one(d, chain(2))
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    env = {**os.environ, "PYTHONPATH": root, "KVSTORE_SECRET": SECRET}
    src = (
        f"node=node-a,endpoint={s['events.publish_address']},"
        f"replay_endpoint={s['events.replay_address']},snapshot_address={s['server.tcp_address']}"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.indexer", "--address", "127.0.0.1:0"]
        + ["--metrics-address", "127.0.0.1:0", "--source", src],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        metrics = address = ""
        deadline = time.monotonic() + 30
        while not address and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if "metrics on" in line:
                metrics = line.rsplit(" ", 1)[1].strip()
            elif "listening on" in line:
                address = line.rsplit(" ", 1)[1].strip()
        assert metrics and address, "indexer did not start"

        def status() -> dict:  # type: ignore[type-arg]
            out = subprocess.run(
                [sys.executable, "-m", "kvstore", "status", "--indexer", address, "--json"],
                cwd=root,
                env=env,
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)

        wait_for(lambda: int(status()["sources"][0]["snapshots"]) >= 1, what="a snapshot applied")
        doc = status()
        assert doc["health"] == "SERVING"
        (n,) = doc["sources"]
        assert n["connected"] and 0 <= n["sinceSnapshotS"] < 30
        text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
        assert "kvstore_indexer_up 1.0" in text
        assert 'kvstore_indexer_source_since_snapshot_seconds{kind="daemon",node="node-a"' in text
        assert "kvstore_indexer_source_last_event_age_seconds{" in text
        human = subprocess.run(
            [sys.executable, "-m", "kvstore", "status", "--indexer", address],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        assert "SERVING" in human and "node-a" in human and "snapshot" in human
    finally:
        proc.terminate()
        proc.wait(10)


def test_snapshots_over_tcp_carry_the_cluster_secret(daemon_factory, indexers):
    """A daemon with a cluster secret answers the indexer's Snapshot only with it."""
    s = daemon_settings(
        # one event per batch: else a slow machine's sender may coalesce the 6 puts into
        # the 2 batches replay keeps, and the wrong secret's indexer gets them replayed
        **{"peer.secret": "s3cret", "events.buffer_batches": 2, "events.max_events_per_batch": 1}
    )
    d = daemon_factory("node-a", settings=s)
    hashes = chain(6)
    put_one_by_one(d, hashes)  # past the replay buffer: only a snapshot has it all
    wrong = indexers([source_for("node-a", s)], cluster_secret="wrong")
    right = indexers([source_for("node-a", s)], cluster_secret="s3cret")
    wait_for(lambda: prefix(right, "tiny", hashes, "node-a") == 6, what="snapshot with the secret")
    wait_for(lambda: wrong.subscriber.stats.snapshot_failures >= 1)
    assert wrong.subscriber.stats.snapshots == 0
    assert prefix(wrong, "tiny", hashes, "node-a") == 0


@pytest.mark.redis
def test_every_replica_notices_that_redis_lost_the_index(redis_server):  # noqa: F811
    """Two mirrors on one Redis: after it restarts empty both reload, not just the first."""
    from kvstore.indexer.mirror import MirroredIndex

    a, b = MirroredIndex(RedisIndex(redis_server.url)), MirroredIndex(RedisIndex(redis_server.url))
    try:
        hv = np.array([5, 6], dtype=np.uint64)
        a.add("m", "n1", "CPU", hv)
        assert not a.ping() and not b.ping()
        redis_server.stop()
        redis_server.start()
        assert a.ping()  # sets a new epoch ...
        assert b.ping()  # ... which b sees differ from the one it knew
        assert a.score("m", hv) == [] and b.score("m", hv) == []  # mirrors match Redis
        b.add("m", "n2", "CPU", hv)  # ids handed out anew: no stale cache
        a.ping()
        assert a.durable.score("m", hv) == [NodeScore("n2", 2, 0, 2, 0)]
    finally:
        a.close()
        b.close()


def test_models_report_first_blocks_hashed_with_another_seed(daemon_factory, indexers):
    """Engines seeded differently never match a token-id Score: the indexer says so."""
    s = daemon_settings()
    d = daemon_factory("node-a", settings=s)
    ix = indexers([source_for("node-a", s)])
    server, port = serve(ix, "127.0.0.1:0")
    try:
        tokens = np.random.default_rng(9).integers(0, 32_000, 16 * 3)
        # snapshots carry no token ids: the events must reach the indexer (live
        # or replayed), so it follows the daemon before they are published
        wait_for(lambda: ix.subscriber.stats.snapshots >= 1)
        with Client(d.address) as c:
            for model, seed in (("same", None), ("seeded", "4242")):
                hashes = BlockHasher(16, "sha256", seed).hash_tokens_int(tokens)
                ns = c.declare_namespace(make_spec(BLOCK_BYTES, model=model))
                h = c.prepare_store(ns, hashes)
                c.commit_store(h, token_ids=tokens)  # a connector passes the tokens
        wait_for(lambda: {"same", "seeded"} <= set(ix.subscriber.seeds.verdicts))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            models = indexer_pb2_grpc.IndexerServiceStub(ch).Models(
                indexer_pb2.ModelsRequest(), timeout=5
            )
        got = {m.model: (m.first_blocks_checked, m.first_blocks_mismatched) for m in models.models}
        assert got == {"same": (1, 0), "seeded": (1, 1)}
    finally:
        server.stop(0)


# --- supervision: a dead ingestion thread ---------------------------------------------


class _ThreadKilled(BaseException):
    """What no handler in the thread catches (as SystemExit or a C extension's
    fatal error would): the thread dies."""


def test_a_dead_ingestion_thread_is_restarted_and_catches_up(daemon_factory, indexers):
    """Supervision: a thread that dies is restarted (counted, logged), follows every
    source its predecessor followed, and catches up through a snapshot."""
    s = daemon_settings()
    d = daemon_factory("node-a", settings=s)
    first, later = chain(4), chain(6, seed=3)
    put_one_by_one(d, first)
    ix = indexers([source_for("node-a", s)])
    wait_for(lambda: prefix(ix, "tiny", first, "node-a") == 4, what="first chain")
    sub = ix.subscriber
    turn = sub._turn  # fault injection: the next turn kills the thread
    killed = []

    def die_once(poller):  # type: ignore[no-untyped-def]
        if not killed:
            killed.append(True)
            raise _ThreadKilled()
        return turn(poller)

    sub._turn = die_once  # type: ignore[method-assign]
    wait_for(lambda: sub.stats.thread_restarts == 1, what="the thread restarted")
    put_one_by_one(d, later)  # stored after the death: the new thread must see them
    wait_for(lambda: prefix(ix, "tiny", later, "node-a") == 6, what="ingestion resumed")
    assert prefix(ix, "tiny", first, "node-a") == 4
    assert sub.alive and ix.health()[0], ix.health()
