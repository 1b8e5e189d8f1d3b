"""The GPU tier wired through a real daemon, in host mode (gpu.device = "cpu").

Host mode is the daemon's GPU-tier code over a shared-memory file instead of
HBM (no CUDA here): clients map it from Hello as they would map the CUDA IPC
handle, stores and loads ask for the tier, a full pool demotes to DRAM and on
to disk. tests/gpu/test_gpu_tier.py runs the CUDA pool itself where a GPU exists.
"""

from __future__ import annotations

import os
import time

import grpc
import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import InvalidRequest, StateConflict
from kvstore.v1 import store_pb2 as pb
from kvstore.v1 import store_pb2_grpc as pb_grpc
from tests.conftest import make_spec

pytest.importorskip("torch")

BLOCK = 64 * 1024


def blocks_for(hashes):
    return np.stack(
        [np.random.default_rng(int(h)).integers(0, 256, BLOCK, dtype=np.uint8) for h in hashes]
    )


def gpu_daemon(daemon_factory, tmp_path, *, disk=False):
    settings = {
        "gpu.device": "cpu",
        "gpu.capacity_bytes": "1MiB",  # 16 blocks
        "gpu.chunk_bytes": "1MiB",
        "gpu.demote_free_fraction": 0,  # exact placements; the background is unit-tested
    }
    if disk:
        (tmp_path / "disk").mkdir()
        settings |= {
            "disk.path": str(tmp_path / "disk"),
            "disk.capacity_bytes": "32MiB",
            "disk.slab_bytes": "1MiB",
            "disk.demote_free_fraction": 1.0,
        }
    return daemon_factory(dram_bytes=2 << 20, chunk_bytes=1 << 20, settings=settings)  # 32 blocks


