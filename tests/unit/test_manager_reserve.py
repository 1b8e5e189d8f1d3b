"""Slots reserved ahead (BlockManager.reserve_store), in-process: binding at commit,
placeholders that nothing shows, bad commits refused before anything changes."""

from __future__ import annotations

import time

import pytest

from kvstore.errors import CapacityExhausted, InvalidRequest, StateConflict
from kvstore.manager import STORE_ALLOCATED, STORE_NO_ROOM
from kvstore.manager import StoreChain as C
from tests.conftest import make_spec
from tests.unit import test_manager

make_manager = test_manager.make_manager  # the fixture

BS = 16  # make_spec's block_size_tokens


def _tokens(n_blocks: int, base: int = 0) -> list[int]:
    return list(range(base, base + n_blocks * BS))


def test_a_reserve_binds_real_hashes_at_commit(make_manager):
    m = make_manager()
    ns = m.declare_namespace(make_spec(4096))
    plan = m.reserve_store(ns.namespace_id, 4)
    assert plan.lease_id and list(plan.statuses) == [STORE_ALLOCATED] * 4
    assert len(set(plan.offsets)) == 4
    # blocks 7 and 8 written at positions 2 and 0; positions 1 and 3 unused
    n = m.commit_store(
        plan.lease_id, [7, 8], positions=[2, 0], parent_block_hash=5, token_ids=_tokens(2)
    )
    assert n == 2
    assert ns.blocks[7].offset == plan.offsets[2] and ns.blocks[8].offset == plan.offsets[0]
    assert not ns.reserved and not ns.pending
    assert m.sink_record.events == [("stored", [7, 8], "CPU", 5, _tokens(2))]
    assert m.stats().tiers[0].used_bytes == 2 * ns.slot_bytes  # the two unused slots freed
    assert m.stats().active_leases == 0
    load = m.prepare_load(ns.namespace_id, [7, 8])
    assert [b.offset for b in load.blocks] == [plan.offsets[2], plan.offsets[0]]


def test_placeholders_are_seen_by_no_lookup_load_delete_event_or_count(make_manager):
    m = make_manager()
    ns = m.declare_namespace(make_spec(4096))
    before = m.stats().tiers[0]
    plan = m.reserve_store(ns.namespace_id, 3)
    placeholders = list(ns.reserved)
    assert len(placeholders) == 3
    assert m.lookup(ns.namespace_id, placeholders).prefix_blocks == 0
    assert m.prepare_load(ns.namespace_id, placeholders).lease_id == 0
    assert m.delete(ns.namespace_id, placeholders) == (0, 0)
    after = m.stats().tiers[0]
    assert after.blocks == before.blocks  # slots held, no block counted
    assert after.used_bytes == before.used_bytes + 3 * ns.slot_bytes
    # a store of a placeholder's value is a store like any other (a different block)
    other = m.prepare_store(ns.namespace_id, [placeholders[0]])
    assert list(other.statuses) == [STORE_ALLOCATED]
    m.release([other.lease_id])
    assert m.sink_record.events == []
    m.release([plan.lease_id])  # given back whole
    assert not ns.reserved and m.stats().tiers[0].used_bytes == before.used_bytes
    assert m.sink_record.events == []


def test_a_hash_present_or_in_flight_is_not_committed_and_its_slot_is_freed(make_manager):
    m = make_manager()
    ns = m.declare_namespace(make_spec(4096))
    done = m.prepare_store(ns.namespace_id, [10])
    m.commit_store(done.lease_id)
    flying = m.prepare_store(ns.namespace_id, [11])  # another client's, in flight
    m.sink_record.events.clear()
    used = m.stats().tiers[0].used_bytes
    plan = m.reserve_store(ns.namespace_id, 3)
    # one chain 10 -> 11 -> 12 -> 13: 10 present, 11 in flight, 12 and 13 new
    n = m.commit_store(
        plan.lease_id,
        [10, 11, 12],
        positions=[0, 1, 2],
        chains=[C(3, 9, _tokens(3))],
    )
    assert n == 1
    assert ns.blocks[10].offset == done.offsets[0]  # the stored block is untouched
    assert ns.pending[11].offset == flying.offsets[0]
    assert ns.blocks[12].offset == plan.offsets[2]
    # the run after the skipped blocks is parented on the last of them
    assert m.sink_record.events == [("stored", [12], "CPU", 11, _tokens(3)[2 * BS :])]
    assert m.stats().tiers[0].used_bytes == used + ns.slot_bytes
    assert m.commit_store(flying.lease_id) == 1


