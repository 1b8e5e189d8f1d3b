"""Slot lifetimes across tier moves (issue 19): a slot is reused only when nothing can
still touch it, and a cancelled load leaves nothing behind.

Timing is forced, never hoped for: a Gate installed as the GPU layer's copy hook or
the disk tier's I/O hook holds the worker thread at the start of its copy, read or
write until the test has done what must happen meanwhile.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from kvstore.manager import STORE_ALLOCATED
from kvstore.tiers import Tier
from tests.conftest import make_spec
from tests.unit.test_gpu_layer import BLOCK, Node, data, same

pytest.importorskip("torch")

WAIT_S = 10.0


class Gate:
    """A hook that holds worker threads (of one kind of I/O) until opened."""

    def __init__(self, kind: str | None = None) -> None:
        self.kind = kind
        self.entered = threading.Event()
        self._open = threading.Event()
        self.calls = 0

    def __call__(self, kind: str | None = None) -> None:
        if self.kind is not None and kind != self.kind:
            return
        self.calls += 1
        self.entered.set()
        assert self._open.wait(WAIT_S), "gate never opened"

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, WAIT_S), "no worker reached the gate"

    def open(self) -> None:
        self._open.set()


async def until(predicate, what: str) -> None:
    """A bounded wait for a state the event loop reaches by itself."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


def read(space: np.ndarray, offsets) -> list[np.ndarray]:
    return [space[o : o + BLOCK].copy() for o in offsets]


# ------------------------------------------------------------------ bug 1


async def test_a_gpu_load_never_frees_dram_slots_a_lease_holds(tmp_path):
    node = Node(tmp_path)  # GPU 8 blocks, DRAM 16
    node.put([1, 2, 3, 4], tier=Tier.DRAM)
    a = node.m.prepare_load(node.ns.namespace_id, [1, 2, 3, 4])  # client A's DRAM lease
    got = await node.get([1, 2, 3, 4], tier=Tier.GPU)  # client B asks for the GPU tier
    assert same(got, [1, 2, 3, 4][: len(got)])
    node.put(list(range(100, 116)), tier=Tier.DRAM)  # client C fills DRAM
    assert same(read(node.region.array, a.offsets), [1, 2, 3, 4])
    node.m.release([a.lease_id])
    node.check_accounting()
    await node.close()


async def test_a_dram_load_never_frees_gpu_slots_a_lease_holds(tmp_path):
    node = Node(tmp_path)
    node.put([1, 2, 3, 4], tier=Tier.GPU)
    a = node.m.prepare_load(node.ns.namespace_id, [1, 2, 3, 4], tier=Tier.GPU)
    got = await node.get([1, 2, 3, 4], tier=Tier.DRAM)
    assert same(got, [1, 2, 3, 4][: len(got)])
    node.put(list(range(100, 108)), tier=Tier.GPU)  # fills the pool
    assert same(read(node.pool, a.offsets), [1, 2, 3, 4])
    node.m.release([a.lease_id])
    node.check_accounting()
    await node.close()


async def test_a_lease_taken_during_a_move_keeps_its_slots(tmp_path):
    node = Node(tmp_path)
    node.put([1, 2, 3, 4], tier=Tier.DRAM)
    gate = node.m.gpu.copy_hook = Gate()
    b = asyncio.create_task(
        node.m.prepare_load_async(node.ns.namespace_id, [1, 2, 3, 4], tier=Tier.GPU)
    )
    await gate.wait_entered()  # B's copy up is running
    a = node.m.prepare_load(node.ns.namespace_id, [1, 2, 3, 4])  # A pins them in DRAM
    assert a.lease_id and len(a.blocks) == 4
    gate.open()
    plan_b = await b
    assert same(read(node.pool, plan_b.offsets), [1, 2, 3, 4][: len(plan_b.blocks)])
    if plan_b.lease_id:
        node.m.release([plan_b.lease_id])
    node.put(list(range(100, 116)), tier=Tier.DRAM)
    assert same(read(node.region.array, a.offsets), [1, 2, 3, 4])
    node.m.release([a.lease_id])
    node.check_accounting()
    await node.close()


