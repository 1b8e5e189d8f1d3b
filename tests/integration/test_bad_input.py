"""Every bad input gets a precise gRPC status, loses nothing, leaks nothing.

Raw stubs are used where the client library would refuse the input itself, so
the daemon's own answer is what is checked. After each case the daemon must
still serve, with no slot or lease left behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import grpc
import numpy as np
import pytest

from kvstore.client import Client, pack_hashes
from kvstore.errors import BlockSizeMismatch, CapacityExhausted
from kvstore.v1 import store_pb2 as pb
from kvstore.v1 import store_pb2_grpc
from tests.conftest import make_spec


@pytest.fixture
def raw(daemon):
    with grpc.insecure_channel(
        daemon.address, options=[("grpc.max_send_message_length", 256 << 20)]
    ) as ch:
        yield store_pb2_grpc.StoreServiceStub(ch)


@pytest.fixture
def client(daemon):
    with Client(daemon.address) as c:
        yield c


def code_of(fn, *args, **kw):
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, timeout=10, **kw)
    return info.value.code(), info.value.details()


def assert_healthy_and_clean(client):
    client.flush_releases()  # get() releases its lease in the background
    s = client.stats()
    assert s.active_leases == 0
    assert s.tiers[0].pinned_blocks == 0
    ns = client.declare_namespace(make_spec(4096, model="probe"))
    assert client.put(ns, [424242], np.ones((1, 4096), np.uint8)).stored in (0, 1)


def test_unknown_namespace_is_not_found(raw, client):
    for call, req in [
        (raw.Lookup, pb.LookupRequest(namespace_id="ns-nope", block_hashes=pack_hashes([1]))),
        (
            raw.PrepareStore,
            pb.PrepareStoreRequest(namespace_id="ns-nope", block_hashes=pack_hashes([1])),
        ),
        (
            raw.PrepareLoad,
            pb.PrepareLoadRequest(namespace_id="ns-nope", block_hashes=pack_hashes([1])),
        ),
        (raw.Clear, pb.ClearRequest(namespace_id="ns-nope")),
    ]:
        code, details = code_of(call, req)
        assert code == grpc.StatusCode.NOT_FOUND and "unknown namespace" in details
    assert_healthy_and_clean(client)


def test_wrong_block_size_is_invalid_argument(raw, client):
    ns = client.declare_namespace(make_spec(4096))
    code, details = code_of(
        raw.PutInline,
        pb.PutInlineRequest(
            namespace_id=ns.namespace_id, block_hashes=pack_hashes([1, 2]), data=b"x" * 4097
        ),
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "8192" in details
    with pytest.raises(BlockSizeMismatch):  # the client library refuses before sending
        client.put(ns, [1, 2], np.zeros((2, 4000), np.uint8))
    assert client.lookup(ns, [1, 2]).prefix_blocks == 0
    assert_healthy_and_clean(client)


def test_malformed_requests_are_invalid_argument(raw, client):
    ns = client.declare_namespace(make_spec(4096))
    cases = [
        (raw.Lookup, pb.LookupRequest(namespace_id=ns.namespace_id, block_hashes=b"\x01\x02\x03")),
        (raw.DeclareNamespace, pb.DeclareNamespaceRequest()),
        (
            raw.DeclareNamespace,
            pb.DeclareNamespaceRequest(spec=pb.NamespaceSpec(model="m", block_bytes=0)),
        ),
        (
            raw.DeclareNamespace,
            pb.DeclareNamespaceRequest(
                spec=pb.NamespaceSpec(
                    model="m",
                    dtype="f16",
                    block_size_tokens=16,
                    num_layers=1,
                    num_kv_heads=1,
                    head_dim=8,
                    block_bytes=1 << 40,
                )
            ),
        ),
        (
            raw.PrepareLoad,
            pb.PrepareLoadRequest(
                namespace_id=ns.namespace_id, block_hashes=pack_hashes([1]), lease_ttl_s=-5
            ),
        ),
        (
            raw.PrepareStore,
            pb.PrepareStoreRequest(
                namespace_id=ns.namespace_id, block_hashes=pack_hashes(range(70000))
            ),
        ),
    ]
    for call, req in cases:
        code, _ = code_of(call, req)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (call, req)
    h = client.prepare_store(ns, [1, 2])
    code, details = code_of(
        raw.CommitStore, pb.CommitStoreRequest(lease_id=h.lease_id, token_ids=b"\x00" * 12)
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in details
    assert client.commit_store(h) == 2  # the bad commit lost nothing
    assert_healthy_and_clean(client)


def test_oversize_message_is_resource_exhausted(daemon_factory):
    d = daemon_factory(settings={"server.max_message_bytes": 1 << 20})
    with grpc.insecure_channel(
        d.address, options=[("grpc.max_send_message_length", 64 << 20)]
    ) as ch:
        stub = store_pb2_grpc.StoreServiceStub(ch)
        code, _ = code_of(
            stub.PutInline, pb.PutInlineRequest(namespace_id="x", data=b"\0" * (2 << 20))
        )
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with Client(d.address, map_region=False) as c:
        ns = c.declare_namespace(make_spec(4096))
        c.put(ns, range(8), np.ones((8, 4096), np.uint8))
        with pytest.raises(Exception) as info:
            c._call(
                c._stub.GetInline,
                pb.GetInlineRequest(
                    namespace_id=ns.namespace_id, block_hashes=pack_hashes(range(300))
                ),
            )
        assert "message limit" in str(info.value) and "INVALID_ARGUMENT" in str(info.value)
        assert_healthy_and_clean(c)


def test_unknown_or_expired_lease_is_not_found(raw, client):
    code, details = code_of(raw.Release, pb.ReleaseRequest(lease_ids=[987654321]))
    assert code == grpc.StatusCode.NOT_FOUND and "never issued" in details
    code, _ = code_of(raw.CommitStore, pb.CommitStoreRequest(lease_id=987654321))
    assert code == grpc.StatusCode.NOT_FOUND
    ns = client.declare_namespace(make_spec(4096))
    client.put(ns, [1], np.ones((1, 4096), np.uint8))
    h = client.prepare_load(ns, [1])
    client.release(h)
    code, _ = code_of(raw.Release, pb.ReleaseRequest(lease_ids=[h.lease_id]))  # released twice
    assert code == grpc.StatusCode.NOT_FOUND
    assert_healthy_and_clean(client)


def test_commit_without_prepare_is_failed_precondition(raw, client):
    ns = client.declare_namespace(make_spec(4096))
    h = client.prepare_store(ns, [1, 2])
    code, details = code_of(
        raw.CommitStore,
        pb.CommitStoreRequest(lease_id=h.lease_id, block_hashes=pack_hashes([1, 3])),
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "not prepared" in details
    client.put(ns, [9], np.ones((1, 4096), np.uint8))
    load = client.prepare_load(ns, [9])
    code, _ = code_of(raw.CommitStore, pb.CommitStoreRequest(lease_id=load.lease_id))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    client.release(load)
    client.commit_store(h)
    assert client.lookup(ns, [1, 2]).prefix_blocks == 2
    assert_healthy_and_clean(client)


def test_commit_with_bad_chains_is_invalid_argument_and_keeps_the_lease(raw, client):
    ns = client.declare_namespace(make_spec(4096))  # 16 tokens per block
    h = client.prepare_store(ns, [1, 2, 3])
    toks = np.arange(16, dtype="<i4").tobytes()
    hashes = pack_hashes([1, 2, 3])
    for chains, details_has in [
        ([pb.StoreChain(blocks=2)], "hold 2 blocks"),
        ([pb.StoreChain(blocks=3, token_ids=toks)], "expected 3 blocks x 16"),
        ([pb.StoreChain(blocks=0), pb.StoreChain(blocks=3)], ">= 1 block"),
    ]:
        req = pb.CommitStoreRequest(lease_id=h.lease_id, block_hashes=hashes, chains=chains)
        code, details = code_of(raw.CommitStore, req)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details_has in details, details
    code, details = code_of(
        raw.CommitStore,
        pb.CommitStoreRequest(
            lease_id=h.lease_id,
            block_hashes=hashes,
            token_ids=toks * 3,
            chains=[pb.StoreChain(blocks=3)],
        ),
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "per chain" in details
    # nothing was lost: the lease still commits, in chains
    assert client.commit_store(h, [1, 2, 3], chains=[(1, None), (2, 1)]) == 3
    assert client.lookup(ns, [1, 2, 3]).prefix_blocks == 3
    assert_healthy_and_clean(client)


def test_full_tier_of_pinned_blocks_is_resource_exhausted_not_a_hang(daemon_factory):
    d = daemon_factory(dram_bytes=256 << 10, chunk_bytes=256 << 10)
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(4096))
        c.put(ns, range(64), np.ones((64, 4096), np.uint8))
        pin = c.prepare_load(ns, list(range(64)))
        assert pin.found == 64
        t = time.monotonic()
        with pytest.raises(CapacityExhausted) as info:
            c.put(ns, [1000], np.ones((1, 4096), np.uint8))
        assert time.monotonic() - t < 1.0
        assert info.value.status_code == grpc.StatusCode.RESOURCE_EXHAUSTED
        c.release(pin)
        assert c.put(ns, [1000], np.ones((1, 4096), np.uint8)).stored == 1
        assert_healthy_and_clean(c)


def _prepare_and_die(address, ns_id, block_bytes):
    c = Client(address)
    from kvstore.client import Namespace

    ns = Namespace(ns_id, block_bytes, make_spec(block_bytes))
    h = c.prepare_store(ns, list(range(500, 532)), lease_ttl_s=0.5)
    assert h.lease_id
    c.prepare_load(ns, [1], lease_ttl_s=0.5)
    os._exit(0)  # killed between prepare and commit


def test_client_killed_between_prepare_and_commit_strands_nothing(daemon_factory):
    d = daemon_factory(settings={"leases.reap_interval_s": 0.05})
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(4096))
        c.put(ns, [1], np.ones((1, 4096), np.uint8))
        used_before = c.stats().tiers[0].used_bytes
        p = mp.get_context("spawn").Process(
            target=_prepare_and_die, args=(d.address, ns.namespace_id, 4096)
        )
        p.start()
        p.join(30)
        assert p.exitcode == 0
        deadline = time.monotonic() + 5
        while c.stats().active_leases and time.monotonic() < deadline:
            time.sleep(0.05)
        s = c.stats()
        assert s.active_leases == 0 and s.expired_leases == 2
        assert s.tiers[0].used_bytes == used_before and s.tiers[0].pinned_blocks == 0
        assert c.put(ns, list(range(500, 532)), np.ones((32, 4096), np.uint8)).stored == 32


def _worker(address, ns_id, block_bytes, seed, results):
    from kvstore.client import Namespace

    rng = np.random.default_rng(seed)
    ns = Namespace(ns_id, block_bytes, make_spec(block_bytes))
    bad = 0
    with Client(address) as c:
        for _ in range(30):
            hashes = sorted(set(rng.integers(0, 400, 16).tolist()))
            data = np.stack([np.full(block_bytes, h % 251, np.uint8) for h in hashes])
            c.put(ns, hashes, data)
            got = c.get(ns, hashes)
            for h, row in zip(hashes, got.data, strict=False):
                bad += int(not np.all(row == h % 251))
    results.put(bad)


def test_many_concurrent_clients_lose_and_duplicate_nothing(daemon_factory):
    d = daemon_factory(dram_bytes=8 << 20, chunk_bytes=1 << 20)
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(4096))
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [
            ctx.Process(target=_worker, args=(d.address, ns.namespace_id, 4096, s, results))
            for s in range(8)
        ]
        for p in procs:
            p.start()
        bad = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        assert bad == [0] * 8  # every byte read matched its hash
        everything = list(range(400))
        present = [h for h in everything if c.lookup(ns, [h]).prefix_blocks]
        s = c.stats()
        assert s.tiers[0].blocks == len(present)  # one block per hash: no duplicates
        got = c.get(ns, present)
        assert all(np.all(row == h % 251) for h, row in zip(present, got.data, strict=True))
        assert_healthy_and_clean(c)
