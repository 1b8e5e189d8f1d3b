"""The indexer following real ZMQ event streams: gaps, restarts, bad input, departures.

Publishers are kvstore's own ``ZmqEventPublisher`` or, where a test needs a
precise fault (a skipped sequence number, garbage frames), a raw ZMQ PUB +
ROUTER pair speaking vLLM's framing byte for byte, as a vLLM engine does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import msgspec
import numpy as np
import pytest
import zmq

from kvstore.errors import ConfigError
from kvstore.events.publisher import ZmqEventPublisher
from kvstore.events.wire import END_SEQ, AllBlocksCleared, BlockStored, KVEventBatch
from kvstore.indexer.backend import NodeScore, RankScore
from kvstore.indexer.config import IndexerConfig
from kvstore.indexer.service import Indexer
from kvstore.indexer.subscriber import SourceSpec
from tests.integration._redis import redis_server  # noqa: F401


class NS:
    def __init__(self, model: str = "m") -> None:
        self.namespace_id = "ns-" + model
        self.model = model
        self.tenant = ""
        self.block_size_tokens = 16


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"condition not reached within {timeout_s:.1f}s")


def H(*xs: int) -> list[int]:
    return list(xs)


def prefix(ix: Indexer, model: str, hashes: list[int], node: str) -> int:
    for s in ix.score(model, np.array(hashes, dtype=np.uint64)):
        if s.node == node:
            return s.prefix_blocks
    return 0


@pytest.fixture
def make_indexer():
    made: list[Indexer] = []

    def make(sources=(), **kw) -> Indexer:
        cfg = IndexerConfig(sources=list(sources), **kw)
        ix = Indexer(cfg)
        ix.start()
        made.append(ix)
        return ix

    yield make
    for ix in made:
        ix.close()


@pytest.fixture
def publishers():
    made: list[ZmqEventPublisher] = []

    def make(node="a", endpoint="tcp://127.0.0.1:0", replay="tcp://127.0.0.1:0", **kw):
        p = ZmqEventPublisher(node, endpoint, replay, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def source_of(p: ZmqEventPublisher, **kw) -> SourceSpec:
    return SourceSpec(
        node=p.node_id, endpoint=p.endpoint, replay_endpoint=p.replay_endpoint or "", **kw
    )


def test_store_remove_clear_reach_the_index(make_indexer, publishers):
    pub = publishers("a")
    ix = make_indexer([source_of(pub)])
    pub.blocks_stored(NS(), H(1, 2, 3, 4), "CPU", None, list(range(64)))
    pub.blocks_stored(NS(), H(1, 2), "GPU", None, None)
    pub.blocks_stored(NS("other"), H(1), "DISK", None, None)
    wait_for(lambda: prefix(ix, "m", H(1, 2, 3, 4), "a") == 4)
    assert ix.score("m", np.array(H(1, 2, 3, 4), dtype=np.uint64)) == [NodeScore("a", 4, 2, 2, 0)]
    pub.blocks_removed(NS(), H(3), "CPU")
    wait_for(lambda: prefix(ix, "m", H(1, 2, 3, 4), "a") == 2)
    pub.all_cleared(NS())  # this model only
    wait_for(lambda: prefix(ix, "m", H(1, 2), "a") == 0)
    assert prefix(ix, "other", H(1), "a") == 1
    pub.all_cleared(None)  # every model of the node
    wait_for(lambda: prefix(ix, "other", H(1), "a") == 0)
    assert ix.subscriber.stats.malformed == 0


def test_late_subscriber_catches_up_by_replay(make_indexer, publishers):
    pub = publishers("a")
    for i in range(5):
        pub.blocks_stored(NS(), H(i + 1), "CPU", i or None, None)
    wait_for(lambda: pub.published_events >= 6)
    ix = make_indexer([source_of(pub)])
    # nothing new is published: the subscriber replays the history on connect
    wait_for(lambda: prefix(ix, "m", H(1, 2, 3, 4, 5), "a") == 5)
    pub.blocks_stored(NS(), H(6), "CPU", 5, None)
    wait_for(lambda: prefix(ix, "m", H(1, 2, 3, 4, 5, 6), "a") == 6)
    st = ix.subscriber.stats
    assert st.replays >= 1 and st.resyncs == 0


class RawPublisher:
    """vLLM's framing by hand: PUB (topic, seq BE, payload), ROUTER replay.

    A thread owns the ROUTER and answers replay requests from ``buffer``
    (what a real publisher keeps, including batches it never sent live).
    """

    def __init__(self, topic: bytes = b"kv@raw@m") -> None:
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:0")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind("tcp://127.0.0.1:0")
        self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_starts: list[int] = []
        self.lock = threading.Lock()
        self.enc = msgspec.msgpack.Encoder()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(router,), daemon=True)
        self._thread.start()

    def batch(self, *events) -> bytes:
        return self.enc.encode(KVEventBatch(ts=time.time(), events=list(events)))

    def send(self, seq: int, payload: bytes, *, publish: bool = True, frames=None) -> None:
        with self.lock:
            self.buffer.append((seq, payload))
        if publish:
            self.pub.send_multipart(frames or (self.topic, seq.to_bytes(8, "big"), payload))

    def _serve(self, router) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(50):
                    continue
                ident, _, start_b = router.recv_multipart()
                start = int.from_bytes(start_b, "big")
                with self.lock:
                    self.replay_starts.append(start)
                    items = [(q, p) for q, p in self.buffer if q >= start]
                for seq, payload in items:
                    router.send_multipart((ident, b"", self.topic, seq.to_bytes(8, "big"), payload))
                router.send_multipart((ident, b"", b"", END_SEQ, b""))
        finally:
            router.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pub.close(linger=0)


def stored(*hashes: int, medium="CPU") -> BlockStored:
    return BlockStored(list(hashes), None, [], 16, None, medium, None)


def connected(ix: Indexer, raw: RawPublisher, source: SourceSpec) -> None:
    """Publish seq 0 until the subscriber holds it (it may also replay it)."""
    payload = raw.batch(stored(100))
    raw.send(0, payload, publish=False)
    deadline = time.monotonic() + 10
    while prefix(ix, "m", H(100), source.node) == 0:
        assert time.monotonic() < deadline, "subscriber never connected"
        raw.pub.send_multipart((raw.topic, (0).to_bytes(8, "big"), payload))
        time.sleep(0.05)


def test_dropped_batch_is_recovered_by_replay(make_indexer):
    raw = RawPublisher()
    try:
        src = SourceSpec(node="raw", endpoint=raw.endpoint, replay_endpoint=raw.replay_endpoint)
        ix = make_indexer([src])
        connected(ix, raw, src)
        gaps = ix.subscriber.stats.gaps
        raw.send(1, raw.batch(stored(101)), publish=False)  # lost on the way
        raw.send(2, raw.batch(stored(102)))
        wait_for(lambda: prefix(ix, "m", H(100, 101, 102), "raw") == 3)
        st = ix.subscriber.stats
        assert st.gaps == gaps + 1 and st.resyncs == 0
        assert raw.replay_starts[-1] == 1  # asked for exactly what it missed
    finally:
        raw.close()


def test_malformed_and_unknown_events_are_counted_and_skipped(make_indexer):
    raw = RawPublisher()
    try:
        src = SourceSpec(node="raw", endpoint=raw.endpoint, replay_endpoint=raw.replay_endpoint)
        ix = make_indexer([src])
        connected(ix, raw, src)
        enc = msgspec.msgpack.encode
        raw.send(1, b"\xc1 not msgpack")  # undecodable payload
        raw.send(
            2,
            enc(
                [
                    1.0,
                    [
                        {"type": "BlockTeleported", "block_hashes": [5]},
                        {"type": "BlockStored", "block_hashes": [101], "medium": "CPU"},
                    ],
                ]
            ),
        )
        raw.send(3, enc([1.0, [{"type": "BlockStored", "block_hashes": ["x"], "medium": "CPU"}]]))
        raw.send(4, enc({"not": "a batch"}))
        raw.send(5, raw.batch(stored(102, medium="TAPE"), stored(102)))
        raw.pub.send_multipart((b"only-two", b"frames"))  # wrong frame count
        raw.pub.send_multipart((raw.topic, b"\x00\x01", b""))  # bad seq width
        raw.send(
            6,
            raw.batch(stored(103)),
            frames=(b"not-a-topic", (6).to_bytes(8, "big"), raw.batch(stored(103))),
        )
        raw.send(7, raw.batch(stored(103)))
        wait_for(lambda: prefix(ix, "m", H(100, 101, 102, 103), "raw") == 4)
        st = ix.subscriber.stats
        assert st.unknown_events == 2  # BlockTeleported, medium TAPE
        assert st.malformed == 6  # payload, bad hash type, non-batch, 2 frames, seq width, topic
        assert st.resyncs == 0
    finally:
        raw.close()


def test_publisher_restart_resets_sequence_and_resyncs(make_indexer, publishers):
    first = publishers("a")
    ix = make_indexer([source_of(first)])
    first.blocks_stored(NS(), H(1, 2, 3), "CPU", None, None)
    wait_for(lambda: prefix(ix, "m", H(1, 2, 3), "a") == 3)
    for i in range(20):  # move the counter well past what the new life will reach
        first.blocks_stored(NS(f"pad{i}"), H(50 + i), "CPU", None, None)
    wait_for(lambda: first.published_batches >= 22)
    wait_for(lambda: ix.subscriber.stats.batches >= 22)
    endpoint, replay = first.endpoint, first.replay_endpoint
    first.close()
    # same address, counter from 0; ZMQ releases a closed socket's port from
    # its I/O thread, so the rebind may need a moment (bounded)
    deadline = time.monotonic() + 5
    while True:
        try:
            second = publishers("a", endpoint, replay)
            break
        except ConfigError:
            assert time.monotonic() < deadline, "the old publisher's port never came free"
            time.sleep(0.05)
    second.blocks_stored(NS(), H(1), "GPU", None, None)
    wait_for(
        lambda: ix.score("m", np.array(H(1, 2, 3), dtype=np.uint64)) == [NodeScore("a", 1, 1, 0, 0)]
    )
    assert ix.subscriber.stats.restarts + ix.subscriber.stats.clears >= 1


def test_unrecoverable_gap_resyncs_from_what_is_left(make_indexer, publishers):
    pub = publishers("a", replay_buffer_batches=2)
    for i in range(6):
        pub.blocks_stored(NS(f"m{i}"), H(i + 1), "CPU", None, None)
        wait_for(lambda i=i: pub.published_batches >= i + 2)
    ix = make_indexer([source_of(pub)])
    pub.blocks_stored(NS("m9"), H(9), "CPU", None, None)
    wait_for(lambda: prefix(ix, "m9", H(9), "a") == 1)
    st = ix.subscriber.stats
    assert st.resyncs == 1
    # the two batches still buffered were replayed; older ones are gone
    assert prefix(ix, "m5", H(6), "a") == 1
    assert prefix(ix, "m0", H(1), "a") == 0


def test_node_gone_drops_its_entries(make_indexer, publishers):
    pub = publishers("gone")
    stay = publishers("stay")
    ix = make_indexer([source_of(pub), source_of(stay)], node_gone_s=0.5)
    pub.blocks_stored(NS(), H(1, 2), "CPU", None, None)
    stay.blocks_stored(NS(), H(1), "CPU", None, None)
    wait_for(lambda: prefix(ix, "m", H(1, 2), "gone") == 2 and prefix(ix, "m", H(1), "stay") == 1)
    pub.close()
    wait_for(lambda: prefix(ix, "m", H(1, 2), "gone") == 0)
    assert prefix(ix, "m", H(1), "stay") == 1
    assert ix.subscriber.stats.nodes_gone == 1


def test_engine_stream_clear_touches_only_its_gpu_tier(make_indexer, publishers):
    daemon = publishers("n1")
    # a vLLM engine publishes with an empty topic and no model
    engine = RawPublisher(topic=b"")
    try:
        src = SourceSpec(
            node="n1",
            endpoint=engine.endpoint,
            replay_endpoint=engine.replay_endpoint,
            kind="engine",
            model="m",
        )
        ix = make_indexer([source_of(daemon), src])
        daemon.blocks_stored(NS(), H(100, 1, 2), "CPU", None, None)
        connected(ix, engine, src)
        engine.send(1, engine.batch(stored(1, 2, medium="GPU"), stored(3, medium=None)))
        wait_for(lambda: prefix(ix, "m", H(100, 1, 2, 3), "n1") == 4)
        assert ix.score("m", np.array(H(100, 1, 2, 3), dtype=np.uint64)) == [
            NodeScore("n1", 4, 3, 1, 0)
        ]
        engine.send(2, engine.batch(AllBlocksCleared()))
        wait_for(lambda: prefix(ix, "m", H(100, 1, 2, 3), "n1") == 3)
        assert ix.score("m", np.array(H(100, 1, 2), dtype=np.uint64)) == [
            NodeScore("n1", 3, 0, 3, 0)
        ]
    finally:
        engine.close()


@pytest.mark.redis
def test_redis_backed_indexer_restart_loses_nothing(make_indexer, publishers, redis_server):  # noqa: F811
    pub = publishers("a")
    cfg = dict(backend="redis", redis_url=redis_server.url)
    ix = make_indexer([source_of(pub)], **cfg)
    pub.blocks_stored(NS(), H(1, 2), "CPU", None, None)
    wait_for(lambda: prefix(ix, "m", H(1, 2), "a") == 2)
    ix.close()
    # events while no indexer runs: kept in the publisher's replay buffer
    pub.blocks_stored(NS(), H(3), "CPU", 2, None)
    pub.blocks_removed(NS(), H(1), "CPU")
    pub.blocks_stored(NS(), H(1), "DISK", None, None)
    wait_for(lambda: pub.published_events >= 5)
    again = make_indexer([source_of(pub)], **cfg)
    assert prefix(again, "m", H(1, 2), "a") == 2  # nothing lost across the restart
    pub.blocks_stored(NS(), H(4), "CPU", 3, None)  # next batch reveals the gap
    wait_for(lambda: prefix(again, "m", H(1, 2, 3, 4), "a") == 4)
    assert again.score("m", np.array(H(1, 2, 3, 4), dtype=np.uint64)) == [
        NodeScore("a", 4, 0, 3, 1)
    ]
    assert again.subscriber.stats.resyncs == 0


def test_queue_overflow_is_counted_and_becomes_a_node_clear(publishers):
    pub = publishers("a", max_queue_events=2, max_batch_events=1)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@a@")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(pub.endpoint)
    try:
        # PUB/SUB join: one probe at a time (no overflow) until one arrives, and
        # what arrived read, so that the frames below are the burst's.
        deadline = time.monotonic() + 15
        for probe in range(10_000_000, 20_000_000):
            pub.blocks_stored(NS(), [probe], "CPU", None, None)
            if sub.poll(200):
                break
            assert time.monotonic() < deadline, "the subscriber never joined"
        while sub.poll(200):
            sub.recv_multipart()
        assert pub.dropped_events == 0
        for i in range(5_000):  # far faster than one batch per event is sent
            pub.blocks_stored(NS(), [i + 1], "CPU", None, None)
        assert pub.dropped_events > 0
        dec = msgspec.msgpack.Decoder(KVEventBatch)
        frames = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sub.poll(500):
            frames.append(sub.recv_multipart())
        clears = [
            int.from_bytes(seq, "big")
            for topic, seq, payload in frames
            if topic == b"kv@a@" and isinstance(dec.decode(payload).events[0], AllBlocksCleared)
        ]
        # besides the start-of-life clear (seq 0), the overflow produced one
        assert any(seq > 0 for seq in clears)
        seqs = [int.from_bytes(f[1], "big") for f in frames]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    finally:
        sub.close()


def test_positional_events_from_older_engines_reach_the_index(make_indexer):
    """Engines before vLLM 0.26 encode events as arrays, tag first; the indexer
    took each for an unknown event and indexed nothing from them."""
    raw = RawPublisher()
    try:
        src = SourceSpec(node="raw", endpoint=raw.endpoint, replay_endpoint=raw.replay_endpoint)
        ix = make_indexer([src])
        connected(ix, raw, src)  # seq 0, map form
        enc = msgspec.msgpack.encode
        toks = list(range(16))
        # an old engine: no lora_name, no later fields
        raw.send(1, enc([1.0, [["BlockStored", [101, 102], 100, toks * 2, 16, None, "CPU"]], None]))
        # more trailing fields than the decoder knows: ignored
        raw.send(
            2,
            enc([1.0, [["BlockStored", [103], 102, toks, 16, None, "CPU", None, None, 0, "x"]]]),
        )
        wait_for(lambda: prefix(ix, "m", H(100, 101, 102, 103), "raw") == 4)
        raw.send(3, enc([1.0, [["BlockRemoved", [103], "CPU"]]]))
        wait_for(lambda: prefix(ix, "m", H(100, 101, 102, 103), "raw") == 3)
        # one batch mixing both forms and an unknown positional event: decoded
        # event by event, the unknown one skipped
        raw.send(
            4,
            enc(
                [
                    1.0,
                    [
                        # with token_ids: the per-event path used to call it malformed
                        {
                            "type": "BlockStored",
                            "block_hashes": [103],
                            "parent_block_hash": 102,
                            "token_ids": toks,
                            "block_size": 16,
                            "medium": "CPU",
                        },
                        ["BlockTeleported", [5]],
                        ["BlockStored", [104], 103, toks, 16, None, "CPU"],
                    ],
                ]
            ),
        )
        wait_for(lambda: prefix(ix, "m", H(100, 101, 102, 103, 104), "raw") == 5)
        raw.send(5, enc([1.0, [["AllBlocksCleared"]]]))
        wait_for(lambda: prefix(ix, "m", H(100), "raw") == 0)
        st = ix.subscriber.stats
        assert st.unknown_events == 1 and st.malformed == 0 and st.resyncs == 0
    finally:
        raw.close()


def test_topic_ids_name_each_engine_in_the_topic(publishers):
    """events.topic_ids: llm-d names an engine by its topic (its serving address:port)."""
    for bad in (["a@b"], ["x:1", "x:1"], [""]):
        with pytest.raises(ConfigError, match="topic"):
            publishers("a", topic_ids=bad)
    pub = publishers("a", topic_ids=["10.0.0.5:8000", "10.0.0.6:8000"])
    pub.blocks_stored(NS(), H(1, 2), "CPU", None, list(range(32)))
    wait_for(lambda: pub.published_batches >= 4)  # 2 start-of-life clears + 2 stores
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        got = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            got.append((topic, [type(e).__name__ for e in KVEventBatch_dec.decode(payload).events]))
    finally:
        dealer.close()
    assert got == [
        (b"kv@10.0.0.5:8000@", ["AllBlocksCleared"]),
        (b"kv@10.0.0.6:8000@", ["AllBlocksCleared"]),
        (b"kv@10.0.0.5:8000@m", ["BlockStored"]),
        (b"kv@10.0.0.6:8000@m", ["BlockStored"]),
    ]


KVEventBatch_dec = msgspec.msgpack.Decoder(KVEventBatch)


def test_dp_rank_streams_key_gpu_entries_by_rank(make_indexer, publishers):
    """Each DP rank's stream feeds that rank's GPU entries; the daemon's stay the node's."""
    daemon = publishers("n1")
    ranks = [RawPublisher(topic=b""), RawPublisher(topic=b"")]
    try:
        srcs = [
            SourceSpec(
                node="n1",
                endpoint=r.endpoint,
                replay_endpoint=r.replay_endpoint,
                kind="engine",
                model="m",
                data_parallel_rank=i,
            )
            for i, r in enumerate(ranks)
        ]
        ix = make_indexer([source_of(daemon), *srcs])
        daemon.blocks_stored(NS(), H(1, 2), "CPU", None, None)

        def batch(raw: RawPublisher, rank: int, *events) -> bytes:
            return raw.enc.encode(KVEventBatch(time.time(), list(events), data_parallel_rank=rank))

        def rank_gpu(hashes: list[int]) -> dict[int, int]:
            for s in ix.score("m", np.array(hashes, dtype=np.uint64)):
                if s.node == "n1":
                    return {r.rank: r.gpu_blocks for r in s.ranks}
            return {}

        # seq 0 of each rank until its subscription is live (PUB drops before)
        for i, r in enumerate(ranks):
            payload = batch(r, i, stored(50 + i, medium="GPU"))
            r.send(0, payload, publish=False)
            deadline = time.monotonic() + 10
            while rank_gpu(H(50 + i)).get(i) != 1:
                assert time.monotonic() < deadline, f"rank {i} stream never connected"
                r.pub.send_multipart((b"", (0).to_bytes(8, "big"), payload))
                time.sleep(0.05)
        ranks[0].send(1, batch(ranks[0], 0, stored(1, 2, 3, medium="GPU")))
        wait_for(lambda: rank_gpu(H(1, 2, 3)).get(0) == 3)
        req = np.array(H(1, 2, 3), dtype=np.uint64)
        (s,) = ix.score("m", req)
        # rank 0 has the prefix in its GPU cache; rank 1 only the node's DRAM
        assert (s.prefix_blocks, s.gpu_blocks, s.rank) == (3, 3, 0)
        assert s.ranks == (
            RankScore(-1, 2, 0, 2, 0),
            RankScore(0, 3, 3, 0, 0),
            RankScore(1, 2, 0, 2, 0),
        )
        assert rank_gpu(H(51)) == {-1: 0, 1: 1}
        # a batch tagged with another rank on rank 1's stream is refused
        ranks[1].send(1, batch(ranks[1], 0, stored(1, 2, 3, medium="GPU")))
        wait_for(lambda: ix.subscriber.stats.rank_mismatches == 1)
        assert rank_gpu(H(1, 2, 3)) == {-1: 0, 0: 3, 1: 0}
        # rank 0's clear drops rank 0's cache only: not rank 1's, not the daemon's
        ranks[1].send(2, batch(ranks[1], 1, stored(1, medium="GPU")))
        wait_for(lambda: rank_gpu(H(1)).get(1) == 1)
        ranks[0].send(2, batch(ranks[0], 0, AllBlocksCleared()))
        wait_for(lambda: rank_gpu(H(1, 2, 3)).get(0) == 0)
        (s,) = ix.score("m", req)
        assert s.ranks == (
            RankScore(-1, 2, 0, 2, 0),
            RankScore(0, 2, 0, 2, 0),
            RankScore(1, 2, 1, 1, 0),
        )
        assert ix.index.nodes() == ["n1"]
    finally:
        for r in ranks:
            r.close()


def test_source_rank_is_checked():
    with pytest.raises(ConfigError, match="data_parallel_rank"):
        SourceSpec(
            node="n", endpoint="tcp://h:1", kind="engine", model="m", data_parallel_rank=-3
        ).check()
    with pytest.raises(ConfigError, match="engine source"):
        SourceSpec(node="n", endpoint="tcp://h:1", data_parallel_rank=0).check()


def test_engine_hash_scheme_is_learned_and_used_for_token_ids(make_indexer):
    """An engine hashing with sha256_cbor and vLLM 0.33's lookahead (L=4): the
    indexer (configured sha256, legacy) learns the scheme from a chain's first
    block, reports it in Models, and hashes token-id Scores with it."""
    import grpc

    from kvstore.hashing import BlockHasher
    from kvstore.indexer.service import serve
    from kvstore.v1 import indexer_pb2, indexer_pb2_grpc

    L, bs = 4, 16
    tokens = [(i * 37) % 500 + 2 for i in range(3 * bs + L)]
    hashes = BlockHasher(bs, "sha256_cbor").hash_tokens_int(tokens, lookahead_tokens=L)
    assert hashes.size == 3
    legacy = BlockHasher(bs, "sha256").hash_tokens_int(tokens)
    assert not set(legacy.tolist()) & set(hashes.tolist())
    engine = RawPublisher(topic=b"")
    server = None
    try:
        src = SourceSpec(
            node="n1",
            endpoint=engine.endpoint,
            replay_endpoint=engine.replay_endpoint,
            kind="engine",
            model="m",
        )
        ix = make_indexer([src], hash_algo="sha256", block_size_tokens=bs)
        ev = BlockStored(
            [int(h) for h in hashes],
            None,
            tokens[: 3 * bs],
            bs,
            None,
            "GPU",
            None,
            lookahead_token_ids=[tokens[(i + 1) * bs : (i + 1) * bs + L] for i in range(3)],
        )
        payload = engine.batch(ev)
        engine.send(0, payload, publish=False)
        deadline = time.monotonic() + 10
        while prefix(ix, "m", [int(h) for h in hashes], "n1") != 3:
            assert time.monotonic() < deadline, "engine stream never connected"
            engine.pub.send_multipart((b"", (0).to_bytes(8, "big"), payload))
            time.sleep(0.05)
        server, port = serve(ix, "127.0.0.1:0")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = indexer_pb2_grpc.IndexerServiceStub(ch)
            wait_for(lambda: "m" in ix.subscriber.seeds.schemes)
            (info,) = stub.Models(indexer_pb2.ModelsRequest(), timeout=10).models
            assert (info.hash_algo, info.hash_lookahead_tokens, info.hash_scheme_learned) == (
                "sha256_cbor",
                L,
                True,
            )
            assert (info.first_blocks_checked, info.first_blocks_mismatched) == (1, 1)
            packed = np.asarray(tokens, dtype="<i4").tobytes()
            resp = stub.Score(indexer_pb2.ScoreRequest(model="m", token_ids=packed), timeout=10)
            assert (resp.request_blocks, resp.scores[0].prefix_blocks) == (3, 3)
            # the caller may still say otherwise: legacy hashing finds nothing
            legacy_req = indexer_pb2.ScoreRequest(
                model="m", token_ids=packed, hash_algo="sha256", lookahead_tokens=0
            )
            resp = stub.Score(legacy_req, timeout=10)
            assert resp.request_blocks == 3 and not resp.scores
    finally:
        if server is not None:
            server.stop(0)
        engine.close()


def test_a_vllm_servers_ranks_are_discovered_from_its_listing(make_indexer):
    """``vllm_servers``: the indexer reads the server's ``/kv_event_sources`` (retrying
    while it does not answer), follows one source per listed rank (wildcard hosts
    replaced by the url's host), and re-reads it: a rank whose endpoint moved (an
    engine restarted on port 0) is followed at its new one, its old entries dropped."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kvstore.errors import PermissionDenied
    from kvstore.indexer.vllm_sources import VllmServer

    ranks = [RawPublisher(topic=b""), RawPublisher(topic=b""), RawPublisher(topic=b"")]

    def wildcard(endpoint: str) -> str:  # as vLLM lists a "tcp://*:0" config
        return endpoint.replace("127.0.0.1", "*")

    def listing(*pubs: RawPublisher) -> bytes:
        return json.dumps(
            {
                str(i): {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": wildcard(p.endpoint),
                    "replay_endpoint": wildcard(p.replay_endpoint),
                    "topic": "",
                }
                for i, p in enumerate(pubs)
            }
        ).encode()

    answer = [(503, b'{"error": "starting"}')]
    reads = [0]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            status, body = answer[0] if self.path == "/kv_event_sources" else (404, b"{}")
            reads[0] += 1
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{http.server_address[1]}"
    try:
        ix = make_indexer(
            vllm_servers=[VllmServer(node="n1", url=url, model="m")],
            vllm_servers_refresh_s=0.3,
        )
        wait_for(lambda: reads[0] >= 2)  # not up yet: asked again, nothing followed
        assert ix.subscriber.sources() == []
        # the server's node is configured: a registration cannot take it over
        with pytest.raises(PermissionDenied, match="configured"):
            ix.register(SourceSpec(node="n1", endpoint="tcp://127.0.0.1:1"), 0)

        answer[0] = (200, listing(ranks[0], ranks[1]))

        def followed() -> list[tuple[int, str, str, str]]:
            return sorted(
                (s.data_parallel_rank, s.endpoint, s.replay_endpoint, s.engine_url)
                for s in ix.subscriber.sources()
            )

        wait_for(lambda: len(followed()) == 2)
        assert followed() == [
            (i, r.endpoint, r.replay_endpoint, url) for i, r in enumerate(ranks[:2])
        ]
        assert all(s.kind == "engine" and s.model == "m" for s in ix.subscriber.sources())

        def rank_gpu(h: int) -> dict[int, int]:
            for s in ix.score("m", np.array([h], dtype=np.uint64)):
                return {r.rank: r.gpu_blocks for r in s.ranks}
            return {}

        def publish_until_indexed(raw: RawPublisher, rank: int, h: int) -> None:
            payload = raw.enc.encode(
                KVEventBatch(time.time(), [stored(h, medium="GPU")], data_parallel_rank=rank)
            )
            raw.send(0, payload, publish=False)
            deadline = time.monotonic() + 10
            while rank_gpu(h).get(rank) != 1:  # PUB drops what it sends before the SUB joins
                assert time.monotonic() < deadline, f"rank {rank} stream never connected"
                raw.pub.send_multipart((b"", (0).to_bytes(8, "big"), payload))
                time.sleep(0.05)

        publish_until_indexed(ranks[1], 1, 61)
        # rank 1's engine restarted on other ports: the listing says so
        answer[0] = (200, listing(ranks[0], ranks[2]))
        # a moved rank is removed, then added at its new endpoint: in between, one
        # source is followed
        wait_for(lambda: [e for _, e, _, _ in followed()] == [ranks[0].endpoint, ranks[2].endpoint])
        wait_for(lambda: rank_gpu(61).get(1, 0) == 0)  # the old stream's entries are gone
        publish_until_indexed(ranks[2], 1, 62)
        # a listing that cannot be followed keeps what is followed
        answer[0] = (200, b"[]")
        before = reads[0]
        wait_for(lambda: reads[0] >= before + 2)
        assert len(followed()) == 2
    finally:
        http.shutdown()
        http.server_close()
        for r in ranks:
            r.close()


