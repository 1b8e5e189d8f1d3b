"""The block manager's rules, in-process (no server): admission, pins, eviction, leases."""

from __future__ import annotations

import time

import pytest

from kvstore.config import load_config
from kvstore.errors import (
    CapacityExhausted,
    InvalidRequest,
    LeaseExpired,
    LeaseNotFound,
    NamespaceNotFound,
    StateConflict,
)
from kvstore.manager import (
    STORE_ALLOCATED,
    STORE_IN_FLIGHT,
    STORE_NO_ROOM,
    STORE_PRESENT,
    BlockManager,
)
from kvstore.manager import (
    StoreChain as C,
)
from kvstore.tiers import Tier
from kvstore.tiers.dram import Region
from tests.conftest import make_spec


class RecordingSink:
    def __init__(self):
        self.events = []

    def blocks_stored(self, ns, hashes, medium, parent, tokens):
        self.events.append(("stored", list(hashes), medium, parent, tokens))

    def blocks_removed(self, ns, hashes, medium):
        self.events.append(("removed", list(hashes), medium))

    def all_cleared(self, ns):
        self.events.append(("cleared",))


@pytest.fixture
def make_manager(tmp_path):
    made = []

    def make(capacity="1MiB", chunk="256KiB", **settings):
        assignments = [
            f"dram.capacity_bytes={capacity}",
            f"dram.chunk_bytes={chunk}",
            f"dram.path={tmp_path}/r{len(made)}",
        ]
        assignments += [f"{k.replace('__', '.')}={v}" for k, v in settings.items()]
        config = load_config(environ={}, assignments=assignments)
        region = Region(
            config.dram.path, config.dram.capacity_bytes, prefault=False, huge_pages="off"
        )
        sink = RecordingSink()
        m = BlockManager(config, region, sink)
        m.sink_record = sink
        made.append(region)
        return m

    yield make
    for r in made:
        r.close(unlink=True)


def store(m, ns, hashes, **kw):
    plan = m.prepare_store(ns.namespace_id, hashes)
    if plan.lease_id:
        m.commit_store(plan.lease_id, **kw)
    return plan


def test_store_then_lookup_and_load(make_manager):
    m = make_manager()
    ns = m.declare_namespace(make_spec(4096))
    plan = m.prepare_store(ns.namespace_id, [1, 2, 3])
    assert list(plan.statuses) == [STORE_ALLOCATED] * 3
    assert m.lookup(ns.namespace_id, [1, 2, 3]).prefix_blocks == 0  # not loadable before commit
    assert m.commit_store(plan.lease_id, parent_block_hash=99, token_ids=list(range(48))) == 3
    r = m.lookup(ns.namespace_id, [1, 2, 3, 4, 1])
    assert r.prefix_blocks == 3 and r.by_tier == {Tier.DRAM: 3}
    load = m.prepare_load(ns.namespace_id, [1, 2, 9, 3])
    assert [b.block_hash for b in load.blocks] == [1, 2]  # longest prefix only
    assert load.offsets == plan.offsets[:2]
    assert m.stats().tiers[0].pinned_blocks == 2
    m.release([load.lease_id])
    assert m.stats().tiers[0].pinned_blocks == 0
    assert m.sink_record.events == [("stored", [1, 2, 3], "CPU", 99, list(range(48)))]


def test_present_and_in_flight_are_reported_not_rewritten(make_manager):
    m = make_manager()
    ns = m.declare_namespace(make_spec(4096))
    first = store(m, ns, [1, 2])
    pending = m.prepare_store(ns.namespace_id, [3])
    plan = m.prepare_store(ns.namespace_id, [1, 3, 4, 4])
    assert list(plan.statuses) == [STORE_PRESENT, STORE_IN_FLIGHT, STORE_ALLOCATED, STORE_IN_FLIGHT]
    assert plan.offsets[0] == 0 and first.offsets[0] != plan.offsets[2]
    m.commit_store(pending.lease_id)
    m.commit_store(plan.lease_id)
    assert m.lookup(ns.namespace_id, [1, 2, 3, 4]).prefix_blocks == 4


