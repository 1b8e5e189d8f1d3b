"""Peer-to-peer pulls between real daemons (`python -m kvstore serve`) over real NIXL.

Every daemon is a child process (NIXL never loads in the pytest process); the
test checks bytes through each daemon's shared-memory region with the client.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import msgspec
import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import (
    DeadlineExceeded,
    InvalidRequest,
    KVStoreError,
    StateConflict,
    Unavailable,
)
from kvstore.process import DaemonProcess
from kvstore.v1 import peer_pb2, peer_pb2_grpc, store_pb2
from kvstore_bench.ports import free_port
from tests.conftest import make_spec

HAVE_NIXL = (
    importlib.util.find_spec("nixl") is not None
    or importlib.util.find_spec("nixl_cu12") is not None
)
pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(not HAVE_NIXL, reason="NIXL (nixl-cu12) not installed"),
]

SECRET = "s3cret-for-tests"
NIXL_ENV = {"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}


def blocks_for(hashes, block_bytes):  # type: ignore[no-untyped-def]
    """Deterministic bytes per hash, so a mix-up between blocks shows."""
    return np.stack(
        [
            np.random.default_rng(int(h)).integers(0, 256, block_bytes, dtype=np.uint8)
            for h in hashes
        ]
    )


@pytest.fixture
def peer_daemon(tmp_path):  # type: ignore[no-untyped-def]
    started: list[DaemonProcess] = []

    def start(
        name: str,
        *,
        secret: str = SECRET,
        transport: str = "auto",
        env=None,  # type: ignore[no-untyped-def]
        dram_bytes: int = 64 << 20,
        port: int = 0,
        timeout_s: float = 3.0,
        extra: dict[str, str] | None = None,
    ) -> DaemonProcess:
        d = DaemonProcess(
            tmp_path / name,
            name=name,
            dram_bytes=dram_bytes,
            settings={
                "server.tcp_address": f"127.0.0.1:{port}",
                "peer.enabled": "true",
                "peer.secret": secret,
                "peer.transport": transport,
                "peer.transfer_timeout_s": timeout_s,
                **(extra or {}),
            },
            env={**NIXL_ENV, **(env or {})},
        )
        d.start()
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


def fetch(puller: DaemonProcess, ns_id: str, hashes, owner: DaemonProcess, timeout_s: float = 0.0):  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(puller.address) as channel:
        stub = peer_pb2_grpc.PeerFetchServiceStub(channel)
        return stub.FetchFromPeer(
            peer_pb2.FetchFromPeerRequest(
                namespace_id=ns_id,
                block_hashes=np.asarray(list(hashes), dtype="<u8").tobytes(),
                peer_address=owner.tcp_address,
                timeout_s=timeout_s,
            ),
            timeout=30,
        )


def put(d: DaemonProcess, hashes, block_bytes: int):  # type: ignore[no-untyped-def]
    """Declare the test namespace on d and store blocks (none: only declare)."""
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(block_bytes))
        if len(hashes):
            assert c.put(ns, list(hashes), blocks_for(hashes, block_bytes)).stored == len(hashes)
        return ns


def assert_holds(d: DaemonProcess, hashes, block_bytes: int) -> None:  # type: ignore[no-untyped-def]
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(block_bytes))
        got = c.get(ns, list(hashes))
        assert got.found == len(hashes)
        np.testing.assert_array_equal(got.data, blocks_for(hashes, block_bytes))


def no_leases_soon(d: DaemonProcess, within_s: float = 5.0) -> bool:
    """True once d holds no lease; pins are released asynchronously after a pull, and
    within_s is under the pin's TTL (the pull's timeout + 5 s, at least 7 s here),
    so this sees a release, not an expiry."""
    deadline = time.monotonic() + within_s
    while leases_and_used(d)[0]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def leases_and_used(d: DaemonProcess) -> tuple[int, int]:
    with Client(d.address) as c:
        s = c.stats()
        return s.active_leases, s.tiers[0].used_bytes


@pytest.mark.parametrize("tls", ["default", "tcp"])
def test_two_daemons_pull_bytes_exactly(peer_daemon, tls: str) -> None:  # type: ignore[no-untyped-def]
    env = {} if tls == "default" else {"UCX_TLS": "tcp"}
    a, b = peer_daemon("node-a", env=env), peer_daemon("node-b", env=env)
    block = 64 << 10
    hashes = list(range(100, 164))
    put(a, hashes, block)
    ns_b = put(b, [], block)
    reply = fetch(b, ns_b.namespace_id, hashes, a)
    assert (reply.fetched_blocks, reply.prefix_blocks, reply.transport) == (64, 64, "nixl")
    assert_holds(b, hashes, block)
    # A's pin was released, not left to expire.
    assert no_leases_soon(a)
    # Already here: nothing moves again; a longer run pulls only what is missing.
    again = fetch(b, ns_b.namespace_id, hashes, a)
    assert (again.fetched_blocks, again.local_blocks, again.prefix_blocks) == (0, 64, 64)
    put(a, list(range(164, 170)), block)
    more = fetch(b, ns_b.namespace_id, list(range(100, 170)), a)
    assert (more.fetched_blocks, more.local_blocks, more.prefix_blocks) == (6, 64, 70)
    assert_holds(b, list(range(100, 170)), block)


def test_three_daemons_pull_from_each_other(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    a, b, c = peer_daemon("node-a"), peer_daemon("node-b"), peer_daemon("node-c")
    block = 256 << 10
    first, tail = list(range(1, 41)), list(range(41, 49))
    ns = put(a, first, block)
    put(b, [], block)
    put(c, [], block)
    # B and C pull from A at the same time.
    replies: dict[str, object] = {}
    threads = [
        threading.Thread(
            target=lambda d=d: replies.__setitem__(d.name, fetch(d, ns.namespace_id, first, a))
        )
        for d in (b, c)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(r.fetched_blocks == 40 for r in replies.values()), replies  # type: ignore[attr-defined]
    assert_holds(b, first, block)
    assert_holds(c, first, block)
    # C adds a tail; A pulls the whole run from C and gets only the tail; B gets it from A.
    with Client(c.address) as cc:
        cns = cc.declare_namespace(make_spec(block))
        cc.put(cns, tail, blocks_for(tail, block))
    r = fetch(a, ns.namespace_id, first + tail, c)
    assert (r.fetched_blocks, r.local_blocks, r.prefix_blocks) == (8, 40, 48)
    r = fetch(b, ns.namespace_id, first + tail, a)
    assert (r.fetched_blocks, r.prefix_blocks) == (8, 48)
    for d in (a, b, c):
        assert_holds(d, first + tail, block)
        assert no_leases_soon(d)


def test_owner_killed_mid_transfer_fails_fast_then_restart_recovers(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    # Over UCX_TLS=tcp the owner's progress thread must answer every READ, so a
    # stopped owner holds the transfer open: the kill lands mid-transfer for sure.
    env = {"UCX_TLS": "tcp"}
    port = free_port()
    a = peer_daemon("node-a", env=env, dram_bytes=160 << 20, port=port)
    b = peer_daemon("node-b", env=env, dram_bytes=160 << 20, timeout_s=2.0)
    block = 2 << 20
    hashes = list(range(1000, 1064))  # 128 MiB
    put(a, hashes, block)
    ns_b = put(b, [], block)
    _, used_before = leases_and_used(b)

    outcome: dict[str, object] = {}

    def run() -> None:
        started = time.monotonic()
        try:
            outcome["reply"] = fetch(b, ns_b.namespace_id, hashes, a)
        except grpc.RpcError as exc:
            outcome["code"] = exc.code()
        outcome["elapsed_s"] = time.monotonic() - started

    with Client(a.address) as ca:
        t = threading.Thread(target=run)
        t.start()
        # Stop A the moment its pin exists (B is about to read or reading).
        deadline = time.monotonic() + 20
        while ca.stats().active_leases == 0 and time.monotonic() < deadline and t.is_alive():
            time.sleep(0.0005)
    os.kill(a.pid, signal.SIGSTOP)
    still_running = t.is_alive()
    time.sleep(0.3)
    killed_at = time.monotonic()
    a.kill()
    t.join(timeout=30)
    assert not t.is_alive()
    if not still_running or "reply" in outcome:  # (done, but not yet returned)
        pytest.skip("the pull finished before the owner could be stopped (machine too fast)")
    assert outcome.get("code") in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    ), outcome
    # Bounded: within the 2 s transfer timeout of the kill (plus scheduling slack).
    assert time.monotonic() - killed_at < 2.0 + 3.0
    # B freed its prepared slots and kept serving.
    assert leases_and_used(b) == (0, used_before)
    with Client(b.address) as cb:
        nsb = cb.declare_namespace(make_spec(block))
        assert cb.lookup(nsb, hashes).prefix_blocks == 0
        assert cb.put(nsb, [7], blocks_for([7], block)).stored == 1

    # A restarts on the same address, as a new incarnation with a new region.
    a2 = peer_daemon("node-a", env=env, dram_bytes=160 << 20, port=port)
    put(a2, hashes[:8], block)
    r = fetch(b, ns_b.namespace_id, hashes[:8], a2)
    assert (r.fetched_blocks, r.prefix_blocks) == (8, 8)
    assert_holds(b, hashes[:8], block)


def test_owner_restart_between_pulls_refetches_metadata(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    a = peer_daemon("node-a", port=port)
    b = peer_daemon("node-b")
    block = 64 << 10
    ns_b = put(b, [], block)
    put(a, [1, 2, 3], block)
    assert fetch(b, ns_b.namespace_id, [1, 2, 3], a).fetched_blocks == 3
    assert a.stop() == 0  # clean drain; the daemon exits 0 despite NIXL
    a2 = peer_daemon("node-a", port=port)
    put(a2, [4, 5], block)
    # B still caches the old incarnation for this address: the pin reply tells it otherwise.
    r = fetch(b, ns_b.namespace_id, [1, 2, 3, 4, 5], a2)
    assert (r.local_blocks, r.fetched_blocks, r.prefix_blocks) == (3, 2, 5)
    assert_holds(b, [1, 2, 3, 4, 5], block)


def test_blocks_evicted_on_owner_give_a_clean_partial_result(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    a, b = peer_daemon("node-a"), peer_daemon("node-b")
    block = 64 << 10
    hashes = list(range(500, 520))
    put(a, hashes, block)
    ns_b = put(b, [], block)
    with Client(a.address) as ca:
        ns_a = ca.declare_namespace(make_spec(block))
        assert ca.lookup(ns_a, hashes).prefix_blocks == 20  # what an indexer/router saw
        assert ca.delete(ns_a, hashes[12:15])[0] == 3  # then gone before the pull
    r = fetch(b, ns_b.namespace_id, hashes, a)
    assert (r.fetched_blocks, r.prefix_blocks, r.corrupt_blocks) == (12, 12, 0)
    assert_holds(b, hashes[:12], block)
    with Client(b.address) as cb:
        nsb = cb.declare_namespace(make_spec(block))
        assert cb.lookup(nsb, hashes).prefix_blocks == 12
    assert no_leases_soon(a) and no_leases_soon(b)
    assert leases_and_used(b)[1] == 12 * block  # slots for A's 12, none more
    # Blocks A does not hold at all: nothing pulled, nothing held on B.
    r = fetch(b, ns_b.namespace_id, [800, 801, 802], a)
    assert (r.fetched_blocks, r.prefix_blocks) == (0, 0)
    assert leases_and_used(b) == (0, 12 * block)


def test_an_owner_that_never_answers_the_pin_costs_the_puller_nothing(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    """A stopped owner (SIGSTOP, its pin channel open and its metadata cached):
    the pull fails DEADLINE_EXCEEDED within the pin's 2 s bound, B holds no lease
    and no slot for it, and once the owner runs again the next pull (on a fresh
    channel) moves the bytes."""
    a, b = peer_daemon("node-a"), peer_daemon("node-b")
    block = 64 << 10
    hashes = list(range(600, 620))
    put(a, hashes, block)
    ns_b = put(b, [], block)
    assert fetch(b, ns_b.namespace_id, hashes[:2], a).fetched_blocks == 2  # A known, channel open
    leases_before, used_before = leases_and_used(b)
    assert leases_before == 0
    os.kill(a.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            fetch(b, ns_b.namespace_id, hashes, a)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 2.0 + 3.0
        assert leases_and_used(b) == (0, used_before)
    finally:
        os.kill(a.pid, signal.SIGCONT)
    r = fetch(b, ns_b.namespace_id, hashes, a)
    assert (r.fetched_blocks, r.prefix_blocks, r.corrupt_blocks) == (18, 20, 0)
    assert_holds(b, hashes, block)


def test_a_pull_that_cannot_reserve_releases_the_pin_it_sent(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    """When B has no room for the blocks A pinned (every slot held by a local
    reader), the caller gets RESOURCE_EXHAUSTED and A's pin is released at once,
    not left to its TTL."""
    a = peer_daemon("node-a")
    b = peer_daemon("node-b", dram_bytes=4 << 20)  # 64 slots of 64 KiB
    block = 64 << 10
    hashes = list(range(700, 708))
    put(a, hashes, block)
    own = list(range(9000, 9064))
    put(b, own, block)
    with Client(b.address) as cb:
        ns = cb.declare_namespace(make_spec(block))
        held = cb.prepare_load(ns, own)  # a reader holds every slot
        assert held.found == 64
        with pytest.raises(grpc.RpcError) as err:
            fetch(b, ns.namespace_id, hashes, a)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert no_leases_soon(a)  # released, well under the pin's 8 s TTL
        assert leases_and_used(b) == (1, 64 * block)  # the reader's lease alone
        cb.release(held)
    r = fetch(b, ns.namespace_id, hashes, a)  # room again (the coldest evicted)
    assert (r.fetched_blocks, r.prefix_blocks) == (8, 8)
    assert no_leases_soon(a) and no_leases_soon(b)


def test_wrong_secret_is_permission_denied(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    a = peer_daemon("node-a")
    b = peer_daemon("node-b", secret="not-the-cluster-secret")
    block = 4096
    put(a, [1, 2], block)
    ns_b = put(b, [], block)
    with pytest.raises(grpc.RpcError) as err:
        fetch(b, ns_b.namespace_id, [1, 2], a)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # A stranger without any secret gets nothing either, metadata included.
    with grpc.insecure_channel(a.tcp_address) as channel:
        stub = peer_pb2_grpc.PeerServiceStub(channel)
        for call, request, md in (
            (stub.GetAgentMetadata, peer_pb2.GetAgentMetadataRequest(), ()),
            (
                stub.GetAgentMetadata,
                peer_pb2.GetAgentMetadataRequest(),
                (("x-kvstore-cluster-secret", SECRET + "x"),),
            ),
            (stub.ReleasePull, peer_pb2.ReleasePullRequest(lease_ids=[1]), ()),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call(request, metadata=md, timeout=5)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        ok = stub.GetAgentMetadata(
            peer_pb2.GetAgentMetadataRequest(),
            metadata=(("x-kvstore-cluster-secret", SECRET),),
            timeout=5,
        )
        assert ok.node_id == "node-a" and ok.transport == "nixl" and ok.agent_metadata
    assert leases_and_used(a)[0] == 0
    assert leases_and_used(b)[0] == 0


@pytest.mark.parametrize("side", ["puller", "owner"])
def test_grpc_stream_fallback_moves_exact_bytes(peer_daemon, side: str) -> None:  # type: ignore[no-untyped-def]
    a = peer_daemon("node-a", transport="grpc_stream" if side == "owner" else "auto")
    b = peer_daemon("node-b", transport="grpc_stream" if side == "puller" else "auto")
    block = 96 << 10  # not a divisor of the 1 MiB stream chunk: blocks straddle chunks
    hashes = list(range(10, 50))
    put(a, hashes, block)
    ns_b = put(b, [], block)
    r = fetch(b, ns_b.namespace_id, hashes, a)
    assert (r.fetched_blocks, r.transport) == (40, "grpc_stream")
    assert_holds(b, hashes, block)
    assert no_leases_soon(a)
    # Counted under the transport the bytes took, on both sides.
    assert peer_stats(b)["grpc_stream"]["fetched_blocks"] == 40
    assert peer_stats(a)["grpc_stream"]["served_blocks"] == 40
    assert "fetched_blocks" not in peer_stats(b)["nixl"]
    fallback_log = (b if side == "puller" else a).log_path.read_text()
    assert "grpc_stream" in fallback_log


def test_stream_refuses_offsets_outside_the_pin(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    a = peer_daemon("node-a")
    block = 4096
    put(a, [1, 2, 3], block)
    md = (("x-kvstore-cluster-secret", SECRET),)
    with grpc.insecure_channel(a.tcp_address) as channel:
        stub = peer_pb2_grpc.PeerServiceStub(channel)
        from kvstore.v1 import store_pb2

        spec = make_spec(block)
        pin = stub.PinForPull(
            peer_pb2.PinForPullRequest(
                spec=store_pb2.NamespaceSpec(
                    **{f: getattr(spec, f) for f in spec.__struct_fields__}
                ),
                block_hashes=np.asarray([1, 2], dtype="<u8").tobytes(),
            ),
            metadata=md,
            timeout=5,
        )
        assert pin.found_blocks == 2 and pin.lease_id
        offsets = np.frombuffer(pin.offsets, dtype="<u8")
        bad = np.asarray([offsets[0], offsets[0] + block * 100], dtype="<u8").tobytes()
        with pytest.raises(grpc.RpcError) as err:
            list(
                stub.StreamBlocks(
                    peer_pb2.StreamBlocksRequest(lease_id=pin.lease_id, offsets=bad),
                    metadata=md,
                    timeout=5,
                )
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            list(
                stub.StreamBlocks(
                    peer_pb2.StreamBlocksRequest(lease_id=999999, offsets=bad),
                    metadata=md,
                    timeout=5,
                )
            )
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        good = b"".join(
            c.data
            for c in stub.StreamBlocks(
                peer_pb2.StreamBlocksRequest(lease_id=pin.lease_id, offsets=pin.offsets),
                metadata=md,
                timeout=5,
            )
        )
        assert good == blocks_for([1, 2], block).tobytes()
        # A peer can only release the pins it was given.
        assert (
            stub.ReleasePull(
                peer_pb2.ReleasePullRequest(lease_ids=[pin.lease_id, 12345]), metadata=md
            ).released
            == 1
        )
    assert leases_and_used(a)[0] == 0


def test_peer_pins_and_local_leases_never_release_each_other(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    """Peer pins are ordinary load leases with their own owner: a peer's ReleasePull
    cannot end a local client's lease, and a local client's Release cannot end a
    peer's pin (each is answered as for an id never issued)."""
    a = peer_daemon("node-a")
    block = 4096
    ns = put(a, [1, 2, 3], block)
    md = (("x-kvstore-cluster-secret", SECRET),)
    from kvstore.errors import LeaseNotFound
    from kvstore.v1 import store_pb2

    spec = make_spec(block)
    with Client(a.address) as c, grpc.insecure_channel(a.tcp_address) as channel:
        stub = peer_pb2_grpc.PeerServiceStub(channel)
        local = c.prepare_load(ns, [1, 2, 3])
        assert local.found == 3
        pin = stub.PinForPull(
            peer_pb2.PinForPullRequest(
                spec=store_pb2.NamespaceSpec(
                    **{f: getattr(spec, f) for f in spec.__struct_fields__}
                ),
                block_hashes=np.asarray([1, 2], dtype="<u8").tobytes(),
            ),
            metadata=md,
            timeout=5,
        )
        assert pin.found_blocks == 2 and pin.lease_id
        assert leases_and_used(a)[0] == 2
        # The peer names the local lease: nothing is released.
        released = stub.ReleasePull(
            peer_pb2.ReleasePullRequest(lease_ids=[local.lease_id]), metadata=md, timeout=5
        ).released
        assert released == 0 and leases_and_used(a)[0] == 2
        # The local client names the peer's pin: not found, and the pin still streams.
        with pytest.raises(LeaseNotFound):
            c.release(pin.lease_id)
        data = b"".join(
            chunk.data
            for chunk in stub.StreamBlocks(
                peer_pb2.StreamBlocksRequest(lease_id=pin.lease_id, offsets=pin.offsets),
                metadata=md,
                timeout=5,
            )
        )
        assert data == blocks_for([1, 2], block).tobytes()
        # Each ends its own.
        c.release(local)
        released = stub.ReleasePull(
            peer_pb2.ReleasePullRequest(lease_ids=[pin.lease_id]), metadata=md, timeout=5
        ).released
        assert released == 1
    assert leases_and_used(a)[0] == 0


