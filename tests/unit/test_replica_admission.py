"""Admission of pulled copies as low-priority replicas (eviction.pulled_admission,
docs/eviction.md): the cold FIFO of both policies, and the placement's rules
(first to go, promotion at the 2nd local load, the tie-break with copy_aware)."""

from __future__ import annotations

import pytest

from kvstore.config import load_config
from kvstore.errors import ConfigError
from kvstore.eviction.lru import LRUPolicy
from kvstore.eviction.s3fifo import S3FIFOPolicy
from kvstore.manager import BlockManager
from kvstore.tiers.dram import Region
from tests.conftest import make_spec
from tests.sinks import RecordingSink

POLICIES = [LRUPolicy, S3FIFOPolicy]


@pytest.mark.parametrize("make", POLICIES)
def test_cold_keys_go_first_oldest_first_and_touches_do_not_move_them(make) -> None:
    p = make()
    for k in range(6):
        p.insert(k)
    p.insert_cold(4)  # resident already: moves to the cold FIFO
    p.insert_cold("r1")
    p.insert_cold("r2")
    p.touch("r1")
    assert list(p.victims())[:3] == [4, "r1", "r2"]
    assert list(p.coldest())[:3] == [4, "r1", "r2"]
    assert len(p) == 8 and "r1" in p and p.cold_len() == 3
    p.promote("r1")  # reused: a normal key now, no longer ahead of the others
    assert list(p.victims())[:2] == [4, "r2"]
    assert "r1" in p and p.cold_len() == 2 and len(p) == 8
    p.remove("r2")
    p.remove(4)
    assert p.cold_len() == 0 and len(p) == 6 and "r2" not in p
    p.promote("r2")  # not resident: nothing happens
    assert "r2" not in p and len(p) == 6


@pytest.mark.parametrize("make", POLICIES)
def test_a_cold_key_inserted_again_is_a_normal_key(make) -> None:
    p = make()
    p.insert("a")
    p.insert_cold("r")
    p.insert("r")
    assert p.cold_len() == 0 and len(p) == 2 and "r" in p


def test_s3fifo_a_pinned_cold_key_stays_cold_and_resident() -> None:
    p = S3FIFOPolicy()
    for k in range(4):
        p.insert(k)
    p.insert_cold("r")
    walk = p.victims()
    assert next(walk) == "r"  # skipped by the caller (pinned)
    victim = next(walk)
    p.remove(victim)
    assert "r" in p and p.cold_len() == 1
    assert next(iter(p.victims())) == "r"


class Clock:
    now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def make_manager(tmp_path):
    made = []

    def make(
        node_id="b",
        admission="replica",
        copy_aware=False,
        promote=2,
        policy="lru",
        order="window",
        clock=None,
    ):
        config = load_config(
            environ={},
            assignments=[
                f"node_id={node_id}",
                "dram.capacity_bytes=64KiB",  # 16 slots of 4 KiB
                "dram.chunk_bytes=64KiB",
                f"dram.path={tmp_path}/r{len(made)}",
                f"dram.eviction_policy={policy}",
                f"eviction.pulled_admission={admission}",
                f"eviction.replica_promote_loads={promote}",
                f"eviction.copy_aware={str(copy_aware).lower()}",
                f"eviction.copy_order={order}",
                "eviction.copy_ttl_s=60",
            ],
        )
        region = Region(
            config.dram.path, config.dram.capacity_bytes, prefault=False, huge_pages="off"
        )
        made.append(region)
        m = BlockManager(config, region, RecordingSink(), clock=clock or Clock())
        return m, m.declare_namespace(make_spec(4096))

    yield make
    for r in made:
        r.close(unlink=True)


def store(m, ns, hashes):
    plan = m.prepare_store(ns.namespace_id, hashes)
    if plan.lease_id:  # 0: every block was present already
        m.commit_store(plan.lease_id)


def load(m, ns, hashes):
    m.release([m.prepare_load(ns.namespace_id, hashes).lease_id])


def present(m, ns, hashes):
    return [h for h in hashes if m.lookup(ns.namespace_id, [h]).prefix_blocks]