def test_partial_commit_frees_the_rest(make_manager):
    m = make_manager()
    ns = m.declare_namespace(make_spec(4096))
    plan = m.prepare_store(ns.namespace_id, [1, 2, 3])
    assert m.commit_store(plan.lease_id, [1, 3]) == 2
    assert m.lookup(ns.namespace_id, [1]).prefix_blocks == 1
    assert m.lookup(ns.namespace_id, [2]).prefix_blocks == 0
    assert m.allocator.used_bytes == 2 * 4096


def test_commit_rules(make_manager):
    m = make_manager()
    ns = m.declare_namespace(make_spec(4096))
    with pytest.raises(LeaseNotFound):
        m.commit_store(12345)
    plan = m.prepare_store(ns.namespace_id, [1, 2])
    with pytest.raises(StateConflict, match="not prepared"):
        m.commit_store(plan.lease_id, [1, 7])
    with pytest.raises(InvalidRequest, match="token_ids"):
        m.commit_store(plan.lease_id, token_ids=[1, 2, 3])
    # the failed commits changed nothing: the lease still commits
    assert m.commit_store(plan.lease_id) == 2
    load = m.prepare_load(ns.namespace_id, [1])
    with pytest.raises(StateConflict, match="load lease"):
        m.commit_store(load.lease_id)


def test_commit_with_chains_sends_one_event_per_chain_in_the_given_order(make_manager):
    m = make_manager()
    ns = m.declare_namespace(make_spec(4096))  # 16 tokens per block
    plan = m.prepare_store(ns.namespace_id, [1, 2, 3, 4, 5])
    toks = list(range(5 * 16))
    order = [3, 4, 1, 2, 5]
    bad = [
        ([C(2), C(2, 1)], {}, "hold 4 blocks"),  # the chains miss a block
        ([C(0), C(5)], {}, ">= 1 block"),
        ([C(2, 9, toks[:31]), C(3)], {}, "expected 2 blocks x 16 tokens"),
        ([C(5)], {"token_ids": toks}, "per chain"),
        ([C(5)], {"parent_block_hash": 7}, "per chain"),
    ]
    for chains, kw, msg in bad:
        with pytest.raises(InvalidRequest, match=msg):
            m.commit_store(plan.lease_id, order, chains=chains, **kw)
    with pytest.raises(InvalidRequest, match="each block once"):
        m.commit_store(plan.lease_id, [1, 1, 2], chains=[C(3)])
    assert m.sink_record.events == []  # the refused commits changed nothing
    # the caller's order, not the lease's: parents first
    chains = [C(2, 9, toks[:32]), C(2, None, toks[32:64]), C(1, 2, toks[64:])]
    assert m.commit_store(plan.lease_id, order, chains=chains) == 5
    assert m.sink_record.events == [
        ("stored", [3, 4], "CPU", 9, toks[:32]),
        ("stored", [1, 2], "CPU", None, toks[32:64]),
        ("stored", [5], "CPU", 2, toks[64:]),
    ]


def test_unknown_namespace_and_limits(make_manager):
    m = make_manager(limits__max_blocks_per_request=4)
    with pytest.raises(NamespaceNotFound):
        m.lookup("ns-nope", [1])
    ns = m.declare_namespace(make_spec(4096))
    with pytest.raises(InvalidRequest, match="max_blocks_per_request"):
        m.prepare_store(ns.namespace_id, [1, 2, 3, 4, 5])
    with pytest.raises(InvalidRequest, match="lease_ttl_s"):
        m.prepare_load(ns.namespace_id, [1], ttl_s=-1)
    with pytest.raises(InvalidRequest, match="block_bytes"):
        m.declare_namespace(make_spec(0))
    with pytest.raises(InvalidRequest, match="exceeds"):
        m.declare_namespace(make_spec(512 << 10))  # > chunk


