"""The one error mapping, over real gRPC: every class survives the wire as itself.

A tiny servicer (generic handlers, no protos) on a temp Unix socket fails each
call with ``errors.abort`` (grpc.aio) or ``errors.abort_sync`` (thread pool, as
the indexer serves); the client side is ``errors.error_from_rpc``, the one
function every kvstore client maps failures with.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from kvstore import errors

SERVICE = "kvstore.test.Errors"
RAISE = f"/{SERVICE}/Raise"  # request: the reason to raise; message after a NUL
STREAM = f"/{SERVICE}/Stream"  # one chunk, then fail as Raise does
RAW = f"/{SERVICE}/Raw"  # request: a status name; abort with it and no reason
SILENT = f"/{SERVICE}/Silent"  # never answers (the client's deadline fires)
BOOM = f"/{SERVICE}/Boom"  # a non-kvstore exception: gRPC's own UNKNOWN


def all_classes() -> list[type[errors.KVStoreError]]:
    seen: list[type[errors.KVStoreError]] = []
    todo: list[type[errors.KVStoreError]] = [errors.KVStoreError]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    return seen


# A newer daemon's reason this version does not know: the status decides.
FUTURE_REASON = "some_reason_from_the_future"


def _error(request: bytes) -> errors.KVStoreError:
    reason, _, message = request.decode().partition("\0")
    if reason == FUTURE_REASON:
        exc = errors.CapacityExhausted(message)
        exc.reason = FUTURE_REASON  # type: ignore[misc]  # as a newer daemon would send
        return exc
    return errors.BY_REASON[reason](message)


def _request(cls_or_reason: type[errors.KVStoreError] | str, message: str = "") -> bytes:
    reason = cls_or_reason if isinstance(cls_or_reason, str) else cls_or_reason.reason
    return f"{reason}\0{message or f'a {reason} happened'}".encode()


async def _aio_raise(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    await errors.abort(context, _error(request))


async def _aio_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield b"first chunk"
    await errors.abort(context, _error(request))


async def _aio_raw(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    await context.abort(grpc.StatusCode[request.decode()], "an older daemon's error")
    raise AssertionError("unreachable")


async def _aio_silent(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    await asyncio.Event().wait()  # cancelled when the client's deadline passes
    raise AssertionError("unreachable")


async def _aio_boom(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    raise ValueError("not a kvstore error")


def _sync_raise(request: bytes, context: grpc.ServicerContext) -> bytes:
    errors.abort_sync(context, _error(request))


def _sync_stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    yield b"first chunk"
    errors.abort_sync(context, _error(request))


def _handler(unary: dict, stream: dict) -> grpc.GenericRpcHandler:
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(fn, lambda b: b, lambda b: b)
        for name, fn in unary.items()
    }
    handlers.update(
        {
            name: grpc.unary_stream_rpc_method_handler(fn, lambda b: b, lambda b: b)
            for name, fn in stream.items()
        }
    )
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


AIO_HANDLER = _handler(
    {"Raise": _aio_raise, "Raw": _aio_raw, "Silent": _aio_silent, "Boom": _aio_boom},
    {"Stream": _aio_stream},
)


@pytest.fixture
def aio_server(tmp_path: Path) -> Iterator[str]:
    """A grpc.aio server on a temp Unix socket, run on its own loop in a thread."""
    address = f"unix:{tmp_path / 'errors.sock'}"
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop: asyncio.Event | None = None

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((AIO_HANDLER,))
        server.add_insecure_port(address)
        await server.start()
        ready.set()
        await stop.wait()
        await server.stop(grace=None)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(10), "the test server did not start"
    try:
        yield address
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()


@pytest.fixture
def sync_server(tmp_path: Path) -> Iterator[str]:
    address = f"unix:{tmp_path / 'errors-sync.sock'}"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((_handler({"Raise": _sync_raise}, {"Stream": _sync_stream}),))
    server.add_insecure_port(address)
    server.start()
    try:
        yield address
    finally:
        server.stop(grace=None)


def _call(
    address: str, method: str, request: bytes, timeout_s: float = 10.0
) -> errors.KVStoreError:
    """The sync client's view: the call must fail; return its mapped error."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(method, lambda b: b, lambda b: b)
        with pytest.raises(grpc.RpcError) as info:
            call(request, timeout=timeout_s)
    return errors.error_from_rpc(info.value)