def pulled(m, ns, hashes, source):
    """What the puller does with new blocks it pulled and verified
    (kvstore.transfer.puller): one commit that keeps their checksums and tells
    the placement the source holds them too."""
    plan = m.prepare_store(ns.namespace_id, hashes)
    assert not any(plan.statuses), "pulled() takes new blocks"
    m.commit_pulled(plan.lease_id, hashes, [h * 7 for h in hashes], source)
    assert [ns.blocks[h].checksum for h in hashes] == [h * 7 for h in hashes]


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
@pytest.mark.parametrize("admission", ["replica", "full"])
def test_a_pulled_copy_goes_before_colder_local_blocks(make_manager, admission, policy):
    m, ns = make_manager(admission=admission, policy=policy)
    store(m, ns, list(range(12)))
    pulled(m, ns, [50, 51, 52, 53], "a")
    load(m, ns, [50, 51, 52, 53])  # the pulling request's own load: not a reuse
    store(m, ns, [100, 101])
    if admission == "replica":
        assert present(m, ns, [50, 51]) == []
        assert present(m, ns, range(12)) == list(range(12))
        assert m.counters.evicted_replica_blocks == 2
        assert m.stats().replica_blocks == 2
        assert m.counters.admitted_replicas == 4
    else:
        assert present(m, ns, [50, 51, 52, 53]) == [50, 51, 52, 53]
        assert len(present(m, ns, range(12))) == 10
        assert m.counters.evicted_replica_blocks == 0
        assert m.stats().replica_blocks == 0


def test_a_replica_is_promoted_at_its_second_local_load(make_manager):
    m, ns = make_manager()
    store(m, ns, list(range(12)))
    pulled(m, ns, [50, 51, 52, 53], "a")
    load(m, ns, [50, 51, 52, 53])  # 1st local load (the pull's own request)
    store(m, ns, [50, 51])  # a store finding them present is no reuse
    load(m, ns, [50, 51])  # 2nd: reused by a later request -> normal blocks, hot
    assert m.counters.promoted_replicas == 2
    store(m, ns, [100, 101, 102, 103])  # 2 replicas go first, then the 2 coldest
    assert present(m, ns, [50, 51, 52, 53]) == [50, 51]
    assert present(m, ns, [0, 1]) == []
    assert present(m, ns, range(2, 12)) == list(range(2, 12))
    assert m.stats().replica_blocks == 0


def test_serving_a_replica_to_a_peer_promotes_it(make_manager):
    # b holds X as a replica (pulled from a); c pulls X from b and will hold a
    # replica believing b keeps its copy: b's copy must not go first as well.
    m, ns = make_manager(node_id="b")
    store(m, ns, list(range(12)))
    pulled(m, ns, [50, 51], "a")
    m.note_held_elsewhere([ns.blocks[50]], "c", served=True)
    store(m, ns, [100, 101, 102])
    assert present(m, ns, [50, 51]) == [50]
    assert m.counters.promoted_replicas == 1


@pytest.mark.parametrize(("source", "replica"), [("a", True), ("c", False)])
def test_with_copy_aware_only_a_lower_id_source_makes_a_replica(make_manager, source, replica):
    # The tie-break: a higher-id owner marks its own copy redundant when b pulls
    # it (learn served), so b's copy must stay a full one.
    m, ns = make_manager(node_id="b", copy_aware=True)
    store(m, ns, list(range(12)))
    pulled(m, ns, [50, 51, 52, 53], source)
    assert m.stats().replica_blocks == (4 if replica else 0)
    # Served to a lower-id peer: b's copy is the redundant one (not promoted);
    # to a higher-id one, whose copy will be a replica: promoted.
    m.note_held_elsewhere([ns.blocks[50]], "a", served=True)
    m.note_held_elsewhere([ns.blocks[51]], "c", served=True)
    assert m.counters.promoted_replicas == (1 if replica else 0)


def test_pulled_admission_must_be_known(make_manager):
    with pytest.raises(ConfigError, match="pulled_admission"):
        make_manager(admission="half")


def test_replica_promote_loads_must_be_positive(make_manager):
    with pytest.raises(ConfigError, match="replica_promote_loads"):
        make_manager(promote=0)


