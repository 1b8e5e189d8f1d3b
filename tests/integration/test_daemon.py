"""A real daemon process: data round trips, eviction, leases, health, metrics, drain."""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import Client
from kvstore.errors import LeaseNotFound
from kvstore.v1 import store_pb2
from tests.conftest import make_spec


def blocks_for(hashes, block_bytes):
    """Deterministic bytes per hash, so any mix-up shows."""
    return np.stack(
        [
            np.random.default_rng(int(h)).integers(0, 256, block_bytes, dtype=np.uint8)
            for h in hashes
        ]
    )


@pytest.mark.parametrize("block_bytes", [4096, 1000, 256 << 10, 1 << 20])
def test_put_get_round_trip_bytes(daemon, block_bytes):
    with Client(daemon.address) as c:
        assert c.mapped
        ns = c.declare_namespace(make_spec(block_bytes))
        hashes = list(range(1000, 1012))
        data = blocks_for(hashes, block_bytes)
        assert c.put(ns, hashes, data).stored == 12
        got = c.get(ns, hashes + [5])
        assert got.found == 12
        np.testing.assert_array_equal(got.data, data)
        # stored again: skipped, not rewritten
        assert c.put(ns, hashes, np.zeros_like(data)).skipped == 12
        np.testing.assert_array_equal(c.get(ns, hashes).data, data)


def test_torch_tensors_and_out_buffers(daemon):
    torch = pytest.importorskip("torch")
    with Client(daemon.address) as c:
        ns = c.declare_namespace(make_spec(4096))
        t = torch.arange(8 * 1024, dtype=torch.float32).reshape(8, 1024)
        assert c.put(ns, range(8), t).stored == 8
        out = torch.zeros_like(t)
        got = c.get(ns, list(range(8)), out=out)
        assert got.found == 8
        assert torch.equal(out, t)


def test_tcp_and_inline_paths_agree(daemon_factory):
    # Data calls over TCP need the cluster secret (docs/security.md).
    daemon = daemon_factory(settings={"peer.secret": "tcp-test-secret"})
    with (
        Client(daemon.tcp_address, secret="tcp-test-secret") as tcp,
        Client(daemon.address, map_region=False) as inline,
    ):
        assert tcp.mapped and not inline.mapped
        ns = tcp.declare_namespace(make_spec(4096))
        data = blocks_for(range(4), 4096)
        assert inline.put(ns, range(4), data).stored == 4
        np.testing.assert_array_equal(tcp.get(ns, list(range(4))).data, data)
        np.testing.assert_array_equal(inline.get(ns, list(range(4))).data, data)


def test_lookup_delete_clear_stats(daemon):
    with Client(daemon.address) as c:
        ns = c.declare_namespace(make_spec(4096))
        c.put(ns, range(10), blocks_for(range(10), 4096))
        r = c.lookup(ns, [0, 1, 2, 99, 3])
        assert r.prefix_blocks == 3 and r.by_tier == {"dram": 3}
        assert c.delete(ns, [1]) == (1, 0)
        assert c.lookup(ns, list(range(10))).prefix_blocks == 1
        assert c.clear(ns) == 9
        s = c.stats()
        assert s.tiers[0].used_bytes == 0 and s.active_leases == 0 and s.stored_blocks == 10


def test_eviction_when_full_keeps_capacity(daemon_factory):
    d = daemon_factory(dram_bytes=1 << 20, chunk_bytes=256 << 10)
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(4096))
        for start in range(0, 1024, 64):  # 4 MiB through a 1 MiB tier
            hs = list(range(start, start + 64))
            assert c.put(ns, hs, blocks_for(hs, 4096)).stored == 64
        s = c.stats()
        assert s.tiers[0].used_bytes <= 1 << 20
        assert s.evicted_blocks == 1024 - 256
        newest = list(range(768, 1024))
        got = c.get(ns, newest)
        assert got.found == 256
        np.testing.assert_array_equal(got.data, blocks_for(newest, 4096))


def test_lease_expiry_unpins(daemon_factory):
    d = daemon_factory(settings={"leases.reap_interval_s": 0.05})
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(4096))
        c.put(ns, [1], blocks_for([1], 4096))
        h = c.prepare_load(ns, [1], lease_ttl_s=1.0)
        assert c.stats().tiers[0].pinned_blocks == 1  # (1 s: a loaded machine may stall)
        deadline = time.monotonic() + 5
        while c.stats().active_leases and time.monotonic() < deadline:
            time.sleep(0.05)
        s = c.stats()
        assert s.active_leases == 0 and s.expired_leases == 1 and s.tiers[0].pinned_blocks == 0
        with pytest.raises(LeaseNotFound):
            c.release(h)


def test_health_and_reflection(daemon):
    with grpc.insecure_channel(daemon.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "kvstore.v1.StoreService"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=3)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        replies = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert "kvstore.v1.StoreService" in names


