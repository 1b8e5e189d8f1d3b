"""kvstore-bench local measures what a workload pays: no namespace re-declares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstore.client import Client
from kvstore.process import DaemonProcess
from kvstore_bench import local

MiB = 1 << 20


def test_transfer_rounds_reuse_the_namespace_and_drop_warmup(tmp_path: Path) -> None:
    """Between rounds the bench frees its blocks without dropping the namespace:
    a clear that empties it dropped it, so every round's first put paid a
    NamespaceNotFound answer and a declare again, inside the timed region."""
    daemon = DaemonProcess(str(tmp_path), dram_bytes=64 * MiB, chunk_bytes=4 * MiB)
    daemon.start()
    try:
        with Client(daemon.address) as client:
            declares: list[Any] = []
            declare = client.declare_namespace

            def counting(spec: Any) -> Any:
                declares.append(spec)
                return declare(spec)

            client.declare_namespace = counting  # type: ignore[method-assign]
            r = local._transfer(client, 64 * 1024, 4 * MiB, 16, False, 3)
            assert len(declares) == 1, f"declared {len(declares)} times over the rounds"
            assert r["store"].n == r["load"].n == r["memcpy"].n == 3  # warm-up rounds dropped
    finally:
        daemon.stop()


def test_full_tier_steps_evict_as_many_blocks_as_they_store(tmp_path: Path) -> None:
    """store_step_full_tier: the tier is full before the timed steps, and each
    timed step's prepare evicts as many blocks as it stores (no free room left)."""
    daemon = DaemonProcess(str(tmp_path), dram_bytes=16 * MiB, chunk_bytes=4 * MiB)
    daemon.start()
    try:
        with Client(daemon.address) as client:
            s = local._full_tier_steps(client, repeats=2, blocks=64)
            assert s.n == 40
            stats = client.stats()
            # 16 MiB of 4 KiB slots = 4,096: two untimed steps past the fill, 40 timed
            assert stats.evicted_blocks >= (2 + 40) * 64
            assert stats.stored_blocks == stats.evicted_blocks + 4096
    finally:
        daemon.stop()


def test_stores_into_reserves_land_every_block_and_keep_no_reserve(tmp_path: Path) -> None:
    """The connector's save path measured by `local` (store into reserves): every
    block committed and read back equal inside the bench (it raises otherwise),
    and no reserve or lease outlives a round (the last step asks for none)."""
    daemon = DaemonProcess(str(tmp_path), dram_bytes=64 * MiB, chunk_bytes=4 * MiB)
    daemon.start()
    try:
        with Client(daemon.address) as client:
            assert client.reserves  # the lean channel: CI must measure this path
            # 64 blocks in steps of 24: the last step is short (16 blocks)
            r = local._transfer(client, 64 * 1024, 4 * MiB, 24, True, 3)
            assert r["store_reserved"].n == 3 and r["store_reserved_ratio"] > 0
            client.flush()
            stats = client.stats()
            assert stats.active_leases == 0
            dram = next(t for t in stats.tiers if t.capacity_bytes == 64 * MiB)
            assert dram.used_bytes == 0 and dram.pinned_blocks == 0
    finally:
        daemon.stop()
