"""Handed-over pins (HandOver, FetchFromPeer's ticket) between real daemons over
real NIXL: the owner pins before the puller asks, the puller reads at once, and a
ticket moves nothing its caller is not owed."""

from __future__ import annotations

import time

import grpc
import pytest

from kvstore.client import Client
from kvstore.errors import InvalidRequest, KVStoreError, PermissionDenied
from kvstore.v1 import peer_pb2, peer_pb2_grpc
from kvstore_bench.ports import free_port
from tests.conftest import make_spec
from tests.integration import test_nixl_peer
from tests.integration.test_nixl_peer import (
    assert_holds,
    blocks_for,
    denied,
    leases_and_used,
    metric_sum,
    no_leases_soon,
    peer_stats,
    put,
)

pytestmark = test_nixl_peer.pytestmark  # NIXL, in its daemons
peer_daemon = test_nixl_peer.peer_daemon  # the fixture: real daemons with peers on

BLOCK = 64 << 10
METRICS = {"metrics.address": "127.0.0.1:0"}


def serve_pins(d) -> float:  # type: ignore[no-untyped-def]
    return metric_sum(d, "kvstore_peer_serve_pins_total")


@pytest.mark.parametrize("local_channel", [True, False], ids=["lean", "grpc"])
def test_a_handed_over_pin_is_read_without_asking_the_owner_again(
    peer_daemon, local_channel: bool
) -> None:  # type: ignore[no-untyped-def]
    a = peer_daemon("node-a", extra=METRICS)
    b = peer_daemon("node-b", extra={**METRICS, "peer.peers.node-a": a.tcp_address})
    hashes = list(range(1, 9))
    ns_a = put(a, hashes, BLOCK)
    with (
        Client(a.address, local_channel=local_channel) as ca,
        Client(b.address, local_channel=local_channel) as cb,
    ):
        handed = ca.hand_over(ns_a, [*hashes, 99])  # 99: not on A, the prefix stops before
        assert handed.found_blocks == 8 and handed.ticket and handed.ttl_s == 30.0
        assert leases_and_used(a)[0] == 1  # the pin, held for a puller not known yet
        assert serve_pins(a) == 1
        ns_b = cb.declare_namespace(make_spec(BLOCK))
        # The ticket names its owner: no peer given, B resolves node-a from [peer] peers.
        r = cb.fetch_from_peer(ns_b, hashes, ticket=handed.ticket)
        assert (r.fetched_blocks, r.prefix_blocks, r.corrupt_blocks) == (8, 8, 0)
        assert r.pin_s == 0.0  # no PinForPull before the read
    assert_holds(b, hashes, BLOCK)
    assert serve_pins(a) == 1  # the hand-over's pin, and no other
    assert metric_sum(b, "kvstore_peer_handed_over_pulls_total") == 1
    assert peer_stats(b)["nixl"]["handed_over_pulls"] == 1
    assert no_leases_soon(a)  # B released the handed-over pin after its read
    assert leases_and_used(b)[0] == 0