@pytest.mark.parametrize(
    ("hashes", "positions", "error", "text"),
    [
        ([1, 2], [0, 4], InvalidRequest, "outside reserve"),
        ([1, 2], [1, 1], InvalidRequest, "position twice"),
        ([1, 2], [0], InvalidRequest, "1 positions for 2 hashes"),
        ([1, 1], [0, 1], InvalidRequest, "block hash twice"),
        ([1, 2], None, StateConflict, "is a reserve"),
    ],
)
def test_bad_commits_of_a_reserve_are_refused_and_lose_nothing(
    make_manager, hashes, positions, error, text
):
    m = make_manager()
    ns = m.declare_namespace(make_spec(4096))
    plan = m.reserve_store(ns.namespace_id, 4)
    used = m.stats().tiers[0].used_bytes
    with pytest.raises(error, match=text):
        m.commit_store(plan.lease_id, hashes, positions=positions)
    assert m.stats().tiers[0].used_bytes == used and len(ns.reserved) == 4
    assert m.sink_record.events == []
    assert m.commit_store(plan.lease_id, [1, 2], positions=[3, 0]) == 2  # still usable


def test_bad_token_counts_and_chains_are_refused_before_anything_changes(make_manager):
    m = make_manager()
    ns = m.declare_namespace(make_spec(4096))
    plan = m.reserve_store(ns.namespace_id, 2)
    with pytest.raises(InvalidRequest, match="token_ids"):
        m.commit_store(plan.lease_id, [1, 2], positions=[0, 1], token_ids=[1, 2, 3])
    with pytest.raises(InvalidRequest, match="chains hold"):
        m.commit_store(plan.lease_id, [1, 2], positions=[0, 1], chains=[C(1, None)])
    assert m.commit_store(plan.lease_id, [1, 2], positions=[0, 1], chains=[C(2, None)]) == 2


def test_positions_on_a_prepared_store_are_refused(make_manager):
    m = make_manager()
    ns = m.declare_namespace(make_spec(4096))
    plan = m.prepare_store(ns.namespace_id, [1, 2])
    with pytest.raises(StateConflict, match="not a reserve"):
        m.commit_store(plan.lease_id, [1, 2], positions=[0, 1])
    assert m.commit_store(plan.lease_id) == 2


def test_an_empty_commit_gives_every_slot_back(make_manager):
    m = make_manager()
    ns = m.declare_namespace(make_spec(4096))
    plan = m.reserve_store(ns.namespace_id, 2)
    assert m.commit_store(plan.lease_id, [], positions=[]) == 0
    assert not ns.reserved and m.stats().tiers[0].used_bytes == 0
    assert m.stats().active_leases == 0


def test_a_reserve_has_prepare_stores_admission_and_limits(make_manager):
    m = make_manager(capacity="1MiB", chunk="256KiB", limits__max_blocks_per_request=100)
    ns = m.declare_namespace(make_spec(256 * 1024))
    with pytest.raises(InvalidRequest, match="max_blocks_per_request"):
        m.reserve_store(ns.namespace_id, 101)
    with pytest.raises(InvalidRequest, match=">= 1 block"):
        m.reserve_store(ns.namespace_id, 0)
    plan = m.reserve_store(ns.namespace_id, 6)  # room for 4 slots of 256 KiB
    assert list(plan.statuses) == [STORE_ALLOCATED] * 4 + [STORE_NO_ROOM] * 2
    with pytest.raises(CapacityExhausted):
        m.reserve_store(ns.namespace_id, 1)  # everything is reserved (in flight)
    m.commit_store(plan.lease_id, [1, 2, 3, 4], positions=[0, 1, 2, 3])
    again = m.reserve_store(ns.namespace_id, 2)  # evicts committed, unpinned blocks
    assert list(again.statuses) == [STORE_ALLOCATED] * 2


