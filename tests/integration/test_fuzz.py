"""Fuzzing every external input of a real daemon and a real indexer (issue 13).

Hypothesis drives arbitrary bytes and arbitrary valid-but-absurd messages into
the store gRPC API, the peer service, the lean local channel, the indexer's
gRPC API and its KV event ingestion. One daemon and one indexer serve a whole
module (starting one per example would cost the run). Properties, for each
input: a precise status (never UNKNOWN or INTERNAL, never a hang), and after
the module's fuzzing: the daemon still answers Hello, nothing leaked (no lease,
no pinned block once the short lease TTL passed), no traceback in its log.

Reproducible in CI: ``derandomize=True`` (the same examples every run, no
example database), ``deadline=None`` (a shared 2-core runner is slow, not
wrong); ~200 examples a test keep each test to seconds. A longer hunt:
``FUZZ_EXAMPLES=5000`` (random examples, not the CI ones).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import grpc
import msgspec
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvstore import local_wire
from kvstore.client import Client
from kvstore.events.publisher import ZmqEventPublisher
from kvstore.events.wire import make_topic
from kvstore.indexer.config import IndexerConfig
from kvstore.indexer.service import Indexer, serve
from kvstore.indexer.subscriber import SourceSpec
from kvstore.process import DaemonProcess
from kvstore.v1 import indexer_pb2, peer_pb2, store_pb2, store_pb2_grpc
from tests.conftest import make_spec
from tests.integration.test_indexer_events import RawPublisher

SECRET = "fuzz-secret"
# FUZZ_EXAMPLES=5000: a longer hunt, with new random examples each run.
_HUNT = int(os.environ.get("FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=_HUNT or 200,
    deadline=None,
    derandomize=not _HUNT,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# What a bad input may get: each names what is wrong. UNKNOWN / INTERNAL (an
# unhandled exception) and DEADLINE_EXCEEDED (a hang) never.
PRECISE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.ABORTED,
}
CALL_TIMEOUT_S = 10.0
LEASE_TTL_S = 1.0


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(
        tmp_path_factory.mktemp("fuzz") / "d",
        name="fuzz",
        dram_bytes=16 << 20,
        chunk_bytes=1 << 20,
        settings={
            "peer.enabled": "true",
            "peer.secret": SECRET,
            "peer.transport": "grpc_stream",
            # Fuzzed calls that do take a lease (a declared namespace) must not
            # outlive the module: short TTLs, so "nothing leaked" is checkable.
            "leases.default_ttl_s": LEASE_TTL_S,
            "leases.max_ttl_s": LEASE_TTL_S,
            "leases.quarantine_s": 0.5,
        },
    )
    d.start()
    try:
        yield d
    finally:
        d.stop()
        d.remove_region()


@pytest.fixture(scope="module")
def namespace_id(node) -> str:
    """A real namespace, so fuzzed calls also reach past the namespace check."""
    with Client(node.address) as c:
        return str(c.declare_namespace(make_spec(4096, model="fuzz")).namespace_id)


def assert_daemon_fine(node: DaemonProcess) -> None:
    with grpc.insecure_channel(node.address) as ch:
        hello = store_pb2_grpc.StoreServiceStub(ch).Hello(store_pb2.HelloRequest(), timeout=5)
        assert hello.node_id == node.name
    with Client(node.address) as c:
        deadline = time.monotonic() + 10 * LEASE_TTL_S + 5
        while True:  # bounded: the leases fuzzed calls took expire after LEASE_TTL_S
            s = c.stats()
            if s.active_leases == 0 and all(t.pinned_blocks == 0 for t in s.tiers):
                break
            assert time.monotonic() < deadline, f"leaked: {s.active_leases} leases, {s.tiers}"
            time.sleep(0.1)
    log = node.log_tail(200_000)
    assert "Traceback" not in log, log[-4000:]
    assert " ERROR " not in log and '"level": "error"' not in log, log[-4000:]


# ------------------------------------------------------------ message strategies

_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FieldDescriptor.TYPE_DOUBLE: st.floats(allow_nan=True, allow_infinity=True),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32, allow_nan=True, allow_infinity=True),
    FieldDescriptor.TYPE_INT32: st.integers(-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_SINT32: st.integers(-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_SFIXED32: st.integers(-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_INT64: st.integers(-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_SINT64: st.integers(-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_SFIXED64: st.integers(-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_UINT32: st.integers(0, (1 << 32) - 1),
    FieldDescriptor.TYPE_FIXED32: st.integers(0, (1 << 32) - 1),
    FieldDescriptor.TYPE_UINT64: st.integers(0, (1 << 64) - 1),
    FieldDescriptor.TYPE_FIXED64: st.integers(0, (1 << 64) - 1),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: st.text(max_size=80),
    FieldDescriptor.TYPE_ENUM: st.integers(-3, 40),  # open enums: unknown values too
}


def _bytes_field(name: str) -> st.SearchStrategy[bytes]:
    if "hash" in name or "offsets" in name or "checksums" in name:
        # packed uint64s: mostly well formed, absurd values, sometimes ragged
        words = st.lists(st.integers(0, (1 << 64) - 1), max_size=40)
        return st.one_of(
            words.map(lambda ws: struct.pack(f"<{len(ws)}Q", *ws)),
            st.binary(max_size=100),
        )
    return st.binary(max_size=200)


def message(desc: Descriptor, cls: Any, depth: int = 0, ns: str = "") -> st.SearchStrategy[Any]:
    """Any message of ``desc``: every field present or not, with any value of its type."""
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for f in desc.fields:
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            if depth >= 2 or f.message_type.GetOptions().map_entry:
                continue
            sub = message(f.message_type, None, depth + 1, ns)
        elif f.type == FieldDescriptor.TYPE_BYTES:
            sub = _bytes_field(f.name)
        elif f.name == "namespace_id" and ns:
            sub = st.one_of(st.just(ns), st.text(max_size=80))
        else:
            sub = _SCALARS[f.type]
        if f.is_repeated:
            sub = st.lists(sub, max_size=5)
        fields[f.name] = st.one_of(st.none(), sub)

    def build(values: dict[str, Any]) -> Any:
        from google.protobuf import message_factory

        msg_cls = cls or message_factory.GetMessageClass(desc)
        msg = msg_cls()
        for name, value in values.items():
            if value is None:
                continue
            f = desc.fields_by_name[name]
            target = getattr(msg, name)
            if f.is_repeated:
                if f.type == FieldDescriptor.TYPE_MESSAGE:
                    for v in value:
                        target.add().CopyFrom(v)
                else:
                    target.extend(value)
            elif f.type == FieldDescriptor.TYPE_MESSAGE:
                target.CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg

    return st.fixed_dictionaries(fields).map(build)


STORE_UNARY = [
    "Hello",
    "DeclareNamespace",
    "PrepareStore",
    "CommitStore",
    "Lookup",
    "PrepareLoad",
    "Release",
    "Delete",
    "Stats",
    "PutInline",
    "GetInline",
]
PEER_UNARY = ["GetAgentMetadata", "PinForPull", "ReleasePull"]


def _request_class(module: Any, method: str) -> Any:
    return getattr(module, f"{method}Request")


def call_unary(
    channel: grpc.Channel, path: str, body: bytes, metadata: tuple[tuple[str, str], ...] = ()
) -> grpc.StatusCode:
    fn = channel.unary_unary(path)
    try:
        fn(body, timeout=CALL_TIMEOUT_S, metadata=metadata)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def call_stream(
    channel: grpc.Channel, path: str, body: bytes, metadata: tuple[tuple[str, str], ...] = ()
) -> grpc.StatusCode:
    fn = channel.unary_stream(path)
    try:
        for _ in fn(body, timeout=CALL_TIMEOUT_S, metadata=metadata):
            pass
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def parses(cls: Any, body: bytes) -> bool:
    try:
        cls.FromString(body)
    except Exception:
        return False
    return True


# ------------------------------------------------------------ store gRPC API


@pytest.fixture(scope="module")
def unix_channel(node) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(node.address) as ch:
        yield ch


@FUZZ
@given(method=st.sampled_from(STORE_UNARY), body=st.binary(max_size=300))
def test_store_api_arbitrary_bytes(node, unix_channel, method, body):
    code = call_unary(unix_channel, f"/kvstore.v1.StoreService/{method}", body)
    event(f"{method}: {code.name}")
    assert code in PRECISE, (method, body, code)


@st.composite
def store_call(draw: st.DrawFn, ns: str) -> tuple[str, bytes]:
    method = draw(st.sampled_from(STORE_UNARY))
    cls = _request_class(store_pb2, method)
    return method, draw(message(cls.DESCRIPTOR, cls, ns=ns)).SerializeToString()


def test_store_api_absurd_messages(node, unix_channel, namespace_id):
    @FUZZ
    @given(call=store_call(namespace_id))
    def run(call: tuple[str, bytes]) -> None:
        method, body = call
        code = call_unary(unix_channel, f"/kvstore.v1.StoreService/{method}", body)
        event(f"{method}: {code.name}")  # --hypothesis-show-statistics: what was reached
        assert code in PRECISE, (method, body, code)

    run()
    assert_daemon_fine(node)


@st.composite
def tcp_store_call(draw: st.DrawFn, ns: str) -> tuple[str, bytes, bool]:
    method, body = draw(store_call(ns))
    if draw(st.booleans()):
        body = draw(st.binary(max_size=300))
    return method, body, draw(st.booleans())


def test_store_api_over_tcp_with_and_without_the_secret(node, tcp_channel, namespace_id):
    """The secret interceptor and the parse guard together: each bad input still
    gets a precise status, and without the secret no data call does anything."""

    @FUZZ
    @given(call=tcp_store_call(namespace_id))
    def run(call: tuple[str, bytes, bool]) -> None:
        method, body, with_secret = call
        md = (("x-kvstore-cluster-secret", SECRET),) if with_secret else ()
        code = call_unary(tcp_channel, f"/kvstore.v1.StoreService/{method}", body, md)
        event(f"{method}: {code.name}")
        assert code in PRECISE, (method, body, code)
        data_call = method not in ("Hello", "Stats")
        if not with_secret and data_call and parses(_request_class(store_pb2, method), body):
            assert code == grpc.StatusCode.PERMISSION_DENIED, (method, body, code)

    run()
    assert_daemon_fine(node)


# ------------------------------------------------------------ peer service


@pytest.fixture(scope="module")
def tcp_channel(node) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(node.tcp_address) as ch:
        yield ch


@st.composite
def peer_call(draw: st.DrawFn) -> tuple[str, bytes, bool]:
    method = draw(st.sampled_from([*PEER_UNARY, "StreamBlocks"]))
    cls = _request_class(peer_pb2, method)
    if draw(st.booleans()):
        body = draw(st.binary(max_size=300))
    else:
        body = draw(message(cls.DESCRIPTOR, cls)).SerializeToString()
    return method, body, draw(st.booleans())


def test_peer_service_arbitrary_input(node, tcp_channel):
    @FUZZ
    @given(call=peer_call())
    def run(call: tuple[str, bytes, bool]) -> None:
        method, body, with_secret = call
        md = (("x-kvstore-cluster-secret", SECRET),) if with_secret else ()
        path = f"/kvstore.v1.PeerService/{method}"
        do = call_stream if method == "StreamBlocks" else call_unary
        code = do(tcp_channel, path, body, md)
        event(f"{method}: {code.name}")  # --hypothesis-show-statistics: what was reached
        assert code in PRECISE, (method, body, code)
        if not with_secret and parses(_request_class(peer_pb2, method), body):
            # no secret: nothing but the refusal (one that does not parse is refused
            # by gRPC's deserializer first, INVALID_ARGUMENT, before any handler runs)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (method, body, code)

    run()
    assert_daemon_fine(node)


# ------------------------------------------------------------ lean local channel


def lean_connect(node: DaemonProcess) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(CALL_TIMEOUT_S)
    s.connect(node.socket_path + ".lean")
    return s


def read_frame(s: socket.socket) -> list[Any]:
    def exactly(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf

    (length,) = local_wire.HEADER.unpack(exactly(local_wire.HEADER.size))
    return list(local_wire.raw_decoder.decode(exactly(length)))


def lean_probe(s: socket.socket, seq: int) -> None:
    """The connection still answers, in order: a hello right after the fuzz."""
    s.sendall(local_wire.frame([local_wire.Hello(seq=seq, client_id="fuzz-probe")]))
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while time.monotonic() < deadline:
        for msg in read_frame(s):
            if msg[0] == "hello" and msg[1] == seq:
                return
            # earlier answers (the fuzz frame's) are errors with a known reason
            if msg[0] == "error":
                assert isinstance(msg[2], str) and msg[2], msg
    raise AssertionError("no hello answer")


def _nested(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(values, max_size=6)


_LEAN_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40),
    _nested,
    max_leaves=20,
)


@st.composite
def lean_frame_body(draw: st.DrawFn, ns: str) -> bytes:
    kind = draw(st.integers(0, 2))
    if kind == 0:
        return draw(st.binary(max_size=300))
    if kind == 1:  # msgpack of anything
        return msgspec.msgpack.encode(draw(_LEAN_VALUES))
    # messages with a real tag and absurd fields
    msgs = draw(
        st.lists(
            st.tuples(
                st.sampled_from(local_wire.REQUEST_TAGS),
                st.integers(0, 1 << 40),
                st.lists(_LEAN_VALUES | st.just(ns), max_size=6),
            ).map(lambda t: [t[0], t[1], *t[2]]),
            min_size=1,
            max_size=4,
        )
    )
    return msgspec.msgpack.encode(msgs)


def test_lean_channel_arbitrary_frames(node, namespace_id):
    conn = lean_connect(node)
    conn.sendall(local_wire.frame([local_wire.Hello(seq=1, client_id="fuzz")]))
    assert read_frame(conn)[0][0] == "hello"
    seq = [1 << 50]

    @FUZZ
    @given(body=lean_frame_body(namespace_id), before_hello=st.booleans())
    def run(body: bytes, before_hello: bool) -> None:
        nonlocal conn
        if before_hello:  # a fresh connection: the fuzz frame comes before any hello
            conn.close()
            conn = lean_connect(node)
        conn.sendall(local_wire.HEADER.pack(len(body)) + body)
        seq[0] += 1
        try:
            lean_probe(conn, seq[0])
        except ConnectionError:
            # the daemon may close a connection it refused a frame on: never the daemon
            conn.close()
            conn = lean_connect(node)
            lean_probe(conn, seq[0])

    try:
        run()
    finally:
        conn.close()
    assert_daemon_fine(node)


# ------------------------------------------------------------ indexer


@pytest.fixture(scope="module")
def indexer() -> Iterator[tuple[Indexer, RawPublisher, ZmqEventPublisher, grpc.Channel]]:
    raw = RawPublisher(topic=make_topic("fuzz-raw", "m").encode())
    good = ZmqEventPublisher("fuzz-good", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    ix = Indexer(
        IndexerConfig(
            address="127.0.0.1:0",
            sources=[
                SourceSpec(node="fuzz-raw", endpoint=raw.endpoint),
                SourceSpec(
                    node="fuzz-good", endpoint=good.endpoint, replay_endpoint=good.replay_endpoint
                ),
            ],
            cluster_secret=SECRET,
        )
    )
    ix.start()
    server, port = serve(ix, "127.0.0.1:0")
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield ix, raw, good, ch
    finally:
        ch.close()
        server.stop(0)
        ix.close()
        good.close()
        raw.close()


INDEXER_UNARY = ["Score", "RegisterNode", "UnregisterNode", "ListNodes", "Models"]


@st.composite
def indexer_call(draw: st.DrawFn) -> tuple[str, bytes, bool]:
    method = draw(st.sampled_from(INDEXER_UNARY))
    cls = _request_class(indexer_pb2, method)
    if draw(st.booleans()):
        body = draw(st.binary(max_size=300))
    else:
        body = draw(message(cls.DESCRIPTOR, cls)).SerializeToString()
    return method, body, draw(st.booleans())


def assert_no_error_logged(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad[:5]]


def test_indexer_api_arbitrary_input(indexer, caplog):
    ix, _, _, ch = indexer

    @FUZZ
    @given(call=indexer_call())
    def run(call: tuple[str, bytes, bool]) -> None:
        method, body, with_secret = call
        md = (("x-kvstore-cluster-secret", SECRET),) if with_secret else ()
        code = call_unary(ch, f"/kvstore.v1.IndexerService/{method}", body, md)
        event(f"{method}: {code.name}")  # --hypothesis-show-statistics: what was reached
        assert code in PRECISE, (method, body, code)

    run()
    assert ix.healthy and ix.subscriber.alive
    assert_no_error_logged(caplog)


class _NS:
    namespace_id = "ns"
    model = "m"
    tenant = ""
    block_size_tokens = 16


def _score(ch: grpc.Channel, h: int) -> dict[str, int]:
    stub = ch.unary_unary(
        "/kvstore.v1.IndexerService/Score",
        request_serializer=indexer_pb2.ScoreRequest.SerializeToString,
        response_deserializer=indexer_pb2.ScoreResponse.FromString,
    )
    req = indexer_pb2.ScoreRequest(model="m", block_hashes=struct.pack("<Q", h))
    return {s.node: s.prefix_blocks for s in stub(req, timeout=5).scores}


def ingestion_goes_on(ix: Indexer, good: ZmqEventPublisher, ch: grpc.Channel, h: int) -> None:
    deadline = time.monotonic() + 20
    while _score(ch, h).get("fuzz-good") != 1:  # PUB/SUB join: republish until seen
        assert time.monotonic() < deadline, "a valid event is no longer ingested"
        good.blocks_stored(_NS(), [h], "CPU", None, None)
        time.sleep(0.05)
    assert ix.healthy and ix.subscriber.alive


def test_event_ingestion_arbitrary_payloads(indexer, caplog):
    ix, raw, good, ch = indexer
    ingestion_goes_on(ix, good, ch, 0xF00D)  # subscribed, before the fuzz
    before = ix.subscriber.stats.malformed
    deadline = time.monotonic() + 20
    while ix.subscriber.stats.malformed == before:  # the raw source joined too (PUB/SUB)
        assert time.monotonic() < deadline, "the fuzzing source never reached the indexer"
        raw.send(0, b"\xc1")  # 0xc1: never valid msgpack
        time.sleep(0.05)
    seq = [0]

    @FUZZ
    @given(
        payload=st.one_of(
            st.binary(max_size=300),
            _LEAN_VALUES.map(msgspec.msgpack.encode),
            st.builds(  # an event batch shape with absurd events
                lambda ts, evs: msgspec.msgpack.encode([ts, evs]),
                _LEAN_VALUES,
                st.lists(
                    st.tuples(
                        st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "x"]),
                        st.lists(_LEAN_VALUES, max_size=8),
                    ).map(lambda t: [t[0], *t[1]]),
                    max_size=4,
                ),
            ),
        ),
        odd_frames=st.booleans(),
    )
    def run(payload: bytes, odd_frames: bool) -> None:
        seq[0] += 1
        frames = None
        if odd_frames:  # a wrong frame count or a short sequence number
            frames = (raw.topic, payload) if seq[0] % 2 else (raw.topic, b"\x01", payload)
        raw.send(seq[0], payload, frames=frames)

    run()
    ingestion_goes_on(ix, good, ch, 0xBEEF)
    assert ix.subscriber.stats.malformed > 0  # the fuzz did reach the decoder
    assert_no_error_logged(caplog)