def _stream(address: str, request: bytes) -> tuple[list[bytes], errors.KVStoreError]:
    got: list[bytes] = []
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(STREAM, lambda b: b, lambda b: b)
        with pytest.raises(grpc.RpcError) as info:
            for chunk in call(request, timeout=10.0):
                got.append(chunk)
    return got, errors.error_from_rpc(info.value)


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("cls", all_classes(), ids=lambda c: c.__name__)
def test_round_trip_over_grpc_aio_rebuilds_the_class(aio_server, cls):
    err = _call(aio_server, RAISE, _request(cls, "why: 42"))
    assert type(err) is cls
    assert err.status_code is cls.status
    assert "why: 42" in str(err)


@pytest.mark.parametrize("cls", all_classes(), ids=lambda c: c.__name__)
def test_round_trip_over_a_thread_pool_server_rebuilds_the_class(sync_server, cls):
    err = _call(sync_server, RAISE, _request(cls))
    assert type(err) is cls
    assert err.status_code is cls.status


@pytest.mark.parametrize("server", ["aio_server", "sync_server"])
def test_a_stream_failing_after_a_chunk_keeps_the_class(request, server):
    got, err = _stream(request.getfixturevalue(server), _request(errors.LeaseExpired))
    assert got == [b"first chunk"]
    assert type(err) is errors.LeaseExpired


def test_an_aio_client_and_a_future_map_the_same(aio_server):
    async def aio() -> errors.KVStoreError:
        async with grpc.aio.insecure_channel(aio_server) as channel:
            call = channel.unary_unary(RAISE, lambda b: b, lambda b: b)
            with pytest.raises(grpc.RpcError) as info:
                await call(_request(errors.NamespaceNotFound), timeout=10.0)
        return errors.error_from_rpc(info.value)

    assert type(asyncio.run(aio())) is errors.NamespaceNotFound
    with grpc.insecure_channel(aio_server) as channel:
        future = channel.unary_unary(RAISE, lambda b: b, lambda b: b).future(
            _request(errors.BlockSizeMismatch), timeout=10.0
        )
        with pytest.raises(grpc.RpcError) as info:
            future.result()
    assert type(errors.error_from_rpc(info.value)) is errors.BlockSizeMismatch


# ------------------------------------------------------------------ message text


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        # each message is one the old text matching read as another class
        (errors.LeaseExpired, "unknown namespace, oddly worded"),
        (errors.NotFound, "lease expired? no: the thing is just not here"),
        (errors.BlockNotFound, "lease 7's block is gone"),
        (errors.InvalidRequest, "bytes of the spec need a model name"),
        (errors.LeaseExpired, ""),
    ],
)
def test_the_message_never_chooses_the_class(aio_server, cls, message):
    request = f"{cls.reason}\0{message}".encode()
    assert type(_call(aio_server, RAISE, request)) is cls


# ------------------------------------------------------------------ no reason


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        ("INVALID_ARGUMENT", errors.InvalidRequest),
        ("NOT_FOUND", errors.NotFound),
        ("FAILED_PRECONDITION", errors.StateConflict),
        ("RESOURCE_EXHAUSTED", errors.CapacityExhausted),
        ("PERMISSION_DENIED", errors.PermissionDenied),
        ("UNAVAILABLE", errors.Unavailable),
        ("DEADLINE_EXCEEDED", errors.DeadlineExceeded),
        ("DATA_LOSS", errors.DataCorruption),
        ("INTERNAL", errors.BackendError),
        ("ABORTED", errors.KVStoreError),  # no class is sent with it
    ],
)
def test_an_older_daemon_without_reasons_maps_by_status(aio_server, status, cls):
    err = _call(aio_server, RAW, status.encode())
    assert type(err) is cls
    assert err.status_code is grpc.StatusCode[status]


def test_a_reason_this_version_does_not_know_falls_back_to_the_status(aio_server):
    err = _call(aio_server, RAISE, _request(FUTURE_REASON))
    assert type(err) is errors.CapacityExhausted  # RESOURCE_EXHAUSTED, the status it came with