def test_an_expired_reserve_gives_its_slots_back_after_quarantine(make_manager):
    m = make_manager(leases__quarantine_s=1.0)
    ns = m.declare_namespace(make_spec(4096))
    plan = m.reserve_store(ns.namespace_id, 3, ttl_s=1.0)
    now = time.monotonic()
    assert m.expire_leases(now + 1.5) == 1
    assert len(ns.reserved) == 3  # quarantined: a late writer may still copy
    assert m.stats().active_leases == 1
    m.expire_leases(now + 3.0)
    assert not ns.reserved and m.stats().tiers[0].used_bytes == 0
    assert m.stats().active_leases == 0
    assert plan.lease_id


# ------------------------------------------------------------ a reserve committed in parts


def test_a_reserve_committed_in_parts_keeps_its_other_slots_at_their_positions(make_manager):
    m = make_manager()
    ns = m.declare_namespace(make_spec(4096))
    plan = m.reserve_store(ns.namespace_id, 6)
    slot = ns.slot_bytes
    # step 1: two blocks at positions 4 and 0; the other four stay reserved
    assert m.commit_store(plan.lease_id, [1, 2], positions=[4, 0], keep_rest=True) == 2
    assert ns.blocks[1].offset == plan.offsets[4] and ns.blocks[2].offset == plan.offsets[0]
    assert len(ns.reserved) == 4 and m.stats().active_leases == 1
    assert m.stats().tiers[0].used_bytes == 6 * slot
    # step 2: a position already committed is refused, and nothing changes
    with pytest.raises(InvalidRequest, match=r"position 0 of reserve \d+ was committed already"):
        m.commit_store(plan.lease_id, [3, 9], positions=[1, 0], keep_rest=True)
    assert len(ns.reserved) == 4 and 3 not in ns.blocks and 9 not in ns.blocks
    # a hash the daemon has is not committed again: its slot is freed, the rest kept
    assert m.commit_store(plan.lease_id, [3, 1], positions=[1, 2], keep_rest=True) == 1
    assert ns.blocks[3].offset == plan.offsets[1] and ns.blocks[1].offset == plan.offsets[4]
    assert len(ns.reserved) == 2 and m.stats().tiers[0].used_bytes == 5 * slot
    # the last open slots committed: the lease ends (nothing left to keep)
    assert m.commit_store(plan.lease_id, [5, 6], positions=[3, 5], keep_rest=True) == 2
    assert not ns.reserved and m.stats().active_leases == 0
    assert [ns.blocks[h].offset for h in (5, 6)] == [plan.offsets[3], plan.offsets[5]]
    assert [e[1] for e in m.sink_record.events] == [[1, 2], [3], [5, 6]]
    load = m.prepare_load(ns.namespace_id, [1, 2, 3, 5, 6])
    assert len(load.blocks) == 5


@pytest.mark.parametrize("end", ["release", "commit", "expiry"])
def test_after_a_kept_commit_the_lease_ends_with_only_its_open_slots(make_manager, end):
    m = make_manager(leases__quarantine_s=1.0)
    ns = m.declare_namespace(make_spec(4096))
    plan = m.reserve_store(ns.namespace_id, 4, ttl_s=1.0)
    assert m.commit_store(plan.lease_id, [7], positions=[2], keep_rest=True) == 1
    if end == "release":
        assert m.release([plan.lease_id]) == 1
    elif end == "commit":  # without keep_rest: the slots not named are freed
        assert m.commit_store(plan.lease_id, [8], positions=[0]) == 1
    else:
        now = time.monotonic()
        assert m.expire_leases(now + 1.5) == 1
        assert len(ns.reserved) == 3  # quarantined, the committed block untouched
        m.expire_leases(now + 3.0)
    assert not ns.reserved and m.stats().active_leases == 0
    stored = [7, 8] if end == "commit" else [7]
    assert m.stats().tiers[0].used_bytes == len(stored) * ns.slot_bytes
    assert sorted(ns.blocks) == stored and ns.blocks[7].offset == plan.offsets[2]
    assert len(m.prepare_load(ns.namespace_id, stored).blocks) == len(stored)


def test_keep_rest_on_a_prepared_store_is_refused(make_manager):
    m = make_manager()
    ns = m.declare_namespace(make_spec(4096))
    plan = m.prepare_store(ns.namespace_id, [1, 2])
    with pytest.raises(InvalidRequest, match="only a reserve's commit can keep"):
        m.commit_store(plan.lease_id, keep_rest=True)
    assert m.commit_store(plan.lease_id) == 2
