"""A store whose blocks are all new and fit in free room takes its slots in one
pass (BlockManager.prepare_store -> Placement.occupy_new), and a commit of all
of a lease's blocks commits them in passes (Placement.commit, policies'
insert_many): the very state the per-block walks leave."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import CapacityExhausted
from kvstore.eviction import make_policy
from kvstore.manager import BlockManager
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
            plans = []
            for m, asked in ((fast, hashes), (walked, hashes + hashes[-1:])):
                try:
                    plans.append(m.prepare_store(ns_id, asked))
                except CapacityExhausted:
                    plans.append(None)
            if plans[0] is None or plans[1] is None:
                assert plans[0] is plans[1], f"step {step}"
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
            for m in (fast, walked):
                have = [h for h in range(1, 301) if h in m.namespaces[ns_id].blocks][:20]
                if have:
                    m.release([m.prepare_load(ns_id, have).lease_id])
        else:
            for m in (fast, walked):
                m.delete(ns_id, list(range(1, 301)))
        assert _state(fast) == _state(walked), f"step {step}"
    assert one_pass > 100  # the one-pass path ran, many times
    assert fast.placement.counters.evicted_blocks > 100  # and full tiers were in play


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_insert_many_is_insert_of_each(policy):
    """Into an order holding hot keys, low-priority copies and (S3-FIFO) ghosts:
    new keys, resident ones and cold ones, inserted together or one by one."""
    many, each = make_policy(policy), make_policy(policy)
    for p in (many, each):
        for k in range(20):
            p.insert(k)
        for k in range(20, 25):
            p.insert_cold(k)
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