def test_a_store_that_pins_its_pulled_replicas_still_finds_a_victim(make_manager):
    # The bench's failure: a request stores its whole sequence after pulling the
    # prefix; the pulled replicas it finds present are pinned while it allocates
    # and fill the head of the order, so a 4-deep search found no victim.
    m, ns = make_manager()
    store(m, ns, list(range(8)))
    pulled(m, ns, list(range(50, 58)), "a")  # 16 of 16 slots used
    plan = m.prepare_store(ns.namespace_id, [*range(50, 58), 100, 101])
    assert plan.lease_id
    m.commit_store(plan.lease_id)
    assert present(m, ns, [100, 101]) == [100, 101]
    assert present(m, ns, range(50, 58)) == list(range(50, 58))
    assert present(m, ns, [0, 1]) == []


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
@pytest.mark.parametrize("order", ["fifo", "window"])
def test_copy_order_fifo_drops_a_hot_redundant_copy_first_beyond_any_window(
    make_manager, order, policy
):
    # The owner's copies 12..15 are the hottest here (just stored) and a lower-id
    # peer pulled them (learn served): fifo finds them in O(1); the window of 4
    # coldest does not reach them.
    m, ns = make_manager(admission="full", copy_aware=True, order=order, policy=policy)
    m.placement.copy_window = 4
    store(m, ns, list(range(16)))
    m.note_held_elsewhere([ns.blocks[h] for h in range(12, 16)], "a", served=True)
    store(m, ns, [100, 101])
    if order == "fifo":
        assert present(m, ns, [12, 13]) == []
        assert present(m, ns, range(12)) == list(range(12))
        assert m.counters.evicted_redundant_blocks == 2
    else:
        assert present(m, ns, [12, 13]) == [12, 13]
        assert m.counters.evicted_redundant_blocks == 0


def test_copy_order_fifo_a_local_load_or_the_ttl_makes_it_a_normal_block(make_manager):
    clock = Clock()
    m, ns = make_manager(admission="full", copy_aware=True, order="fifo", clock=clock)
    store(m, ns, list(range(16)))
    m.note_held_elsewhere([ns.blocks[h] for h in range(8, 16)], "a", served=True)
    load(m, ns, [8, 9])  # wanted here: back in the normal order (the hot end)
    clock.now_s += 30.0
    m.note_held_elsewhere([ns.blocks[h] for h in (14, 15)], "a", served=True)  # re-marked
    clock.now_s += 31.0  # 10..13's marks expired; 14, 15's hold 29 s more
    store(m, ns, [100, 101])
    assert present(m, ns, [14, 15]) == []
    assert m.counters.evicted_redundant_blocks == 2
    store(m, ns, [102, 103])  # now plain LRU: the coldest sole copies
    assert present(m, ns, [0, 1]) == []
    assert present(m, ns, range(2, 14)) == list(range(2, 14))


def test_copy_order_must_be_known(make_manager):
    with pytest.raises(ConfigError, match="copy_order"):
        make_manager(order="heap")


async def test_with_a_disk_tier_replicas_are_not_demoted_and_go_before_clean_blocks(tmp_path):
    (tmp_path / "disk").mkdir()
    settings = {
        "node_id": "b",
        "dram.capacity_bytes": "64KiB",  # 16 slots of 4 KiB
        "dram.chunk_bytes": "64KiB",
        "dram.path": str(tmp_path / "region"),
        "disk.path": str(tmp_path / "disk"),
        "disk.capacity_bytes": "1MiB",
        "disk.slab_bytes": "64KiB",
        "eviction.pulled_admission": "replica",
    }
    config = load_config(environ={}, assignments=[f"{k}={v}" for k, v in settings.items()])
    region = Region(config.dram.path, config.dram.capacity_bytes, prefault=False, huge_pages="off")
    m = BlockManager(config, region, RecordingSink())
    try:
        ns = m.declare_namespace(make_spec(4096))
        # No await between these calls: the demoter (a task on this loop) runs
        # only when the test lets it, so what is dirty is what placement decided.
        store(m, ns, list(range(12)))
        pulled(m, ns, [50, 51, 52, 53], "a")
        dirty = m.placement.dirty
        assert [h for h in range(12) if ns.blocks[h] in dirty] == list(range(12))
        assert [h for h in (50, 51, 52, 53) if ns.blocks[h] in dirty] == []
        load(m, ns, [53])
        load(m, ns, [53])  # promoted: a normal block, to be demoted like the others
        assert ns.blocks[53] in dirty
        store(m, ns, [100, 101, 102])
        assert present(m, ns, [50, 51, 52, 53]) == [53]
        assert present(m, ns, range(12)) == list(range(12))
        assert m.counters.evicted_replica_blocks == 3
    finally:
        await m.close()
        region.close(unlink=True)
