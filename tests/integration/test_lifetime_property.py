"""The lifetime property (issue 19): several client processes, one daemon with DRAM, a
GPU tier in host mode and disk, random put / get / get(tier=gpu) / short-TTL loads /
delete / clear with random call deadlines. Every byte read is verified against its
hash's content; the run must end with 0 wrong bytes, no status outside the expected
ones (no UNKNOWN, no INTERNAL), no traceback in the daemon's log, and 0 slots in use
once every namespace is cleared and every lease is gone.

Bounded for CI (KVSTORE_PROPERTY_S seconds per client, default 8; raise it for a
soak). The worker is tests/integration/lifetime_worker.py; its seeds are printed, so
a failing mix can be replayed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvstore.client import Client
from tests.conftest import make_spec
from tests.integration.lifetime_worker import NAMESPACES

pytest.importorskip("torch")

BLOCK = 16 * 1024
CLIENTS = 3
DURATION_S = float(os.environ.get("KVSTORE_PROPERTY_S", "8"))
DEFAULT_TTL_S = 5.0  # Client.get's leases: far above any copy here
QUIESCE_S = DEFAULT_TTL_S + 15.0


def lifetime_daemon(daemon_factory, tmp_path):
    (tmp_path / "disk").mkdir()
    settings = {
        "gpu.device": "cpu",
        "gpu.capacity_bytes": "256KiB",  # 16 blocks
        "gpu.chunk_bytes": "64KiB",
        "gpu.demote_free_fraction": 0.25,  # the background demoter runs too
        "disk.path": str(tmp_path / "disk"),
        "disk.capacity_bytes": "2MiB",  # 128 blocks: the disk evicts as well
        "disk.slab_bytes": "64KiB",
        "disk.io_threads": 2,
        "disk.demote_free_fraction": 0.5,
        "disk.when_full": "drop",
        "leases.default_ttl_s": DEFAULT_TTL_S,
        "leases.reap_interval_s": 0.05,
    }
    # DRAM 512 KiB = 32 blocks: 2 namespaces x 48 hashes never fit, so every tier moves.
    return daemon_factory(dram_bytes=512 << 10, chunk_bytes=64 << 10, settings=settings)


def run_clients(address: str, *, stall: bool) -> list[dict]:
    seeds = [int.from_bytes(os.urandom(4), "little") for _ in range(CLIENTS)]
    print(f"lifetime property seeds: {seeds} stall={stall}")
    cmd = [sys.executable, "-m", "tests.integration.lifetime_worker", address]
    procs = [
        subprocess.Popen(
            [*cmd, str(seed), str(DURATION_S), str(BLOCK), *(["--stall"] if stall else [])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in seeds
    ]
    results = []
    for seed, proc in zip(seeds, procs, strict=True):
        out, err = proc.communicate(timeout=DURATION_S + 60)
        assert proc.returncode == 0, f"client seed {seed} failed:\n{err[-4000:]}"
        results.append(json.loads(out.strip().splitlines()[-1]) | {"seed": seed})
    return results


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def tiers(c: Client) -> dict:
    return {t.tier: t for t in c.stats().tiers}


def check_run(d, results: list[dict]) -> None:
    for r in results:
        print(
            f"seed {r['seed']}: ops {r['ops']} errors {r['errors']} "
            f"checked {r['checked_blocks']} unconfirmed {r['unconfirmed']}"
        )
    wrong = [(r["seed"], w) for r in results for w in r["wrong"]]
    assert sum(r["wrong_count"] for r in results) == 0, f"wrong bytes served: {wrong[:10]}"
    unexpected = [(r["seed"], u) for r in results for u in r["unexpected"]]
    assert not unexpected, f"unexpected statuses: {unexpected[:10]}"
    assert sum(r["checked_blocks"] for r in results) > 0  # the mix did read blocks
    with Client(d.address) as c:
        # Quiesce: leases of calls whose deadline passed expire by their TTL.
        wait_for(lambda: c.stats().active_leases == 0, QUIESCE_S, "every lease to end")
        for name in NAMESPACES:
            c.clear(c.declare_namespace(make_spec(BLOCK, model=name)))

        def empty() -> bool:
            t = tiers(c)
            return all(t[k].used_bytes == 0 and t[k].blocks == 0 for k in t)

        # In-flight disk writes and readahead end by themselves; then nothing is left.
        wait_for(empty, QUIESCE_S, "every slot to be free after clear")
    log = d.log_path.read_text()
    assert "Traceback" not in log, log[log.index("Traceback") :][:4000]


def test_random_clients_never_see_a_wrong_byte_and_leak_no_slot(daemon_factory, tmp_path):
    d = lifetime_daemon(daemon_factory, tmp_path)
    check_run(d, run_clients(d.address, stall=False))


def test_stalled_readers_and_writers_never_change_anyone_elses_bytes(daemon_factory, tmp_path):
    """Clients that stall past their lease's TTL (issue 19 bug 4, fixed on its own
    branch): a stalled reader learns at release that its copy is invalid; a stalled
    writer's late bytes must land in no slot another client reads."""
    d = lifetime_daemon(daemon_factory, tmp_path)
    check_run(d, run_clients(d.address, stall=True))


