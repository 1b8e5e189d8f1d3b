"""Copy-aware eviction and replica admission between two real daemons
(docs/eviction.md): a pulled copy goes first (a replica before older local
blocks, until a second local load promotes it), and under a stale view the
lowest-id holder keeps the last copy.

Real `kvstore serve` processes on port 0 and temp dirs, pulling over the gRPC
stream transport (no NIXL needed); the view is made stale on purpose (the owner
deletes its copy after the pull taught the puller it holds one), not by timing.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from kvstore.client import Client
from kvstore.process import DaemonProcess
from kvstore.v1 import peer_pb2, peer_pb2_grpc
from tests.conftest import make_spec

SECRET = "s3cret-for-tests"
BLOCK = 64 << 10
SLOTS = 16  # DRAM of each daemon, in blocks


def blocks_for(hashes):  # type: ignore[no-untyped-def]
    return np.stack(
        [np.random.default_rng(int(h)).integers(0, 256, BLOCK, dtype=np.uint8) for h in hashes]
    )


@pytest.fixture
def daemon(tmp_path):  # type: ignore[no-untyped-def]
    started: list[DaemonProcess] = []

    def start(
        name: str, *, copy_aware: bool = True, learn: str = "pulled", admission: str = "full"
    ) -> DaemonProcess:
        d = DaemonProcess(
            tmp_path / name,
            name=name,
            dram_bytes=SLOTS * BLOCK,
            chunk_bytes=SLOTS * BLOCK,
            settings={
                "server.tcp_address": "127.0.0.1:0",
                "peer.enabled": "true",
                "peer.secret": SECRET,
                "peer.transport": "grpc_stream",
                "eviction.copy_aware": str(copy_aware).lower(),
                "eviction.copy_learn": learn,
                "eviction.copy_ttl_s": "600",  # longer than the test: the view stays stale
                "eviction.pulled_admission": admission,
            },
        )
        d.start()
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


def pull(puller: DaemonProcess, hashes, owner: DaemonProcess) -> int:  # type: ignore[no-untyped-def]
    with Client(puller.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
    with grpc.insecure_channel(puller.address) as channel:
        reply = peer_pb2_grpc.PeerFetchServiceStub(channel).FetchFromPeer(
            peer_pb2.FetchFromPeerRequest(
                namespace_id=ns.namespace_id,
                block_hashes=np.asarray(list(hashes), dtype="<u8").tobytes(),
                peer_address=owner.tcp_address,
            ),
            timeout=30,
        )
    pins_released(owner)
    return int(reply.fetched_blocks)


def pins_released(owner: DaemonProcess) -> None:
    """Wait until the owner's pins for a pull are gone: the puller releases them
    ~1 ms after the pull returns, off the reply's path (docs/peer-transfer.md),
    and a pinned block can be neither evicted nor freed (the tests' eviction
    pressure and deletes need them gone)."""
    deadline = time.monotonic() + 10.0  # far under the pin's TTL: a release, not an expiry
    with Client(owner.address) as c:
        while c.stats().active_leases:
            assert time.monotonic() < deadline, "the pull's pin was never released"
            time.sleep(0.01)


def put(d: DaemonProcess, hashes) -> None:  # type: ignore[no-untyped-def]
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        assert c.put(ns, list(hashes), blocks_for(hashes)).stored == len(hashes)


def delete(d: DaemonProcess, hashes) -> None:  # type: ignore[no-untyped-def]
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        assert c.delete(ns, list(hashes)) == (len(hashes), 0)  # none pinned: pull waited


def held(d: DaemonProcess, hashes) -> list[int]:  # type: ignore[no-untyped-def]
    """The hashes d still holds, bytes checked (touches them: call after evicting)."""
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        out = []
        for h in hashes:
            got = c.get(ns, [h])
            if got.found:
                np.testing.assert_array_equal(got.data, blocks_for([h]))
                out.append(h)
        return out


X = [1000, 1001, 1002, 1003]  # the block both nodes end up holding
FILL_A, FILL_B = list(range(100, 108)), list(range(200, 208))  # sole copies, colder than X
PRESSURE_A, PRESSURE_B = list(range(300, 308)), list(range(400, 408))


@pytest.mark.parametrize(
    ("copy_aware", "learn", "admission"),
    [
        (True, "pulled", "full"),
        (True, "served", "full"),
        (True, "both", "full"),
        (False, "pulled", "full"),
        (True, "served", "replica"),
        (False, "served", "replica"),
    ],
)
def test_lowest_id_holder_keeps_the_last_copy_under_a_stale_view(  # type: ignore[no-untyped-def]
    daemon, copy_aware, learn, admission
) -> None:
    a = daemon("node-a", copy_aware=copy_aware, learn=learn, admission=admission)
    b = daemon("node-b", copy_aware=copy_aware, learn=learn, admission=admission)
    put(a, X)
    put(b, FILL_B)
    # b learns (pulled) node-a holds X; a learns (served) node-b will: a higher id,
    # not counted.
    assert pull(b, X, a) == len(X)
    delete(a, X)  # b's belief is stale from now on: a dropped its copy
    put(a, FILL_A)
    # a learns (pulled) node-b holds X: a higher id, not counted; b learns (served)
    # node-a will hold X.
    assert pull(a, X, b) == len(X)
    # Each node now holds X and believes the other does. Make each evict 4 blocks.
    put(a, PRESSURE_A)
    put(b, PRESSURE_B)
    if admission == "replica" and not copy_aware:
        # a's copy is a replica (pulled from b) and goes first; b's, served to a
        # peer that holds a replica, was promoted: the cluster keeps X on b.
        assert held(a, X) == []
        assert held(a, FILL_A) == FILL_A
        assert held(b, X) == X
        assert held(b, FILL_B) == FILL_B[4:]
        assert held(a, PRESSURE_A) == PRESSURE_A and held(b, PRESSURE_B) == PRESSURE_B
        return
    # The lowest-id holder kept X (it evicted its coldest sole copies), so the
    # cluster still has it, whatever b believed (with replicas too: b's copy came
    # from a lower id, a's from a higher one, which makes no replica).
    assert held(a, X) == X
    assert held(a, FILL_A) == FILL_A[4:]
    if copy_aware:
        # b dropped its redundant copy of X, not its colder sole copies.
        assert held(b, X) == []
        assert held(b, FILL_B) == FILL_B
    else:
        assert held(b, X) == X
        assert held(b, FILL_B) == FILL_B[4:]
    assert held(a, PRESSURE_A) == PRESSURE_A and held(b, PRESSURE_B) == PRESSURE_B


def load(d: DaemonProcess, hashes) -> None:  # type: ignore[no-untyped-def]
    """One local load of the blocks (what an engine does after a pull), bytes checked."""
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        got = c.get(ns, list(hashes))
        assert got.found == len(hashes)
        np.testing.assert_array_equal(got.data, blocks_for(hashes))


def stats(d: DaemonProcess):  # type: ignore[no-untyped-def]
    with Client(d.address) as c:
        return c.stats()


LOCAL = list(range(500, 512))  # the puller's own blocks, older than the pull


@pytest.mark.parametrize("admission", ["replica", "full"])
def test_a_pulled_replica_is_evicted_before_older_local_blocks(daemon, admission) -> None:  # type: ignore[no-untyped-def]
    a = daemon("node-a", copy_aware=False, admission=admission)
    b = daemon("node-b", copy_aware=False, admission=admission)
    put(a, X)
    put(b, LOCAL)
    assert pull(b, X, a) == len(X)
    load(b, X)  # the pulling request's own load: not a reuse
    put(b, PRESSURE_B[:4])  # 16 slots: 4 must go
    if admission == "replica":
        assert stats(b).evicted_replica_blocks == 4
        assert held(b, X) == []
        assert held(b, LOCAL) == LOCAL
    else:
        assert held(b, X) == X
        assert held(b, LOCAL) == LOCAL[4:]
    assert held(a, X) == X  # the owner's copy: a full one either way


def test_a_replica_loaded_again_is_promoted_and_outlives_older_blocks(daemon) -> None:  # type: ignore[no-untyped-def]
    a = daemon("node-a", copy_aware=False, admission="replica")
    b = daemon("node-b", copy_aware=False, admission="replica")
    put(a, X)
    put(b, LOCAL)
    assert pull(b, X, a) == len(X)
    s = stats(b)
    assert (s.admitted_replicas, s.replica_blocks, s.promoted_replicas) == (4, 4, 0)
    load(b, X)  # the pull's own load
    load(b, X[:2])  # a later request reuses two of them: promoted, now the hottest
    s = stats(b)
    assert (s.replica_blocks, s.promoted_replicas) == (2, 2)
    put(b, PRESSURE_B[:4])  # the 2 replicas left go first, then the 2 coldest
    assert stats(b).evicted_replica_blocks == 2
    assert held(b, X) == X[:2]
    assert held(b, LOCAL) == LOCAL[2:]
