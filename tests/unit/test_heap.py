"""The cyclic collector in servers: start-up frozen (`settle_heap`), blocks never tracked."""

from __future__ import annotations

import gc
import weakref

from kvstore.heap import CollectorPauses, PauseCollector, settle_heap
from kvstore.namespace import Namespace, TenantAccount, Tier
from tests.conftest import make_spec
from tests.managers import managers


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_settle_heap_collects_garbage_then_freezes_the_rest():
    gc.unfreeze()
    try:
        live = _Node()
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # an unreachable cycle: only the collector frees it
        dead = weakref.ref(a)
        del a, b
        settle_heap()
        assert dead() is None  # collected first, not frozen with the rest
        assert gc.get_freeze_count() > 0
        assert all(o is not live for o in gc.get_objects())  # live ones: frozen
    finally:
        gc.unfreeze()


def test_blocks_are_never_tracked_and_a_dropped_managers_index_is_freed(tmp_path):
    """A Block is invisible to the cyclic collector (a full collection would walk
    millions of them); so the namespace <-> block cycle (and the tenant order's)
    is cut once the manager is gone, and nothing of its index outlives it."""
    gc.collect()

    def held() -> int:
        return sum(1 for o in gc.get_objects() if isinstance(o, Namespace | TenantAccount))

    before = held()
    with managers(tmp_path, "quotas.default_dram_bytes=16777216") as make:
        m = make()
        spec = make_spec(4096, tenant="s")
        ns = m.declare_namespace(spec)
        plan = m.prepare_store(ns.namespace_id, list(range(1, 65)), 30)
        m.commit_store(plan.lease_id, list(range(1, 33)))
        m.prepare_store(ns.namespace_id, list(range(100, 110)), 30)  # left pending
        block = ns.blocks[1]
        assert not gc.is_tracked(block)
        assert ns.account is not None and ns.account.order[Tier.DRAM]  # a capped tenant's order
        del ns, block, plan, m
    gc.collect()
    assert held() == before


def test_collector_pauses_times_each_collection_by_generation():
    pauses = CollectorPauses()
    pauses.install()
    try:
        before = [pauses.count(g) for g in range(3)]
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        pauses.uninstall()
    gc.collect(2)  # not counted: uninstalled (the counts below would be one more)
    assert pauses.count(0) == before[0] + 1
    assert pauses.count(2) == before[2] + 2
    assert pauses.total_s[2] > 0
    assert 0 < pauses.longest_s[2] <= pauses.total_s[2]
    text = "".join(
        f"{s.name}{s.labels} {s.value}\n"
        for family in PauseCollector(pauses).collect()
        for s in family.samples
    )
    # Cumulative buckets: the last (+Inf) holds every pause of the generation.
    assert (
        f"kvstore_gc_pause_seconds_bucket{{'generation': '2', 'le': '+Inf'}} {pauses.count(2)}"
        in text
    )
    assert f"kvstore_gc_pause_seconds_count{{'generation': '2'}} {pauses.count(2)}" in text
    assert "kvstore_gc_frozen_objects{} " in text