def wait_until(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def tiers(c):
    return {pb.Tier.Name(t.tier): t for t in c.stats().tiers}


def test_hello_put_get_lookup_in_the_gpu_tier(daemon_factory, tmp_path):
    d = gpu_daemon(daemon_factory, tmp_path)
    with Client(d.address) as c:
        assert c.info.gpu_device == "cpu" and c.info.gpu_pool_bytes == 1 << 20
        assert c.info.gpu_region_path and os.path.exists(c.info.gpu_region_path)
        ns = c.declare_namespace(make_spec(BLOCK))
        hashes = list(range(1, 9))
        assert c.put(ns, hashes, blocks_for(hashes), tier="gpu").stored == 8
        assert c.lookup(ns, hashes).by_tier == {"gpu": 8}
        got = c.get(ns, hashes, tier="gpu")
        assert got.found == 8 and np.array_equal(got.data, blocks_for(hashes))
        # The handle says where the offsets point.
        handle = c.prepare_load(ns, hashes, tier="gpu")
        assert handle.tier == "gpu" and handle.found == 8
        assert np.array_equal(
            c.gpu_pool()[int(handle.offsets[0]) : int(handle.offsets[0]) + BLOCK],
            blocks_for([1])[0],
        )
        c.release(handle)
        # A plain (DRAM) reader moves them down and reads the same bytes.
        got = c.get(ns, hashes)
        assert got.found == 8 and np.array_equal(got.data, blocks_for(hashes))
        assert c.lookup(ns, hashes).by_tier == {"dram": 8}
        t = tiers(c)
        assert t["TIER_GPU"].blocks == 0 and t["TIER_DRAM"].blocks == 8
        assert t["TIER_GPU"].capacity_bytes == 1 << 20
    d.stop()
    assert not os.path.exists(c.info.gpu_region_path)  # the pool's file goes with the daemon


def test_gpu_demotes_to_dram_then_disk_and_loads_come_back_up(daemon_factory, tmp_path):
    d = gpu_daemon(daemon_factory, tmp_path, disk=True)
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        hashes = list(range(100, 180))  # 80 blocks: GPU 16, DRAM 32, the rest on disk
        for i in range(0, 80, 8):
            batch = hashes[i : i + 8]
            assert c.put(ns, batch, blocks_for(batch), tier="gpu").stored == 8
            # Let the disk demoter keep up (a store that outruns the disk drops
            # dirty DRAM blocks; that is the disk tier's business, not tested here).
            wait_until(lambda n=i + 8: tiers(c)["TIER_DISK"].blocks >= n - 16)
        res = c.lookup(ns, hashes)
        assert res.prefix_blocks == 80
        assert res.by_tier["gpu"] == 16 and res.by_tier.get("disk", 0) > 0
        stats = c.stats()
        assert stats.demoted_blocks >= 64 and stats.evicted_blocks == 0
        got = c.get(ns, hashes[:16], tier="gpu")  # disk -> DRAM -> GPU
        assert got.found == 16 and np.array_equal(got.data, blocks_for(hashes[:16]))
        assert c.lookup(ns, hashes[:16]).by_tier == {"gpu": 16}
        wait_until(lambda: c.stats().active_leases == 0)  # the get's release is batched


def test_bad_tier_requests_get_precise_errors(daemon_factory, tmp_path):
    plain = daemon_factory("plain")
    with Client(plain.address) as c:
        assert not c.has_gpu_tier
        ns = c.declare_namespace(make_spec(BLOCK))
        with pytest.raises(StateConflict, match="no GPU tier"):
            c.put(ns, [1], blocks_for([1]), tier="gpu")
        with pytest.raises(StateConflict, match="no GPU tier"):
            c.prepare_load(ns, [1], tier="gpu")
        with pytest.raises(InvalidRequest, match="tier must be"):
            c.get(ns, [1], tier="hbm")
        # The raw protocol: a DISK or unknown tier is INVALID_ARGUMENT; the daemon keeps serving.
        stub = pb_grpc.StoreServiceStub(grpc.insecure_channel(plain.address))
        for tier in (pb.TIER_DISK, 7):
            with pytest.raises(grpc.RpcError) as err:
                stub.PrepareStore(
                    pb.PrepareStoreRequest(
                        namespace_id=ns.namespace_id,
                        block_hashes=np.asarray([1], "<u8").tobytes(),
                        tier=tier,
                    )
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            stub.PrepareLoad(
                pb.PrepareLoadRequest(
                    namespace_id=ns.namespace_id,
                    block_hashes=np.asarray([1], "<u8").tobytes(),
                    tier=pb.TIER_GPU,
                )
            )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert c.put(ns, [1], blocks_for([1])).stored == 1
        assert c.stats().active_leases == 0


def test_a_gpu_store_abandoned_mid_way_leaks_nothing(daemon_factory, tmp_path):
    d = gpu_daemon(daemon_factory, tmp_path)
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        handle = c.prepare_store(ns, list(range(16)), lease_ttl_s=0.2, tier="gpu")
        assert handle.tier == "gpu" and len(handle.allocated) == 16
        assert tiers(c)["TIER_GPU"].used_bytes == 16 * BLOCK
        # Never committed (the client "died"): the lease expires, the slots come back.
        wait_until(lambda: tiers(c)["TIER_GPU"].used_bytes == 0)
        assert tiers(c)["TIER_GPU"].used_bytes == 0 and c.stats().active_leases == 0
        assert c.put(ns, list(range(16)), blocks_for(range(16)), tier="gpu").stored == 16


def test_the_torch_copy_path_over_a_host_pool(daemon_factory, tmp_path):
    """The copies a CUDA client takes (one torch copy_ per run of slots) run here
    over the host-mode pool with CPU tensors: same code, no device."""
    import torch

    d = gpu_daemon(daemon_factory, tmp_path)
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        hashes = list(range(40, 52))
        src = torch.from_numpy(blocks_for(hashes))
        assert c._put_torch(ns, hashes, src, "gpu", c.gpu_pool()).stored == 12
        out = np.zeros((12, BLOCK), dtype=np.uint8)
        got = c._get_torch(ns, hashes, out, "gpu", c.gpu_pool())
        assert got.found == 12 and isinstance(got.data, np.ndarray)
        assert np.array_equal(out, blocks_for(hashes))
        got = c._get_torch(ns, hashes, None, "gpu", c.gpu_pool())
        assert torch.equal(got.data, src)
        # And into DRAM (a CUDA tensor's store to the region takes this path too).
        assert c._put_torch(ns, [99], src[:1], "dram", c.region).stored == 1
        assert np.array_equal(c.get(ns, [99]).data[0], blocks_for([40])[0])


def test_graceful_restart_keeps_the_gpu_tiers_blocks_in_dram(daemon_factory, tmp_path):
    """The pool dies with the daemon: on SIGTERM its blocks move to DRAM first, so the
    warm restart serves them."""
    d = gpu_daemon(daemon_factory, tmp_path)
    hashes = list(range(300, 312))
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        assert c.put(ns, hashes, blocks_for(hashes), tier="gpu").stored == 12
    assert d.stop(keep_region=True) == 0
    d.start()
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        assert c.lookup(ns, hashes).by_tier == {"dram": 12}
        got = c.get(ns, hashes, tier="gpu")
        assert got.found == 12 and np.array_equal(got.data, blocks_for(hashes))