async def test_the_gpu_demoter_never_moves_blocks_leased_after_it_chose_them(tmp_path):
    node = Node(tmp_path, **{"gpu.demote_free_fraction": 0.5})  # keep 4 of 8 slots free
    other = node.m.declare_namespace(make_spec(BLOCK, model="other"))
    gate = node.m.gpu.copy_hook = Gate()
    node.put([1, 2], tier=Tier.GPU)  # coldest: the demoter takes them and 11, 12
    plan = node.m.prepare_store(other.namespace_id, list(range(11, 17)), tier=Tier.GPU)
    for h, off in zip(range(11, 17), plan.offsets, strict=True):
        node.pool[off : off + BLOCK] = data(h)
    node.m.commit_store(plan.lease_id)
    await gate.wait_entered()  # the demoter copies ns's blocks; other's wait their turn
    a = node.m.prepare_load(other.namespace_id, [11, 12], tier=Tier.GPU)
    assert len(a.blocks) == 2
    gate.open()
    gpu = node.m.gpu
    await until(lambda: gpu._need_bytes() <= 0 and not gpu._moving, "the demoter to finish")
    node.put(list(range(100, 104)), tier=Tier.GPU)  # takes the free slots
    assert same(read(node.pool, a.offsets), [11, 12])
    node.m.release([a.lease_id])
    await node.close()


# ------------------------------------------------------------------ bug 2


async def test_the_disk_demoter_persists_only_the_blocks_own_bytes(tmp_path):
    node = Node(tmp_path, disk="1MiB")
    gate = node.m.disk.tier.io_hook = Gate("write")
    node.put([1], tier=Tier.DRAM)
    x = node.ns.blocks[1]
    await gate.wait_entered()  # X's disk write has started and reads X's DRAM slot
    await node.get([1], tier=Tier.GPU)  # X moves up (it must not: the write reads it)
    node.put([2], tier=Tier.DRAM)  # Y takes X's old slot if it was freed
    await node.get([1], tier=Tier.DRAM)  # X comes back to another slot
    gate.open()
    await node.m.disk.drain(timeout_s=WAIT_S)
    await until(lambda: x.disk_slot >= 0 and x.pins == 0, "X's write to land")
    out = np.empty(BLOCK, dtype=np.uint8)
    await node.m.disk.tier.read(x.disk_slot, out)
    assert np.array_equal(out, data(1)), "X's disk copy holds another block's bytes"
    await node.close()


# ------------------------------------------------------------------ bug 5


async def test_a_gpu_load_cancelled_mid_copy_leaks_no_slot(tmp_path):
    node = Node(tmp_path)
    node.put([1, 2, 3, 4], tier=Tier.DRAM)
    gpu = node.m.gpu
    for _ in range(3):  # three cancelled loads leaked 12 of 16 pool slots
        gate = gpu.copy_hook = Gate()
        load = asyncio.create_task(
            node.m.prepare_load_async(node.ns.namespace_id, [1, 2, 3, 4], tier=Tier.GPU)
        )
        await gate.wait_entered()
        load.cancel()
        await asyncio.wait([load])
        gate.open()
        await until(lambda: not gpu._moving, "the move to finish")
        node.check_accounting()
        # The move finished for the load that left: the blocks are in the pool, whole.
        assert same(await node.get([1, 2, 3, 4], tier=Tier.GPU), [1, 2, 3, 4])
        node.check_accounting()
        await node.get([1, 2, 3, 4], tier=Tier.DRAM)  # back down for the next round
    await node.close()


