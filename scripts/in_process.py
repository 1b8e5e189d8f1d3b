"""A block manager over a temporary DRAM region, in this process: what the
in-process measurements (scripts/gc_pause.py, scripts/step_stalls.py) start
from. No daemon, no client, no I/O but the region's sparse file.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstore.config import load_config
from kvstore.manager import BlockManager
from kvstore.namespace import NamespaceSpec
from kvstore.tiers.dram import Region

FILL_BATCH_BLOCKS = 16384


def open_manager(
    tmp: str, capacity_bytes: int, block_bytes: int, model: str, chunk_bytes: int = 4 << 20
) -> tuple[Region, BlockManager, str]:
    """A region of ``capacity_bytes`` in ``tmp`` (not prefaulted, 4 KiB pages), a
    manager over it and one namespace of ``block_bytes`` blocks: (region, manager,
    namespace id). The caller closes the region (``close(unlink=True)``)."""
    config = load_config(
        environ={},
        assignments=[
            f"dram.path={tmp}/region",
            f"dram.capacity_bytes={capacity_bytes}",
            f"dram.chunk_bytes={chunk_bytes}",
        ],
    )
    region = Region(config.dram.path, config.dram.capacity_bytes, prefault=False, huge_pages="off")
    try:
        manager = BlockManager(config, region)
        spec = NamespaceSpec(
            model=model,
            dtype="float16",
            block_size_tokens=16,
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            block_bytes=block_bytes,
        )
        ns_id = manager.declare_namespace(spec).namespace_id
    except BaseException:
        region.close(unlink=True)
        raise
    return region, manager, ns_id


def fill(manager: BlockManager, ns_id: str, blocks: int) -> list[float]:
    """Store and commit blocks 1..``blocks`` in batches of FILL_BATCH_BLOCKS; each
    batch's seconds per block."""
    per_block_s = []
    for lo in range(1, blocks + 1, FILL_BATCH_BLOCKS):
        hashes = list(range(lo, min(lo + FILL_BATCH_BLOCKS, blocks + 1)))
        started = time.perf_counter()
        plan = manager.prepare_store(ns_id, hashes, 30)
        manager.commit_store(plan.lease_id, hashes)
        per_block_s.append((time.perf_counter() - started) / len(hashes))
    return per_block_s