def test_namespace_ids_are_stable_and_tenant_scoped(make_manager):
    m = make_manager()
    a = m.declare_namespace(make_spec(4096, tenant="alice"))
    b = m.declare_namespace(make_spec(4096, tenant="bob"))
    assert a is m.declare_namespace(make_spec(4096, tenant="alice"))
    assert a.namespace_id != b.namespace_id
    store(m, a, [1])
    assert m.lookup(b.namespace_id, [1]).prefix_blocks == 0


def test_lru_eviction_keeps_recently_used(make_manager):
    m = make_manager(capacity="64KiB", chunk="64KiB")  # 16 slots of 4 KiB
    ns = m.declare_namespace(make_spec(4096))
    store(m, ns, list(range(16)))
    m.release([m.prepare_load(ns.namespace_id, [0, 1]).lease_id])  # 0 and 1 become hot
    store(m, ns, [100, 101])
    assert m.lookup(ns.namespace_id, [0, 1]).prefix_blocks == 2
    assert m.lookup(ns.namespace_id, [2]).prefix_blocks == 0  # coldest went first
    assert m.lookup(ns.namespace_id, [3]).prefix_blocks == 0
    assert m.counters.evicted_blocks == 2
    assert ("removed", [2], "CPU") in m.sink_record.events


def test_pinned_blocks_are_never_evicted_and_full_pinned_tier_is_exhausted(make_manager):
    m = make_manager(capacity="64KiB", chunk="64KiB")
    ns = m.declare_namespace(make_spec(4096))
    store(m, ns, list(range(16)))
    load = m.prepare_load(ns.namespace_id, list(range(16)))
    with pytest.raises(CapacityExhausted, match="full"):
        m.prepare_store(ns.namespace_id, [100])
    assert m.lookup(ns.namespace_id, list(range(16))).prefix_blocks == 16
    m.release([load.lease_id])
    assert store(m, ns, [100]).lease_id


def test_no_room_for_the_tail_is_reported_per_block(make_manager):
    m = make_manager(capacity="64KiB", chunk="64KiB")
    ns = m.declare_namespace(make_spec(4096))
    plan = m.prepare_store(ns.namespace_id, list(range(20)))  # 16 slots, all reserved by this lease
    assert list(plan.statuses) == [STORE_ALLOCATED] * 16 + [STORE_NO_ROOM] * 4


def test_storing_the_tail_does_not_evict_the_head_it_reported(make_manager):
    m = make_manager(capacity="64KiB", chunk="64KiB")
    ns = m.declare_namespace(make_spec(4096))
    store(m, ns, list(range(16)))
    plan = m.prepare_store(ns.namespace_id, [0, 1, 50])
    assert list(plan.statuses)[:2] == [STORE_PRESENT, STORE_PRESENT]
    m.commit_store(plan.lease_id)
    assert m.lookup(ns.namespace_id, [0, 1, 50]).prefix_blocks == 3


def test_other_sizes_give_up_whole_chunks(make_manager):
    m = make_manager(capacity="512KiB", chunk="256KiB")
    small = m.declare_namespace(make_spec(4096, model="small"))
    big = m.declare_namespace(make_spec(256 << 10, model="big"))
    store(m, small, list(range(128)))  # both chunks hold small blocks
    plan = store(m, big, [1])
    assert plan.lease_id and m.lookup(big.namespace_id, [1]).prefix_blocks == 1
    # exactly one chunk (64 small blocks) was given up, the coldest one
    assert m.lookup(small.namespace_id, list(range(64, 128))).prefix_blocks == 64
    assert m.lookup(small.namespace_id, [0]).prefix_blocks == 0
    assert m.allocator.used_bytes == 512 << 10


