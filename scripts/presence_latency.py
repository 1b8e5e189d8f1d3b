"""Lookup cost: a probe of the presence table vs the lean-channel call (issue 12).

A real daemon (kvstore.process.DaemonProcess in a temp dir) holding a 12,000-block
prefix; two clients of it: one probes the table (map_region=True), one calls
(map_region=False: the lean channel). Each round looks up 16 and 12,000 hashes
(all present, and a miss at the first block) back to back and after an idle gap;
p50/p90 in microseconds. Then the daemon side in-process: a 64-block
prepare_store + commit_store on a BlockManager with and without a table.

    PYTHONPATH=$PWD flock /work/wt/bench.lock .venv/bin/python scripts/presence_latency.py
    ROUNDS=50 GAPS_MS=0,100 ...
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from kvstore.client import Client
from kvstore.config import load_config
from kvstore.files import FilePolicy
from kvstore.manager import BlockManager
from kvstore.namespace import NamespaceSpec
from kvstore.presence import PresenceTable
from kvstore.process import DaemonProcess
from kvstore.tiers.dram import Region
from kvstore_bench._common import summarize

BLOCK_BYTES = 4096
SPEC = NamespaceSpec(
    model="presence",
    dtype="float16",
    block_size_tokens=16,
    num_layers=2,
    num_kv_heads=2,
    head_dim=64,
    block_bytes=BLOCK_BYTES,
)


def _us(samples: list[float]) -> str:
    s = summarize(samples)
    return f"p50 {s.median_s * 1e6:8.1f}  p90 {s.p90_s * 1e6:8.1f}"


def lookups(rounds: int, gaps_ms: list[int]) -> None:
    with tempfile.TemporaryDirectory() as tmp, DaemonProcess(tmp, dram_bytes=128 << 20) as d:
        prober, caller = Client(d.address), Client(d.address, map_region=False)
        assert prober.probes_lookups and caller.using_local_channel
        ns = prober.declare_namespace(SPEC)
        hashes = np.arange(1, 12001, dtype=np.uint64)
        data = np.zeros((1000, BLOCK_BYTES), np.uint8)
        for i in range(0, len(hashes), 1000):
            prober.put(ns, hashes[i : i + 1000], data)
        cases = {
            "16 hit": hashes[:16],
            "16 miss": hashes[:16] + 10**6,
            "12000 hit": hashes,
            "12000 miss": hashes + 10**6,
        }
        for c in (prober, caller):  # same answers
            assert c.lookup(ns, hashes).prefix_blocks == 12000
        print(f"{'gap':>6} {'lookup':>11}   {'probe (us)':>24}   {'lean call (us)':>24}")
        for gap_ms in gaps_ms:
            for name, seq in cases.items():
                took: dict[str, list[float]] = {"probe": [], "call": []}
                for _ in range(rounds):
                    for kind, c in (("probe", prober), ("call", caller)):
                        if gap_ms:
                            time.sleep(gap_ms / 1000)
                        t0 = time.perf_counter()
                        c.lookup(ns, seq)
                        took[kind].append(time.perf_counter() - t0)
                print(f"{gap_ms:>4}ms {name:>11}   {_us(took['probe'])}   {_us(took['call'])}")
        assert caller.probed_lookups == 0 and prober.probed_lookups > 0
        prober.close()
        caller.close()


def commit_cost(rounds: int) -> None:
    """The daemon's side: what a 64-block store step costs with the table kept."""
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for with_table in (False, True, False, True):
            path = f"{tmp}/r{len(results)}{with_table}"
            config = load_config(
                environ={},
                assignments=[
                    "dram.capacity_bytes=256MiB",
                    "dram.chunk_bytes=4MiB",
                    f"dram.path={path}",
                ],
            )
            region = Region(path, config.dram.capacity_bytes, prefault=False, huge_pages="off")
            m = BlockManager(config, region)
            table = None
            if with_table:
                table = PresenceTable.create(
                    path + ".presence", 256 << 20, FilePolicy(), region.region_id
                )
                m.publish_presence(table)
            ns = m.declare_namespace(SPEC)
            took = []
            for r in range(rounds):
                hashes = list(range(r * 64 + 1, r * 64 + 65))
                t0 = time.perf_counter()
                plan = m.prepare_store(ns.namespace_id, hashes)
                m.commit_store(plan.lease_id)
                took.append(time.perf_counter() - t0)
                if r % 100 == 99:  # keep it in DRAM without evictions
                    m.clear(ns.namespace_id)
                    ns = m.declare_namespace(SPEC)
            results[(with_table, len(results))] = summarize(took)
            if table is not None:
                table.close()
            region.close(unlink=True)
        for (with_table, i), s in results.items():
            print(
                f"64-block prepare_store+commit_store, table {'on ' if with_table else 'off'} "
                f"(run {i}): p50 {s.median_s * 1e6:.1f} us  p90 {s.p90_s * 1e6:.1f} us"
            )


def main() -> None:
    rounds = int(os.environ.get("ROUNDS", "30"))
    gaps_ms = [int(g) for g in os.environ.get("GAPS_MS", "0,100").split(",")]
    print(f"load: {os.getloadavg()[0]:.2f}")
    lookups(rounds, gaps_ms)
    commit_cost(max(rounds * 20, 400))


if __name__ == "__main__":
    main()
