"""Copy-aware eviction in-process: redundant copies go before sole ones, the
lower-id tie-break, the belief's expiry (docs/eviction.md)."""

from __future__ import annotations

import pytest

from kvstore.config import load_config
from kvstore.errors import ConfigError
from kvstore.manager import BlockManager
from kvstore.tiers.dram import Region
from tests.conftest import make_spec
from tests.sinks import RecordingSink


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def make_manager(tmp_path):
    made = []

    def make(node_id="b", copy_aware=True, ttl_s=60.0, clock=None, window=64, learn="pulled"):
        config = load_config(
            environ={},
            assignments=[
                f"node_id={node_id}",
                "dram.capacity_bytes=64KiB",  # 16 slots of 4 KiB
                "dram.chunk_bytes=64KiB",
                f"dram.path={tmp_path}/r{len(made)}",
                f"eviction.copy_aware={str(copy_aware).lower()}",
                f"eviction.copy_ttl_s={ttl_s}",
                f"eviction.copy_window={window}",
                f"eviction.copy_learn={learn}",
                # Pulled copies as normal blocks: these tests are about the beliefs
                # (replica admission: test_replica_admission.py).
                "eviction.pulled_admission=full",
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
    m.commit_store(plan.lease_id)


def present(m, ns, hashes):
    return [h for h in hashes if m.lookup(ns.namespace_id, [h]).prefix_blocks]


def fill_and_mark(m, ns, holder):
    """16 blocks, oldest first; 8..11 (warmer than 0..7) pulled from ``holder``."""
    store(m, ns, list(range(16)))
    return m.note_held_elsewhere([ns.blocks[h] for h in range(8, 12)], holder)


@pytest.mark.parametrize("copy_aware", [True, False])
def test_redundant_copies_go_before_colder_sole_copies(make_manager, copy_aware):
    m, ns = make_manager(node_id="b", copy_aware=copy_aware)
    marked = fill_and_mark(m, ns, holder="a")
    store(m, ns, [100, 101])
    if copy_aware:
        assert marked == 4
        assert present(m, ns, [8, 9]) == []  # the redundant ones went
        assert present(m, ns, range(8)) == list(range(8))  # colder sole copies stayed
        assert m.counters.evicted_redundant_blocks == 2
    else:
        assert marked == 0
        assert present(m, ns, [0, 1]) == []  # plain LRU
        assert m.counters.evicted_redundant_blocks == 0
    assert m.counters.evicted_blocks == 2


def test_a_holder_with_a_higher_id_never_makes_a_copy_redundant(make_manager):
    # Node "a" pulled from "b": the lowest-id holder keeps its copy as a sole one,
    # so "a" and "b" cannot both drop theirs each believing the other keeps one.
    m, ns = make_manager(node_id="a")
    assert fill_and_mark(m, ns, holder="b") == 0
    assert m.note_held_elsewhere([ns.blocks[0]], "a") == 0  # itself: never
    store(m, ns, [100, 101])
    assert present(m, ns, [0, 1]) == []
    assert present(m, ns, range(8, 12)) == [8, 9, 10, 11]


def test_the_belief_expires_after_copy_ttl(make_manager):
    clock = Clock()
    m, ns = make_manager(node_id="b", ttl_s=60.0, clock=clock)
    fill_and_mark(m, ns, holder="a")
    assert m.placement.redundant(ns.blocks[8])
    clock.now_s += 60.0  # the peer may have dropped its copy since: a sole copy again
    assert not m.placement.redundant(ns.blocks[8])
    store(m, ns, [100, 101])
    assert present(m, ns, [0, 1]) == []
    assert present(m, ns, range(8, 12)) == [8, 9, 10, 11]
    assert m.counters.evicted_redundant_blocks == 0


def test_a_touched_redundant_copy_still_goes_first_within_the_window(make_manager):
    # Redundancy beats recency only among the coldest COPY_VICTIM_WINDOW: here all
    # 16, so even a just-loaded redundant block goes before a sole one.
    m, ns = make_manager(node_id="b")
    fill_and_mark(m, ns, holder="a")
    hot = [8, 9, 10, 11]
    m.release([m.prepare_load(ns.namespace_id, hot).lease_id])  # now the hottest
    store(m, ns, [100])
    assert present(m, ns, hot) == [9, 10, 11]
    assert present(m, ns, range(8)) == list(range(8))


def test_pinned_redundant_copies_are_not_victims(make_manager):
    m, ns = make_manager(node_id="b")
    fill_and_mark(m, ns, holder="a")
    lease = m.prepare_load(ns.namespace_id, [8, 9, 10, 11]).lease_id
    store(m, ns, [100])
    assert present(m, ns, [0]) == []  # no unpinned redundant one: the coldest
    m.release([lease])


def test_copy_ttl_must_be_positive(make_manager):
    with pytest.raises(ConfigError, match="copy_ttl_s"):
        make_manager(ttl_s=0)


@pytest.mark.parametrize("window", [0, 4097])
def test_copy_window_out_of_range_is_a_config_error(make_manager, window):
    with pytest.raises(ConfigError, match=r"copy_window must be in 1\.\.4096"):
        make_manager(window=window)


def test_a_redundant_copy_beyond_the_window_does_not_go_first(make_manager):
    m, ns = make_manager(node_id="b", window=4)  # 8..11 lie beyond the 4 coldest
    fill_and_mark(m, ns, holder="a")
    store(m, ns, [100])
    assert present(m, ns, [0]) == []
    assert present(m, ns, range(8, 12)) == [8, 9, 10, 11]


@pytest.mark.parametrize("copy_aware", [True, False])
async def test_with_a_disk_tier_a_redundant_copy_goes_before_a_sole_undemoted_one(
    tmp_path, copy_aware
):
    # No await between the stores: the demoter (a task on this loop) has written
    # nothing yet, so every block is DRAM-only (dirty) and none is clean.
    (tmp_path / "disk").mkdir()
    settings = {
        "node_id": "b",
        "dram.capacity_bytes": "64KiB",  # 16 slots of 4 KiB
        "dram.chunk_bytes": "64KiB",
        "dram.path": str(tmp_path / "region"),
        "disk.path": str(tmp_path / "disk"),
        "disk.capacity_bytes": "1MiB",
        "disk.slab_bytes": "64KiB",
        "eviction.copy_aware": str(copy_aware).lower(),
        "eviction.copy_learn": "pulled",
        "eviction.pulled_admission": "full",
    }
    config = load_config(environ={}, assignments=[f"{k}={v}" for k, v in settings.items()])
    region = Region(config.dram.path, config.dram.capacity_bytes, prefault=False, huge_pages="off")
    m = BlockManager(config, region, RecordingSink())
    try:
        ns = m.declare_namespace(make_spec(4096))
        fill_and_mark(m, ns, holder="a")
        assert not any(b.disk_slot >= 0 for b in ns.blocks.values())
        store(m, ns, [100, 101])
        gone = [0, 1] if not copy_aware else [8, 9]
        assert [h for h in gone if h in ns.blocks] == []
        assert m.counters.evicted_redundant_blocks == (2 if copy_aware else 0)
    finally:
        await m.close()
        region.close(unlink=True)


@pytest.mark.parametrize(
    ("learn", "pulled", "served"),
    [("pulled", 4, 0), ("served", 0, 4), ("both", 4, 4)],
)
def test_copy_learn_says_which_side_of_a_pull_learns(make_manager, learn, pulled, served):
    m, ns = make_manager(node_id="b", learn=learn)
    store(m, ns, list(range(4)))
    blocks = [ns.blocks[h] for h in range(4)]
    assert m.note_held_elsewhere(blocks, "a") == pulled
    assert m.note_held_elsewhere(blocks, "a", served=True) == served
    assert m.note_held_elsewhere(blocks, "c", served=True) == 0  # higher id: never


def test_copy_learn_must_be_known(make_manager):
    with pytest.raises(ConfigError, match="copy_learn"):
        make_manager(learn="gossip")