def test_namespace_quota(make_manager):
    m = make_manager(limits__namespace_quota_bytes="16KiB")
    ns = m.declare_namespace(make_spec(4096))
    other = m.declare_namespace(make_spec(4096, tenant="t2"))
    store(m, other, [7])
    plan = store(m, ns, [1, 2, 3, 4, 5, 6])
    assert (
        list(plan.statuses) == [STORE_ALLOCATED] * 4 + [STORE_NO_ROOM] * 2
    )  # its own pending blocks stay
    store(m, ns, [5, 6])  # a later request evicts the namespace's coldest
    assert ns.used_bytes <= 16 << 10
    assert m.lookup(ns.namespace_id, [3, 4, 5, 6]).prefix_blocks == 4
    assert m.lookup(ns.namespace_id, [1]).prefix_blocks == 0
    assert m.lookup(other.namespace_id, [7]).prefix_blocks == 1  # quota evicts only its own


def test_expired_leases_strand_nothing(make_manager):
    m = make_manager()
    ns = m.declare_namespace(make_spec(4096))
    store(m, ns, [1])
    load = m.prepare_load(ns.namespace_id, [1], ttl_s=1.0)
    store_plan = m.prepare_store(ns.namespace_id, [2, 3], ttl_s=1.0)
    now = time.monotonic()
    assert m.expire_leases(now) == 0
    assert m.expire_leases(now + 2.0) == 2
    # Quarantined first: unusable at once, their slots and pins held a while longer.
    with pytest.raises(LeaseExpired):
        m.commit_store(store_plan.lease_id)
    assert m.stats().tiers[0].pinned_blocks == 1 and m.allocator.used_bytes == 3 * 4096
    assert m.expire_leases(now + 2.0 + m.config.leases.quarantine_s) == 0
    assert m.stats().tiers[0].pinned_blocks == 0
    assert m.allocator.used_bytes == 4096  # the aborted store's slots came back
    with pytest.raises(LeaseNotFound):
        m.commit_store(store_plan.lease_id)
    with pytest.raises(LeaseNotFound):
        m.release([load.lease_id])
    assert store(m, ns, [2, 3]).lease_id  # storable again


def test_delete_of_pinned_block_waits_for_release(make_manager):
    m = make_manager()
    ns = m.declare_namespace(make_spec(4096))
    store(m, ns, [1, 2])
    load = m.prepare_load(ns.namespace_id, [1])
    assert m.delete(ns.namespace_id, [1, 2, 3]) == (1, 1)
    # Gone for every new request (Lookup and PrepareLoad agree, issue 19 bug 8);
    # its holder's slot stays its own until the release.
    assert m.lookup(ns.namespace_id, [1]).prefix_blocks == 0
    assert m.prepare_load(ns.namespace_id, [1]).lease_id == 0  # no new pins
    assert m.allocator.used_bytes == 4096
    m.release([load.lease_id])
    assert m.lookup(ns.namespace_id, [1]).prefix_blocks == 0
    assert m.allocator.used_bytes == 0


def test_clear(make_manager):
    m = make_manager()
    ns = m.declare_namespace(make_spec(4096))
    other = m.declare_namespace(make_spec(4096, model="other"))
    store(m, ns, [1, 2, 3])
    store(m, other, [1])
    assert m.clear(ns.namespace_id) == 3
    assert m.lookup(other.namespace_id, [1]).prefix_blocks == 1
    # exact removals: an indexer keyed by model keeps `other`'s block
    assert m.sink_record.events[-1] == ("removed", [1, 2, 3], "CPU")


def test_release_reports_unknown_after_releasing_the_rest(make_manager):
    m = make_manager()
    ns = m.declare_namespace(make_spec(4096))
    store(m, ns, [1])
    load = m.prepare_load(ns.namespace_id, [1])
    with pytest.raises(LeaseNotFound):
        m.release([load.lease_id, 424242])
    assert m.stats().active_leases == 0