async def test_a_dram_load_cancelled_mid_copy_leaks_no_slot(tmp_path):
    node = Node(tmp_path)
    node.put([1, 2, 3, 4], tier=Tier.GPU)
    gpu = node.m.gpu
    gate = gpu.copy_hook = Gate()
    load = asyncio.create_task(
        node.m.prepare_load_async(node.ns.namespace_id, [1, 2, 3, 4], tier=Tier.DRAM)
    )
    await gate.wait_entered()
    load.cancel()
    await asyncio.wait([load])
    gate.open()
    await until(lambda: not gpu._moving, "the move to finish")
    node.check_accounting()
    assert len(node.m.placement.dram.owner) == sum(b.offset >= 0 for b in node.ns.blocks.values())
    assert same(await node.get([1, 2, 3, 4], tier=Tier.DRAM), [1, 2, 3, 4])
    node.check_accounting()
    await node.close()


# ------------------------------------------------------------------ bug 6


async def test_a_promotion_cancelled_mid_read_leaves_no_zombie(tmp_path):
    node = Node(tmp_path, disk="1MiB")
    m, ns_id = node.m, node.ns.namespace_id
    node.put([1, 2, 3, 4], tier=Tier.DRAM)
    await until(lambda: all(node.ns.blocks[h].disk_slot >= 0 for h in (1, 2, 3, 4)), "demotion")
    for h in (1, 2, 3, 4):
        m.disk.drop_dram_copy(node.ns.blocks[h])  # on disk only now
    gate = m.disk.tier.io_hook = Gate("read")
    load = asyncio.create_task(m.prepare_load_async(ns_id, [1, 2, 3, 4]))
    await gate.wait_entered()  # the promotion's read is running
    load.cancel()
    await asyncio.wait([load])
    # Deleted while the read still lands in their reserved slots: busy, not gone.
    assert m.delete(ns_id, [1, 2, 3, 4]) == (0, 4)
    assert m.lookup(ns_id, [1, 2, 3, 4]).prefix_blocks == 0
    gate.open()
    await until(lambda: not m.disk._promoting, "the read to land")
    assert m.placement.pinned_blocks == 0
    assert len(m.placement.dram.policy(node.ns.slot_bytes)) == 0 and m.allocator.used_bytes == 0
    assert m.disk.blocks() == 0  # their disk copies went at the last unpin
    # Eviction runs over a consistent index (a zombie made every such store fail).
    for start in range(100, 140, 8):
        node.put(list(range(start, start + 8)), tier=Tier.DRAM)
    node.put([1, 2, 3, 4], tier=Tier.DRAM)  # stored again: new blocks
    assert same(await node.get([1, 2, 3, 4], tier=Tier.DRAM), [1, 2, 3, 4])
    await node.close()


# ------------------------------------------------------------------ bug 8


async def test_a_store_of_a_block_deleted_while_pinned_is_kept(tmp_path):
    node = Node(tmp_path)
    m, ns_id = node.m, node.ns.namespace_id
    node.put([1, 2, 3], tier=Tier.DRAM)
    a = m.prepare_load(ns_id, [1, 2, 3])
    assert m.delete(ns_id, [1, 2, 3]) == (0, 3)
    # Lookup and PrepareLoad agree: gone for every new request.
    assert m.lookup(ns_id, [1, 2, 3]).prefix_blocks == 0
    assert m.prepare_load(ns_id, [1, 2, 3]).lease_id == 0
    plan = node.put([1, 2, 3], tier=Tier.DRAM)  # a new store of the same hashes
    assert list(plan.statuses) == [STORE_ALLOCATED] * 3
    assert not set(plan.offsets) & set(a.offsets)  # A's slots are still A's
    assert same(read(node.region.array, a.offsets), [1, 2, 3])
    m.release([a.lease_id])
    assert m.lookup(ns_id, [1, 2, 3]).prefix_blocks == 3  # the new store survives
    assert same(await node.get([1, 2, 3], tier=Tier.DRAM), [1, 2, 3])
    node.check_accounting()
    await node.close()