def test_a_ticket_covers_only_what_the_puller_lacks(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    a = peer_daemon("node-a")
    b = peer_daemon("node-b")
    hashes = list(range(10, 20))
    ns_a = put(a, hashes, BLOCK)
    with Client(b.address) as cb:
        ns_b = cb.declare_namespace(make_spec(BLOCK))
        assert cb.put(ns_b, hashes[:4], blocks_for(hashes[:4], BLOCK)).stored == 4
        with Client(a.address) as ca:
            ticket = ca.hand_over(ns_a, hashes).ticket
        # Asked for fewer blocks than the ticket holds: the read stops there.
        r = cb.fetch_from_peer(ns_b, hashes[:7], peer_address=a.tcp_address, ticket=ticket)
        assert (r.local_blocks, r.fetched_blocks, r.prefix_blocks) == (4, 3, 7)
        assert cb.lookup(ns_b, hashes).prefix_blocks == 7
        # Asked from a block inside the ticket (the decode side asks from its first
        # missing block).
        with Client(a.address) as ca:
            ticket = ca.hand_over(ns_a, hashes[:9]).ticket
        r = cb.fetch_from_peer(ns_b, hashes[7:9], peer_address=a.tcp_address, ticket=ticket)
        assert (r.local_blocks, r.fetched_blocks, r.prefix_blocks) == (0, 2, 2)
        assert r.pin_s == 0
        assert cb.lookup(ns_b, hashes).prefix_blocks == 9
        with Client(a.address) as ca:
            ticket = ca.hand_over(ns_a, hashes[:3]).ticket
        # All of it here already: nothing read, the pin given back; and the ticket
        # ends before the wanted blocks do (A had not committed them all when it
        # made it): the rest by an ordinary pin.
        r = cb.fetch_from_peer(ns_b, hashes, peer_address=a.tcp_address, ticket=ticket)
        assert (r.fetched_blocks, r.prefix_blocks) == (1, 10) and r.pin_s > 0
    assert_holds(b, hashes, BLOCK)
    assert no_leases_soon(a) and leases_and_used(b)[0] == 0


def test_tickets_refuse_what_the_caller_is_not_owed(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    a = peer_daemon("node-a")
    b = peer_daemon("node-b", extra=METRICS)
    stranger = peer_daemon("node-x", secret="another-cluster")
    hashes = list(range(30, 36))
    ns_a = put(a, hashes, BLOCK)
    put(stranger, hashes, BLOCK)
    with Client(a.address) as ca, Client(stranger.address) as cx, Client(b.address) as cb:
        ticket = ca.hand_over(ns_a, hashes).ticket
        foreign = cx.hand_over(cx.declare_namespace(make_spec(BLOCK)), hashes).ticket
        ns_b = cb.declare_namespace(make_spec(BLOCK))
        other_tenant = cb.declare_namespace(make_spec(BLOCK, tenant="tenant-two"))

        def fetch(ns, ticket: bytes, hs=hashes):  # type: ignore[no-untyped-def]
            return cb.fetch_from_peer(ns, hs, peer_address=a.tcp_address, ticket=ticket)

        altered = bytearray(ticket)
        altered[len(altered) // 2] ^= 0x01
        # Each bad ticket gets its error and moves nothing.
        for bad_ns, bad, error, match in (
            (ns_b, bytes(altered), PermissionDenied, "not from this cluster"),
            (ns_b, foreign, PermissionDenied, "not from this cluster"),
            (other_tenant, ticket, PermissionDenied, "another namespace"),
            (ns_b, b"not a ticket at all", InvalidRequest, "not a pull ticket"),
        ):
            with pytest.raises(error, match=match):
                fetch(bad_ns, bad)
            assert cb.lookup(bad_ns, hashes).prefix_blocks == 0
        with pytest.raises(InvalidRequest, match="leave the ticket's run"):
            fetch(ns_b, ticket, hs=[*hashes[:2], 999, *hashes[3:]])
        with pytest.raises(InvalidRequest, match="do not start at a block of the ticket"):
            fetch(ns_b, ticket, hs=[999, *hashes])
        c = peer_daemon("node-c")  # of this cluster, but not the ticket's owner
        with pytest.raises(InvalidRequest, match="ticket is from node 'node-a'"):
            cb.fetch_from_peer(ns_b, hashes, peer_address=c.tcp_address, ticket=ticket)
        assert denied(b, "pull_ticket_refused") == 3
        # Nothing lost: the good ticket still serves its own namespace.
        assert fetch(ns_b, ticket).fetched_blocks == 6
        assert cb.lookup(other_tenant, hashes).prefix_blocks == 0
    assert_holds(b, hashes, BLOCK)
    assert leases_and_used(b)[0] == 0


def test_a_replayed_ticket_never_serves_bytes_that_changed(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    a = peer_daemon("node-a")
    b = peer_daemon("node-b")
    hashes = list(range(40, 44))
    ns_a = put(a, hashes, BLOCK)
    with Client(a.address) as ca, Client(b.address) as cb:
        ticket = ca.hand_over(ns_a, hashes).ticket
        ns_b = cb.declare_namespace(make_spec(BLOCK))
        assert (
            cb.fetch_from_peer(
                ns_b, hashes, ticket=ticket, peer_address=a.tcp_address
            ).fetched_blocks
            == 4
        )
        assert no_leases_soon(a)  # the pin is gone: the ticket's slots are A's again
        # A's slot of block 42 now holds other bytes (as a reused slot would).
        h = ca.prepare_load(ns_a, hashes)
        off = int(h.offsets[2])
        ca.region[off : off + BLOCK] ^= 0xFF
        ca.release(h)
        assert cb.delete(ns_b, hashes) == (4, 0)
        r = cb.fetch_from_peer(ns_b, hashes, ticket=ticket, peer_address=a.tcp_address)
        # The changed block fails the ticket's checksum: dropped, and the prefix stops there.
        assert (r.fetched_blocks, r.corrupt_blocks, r.prefix_blocks) == (3, 1, 2)
    assert_holds(b, hashes[:2], BLOCK)


def test_stale_tickets_fall_back_to_an_ordinary_pull(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    a = peer_daemon("node-a", port=port)
    b = peer_daemon("node-b")
    hashes = list(range(50, 54))
    ns_a = put(a, hashes, BLOCK)
    with Client(b.address) as cb:
        ns_b = cb.declare_namespace(make_spec(BLOCK))
        with Client(a.address) as ca:
            short = ca.hand_over(ns_a, hashes, ttl_s=0.5)
        assert short.ttl_s == 0.5
        time.sleep(0.6)
        r = cb.fetch_from_peer(ns_b, hashes, peer_address=a.tcp_address, ticket=short.ticket)
        assert (r.fetched_blocks, r.corrupt_blocks) == (4, 0) and r.pin_s > 0  # pinned anew
        assert cb.delete(ns_b, hashes) == (4, 0)
        with Client(a.address) as ca:
            old = ca.hand_over(ns_a, hashes).ticket
        assert a.stop() == 0
        # A new incarnation: the ticket's pin and offsets died with the old one.
        a2 = peer_daemon("node-a", port=port)
        with Client(a2.address) as ca:
            ns = ca.declare_namespace(make_spec(BLOCK))
            ca.put(ns, hashes, blocks_for(hashes, BLOCK))  # (a warm restart kept them)
            assert ca.lookup(ns, hashes).prefix_blocks == 4
        r = cb.fetch_from_peer(ns_b, hashes, peer_address=a2.tcp_address, ticket=old)
        assert (r.fetched_blocks, r.corrupt_blocks) == (4, 0) and r.pin_s > 0
    assert_holds(b, hashes, BLOCK)


def test_hand_over_bad_input_and_without_peers(peer_daemon, daemon_factory) -> None:  # type: ignore[no-untyped-def]
    a = peer_daemon("node-a")
    ns_a = put(a, [1, 2], BLOCK)
    with Client(a.address) as ca:
        with pytest.raises(InvalidRequest, match="ttl_s"):
            ca.hand_over(ns_a, [1, 2], ttl_s=1000)
        with pytest.raises(InvalidRequest, match="ttl_s"):
            ca.hand_over(ns_a, [1, 2], ttl_s=-1)
        nothing = ca.hand_over(ns_a, [7, 1])  # its first block absent: nothing pinned
        assert (nothing.found_blocks, nothing.ticket) == (0, b"")
        assert leases_and_used(a)[0] == 0
    with grpc.insecure_channel(a.address) as channel:
        stub = peer_pb2_grpc.PeerFetchServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.HandOver(
                peer_pb2.HandOverRequest(namespace_id="ns-nope", block_hashes=b"\x01" * 8),
                timeout=10,
            )
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as err:
            stub.HandOver(
                peer_pb2.HandOverRequest(namespace_id=ns_a.namespace_id, block_hashes=b"\x01" * 7),
                timeout=10,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    plain = daemon_factory()  # no peer.enabled: no hand-overs, and said so
    with Client(plain.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        assert "hand_over" not in (c.local.ops if c.local is not None else ())
        # As FetchFromPeer there: the gRPC service is not served at all.
        with pytest.raises(KVStoreError, match="UNIMPLEMENTED"):
            c.hand_over(ns, [1])