def test_vllm_servers_on_the_command_line_and_their_errors():
    import argparse

    from kvstore.indexer.cli import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(
        p.parse_args(
            [
                "--vllm-server",
                "node=a,url=http://10.0.0.5:8000,model=M",
                "--vllm-server",
                "node=b,url=unix:/run/vllm.sock,model=M,host=10.0.0.6,per_rank=true",
            ]
        )
    )
    a, b = cfg.vllm_servers
    assert (a.node, a.url, a.model, a.connect_host(), a.per_rank) == (
        "a",
        "http://10.0.0.5:8000",
        "M",
        "10.0.0.5",
        None,
    )
    assert (b.url, b.connect_host(), b.per_rank) == ("unix:/run/vllm.sock", "10.0.0.6", True)
    for bad, why in (
        ("node=a,url=ftp://x,model=M", "http://host:port or unix:PATH"),
        ("node=a,url=http://h:1", "model"),
        ("node=a@b,url=http://h:1,model=M", "without '@'"),
        ("node=a,url=http://h:1,model=M,per_rank=maybe", "per_rank"),
        ("node=a,url=http://h:1,model=M,colour=red", "colour"),
        ("node=a,http://h:1", "key=value"),
    ):
        with pytest.raises(ConfigError, match=why):
            config_from_args(p.parse_args(["--vllm-server", bad]))
    with pytest.raises(ConfigError, match="listed twice"):
        config_from_args(p.parse_args(["--vllm-server", "node=a,url=http://h:1,model=M"] * 2))