def test_bad_fetch_requests_get_precise_errors(peer_daemon, tmp_path) -> None:  # type: ignore[no-untyped-def]
    a = peer_daemon("node-a")
    b = DaemonProcess(
        tmp_path / "node-b",
        name="node-b",
        settings={
            "peer.enabled": "true",
            "peer.secret": SECRET,
            "peer.transfer_timeout_s": 2,
            "peer.peers.node-a": a.tcp_address,
            "peer.peers.node-gone": f"127.0.0.1:{free_port()}",
        },
        env=NIXL_ENV,
    ).start()
    try:
        block = 4096
        put(a, [1, 2], block)
        ns_b = put(b, [], block)
        hashes = np.asarray([1, 2], dtype="<u8").tobytes()

        def call(**kw):  # type: ignore[no-untyped-def]
            with grpc.insecure_channel(b.address) as channel:
                stub = peer_pb2_grpc.PeerFetchServiceStub(channel)
                fields = {"namespace_id": ns_b.namespace_id, "block_hashes": hashes, **kw}
                return stub.FetchFromPeer(peer_pb2.FetchFromPeerRequest(**fields), timeout=30)

        # By node id, from [peer] peers.
        r = call(peer_node_id="node-a")
        assert (r.fetched_blocks, r.prefix_blocks) == (2, 2)
        for kw, code in (
            ({"peer_node_id": "node-unknown"}, grpc.StatusCode.INVALID_ARGUMENT),
            ({"peer_node_id": "node-a", "timeout_s": 1e6}, grpc.StatusCode.INVALID_ARGUMENT),
            (
                {"peer_node_id": "node-a", "block_hashes": b"\x01\x02\x03"},
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
            ({"peer_node_id": "node-a", "namespace_id": "ns-nope"}, grpc.StatusCode.NOT_FOUND),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call(**kw)
            assert err.value.code() == code, (kw, err.value)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            call(peer_node_id="node-gone", block_hashes=np.asarray([3], dtype="<u8").tobytes())
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert time.monotonic() - started < 10
        assert leases_and_used(b)[0] == 0
    finally:
        assert b.stop() == 0


def test_client_fetch_from_peer_by_node_id(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    a = peer_daemon("node-a")
    b = peer_daemon("node-b", extra={"peer.peers.node-a": a.tcp_address})
    block = 64 << 10
    put(a, [11, 12, 13], block)
    with Client(b.address) as cb:
        ns = cb.declare_namespace(make_spec(block))
        r = cb.fetch_from_peer(ns, [11, 12, 13, 14], peer_node_id="node-a")
        assert (r.fetched_blocks, r.prefix_blocks, r.corrupt_blocks) == (3, 3, 0)
        assert r.transport == "nixl"
    assert_holds(b, [11, 12, 13], block)


def test_lookup_and_prepare_load_fill_from_a_peer_hint(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    a = peer_daemon("node-a")
    b = peer_daemon("node-b", extra={"peer.peers.node-a": a.tcp_address})
    block = 64 << 10
    put(a, list(range(20, 30)), block)
    put(b, [20, 21], block)  # B already holds the head
    with Client(b.address) as cb:
        ns = cb.declare_namespace(make_spec(block))
        assert cb.lookup(ns, list(range(20, 26))).prefix_blocks == 2
        # by node id: B pulls 22..25 over NIXL before answering
        r = cb.lookup(ns, list(range(20, 26)), peer_hint="node-a")
        assert (r.prefix_blocks, r.by_tier) == (6, {"dram": 6})
        # by address, in the load itself
        h = cb.prepare_load(ns, list(range(20, 30)), peer_hint=a.tcp_address)
        assert h.found == 10
        cb.release(h)
    assert_holds(b, list(range(20, 30)), block)


def test_peer_hint_failures_leave_the_local_answer(peer_daemon, daemon_factory) -> None:  # type: ignore[no-untyped-def]
    b = peer_daemon("node-b")
    block = 4096
    put(b, [1, 2], block)
    with Client(b.address) as cb:
        ns = cb.declare_namespace(make_spec(block))
        dead = f"127.0.0.1:{free_port()}"
        t = time.monotonic()
        assert cb.lookup(ns, [1, 2, 3], peer_hint=dead, peer_timeout_s=1.0).prefix_blocks == 2
        assert time.monotonic() - t < 3.0  # bounded, and the answer is the local prefix
        with pytest.raises(InvalidRequest, match="unknown peer"):
            cb.lookup(ns, [1, 2, 3], peer_hint="no-such-node")
    # A hinted peer that refuses our secret (misconfigured): the local answer too.
    other = peer_daemon("node-other", secret="another-secret")
    put(other, [1, 2, 3], block)
    with Client(b.address) as cb:
        ns = cb.declare_namespace(make_spec(block))
        assert cb.lookup(ns, [1, 2, 3], peer_hint=other.tcp_address).prefix_blocks == 2
        h = cb.prepare_load(ns, [1, 2, 3], peer_hint=other.tcp_address)
        assert h.found == 2
        cb.release(h)
    plain = daemon_factory("plain")  # peer transfer off
    with Client(plain.address) as c:
        ns = c.declare_namespace(make_spec(block))
        with pytest.raises(StateConflict, match=r"peer\.enabled"):
            c.lookup(ns, [1], peer_hint="node-a")


def test_pull_of_blocks_the_owner_holds_in_its_gpu_tier(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    """Peers read the owner's registered DRAM region: GPU-tier blocks (host mode
    here) are moved down before they are served, and arrive intact."""
    pytest.importorskip("torch")
    block = 64 * 1024
    a = peer_daemon(
        "gpu-owner",
        extra={"gpu.device": "cpu", "gpu.capacity_bytes": "4MiB", "gpu.chunk_bytes": "4MiB"},
    )
    b = peer_daemon("gpu-puller")
    hashes = list(range(500, 516))
    with Client(a.address) as c:
        ns = c.declare_namespace(make_spec(block))
        assert c.put(ns, hashes, blocks_for(hashes, block), tier="gpu").stored == 16
        assert c.lookup(ns, hashes).by_tier == {"gpu": 16}
    put(b, [], block)
    r = fetch(b, ns.namespace_id, hashes, a)
    assert r.prefix_blocks == 16 and r.fetched_blocks == 16 and r.corrupt_blocks == 0
    assert_holds(b, hashes, block)
    with Client(a.address) as c:
        assert c.lookup(ns, hashes).by_tier == {"dram": 16}
    assert no_leases_soon(a)


def scrape(d: DaemonProcess) -> dict[tuple[str, str], float]:
    """(sample name, transport label) -> value of d's kvstore_peer_* samples on /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{d.metrics_address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, s.labels.get("transport", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("kvstore_peer_")
    }


def peer_stats(d: DaemonProcess) -> dict[str, dict[str, float]]:
    with Client(d.address, map_region=False) as c:
        return {
            p.transport: {f.name: v for f, v in p.ListFields() if f.name != "transport"}
            for p in c.stats().peer
        }


def test_pull_counters_on_both_daemons_metrics_and_stats(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    metrics = {"metrics.address": "127.0.0.1:0"}
    a, b = peer_daemon("node-a", extra=metrics), peer_daemon("node-b", extra=metrics)
    block = 64 << 10
    hashes = list(range(100, 164))
    ns_a = put(a, hashes, block)
    ns_b = put(b, [], block)
    assert fetch(b, ns_b.namespace_id, hashes, a).fetched_blocks == 64  # pull 1: 64 blocks
    # Pull 2 re-fetches the last 24 blocks after A's copy of block 140 went bad
    # (A hashed it at the first pin and serves that checksum): 23 land, 1 is dropped.
    with Client(b.address) as cb:
        assert cb.delete(ns_b, hashes[40:]) == (24, 0)
    with Client(a.address) as ca:
        h = ca.prepare_load(ns_a, hashes[:41])
        off = int(h.offsets[40])
        ca.region[off : off + block] ^= 0xFF
        ca.release(h)
    r = fetch(b, ns_b.namespace_id, hashes, a)
    assert (r.fetched_blocks, r.corrupt_blocks, r.prefix_blocks) == (23, 1, 40)
    # Pull 3 fails: nobody listens there.
    with pytest.raises(grpc.RpcError) as err, grpc.insecure_channel(b.address) as channel:
        peer_pb2_grpc.PeerFetchServiceStub(channel).FetchFromPeer(
            peer_pb2.FetchFromPeerRequest(
                namespace_id=ns_b.namespace_id,
                block_hashes=np.asarray(hashes, dtype="<u8").tobytes(),
                peer_address=f"127.0.0.1:{free_port()}",
            ),
            timeout=30,
        )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    pulled = {
        "pulls": 3,
        "pull_failures": 1,
        "fetched_blocks": 64 + 23,
        "fetched_bytes": (64 + 23) * block,
        "checksum_failed_blocks": 1,
    }
    served = {"serve_pins": 2, "served_blocks": 64 + 24, "served_bytes": (64 + 24) * block}
    sb, sa = peer_stats(b), peer_stats(a)
    assert sb["nixl"].pop("pull_s") > 0
    assert sb == {"nixl": pulled, "grpc_stream": {}}
    assert sa == {"nixl": served, "grpc_stream": {}}

    mb, ma = scrape(b), scrape(a)
    for name, value in pulled.items():
        metric = f"kvstore_peer_{name}_total"
        assert mb[(metric, "nixl")] == value, metric
        assert ma[(metric, "nixl")] == 0, metric
        assert mb[(metric, "grpc_stream")] == 0, metric
    for name, value in served.items():
        metric = f"kvstore_peer_{name}_total"
        assert ma[(metric, "nixl")] == value, metric
        assert mb[(metric, "nixl")] == 0, metric
    assert mb[("kvstore_peer_pull_duration_seconds_count", "nixl")] == 3
    assert ma[("kvstore_peer_serve_pin_duration_seconds_count", "nixl")] == 2
    assert mb[("kvstore_peer_serve_pin_duration_seconds_count", "nixl")] == 0
    # `kvstore status` shows them too.
    status = subprocess.run(
        [sys.executable, "-m", "kvstore", "status", "--address", b.address],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert "peer transfer over nixl:" in status, status
    assert "pulled 87 blocks (5.4 MiB) in 3 pulls, 1 failed, 1 bad checksums" in status, status


@pytest.mark.parametrize("transport", ["nixl", "grpc_stream"])
def test_pipelined_pull_drops_a_corrupt_block_in_a_middle_piece(
    peer_daemon, transport: str
) -> None:  # type: ignore[no-untyped-def]
    """A pull read in 16 pieces (each verified while later ones are read): a block
    that went bad on the owner, in piece 10 of 16, is caught and never served;
    every other block lands and is served byte-exact."""
    block = 64 << 10
    a = peer_daemon("node-a")
    b = peer_daemon("node-b", transport=transport, extra={"peer.pull_piece_bytes": str(4 * block)})
    hashes = list(range(300, 364))  # 64 blocks = 16 pieces of 4 blocks
    ns_a = put(a, hashes, block)
    ns_b = put(b, [], block)
    r = fetch(b, ns_b.namespace_id, hashes, a)
    assert (r.fetched_blocks, r.corrupt_blocks, r.pieces, r.transport) == (64, 0, 16, transport)
    # A hashed its blocks at that pin and serves those checksums: corrupt its
    # copy of block 38 (piece 9, counting from 0) and pull everything again.
    with Client(b.address) as cb:
        assert cb.delete(ns_b, hashes) == (64, 0)
    with Client(a.address) as ca:
        h = ca.prepare_load(ns_a, hashes[:39])
        off = int(h.offsets[38])
        ca.region[off + 1000 : off + 1008] ^= 0x5A
        ca.release(h)
    r = fetch(b, ns_b.namespace_id, hashes, a)
    assert (r.fetched_blocks, r.corrupt_blocks, r.prefix_blocks, r.pieces) == (63, 1, 38, 16)
    want = blocks_for(hashes, block)
    with Client(b.address) as cb:
        assert cb.lookup(ns_b, hashes).prefix_blocks == 38
        assert cb.get(ns_b, [hashes[38]]).found == 0  # the bad block is not served
        got = cb.get(ns_b, hashes[:38])
        assert got.found == 38 and np.array_equal(got.data, want[:38])
        after = cb.get(ns_b, hashes[39:])
        assert after.found == 25 and np.array_equal(after.data, want[39:])
    assert no_leases_soon(a) and no_leases_soon(b)


def test_fetch_from_peer_after_the_puller_restarted_declares_the_namespace_again(
    peer_daemon,
) -> None:  # type: ignore[no-untyped-def]
    """Found by `kvstore-bench soak`: after a restart of the pulling daemon, a
    client's fetch_from_peer raised NamespaceNotFound where every other call
    naming the namespace declares it again and goes on."""
    a = peer_daemon("node-a")
    b = peer_daemon("node-b", extra={"peer.peers.node-a": a.tcp_address})
    block = 64 << 10
    put(a, [21, 22], block)
    with Client(b.address) as cb:
        ns = cb.declare_namespace(make_spec(block))
        b.stop()  # the namespace goes with the process (no blocks: nothing kept warm)
        b.start()
        r = cb.fetch_from_peer(ns, [21, 22], peer_node_id="node-a")
        assert (r.fetched_blocks, r.prefix_blocks, r.corrupt_blocks) == (2, 2, 0)
    assert_holds(b, [21, 22], block)


def test_client_fetch_from_peer_rides_the_lean_channel(peer_daemon, daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A local client's FetchFromPeer goes over the lean channel (kvstore-bench p2p:
    the first byte then waits for one gRPC call, the owner's pin, not two), with
    the gRPC call's checks, errors and bounds; a pull that fails or times out
    leaves the channel and the leases as they were."""
    a = peer_daemon("node-a")
    b = peer_daemon(
        "node-b",
        timeout_s=2.0,
        extra={
            "peer.peers.node-a": a.tcp_address,
            "peer.peers.node-gone": f"127.0.0.1:{free_port()}",
        },
    )
    block = 64 << 10
    put(a, [31, 32, 33], block)
    with Client(b.address) as cb:
        ns = cb.declare_namespace(make_spec(block))
        assert cb.using_local_channel and cb.local is not None
        assert "fetch_from_peer" in cb.local.ops
        frames = cb.local.frames_sent
        r = cb.fetch_from_peer(ns, [31, 32, 33, 34], peer_node_id="node-a")
        assert cb.local.frames_sent == frames + 1  # asked over the lean channel, not gRPC
        assert (r.fetched_blocks, r.prefix_blocks, r.corrupt_blocks) == (3, 3, 0)
        assert r.transport == "nixl" and r.pin_s > 0
        r = cb.fetch_from_peer(ns, [31, 32], peer_node_id="node-a")  # all here already
        assert (r.fetched_blocks, r.local_blocks) == (0, 2)
        # Bad input: the exact classes the gRPC call raises, and the channel goes on.
        with pytest.raises(InvalidRequest, match="unknown peer 'node-unknown'"):
            cb.fetch_from_peer(ns, [35], peer_node_id="node-unknown")
        with pytest.raises(InvalidRequest, match="timeout_s must be >= 0"):
            cb.fetch_from_peer(ns, [35], peer_node_id="node-a", timeout_s=-1.0)
        with pytest.raises(InvalidRequest, match="timeout_s must be in"):
            cb.fetch_from_peer(ns, [35], peer_node_id="node-a", timeout_s=1e6)
        with pytest.raises(InvalidRequest, match="give its host:port"):
            cb.fetch_from_peer(ns, [35])
        started = time.monotonic()
        with pytest.raises((Unavailable, DeadlineExceeded)):
            cb.fetch_from_peer(ns, [35], peer_node_id="node-gone", timeout_s=1.0)
        assert time.monotonic() - started < 10
        assert cb.using_local_channel  # neither a refusal nor a slow peer broke it
        assert cb.lookup(ns, [31, 32, 33]).prefix_blocks == 3
    assert_holds(b, [31, 32, 33], block)
    assert leases_and_used(b)[0] == 0 and no_leases_soon(a)

    # A daemon without peers does not offer it: the call goes over gRPC, as before.
    plain = daemon_factory()
    with Client(plain.address) as c:
        assert c.using_local_channel and c.local is not None and c.local.ops == frozenset()
        ns = c.declare_namespace(make_spec(block))
        frames = c.local.frames_sent
        with pytest.raises(KVStoreError):
            c.fetch_from_peer(ns, [31], peer_address=a.tcp_address)
        assert c.local.frames_sent == frames


# ------------------------------------------------------------------ pin channel


def metric_sum(d: DaemonProcess, name: str, **labels: str) -> float:
    """The sum of d's ``name`` samples whose labels include ``labels``, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{d.metrics_address}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def rpc_calls(d: DaemonProcess, method: str) -> float:
    """gRPC calls of ``method`` (e.g. "PinForPull") d served, any status."""
    return metric_sum(d, "kvstore_rpc_requests_total", method=method)


def denied(d: DaemonProcess, reason: str) -> float:
    """d's kvstore_denied_requests_total for ``reason``."""
    return metric_sum(d, "kvstore_denied_requests_total", reason=reason)


def agent_metadata(d: DaemonProcess, secret: str = SECRET) -> peer_pb2.GetAgentMetadataResponse:
    with grpc.insecure_channel(d.tcp_address) as channel:
        return peer_pb2_grpc.PeerServiceStub(channel).GetAgentMetadata(
            peer_pb2.GetAgentMetadataRequest(),
            metadata=(("x-kvstore-cluster-secret", secret),),
            timeout=5,
        )


@pytest.mark.parametrize("pin_channel", ["true", "false"])
def test_pins_ride_the_pin_channel_unless_turned_off(peer_daemon, pin_channel: str) -> None:  # type: ignore[no-untyped-def]
    """With the pin channel on both sides a pull's pin and release are no gRPC call
    (counted all the same); turned off, the owner advertises no port and pins go
    over gRPC as before."""
    extra = {"metrics.address": "127.0.0.1:0", "peer.pin_channel": pin_channel}
    a, b = peer_daemon("node-a", extra=extra), peer_daemon("node-b", extra=extra)
    assert (agent_metadata(a).pin_port != 0) == (pin_channel == "true")
    block = 64 << 10
    hashes = list(range(1, 17))
    put(a, hashes, block)
    ns_b = put(b, [], block)
    for part in (hashes[:8], hashes):
        r = fetch(b, ns_b.namespace_id, part, a)
        assert (r.fetched_blocks, r.prefix_blocks, r.corrupt_blocks) == (8, len(part), 0)
    assert_holds(b, hashes, block)
    assert no_leases_soon(a)  # released, not left to expire, either way
    grpc_pins = 0 if pin_channel == "true" else 2
    assert rpc_calls(a, "PinForPull") == grpc_pins
    assert rpc_calls(a, "ReleasePull") == grpc_pins
    assert peer_stats(a)["nixl"]["serve_pins"] == 2
    assert scrape(a)[("kvstore_peer_serve_pin_duration_seconds_count", "nixl")] == 2


def test_stale_pin_channel_after_the_owner_restarts_never_serves_wrong_bytes(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    """B keeps a pin channel and A's agent metadata cached; A is killed -9 and comes
    back on the same address, as a new incarnation with a new region, pin port and
    agent, holding the same hashes at other offsets (and one under other bytes).
    B's next pull must learn all that and land exactly A's current bytes: nothing
    read with stale descriptors, nothing verified against stale checksums."""
    port = free_port()
    extra = {"metrics.address": "127.0.0.1:0"}
    a = peer_daemon("node-a", port=port, extra=extra)
    b = peer_daemon("node-b", extra=extra)
    block = 64 << 10
    hashes = list(range(700, 716))
    put(a, hashes, block)
    ns_b = put(b, [], block)
    old_port = agent_metadata(a).pin_port
    assert fetch(b, ns_b.namespace_id, hashes[:8], a).fetched_blocks == 8  # channel + cache warm
    a.kill()
    a2 = peer_daemon("node-a", port=port, extra=extra)
    assert a2.tcp_address == a.tcp_address
    # Filler first, so every block of the run sits elsewhere than it did on A.
    put(a2, list(range(9000, 9016)), block)
    other = np.random.default_rng(5).integers(0, 256, (1, block), dtype=np.uint8)
    with Client(a2.address) as c:
        ns2 = c.declare_namespace(make_spec(block))
        c.put(ns2, hashes[8:], blocks_for(hashes[8:], block))
        h = c.prepare_load(ns2, hashes[8:])
        new_offsets = list(h.offsets)
        c.release(h)
    assert agent_metadata(a2).incarnation != "" and agent_metadata(a2).pin_port != 0
    r = fetch(b, ns_b.namespace_id, hashes, a2)
    assert (r.local_blocks, r.fetched_blocks, r.prefix_blocks, r.corrupt_blocks) == (8, 8, 16, 0)
    assert_holds(b, hashes, block)
    assert rpc_calls(a2, "PinForPull") == 0  # the new A's pin channel, found anew
    # The blocks moved: the old A had them at other offsets (the filler took those).
    with Client(b.address) as cb:
        nsb = cb.declare_namespace(make_spec(block))
        assert cb.delete(nsb, hashes[8:]) == (8, 0)
    # A2 holds other bytes under one hash now (a block stored anew): B gets those.
    with Client(a2.address) as c:
        ns2 = c.declare_namespace(make_spec(block))
        assert c.delete(ns2, hashes[15:]) == (1, 0)
        assert c.put(ns2, hashes[15:], other).stored == 1
    r = fetch(b, ns_b.namespace_id, hashes, a2)
    assert (r.fetched_blocks, r.prefix_blocks, r.corrupt_blocks) == (8, 16, 0)
    with Client(b.address) as cb:
        nsb = cb.declare_namespace(make_spec(block))
        got = cb.get(nsb, hashes[8:])
        np.testing.assert_array_equal(got.data[:7], blocks_for(hashes[8:15], block))
        np.testing.assert_array_equal(got.data[7], other[0])
    assert old_port != 0 and new_offsets
    assert no_leases_soon(a2) and leases_and_used(b)[0] == 0


def _pin_socket(d: DaemonProcess, secret: str) -> tuple[socket.socket, bytes]:
    """A raw connection to d's pin channel after the handshake with ``secret``: the
    socket, and the first frame the owner sent back (its proof, or its refusal)."""
    port = agent_metadata(d).pin_port
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    hello = recv_exactly(sock, 6 + 32)
    assert hello[:6] == b"KVPIN1"
    nonce_c = os.urandom(32)
    mac = hmac.new(
        secret.encode(),
        b"kvstore-pin-channel-v1 client" + hello[6:] + nonce_c,
        hashlib.sha256,
    ).digest()
    sock.sendall(nonce_c + mac)
    return sock, read_frame(sock)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def read_frame(sock: socket.socket) -> bytes:
    size = int.from_bytes(recv_exactly(sock, 4), "little")
    return recv_exactly(sock, size)


def frame(op: int, seq: int, body: bytes) -> bytes:
    return (5 + len(body)).to_bytes(4, "little") + bytes([op]) + seq.to_bytes(4, "little") + body


def test_pin_channel_refuses_a_wrong_secret_and_bad_frames(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    a = peer_daemon("node-a", extra={"metrics.address": "127.0.0.1:0"})
    block = 4096
    put(a, [1, 2], block)
    # A wrong proof: refused (permission_denied), closed, nothing pinned.
    sock, answer = _pin_socket(a, SECRET + "x")
    assert answer[0] == 0xFF
    assert msgspec.msgpack.decode(answer[5:])[0] == "permission_denied"
    with pytest.raises(ConnectionError):
        sock.sendall(frame(1, 1, b""))
        read_frame(sock)
    sock.close()
    assert denied(a, "peer_wrong_secret") == 1  # audited like a wrong secret over gRPC
    # The right one: A proves the secret back, then bad input gets precise errors
    # and the connection goes on.
    sock, answer = _pin_socket(a, SECRET)
    assert answer[0] == 0x10 and len(answer) == 5 + 32
    spec = peer_pb2.PinForPullRequest(
        spec=store_pb2.NamespaceSpec(**msgspec.structs.asdict(make_spec(block))),
        block_hashes=np.asarray([1, 2], dtype="<u8").tobytes(),
        lease_ttl_s=5.0,
    )
    for op, body, reason, words in (
        (9, b"", "invalid_request", "unknown pin channel op 9"),
        (1, b"\xff\xff\xff", "invalid_request", "bad message"),
        (
            1,
            peer_pb2.PinForPullRequest().SerializeToString(),
            "invalid_request",
            "spec is required",
        ),
        (
            1,
            peer_pb2.PinForPullRequest(spec=spec.spec, lease_ttl_s=1e9).SerializeToString(),
            "invalid_request",
            "lease_ttl_s",
        ),
    ):
        sock.sendall(frame(op, 7, body))
        got = read_frame(sock)
        assert (got[0], int.from_bytes(got[1:5], "little")) == (0xFF, 7)
        reason_got, message = msgspec.msgpack.decode(got[5:])
        assert reason_got == reason and words in message, message
    sock.sendall(frame(1, 8, spec.SerializeToString()))
    got = read_frame(sock)
    assert got[0] == 0x81
    pinned = peer_pb2.PinForPullResponse.FromString(got[5:])
    assert pinned.found_blocks == 2 and pinned.lease_id
    assert leases_and_used(a)[0] == 1
    sock.sendall(
        frame(2, 9, peer_pb2.ReleasePullRequest(lease_ids=[pinned.lease_id]).SerializeToString())
    )
    got = read_frame(sock)
    assert got[0] == 0x82 and peer_pb2.ReleasePullResponse.FromString(got[5:]).released == 1
    assert leases_and_used(a)[0] == 0
    # A frame past the bound: the connection is closed, its bytes never read.
    sock.sendall((1 << 30).to_bytes(4, "little"))
    with pytest.raises(ConnectionError):
        read_frame(sock)
    sock.close()
    # A still serves pulls.
    b = peer_daemon("node-b")
    ns_b = put(b, [], block)
    assert fetch(b, ns_b.namespace_id, [1, 2], a).fetched_blocks == 2


def test_pin_channel_survives_arbitrary_frames(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    """Random ops and bodies after a good handshake: each gets an error or a
    well-formed answer, nothing stays pinned, and the owner keeps serving pulls."""
    a = peer_daemon("node-a")
    block = 4096
    put(a, [1, 2], block)
    rng = np.random.default_rng(12)
    sock, _ = _pin_socket(a, SECRET)
    for seq in range(1, 61):
        op = int(rng.choice([1, 2, 3, 0x81, 0xFF, int(rng.integers(0, 256))]))
        body = rng.integers(0, 256, int(rng.integers(0, 64)), dtype=np.uint8).tobytes()
        sock.sendall(frame(op, seq, body))
        got = read_frame(sock)
        assert int.from_bytes(got[1:5], "little") == seq
        if got[0] == 0xFF:
            reason, _message = msgspec.msgpack.decode(got[5:])
            assert reason == "invalid_request", reason
        elif got[0] == 0x81:  # random bytes that parse as a pin: no spec, so refused above
            raise AssertionError("a pin without a spec was granted")
        else:
            assert got[0] == 0x82  # a release of whatever ids parsed: nothing of ours
            peer_pb2.ReleasePullResponse.FromString(got[5:])
    sock.close()
    assert leases_and_used(a)[0] == 0
    b = peer_daemon("node-b")
    ns_b = put(b, [], block)
    assert fetch(b, ns_b.namespace_id, [1, 2], a).fetched_blocks == 2


def established_to(port: int) -> int:
    """TCP connections in ESTABLISHED state whose local port is ``port`` (IPv4, this host)."""
    count = 0
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            local, state = line.split()[1], line.split()[3]
            if int(local.rsplit(":", 1)[1], 16) == port and state == "01":
                count += 1
    return count


def test_concurrent_first_pulls_share_one_pin_channel_connection(peer_daemon) -> None:  # type: ignore[no-untyped-def]
    a, b = peer_daemon("node-a"), peer_daemon("node-b")
    block = 4096
    hashes = list(range(1, 33))
    put(a, hashes, block)
    ns_b = put(b, [], block)
    replies: list[object] = []
    threads = [
        threading.Thread(
            target=lambda part=part: replies.append(fetch(b, ns_b.namespace_id, part, a))
        )
        for part in (hashes[i : i + 8] for i in range(0, 32, 8))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(replies) == 4 and all(r.fetched_blocks == 8 for r in replies)  # type: ignore[attr-defined]
    assert_holds(b, hashes, block)
    # Every surplus connection is closed at once; what stays is B's one.
    deadline = time.monotonic() + 5
    port = agent_metadata(a).pin_port
    while established_to(port) != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert established_to(port) == 1
    assert no_leases_soon(a)