def test_a_peers_pin_keeps_its_dram_bytes_while_local_clients_move_blocks(daemon_factory, tmp_path):
    """Issue 19 bug 1, the peer side: a peer reads (NIXL or the byte stream) the DRAM
    offsets its PinForPull returned; a local get(tier="gpu") of the same blocks must
    not move them out from under it, nor may a store reuse the slots."""
    import grpc
    import numpy as np

    from kvstore.v1 import peer_pb2, peer_pb2_grpc, store_pb2
    from tests.integration.lifetime_worker import payload

    secret = "lifetime-secret"
    d = daemon_factory(
        dram_bytes=512 << 10,
        chunk_bytes=64 << 10,
        settings={
            "gpu.device": "cpu",
            "gpu.capacity_bytes": "256KiB",
            "gpu.chunk_bytes": "64KiB",
            "gpu.demote_free_fraction": 0,
            "peer.enabled": "true",
            "peer.secret": secret,
            "peer.transport": "grpc_stream",
        },
    )
    spec = make_spec(BLOCK, model="peer-pin")
    hashes = [1, 2, 3, 4]
    rows = np.stack([payload(0, h, BLOCK) for h in hashes])
    md = (("x-kvstore-cluster-secret", secret),)
    with Client(d.address) as c, grpc.insecure_channel(d.tcp_address) as channel:
        ns = c.declare_namespace(spec)
        assert c.put(ns, hashes, rows).stored == 4
        peer = peer_pb2_grpc.PeerServiceStub(channel)
        pin = peer.PinForPull(
            peer_pb2.PinForPullRequest(
                spec=store_pb2.NamespaceSpec(
                    **{f: getattr(spec, f) for f in spec.__struct_fields__}
                ),
                block_hashes=np.asarray(hashes, dtype="<u8").tobytes(),
                lease_ttl_s=30,
            ),
            metadata=md,
            timeout=10,
        )
        assert pin.found_blocks == 4
        got = c.get(ns, hashes, tier="gpu")  # a local engine wants them in its tier
        assert all(np.array_equal(got.data[i], rows[i]) for i in range(got.found))
        others = list(range(100, 132))  # DRAM holds 32: reuses any slot set free
        c.put(ns, others, np.stack([payload(0, h, BLOCK) for h in others]))
        streamed = b"".join(
            chunk.data
            for chunk in peer.StreamBlocks(
                peer_pb2.StreamBlocksRequest(lease_id=pin.lease_id, offsets=pin.offsets),
                metadata=md,
                timeout=10,
            )
        )
        assert streamed == rows.tobytes(), "the peer's pinned DRAM bytes changed"
        peer.ReleasePull(peer_pb2.ReleasePullRequest(lease_ids=[pin.lease_id]), metadata=md)
