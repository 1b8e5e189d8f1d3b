"""Evictions for a store in one pass (Placement.evict_for, from
BlockManager.prepare_store): the very victims reserve_dram takes one by one,
and blocks a request finds present are never evicted for its new ones."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from kvstore.errors import CapacityExhausted
from kvstore.manager import STORE_ALLOCATED, STORE_PRESENT, BlockManager
from kvstore.namespace import Tier
from tests.conftest import make_spec
from tests.managers import managers


@pytest.fixture
def make_manager(tmp_path):
    # 64 slots of 4 KiB
    defaults = ("node_id=b", "dram.capacity_bytes=256KiB", "dram.chunk_bytes=64KiB")
    with managers(tmp_path, *defaults) as make:
        yield make


def _state(m: BlockManager) -> tuple:
    blocks = {ns_id: sorted(ns.blocks) for ns_id, ns in sorted(m.namespaces.items())}
    c = m.placement.counters
    removed = collections.Counter(m.placement.sink.hashes("removed", Tier.DRAM.medium))
    order = [(b.namespace.namespace_id, b.block_hash) for b in m.placement.dram.coldest()]
    used = {ns_id: ns.used_bytes for ns_id, ns in m.namespaces.items()}
    return (
        blocks,
        c.evicted_blocks,
        c.evicted_replica_blocks,
        c.admitted_replicas,
        c.promoted_replicas,
        removed,
        order,
        used,
        m.placement.pinned_blocks,
    )


def test_one_pass_takes_the_victims_one_by_one_would(make_manager):
    """The same random workload on two managers, one evicting per block: stores of
    new, present and repeated hashes over two namespaces, loads that pin blocks
    across stores, pulled copies admitted as replicas (the cold FIFO the search
    window grows by), deletes; after every step the same blocks are held, the
    same victims were evicted (events and counters), in the same eviction order,
    and fewer than all of each store's evictions went through the one pass only
    where the window ran out. The per-block manager also pins and touches a
    load's blocks one by one (the batched one: Placement.pin_many, touch_loaded,
    replicas among them promoted at their second load)."""
    batched, single = make_manager(), make_manager()
    single.placement.evict_for = lambda ns, count: 0  # type: ignore[method-assign]
    one = single.placement
    one.pin_many = lambda blocks: [one.pin(b) for b in blocks]  # type: ignore[method-assign]
    one.touch_loaded = lambda ns, blocks: [one.touch(b) for b in blocks]  # type: ignore[method-assign]
    passes = []
    evict_for = batched.placement.evict_for

    def counting(ns, count):  # type: ignore[no-untyped-def]
        got = evict_for(ns, count)
        passes.append(got)
        return got

    batched.placement.evict_for = counting  # type: ignore[method-assign]
    ns_ids = []
    for m in (batched, single):
        ns_ids = [m.declare_namespace(make_spec(4096, model=name)).namespace_id for name in "ab"]
    rng = np.random.default_rng(11)
    held: list[tuple[int, int]] = []  # (lease in batched, lease in single)
    for step in range(300):
        ns_id = ns_ids[int(rng.integers(0, 2))]
        op = int(rng.integers(0, 10))
        hashes = [int(h) for h in rng.integers(1, 400, int(rng.integers(1, 40)))]
        if op < 6:  # a store (repeats and present hashes included)
            outcomes = []
            for m in (batched, single):
                try:
                    plan = m.prepare_store(ns_id, hashes)
                except CapacityExhausted:  # the pins hold every slot
                    outcomes.append(None)
                    continue
                outcomes.append(bytes(plan.statuses))
                if plan.lease_id:
                    m.commit_store(plan.lease_id)
            assert outcomes[0] == outcomes[1], f"step {step}"
        elif op < 8:  # a load that keeps its pins for a while
            pair = []
            for m in (batched, single):
                have = [h for h in hashes if h in m.namespaces[ns_id].blocks]
                pair.append(m.prepare_load(ns_id, have).lease_id if have else 0)
            if pair[0]:
                held.append((pair[0], pair[1]))
        elif op == 8:  # pulled copies: replicas, first to go
            for m in (batched, single):
                blocks = m.namespaces[ns_id].blocks
                m.note_held_elsewhere([blocks[h] for h in hashes if h in blocks], "a")
                # loads of some of them beside older blocks: touched, counted, and
                # promoted at the second (the loads' per-block path vs touch_loaded)
                again = [h for h in hashes if h in blocks][:3] + sorted(blocks)[:3]
                for _ in range(2):
                    if lease := m.prepare_load(ns_id, again).lease_id:
                        m.release([lease])
        else:
            for m in (batched, single):
                m.delete(ns_id, hashes)
        if len(held) > 6 or (held and rng.integers(0, 3) == 0):
            lease_b, lease_s = held.pop(0)
            batched.release([lease_b])
            single.release([lease_s])
        assert _state(batched) == _state(single), f"step {step}"
    assert batched.placement.counters.evicted_blocks > 500
    assert batched.placement.counters.evicted_replica_blocks > 0
    assert batched.placement.counters.promoted_replicas > 0
    assert sum(passes) > 0.9 * batched.placement.counters.evicted_blocks


def test_a_block_found_present_is_not_evicted_for_a_new_one_before_it(make_manager):
    """A full tier whose coldest block is the last hash of a store: the store's new
    blocks evict others, and that block is reported present and stays."""
    m = make_manager()
    ns_id = m.declare_namespace(make_spec(4096)).namespace_id
    for start in range(1, 65, 16):
        m.commit_store(m.prepare_store(ns_id, list(range(start, start + 16))).lease_id)
    assert len(m.namespaces[ns_id].blocks) == 64  # full: 1 is the coldest
    plan = m.prepare_store(ns_id, [1000, 1001, 1])
    assert list(plan.statuses) == [STORE_ALLOCATED, STORE_ALLOCATED, STORE_PRESENT]
    m.commit_store(plan.lease_id)
    blocks = m.namespaces[ns_id].blocks
    assert 1 in blocks and 1000 in blocks and 1001 in blocks
    assert 2 not in blocks and 3 not in blocks  # the next coldest went instead


@pytest.mark.parametrize(
    "setting",
    [
        "dram.eviction_policy=s3fifo",
        "eviction.copy_aware=true",
        "limits.namespace_quota_bytes=128KiB",
    ],
)
def test_other_rules_evict_block_by_block(make_manager, setting):
    """Where a victim's choice depends on more than the order, no one pass: the
    per-block path evicts, and a full tier still takes a store."""
    m = make_manager(setting)
    ns_id = m.declare_namespace(make_spec(4096)).namespace_id
    ns = m.namespaces[ns_id]
    assert m.placement.evict_for(ns, 4) == 0
    for start in range(1, 200, 16):
        plan = m.prepare_store(ns_id, list(range(start, start + 16)))
        m.commit_store(plan.lease_id)
    assert len(ns.blocks) >= 16 and m.placement.counters.evicted_blocks > 0


def test_pinned_blocks_at_the_cold_end_do_not_stop_a_store(make_manager):
    """Three replicas (the cold FIFO) ahead of five blocks a load lease pins, at the
    cold end of a full tier: a store of ten takes the replicas' slots, then the
    coldest unpinned blocks behind the pinned ones (before 2026-12-05 a search
    looked at the 4 + replicas coldest only: it got three slots, the rest
    NO_ROOM), one by one and in one pass alike."""
    got = []
    for batched in (True, False):
        m = make_manager()
        if not batched:
            m.placement.evict_for = lambda ns, count: 0  # type: ignore[method-assign]
        ns = m.declare_namespace(make_spec(4096))
        m.commit_store(m.prepare_store(ns.namespace_id, [1, 2, 3, 4, 5]).lease_id)
        lease = m.prepare_load(ns.namespace_id, [1, 2, 3, 4, 5]).lease_id  # pinned
        m.commit_store(m.prepare_store(ns.namespace_id, list(range(100, 159))).lease_id)
        m.note_held_elsewhere([ns.blocks[h] for h in (150, 151, 152)], "a")  # replicas
        plan = m.prepare_store(ns.namespace_id, list(range(1000, 1010)))
        got.append((list(plan.statuses), sorted(ns.blocks)))
        m.release([lease])
    assert got[0] == got[1]
    statuses, held = got[0]
    assert statuses == [STORE_ALLOCATED] * 10
    assert {1, 2, 3, 4, 5} <= set(held)  # pinned: kept
    gone = set(range(100, 159)) - set(held)
    assert gone == {150, 151, 152, 100, 101, 102, 103, 104, 105, 106}
