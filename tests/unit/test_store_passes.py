"""A store whose blocks are all new and fit in free room takes its slots in one
pass (BlockManager.prepare_store -> Placement.occupy_new), and a commit of all
of a lease's blocks commits them in passes (Placement.commit, policies'
insert_many): the very state the per-block walks leave."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import CapacityExhausted, StateConflict
from kvstore.eviction import make_policy
from kvstore.manager import STORE_ALLOCATED, BlockManager
from kvstore.namespace import Tier
from tests.conftest import make_spec
from tests.managers import managers


@pytest.fixture
def make_manager(tmp_path):
    # 128 slots of 4 KiB
    with managers(tmp_path, "dram.capacity_bytes=512KiB", "dram.chunk_bytes=64KiB") as make:
        yield make


def _state(m: BlockManager) -> tuple:
    """Where every block is, which are in flight, the eviction order, the counts."""

    def key(b):  # type: ignore[no-untyped-def]
        return (b.namespace.namespace_id, b.block_hash, b.offset, b.state.name)

    spaces = sorted(m.namespaces.items())
    held = {i: sorted(map(key, ns.blocks.values())) for i, ns in spaces}
    pending = {i: sorted(map(key, ns.pending.values())) for i, ns in spaces}
    owners = sorted((o, key(b)) for o, b in m.placement.dram.owner.items())
    order = [key(b) for b in m.placement.pool(Tier.DRAM).policy(4096).coldest()]
    used = {i: ns.used_bytes for i, ns in spaces}
    c = m.placement.counters
    return held, pending, owners, order, used, c.stored_blocks, c.evicted_blocks, m.sink.events


def _prepare_both(asks: tuple, ns_id: str) -> list | None:
    """prepare_store of each (manager, hashes) pair: both plans, or None when both
    found no room (one refusing alone fails the test)."""
    plans = []
    for m, hashes in asks:
        try:
            plans.append(m.prepare_store(ns_id, hashes))
        except CapacityExhausted:
            plans.append(None)
    assert (plans[0] is None) == (plans[1] is None), "one refused, the other did not"
    return None if plans[0] is None else plans


def _load_both(pair: tuple, ns_id: str, below: int) -> None:
    """A load (pinned, then released) of the first 20 blocks under ``below`` each holds."""
    for m in pair:
        have = [h for h in range(1, below) if h in m.namespaces[ns_id].blocks][:20]
        if have:
            m.release([m.prepare_load(ns_id, have).lease_id])


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_one_pass_stores_leave_what_the_walk_leaves(make_manager, policy):
    """The same random stores on two managers; the second's every prepare names its
    last hash twice, which sends it through the per-block walk (not all distinct)
    and changes nothing else (the repeat gets no slot), and it commits block by
    block (its placement's one-pass commit replaced by the per-block one). Commits of all
    blocks, of some (the per-block commit), none; loads and deletes between. After
    every step both hold the same blocks at the same offsets, in the same
    eviction order, with the same counts and events."""
    setting = f"dram.eviction_policy={policy}"
    fast, walked = make_manager(setting), make_manager(setting)
    # the walked one commits block by block, whatever it commits
    some = walked.placement._commit_some
    walked.placement._commit_all = lambda ns, blocks, policy, order: some(  # type: ignore[method-assign]
        ns, blocks, blocks, policy, order
    )
    ns_ids = []
    for m in (fast, walked):
        ns_ids = [m.declare_namespace(make_spec(4096, model=name)).namespace_id for name in "ab"]
    rng = np.random.default_rng(7)
    one_pass = 0
    for step in range(400):
        ns_id = ns_ids[int(rng.integers(0, 2))]
        op = int(rng.integers(0, 10))
        if op < 7:
            # mostly new hashes (the one-pass case), sometimes known ones
            span = 100_000 if rng.integers(0, 3) else 300
            hashes = [int(h) for h in rng.choice(span, int(rng.integers(1, 40)), replace=False) + 1]
            plans = _prepare_both(((fast, hashes), (walked, hashes + hashes[-1:])), ns_id)
            if plans is None:  # no room in either (the pins hold every slot)
                continue
            fast_plan, walked_plan = plans
            # the repeat: in flight behind the first (or present, or no room, as it)
            assert walked_plan.offsets[-1] == 0 and walked_plan.statuses[-1] != 0
            assert bytes(fast_plan.statuses) == bytes(walked_plan.statuses)[:-1], f"step {step}"
            assert list(fast_plan.offsets) == list(walked_plan.offsets)[:-1], f"step {step}"
            one_pass += not any(fast_plan.statuses)
            how = int(rng.integers(0, 4))
            new = [h for h, got in zip(hashes, fast_plan.statuses, strict=False) if not got]
            for m, plan in ((fast, fast_plan), (walked, walked_plan)):
                if not plan.lease_id:
                    continue
                if how < 2:
                    m.commit_store(plan.lease_id)
                elif how == 2:
                    m.commit_store(plan.lease_id, new[: len(new) // 2])
                else:
                    m.release([plan.lease_id])
        elif op < 9:
            _load_both((fast, walked), ns_id, 301)
        else:
            for m in (fast, walked):
                m.delete(ns_id, list(range(1, 301)))
        assert _state(fast) == _state(walked), f"step {step}"
    assert one_pass > 100  # the one-pass path ran, many times
    assert fast.placement.counters.evicted_blocks > 100  # and full tiers were in play


def _two_orders(policy: str) -> tuple:
    """Two eviction orders alike: keys 0-19 inserted, 20-24 low-priority copies."""
    pair = make_policy(policy), make_policy(policy)
    for p in pair:
        for k in range(20):
            p.insert(k)
        for k in range(20, 25):
            p.insert_cold(k)
    return pair


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_insert_many_is_insert_of_each(policy):
    """Into an order holding hot keys, low-priority copies and (S3-FIFO) ghosts:
    new keys, resident ones and cold ones, inserted together or one by one."""
    many, each = _two_orders(policy)
    for p in (many, each):
        for k in range(0, 6):
            p.touch(k)
        for k in list(p.victims())[:4]:  # evicted: S3-FIFO remembers them as ghosts
            p.remove(k)
    keys = [30, 3, 21, 31, 10, 0, 24, 32]
    many.insert_many(keys)
    for k in keys:
        each.insert(k)
    assert list(many.coldest()) == list(each.coldest())
    assert many.cold_len() == each.cold_len() and len(many) == len(each)


@pytest.mark.parametrize("setting", ["eviction.copy_aware=false", "eviction.copy_aware=true"])
def test_a_pulls_commit_leaves_what_commit_checksums_and_note_leave(make_manager, setting):
    """BlockManager.commit_pulled (a peer pull's one pass) against what the puller
    did before: commit_store, then a lookup of each committed block,
    set_checksums and note_held_elsewhere. Random pulls (some hashes present, in
    flight or repeated) from sources with a lower and a higher node id than this
    one's, commits of all verified blocks or of some (the others corrupt), loads
    and deletes between: after every step the same blocks, eviction order
    (replicas first), checksums, copy marks, counts and events."""
    one, three = make_manager("node_id=m", setting), make_manager("node_id=m", setting)
    ns_ids = []
    for m in (one, three):
        ns_ids = [m.declare_namespace(make_spec(4096, model=name)).namespace_id for name in "ab"]
    rng = np.random.default_rng(5)

    def marks(m: BlockManager) -> list:
        return sorted(
            (b.block_hash, b.checksum, b.redundant_until_s, b.replica_loads)
            for ns in m.namespaces.values()
            for b in ns.blocks.values()
        )

    whole = 0
    for step in range(300):
        ns_id = ns_ids[int(rng.integers(0, 2))]
        op = int(rng.integers(0, 10))
        if op < 7:
            hashes = [int(h) for h in rng.integers(1, 400, int(rng.integers(1, 40)))]
            source = "a" if rng.integers(0, 2) else "z"
            plans = _prepare_both(((one, hashes), (three, hashes)), ns_id)
            if plans is None:
                continue
            assert bytes(plans[0].statuses) == bytes(plans[1].statuses), f"step {step}"
            if not plans[0].lease_id:
                continue
            new = [
                h for h, s in zip(hashes, plans[0].statuses, strict=True) if s == STORE_ALLOCATED
            ]
            good = new if rng.integers(0, 2) else [h for h in new if rng.integers(0, 4)]
            whole += good == new
            sums = [h * 31 + 1 for h in good]
            if not good:
                for m, plan in ((one, plans[0]), (three, plans[1])):
                    m.release([plan.lease_id])
                continue
            one.commit_pulled(plans[0].lease_id, good, sums, source)
            three.commit_store(plans[1].lease_id, good)
            index = three.namespaces[ns_id].blocks
            kept = [(b, c) for h, c in zip(good, sums, strict=True) if (b := index.get(h))]
            three.set_checksums([b for b, _ in kept], [c for _, c in kept])
            three.note_held_elsewhere([b for b, _ in kept], source)
        elif op < 9:
            _load_both((one, three), ns_id, 400)
        else:
            gone = [int(h) for h in rng.integers(1, 400, 30)]
            for m in (one, three):
                m.delete(ns_id, gone)
        assert _state(one) == _state(three), f"step {step}"
        assert marks(one) == marks(three), f"step {step}"
    assert whole > 50 and one.placement.counters.admitted_replicas > 100


def test_a_pulls_commit_of_a_block_not_prepared_is_refused_and_loses_nothing(make_manager):
    """A hash the lease does not hold: StateConflict naming it; the lease and its
    blocks as they were (still pending, no checksum), committable after."""
    m = make_manager()
    ns_id = m.declare_namespace(make_spec(4096)).namespace_id
    plan = m.prepare_store(ns_id, [1, 2, 3])
    with pytest.raises(StateConflict, match="0x63"):
        m.commit_pulled(plan.lease_id, [1, 99], [11, 12], "a")
    pending = m.namespaces[ns_id].pending
    assert sorted(pending) == [1, 2, 3] and all(b.checksum == 0 for b in pending.values())
    assert m.commit_pulled(plan.lease_id, [1, 2, 3], [11, 12, 13], "a") == 3
    assert [m.namespaces[ns_id].blocks[h].checksum for h in (1, 2, 3)] == [11, 12, 13]


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_touch_many_and_insert_cold_many_are_each_in_turn(policy):
    """The batch forms a load's touches and a pull's replicas use: hot keys, cold
    ones, keys not resident, repeats; the same order as one call per key."""
    many, each = _two_orders(policy)
    touched = [3, 21, 40, 0, 3, 17, 9]
    cold = [5, 22, 41, 2, 5, 30]
    many.touch_many(touched)
    many.insert_cold_many(cold)
    for k in touched:
        each.touch(k)
    for k in cold:
        each.insert_cold(k)
    assert list(many.coldest()) == list(each.coldest())
    assert list(many.cold_keys()) == list(each.cold_keys())
    assert many.cold_len() == each.cold_len() and len(many) == len(each)
