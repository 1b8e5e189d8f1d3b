"""The lean channel's wire format across versions: HelloReply.ops is last and
defaulted, so a daemon and a client one version apart still agree."""

from __future__ import annotations

import msgspec

from kvstore import local_wire


class OldHelloReply(msgspec.Struct, array_like=True, frozen=True, tag="hello"):
    """HelloReply as it was before it named the optional ops."""

    seq: int
    node_id: str
    region_id: int
    max_frame_bytes: int


def test_hello_reply_ops_cross_versions():
    new = local_wire.HelloReply(1, "n", 7, 1024, ["fetch_from_peer"])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=OldHelloReply) == (
        OldHelloReply(1, "n", 7, 1024)
    )
    old = msgspec.msgpack.encode(OldHelloReply(1, "n", 7, 1024))
    assert msgspec.msgpack.decode(old, type=local_wire.HelloReply).ops == []  # -> gRPC


def test_fetch_from_peer_is_an_optional_op_with_the_grpc_fields():
    assert set(local_wire.OPTIONAL_OPS) <= set(local_wire.REQUEST_TAGS)
    m = local_wire.FetchFromPeer(3, "ns", b"\x01" * 8, peer_address="h:1", timeout_s=2.0)
    body = local_wire.request_encoder.encode([m])
    assert local_wire.request_decoder.decode(body) == [m]
    reply = local_wire.Fetched(3, 1, 1, 0, 0, "nixl", 0.1, 0.2, 0.3, 1)
    assert local_wire.reply_decoder.decode(msgspec.msgpack.encode([reply])) == [reply]