def test_metrics_endpoint(daemon_factory):
    d = daemon_factory(metrics=True)
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(4096))
        c.put(ns, range(3), blocks_for(range(3), 4096))
    # a client that maps nothing calls Lookup (a mapping one probes the presence
    # table: the daemon never sees that lookup, docs/presence.md)
    with Client(d.address, map_region=False) as c:
        c.lookup(ns, [0, 1, 2, 3])
    body = urllib.request.urlopen(f"http://{d.metrics_address}/metrics", timeout=5).read().decode()
    assert 'kvstore_tier_used_bytes{tier="dram"} 12288.0' in body
    assert "kvstore_lookup_hit_blocks_total 3.0" in body
    assert "kvstore_lookup_miss_blocks_total 1.0" in body
    assert 'kvstore_rpc_duration_seconds_count{method="Lookup"} 1.0' in body
    assert 'kvstore_rpc_requests_total{code="OK",method="PrepareStore"} 1.0' in body
    assert "kvstore_lease_active 0.0" in body
    # Collector pauses: the start-up heap was frozen after one full collection
    # (kvstore.heap.settle_heap), which the histogram counted.
    metric = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line.startswith("kvstore_gc_")
    }
    assert metric['kvstore_gc_pause_seconds_count{generation="2"}'] >= 1
    assert metric['kvstore_gc_pause_seconds_bucket{generation="2",le="+Inf"}'] >= 1
    assert metric['kvstore_gc_pause_seconds_sum{generation="2"}'] > 0
    assert 0 < metric['kvstore_gc_longest_pause_seconds{generation="2"}'] < 5
    assert metric["kvstore_gc_frozen_objects"] > 10_000


def test_sigterm_drains_and_exits_zero(daemon_factory):
    d = daemon_factory()
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(4096))
        c.put(ns, range(4), blocks_for(range(4), 4096))
    os.kill(d.pid, signal.SIGTERM)
    assert d.proc.wait(timeout=15) == 0
    assert not os.path.exists(d.socket_path)
    # The region stays for a warm restart, described by the manifest beside it.
    assert os.path.exists(d.settings["dram.path"] + ".manifest")


def test_stale_socket_is_reclaimed_and_live_one_refused(daemon_factory, tmp_path):
    a = daemon_factory("a")
    a.kill()  # leaves its socket file behind
    assert os.path.exists(a.socket_path)
    b = daemon_factory("a2", settings={"server.socket_path": a.socket_path})
    with Client(b.address) as c:
        assert c.stats().node_id == "a2"
    from kvstore.errors import Unavailable

    with pytest.raises(Unavailable, match="another process is serving"):
        daemon_factory("a3", settings={"server.socket_path": a.socket_path})
    with Client(b.address) as c:  # the refused daemon left the live one's socket alone
        assert c.stats().node_id == "a2"


def test_print_config_and_status_cli(daemon, tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "serve",
            "--print-config",
            "--set",
            "dram.capacity_bytes=2GiB",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert "capacity_bytes = 2147483648" in out and "[server]" in out
    bad = subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--set", "dram.capcity_bytes=1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2 and "capcity_bytes" in bad.stderr and "$.dram" in bad.stderr
    status = subprocess.run(
        [sys.executable, "-m", "kvstore", "status", "--address", daemon.address],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert "node=kvstored" in status and "dram" in status


def test_store_status_values_match_proto():
    from kvstore import manager

    assert manager.STORE_ALLOCATED == store_pb2.STORE_ALLOCATED
    assert manager.STORE_PRESENT == store_pb2.STORE_PRESENT
    assert manager.STORE_IN_FLIGHT == store_pb2.STORE_IN_FLIGHT
    assert manager.STORE_NO_ROOM == store_pb2.STORE_NO_ROOM


def test_put_result_tells_no_room_from_present(daemon_factory):
    d = daemon_factory(dram_bytes=256 << 10, chunk_bytes=256 << 10)  # 64 slots of 4 KiB
    for mapped in (True, False):
        with Client(d.address, map_region=mapped) as c:
            ns = c.declare_namespace(make_spec(4096, model=f"m{mapped}"))
            c.clear(ns)
            first = c.put(ns, range(60), blocks_for(range(60), 4096))
            pin = c.prepare_load(ns, list(range(60)))  # nothing evictable now
            r = c.put(ns, range(58, 66), blocks_for(range(58, 66), 4096))
            assert (r.stored, r.skipped, r.no_room) == (4, 2, 2), mapped
            assert first.no_room == 0
            c.release(pin)
            c.clear(ns)


def test_background_releases_unpin_in_batches(daemon):
    with Client(daemon.address) as c:
        ns = c.declare_namespace(make_spec(4096))
        c.put(ns, range(50), blocks_for(range(50), 4096))
        for i in range(50):
            c.release(c.prepare_load(ns, [i]), wait=False)
        deadline = time.monotonic() + 5
        while c.stats().active_leases and time.monotonic() < deadline:
            time.sleep(0.02)
        s = c.stats()
        assert s.active_leases == 0 and s.tiers[0].pinned_blocks == 0 and s.expired_leases == 0


def test_long_get_is_pipelined_in_chunks_with_the_same_result(daemon, monkeypatch):
    """A get longer than two chunks asks for chunk k+1 while copying chunk k: same
    bytes, same longest-prefix answer, no lease left behind."""
    import kvstore.client as client_module

    monkeypatch.setattr(client_module, "PIPELINE_CHUNK_BYTES", 256 << 10)  # 4 blocks
    block_bytes = 64 << 10
    with Client(daemon.address) as c:
        ns = c.declare_namespace(make_spec(block_bytes))
        hashes = list(range(7000, 7030))
        data = blocks_for(hashes, block_bytes)
        assert c.put(ns, hashes, data).stored == 30
        got = c.get(ns, hashes)
        assert got.found == 30 and np.array_equal(got.data, data)
        out = np.zeros_like(data)
        assert c.get(ns, hashes, out).found == 30 and np.array_equal(out, data)
        # A hole in the 5th chunk: the prefix ends there, later chunks are not pinned.
        c.delete(ns, [hashes[17]])
        got = c.get(ns, hashes + [1, 2])
        assert got.found == 17 and np.array_equal(got.data, data[:17])
        assert c.get(ns, [999] + hashes).found == 0
        deadline = time.monotonic() + 5
        while c.stats().active_leases and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.stats().active_leases == 0