def test_expired_store_slots_are_not_reused_until_the_quarantine_ends(make_manager):
    """Issue 19, bug 4b: the reaper freed an expired store lease's slots at once, so a
    writer still copying (stalled past its TTL) wrote into another client's blocks."""
    m = make_manager(leases__quarantine_s=3.0)
    ns = m.declare_namespace(make_spec(4096))
    late = m.prepare_store(ns.namespace_id, [1, 2], ttl_s=1.0)
    now = time.monotonic()
    assert m.expire_leases(now + 1.5) == 1
    # The late writer's hashes can be stored again at once, into other slots.
    other = m.prepare_store(ns.namespace_id, [1, 2, 3])
    assert list(other.statuses) == [STORE_ALLOCATED] * 3
    assert not set(other.offsets) & set(late.offsets)
    m.commit_store(other.lease_id)
    with pytest.raises(LeaseExpired, match="lease expired"):
        m.commit_store(late.lease_id)  # the owner is told why
    assert m.lookup(ns.namespace_id, [1, 2, 3]).prefix_blocks == 3
    assert m.stats().active_leases == 1  # the quarantined one still holds its slots
    m.expire_leases(now + 1.5 + 3.0)
    assert m.stats().active_leases == 0
    assert m.allocator.used_bytes == 3 * 4096


def test_expired_load_keeps_its_pins_through_the_quarantine(make_manager):
    m = make_manager(leases__quarantine_s=3.0)
    ns = m.declare_namespace(make_spec(4096))
    store(m, ns, [1])
    load = m.prepare_load(ns.namespace_id, [1], ttl_s=1.0)
    now = time.monotonic()
    m.expire_leases(now + 1.5)
    assert m.delete(ns.namespace_id, [1]) == (0, 1)  # still pinned: a late reader may be copying
    with pytest.raises(LeaseExpired):
        m.release([load.lease_id])
    m.expire_leases(now + 4.6)
    assert m.lookup(ns.namespace_id, [1]).prefix_blocks == 0 and m.allocator.used_bytes == 0


def test_lease_ids_are_not_guessable_and_answer_only_their_owner(make_manager):
    """Issue 13, defect 5: ids were sequential, and anyone could commit or release them."""
    m = make_manager()
    ns = m.declare_namespace(make_spec(4096))
    mine = m.prepare_store(ns.namespace_id, [1], owner="ipv4:10.0.0.1")
    ids = [m.prepare_store(ns.namespace_id, [100 + i]).lease_id for i in range(200)]
    assert len(set(ids)) == len(ids) and 0 not in ids
    # Neighbours of one's own ids are nobody's.
    live = set(ids) | {mine.lease_id}
    assert not {i + d for i in ids for d in range(-64, 65) if d} & live
    for caller in ("", "unix", "ipv4:10.0.0.2"):
        with pytest.raises(LeaseNotFound) as err:
            m.commit_store(mine.lease_id, owner=caller)
        assert type(err.value) is LeaseNotFound and "never issued" in str(err.value)
        with pytest.raises(LeaseNotFound):
            m.release([mine.lease_id], owner=caller)
    assert m.commit_store(mine.lease_id, owner="ipv4:10.0.0.1") == 1


def test_lease_ids_are_a_keyed_permutation_of_a_counter():
    from kvstore.leases import LeaseIds

    a, again, other = LeaseIds(b"k" * 16), LeaseIds(b"k" * 16), LeaseIds(b"j" * 16)
    ids = [a.next() for _ in range(5000)]
    assert ids == [again.next() for _ in range(5000)]  # the key alone decides them
    assert len(set(ids)) == len(ids) and 0 not in ids and max(ids) >= 1 << 48
    assert not set(ids) & {other.next() for _ in range(5000)}


def test_released_leases_do_not_stay_in_the_expiry_heap(make_manager):
    """Issue 19: released leases stayed in the expiry heap until their TTL (600 s at most)."""
    import tracemalloc

    from kvstore.leases import LeaseKind, LeaseTable

    m = make_manager()
    ns = m.declare_namespace(make_spec(4096))
    table = LeaseTable()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for _ in range(20_000):
            lease = table.add(LeaseKind.LOAD, ns, [], time.monotonic() + 600.0)
            assert table.pop(lease.lease_id) is lease
        retained, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(table) == 0
    assert retained - before < 256 * 1024  # 20,000 stale heap entries were ~2 MB