def test_grpcs_own_errors_map_by_status(aio_server, tmp_path):
    late = _call(aio_server, SILENT, b"", timeout_s=0.2)  # the server never answers
    assert type(late) is errors.DeadlineExceeded
    gone = _call(f"unix:{tmp_path / 'nobody-listens.sock'}", RAISE, b"", timeout_s=10.0)
    assert type(gone) is errors.Unavailable
    with grpc.insecure_channel(aio_server) as channel, pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(BOOM, lambda b: b, lambda b: b)(b"", timeout=10.0)
    assert info.value.code() is grpc.StatusCode.UNKNOWN
    assert type(errors.error_from_rpc(info.value)) is errors.KVStoreError
    # peers and the indexer client read an unclassified failure as "gone"
    odd = errors.error_from_rpc(info.value, "peer x", unclassified=errors.Unavailable)
    assert type(odd) is errors.Unavailable and str(odd).startswith("peer x: ")


# ------------------------------------------------------------------ the real servicers


def _reason_sent(exc: grpc.RpcError) -> str | None:
    return dict(exc.trailing_metadata() or ()).get(errors.REASON_METADATA_KEY)


def test_the_indexer_sends_capacity_as_resource_exhausted_with_its_reason():
    from kvstore.indexer.config import IndexerConfig
    from kvstore.indexer.service import Indexer, serve
    from kvstore.v1 import indexer_pb2, indexer_pb2_grpc

    ix = Indexer(IndexerConfig(address="127.0.0.1:0", sources=[], max_registered_sources=1))
    ix.start()
    server, port = serve(ix, "127.0.0.1:0")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = indexer_pb2_grpc.IndexerServiceStub(channel)

            def register(node: str) -> None:
                source = indexer_pb2.EventSource(node=node, endpoint="tcp://127.0.0.1:9")
                stub.RegisterNode(indexer_pb2.RegisterNodeRequest(source=source), timeout=10)

            register("r1")
            with pytest.raises(grpc.RpcError) as full:
                register("r2")
            with pytest.raises(grpc.RpcError) as unknown:
                stub.UnregisterNode(indexer_pb2.UnregisterNodeRequest(node="nobody"), timeout=10)
    finally:
        server.stop(0)
        ix.close()
    assert full.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _reason_sent(full.value) == "capacity_exhausted"
    assert type(errors.error_from_rpc(full.value)) is errors.CapacityExhausted
    assert unknown.value.code() is grpc.StatusCode.NOT_FOUND
    assert type(errors.error_from_rpc(unknown.value)) is errors.NotFound


def test_the_daemon_and_its_peer_service_send_reasons(daemon_factory):
    from kvstore.client import Client
    from kvstore.transfer.grpc_stream import error_from_rpc as peer_error
    from kvstore.v1 import peer_pb2, peer_pb2_grpc, store_pb2, store_pb2_grpc

    secret = "s3cret-for-tests"
    d = daemon_factory(
        "reasons",
        settings={
            "peer.enabled": "true",
            "peer.secret": secret,
            "peer.transport": "grpc_stream",  # no NIXL needed to fail calls
        },
    )
    md = (("x-kvstore-cluster-secret", secret),)
    with grpc.insecure_channel(d.tcp_address) as channel:
        peer = peer_pb2_grpc.PeerServiceStub(channel)
        cases = [  # (call, the class the client must rebuild from the reason sent)
            (
                lambda: peer.GetAgentMetadata(peer_pb2.GetAgentMetadataRequest(), timeout=10),
                errors.PermissionDenied,
            ),
            (
                lambda: peer.PinForPull(peer_pb2.PinForPullRequest(), metadata=md, timeout=10),
                errors.InvalidRequest,
            ),
            (
                lambda: next(
                    iter(
                        peer.StreamBlocks(
                            peer_pb2.StreamBlocksRequest(lease_id=12345), metadata=md, timeout=10
                        )
                    )
                ),
                errors.LeaseNotFound,
            ),
            (  # the TCP secret check in front of the store service
                lambda: store_pb2_grpc.StoreServiceStub(channel).Hello(
                    store_pb2.HelloRequest(), timeout=10
                ),
                errors.PermissionDenied,
            ),
        ]
        for call, cls in cases:
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert _reason_sent(info.value) == cls.reason, cls
            assert type(peer_error(info.value, "peer")) is cls
    with Client(d.address) as c, pytest.raises(errors.LeaseNotFound) as lease:
        c.release(987654)
    assert type(lease.value) is errors.LeaseNotFound
    assert lease.value.status_code is grpc.StatusCode.NOT_FOUND
