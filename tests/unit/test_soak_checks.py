"""The soak's checks themselves: each one must see what it is there to catch."""

from __future__ import annotations

import numpy as np

from kvstore_bench import chaos as C
from kvstore_bench import soak
from kvstore_bench import soak_client as SC


def test_payload_is_a_function_of_the_hash_and_catches_any_wrong_byte() -> None:
    hashes = np.asarray([1, 2, 3], dtype=np.uint64)
    data = SC.payload(hashes, 4096)
    assert data.shape == (3, 4096)
    assert np.array_equal(data, SC.payload(hashes, 4096))
    assert SC.wrong_bytes(data, hashes, 4096) == (0, 0)
    bad = data.copy()
    bad[1, 4095] ^= 1
    assert SC.wrong_bytes(bad, hashes, 4096) == (1, 1)
    # another block's bytes, or a block shifted by one word, are wrong too
    assert SC.wrong_bytes(data[[0, 0, 2]], hashes, 4096)[0] == 1
    shifted = np.roll(data, 8, axis=1)
    assert SC.wrong_bytes(shifted, hashes, 4096)[0] == 3


def _stats(leases: int = 0, pinned: int = 0, dram_used: int = 0, dram_blocks: int = 0) -> dict:
    return {
        "active_leases": leases,
        "tiers": [
            {
                "tier": "dram",
                "capacity_bytes": 1 << 20,
                "used_bytes": dram_used,
                "blocks": dram_blocks,
                "pinned_blocks": pinned,
            },
            {
                "tier": "disk",
                "capacity_bytes": 1 << 20,
                "used_bytes": 8192,
                "blocks": 2,
                "pinned_blocks": 0,
            },
        ],
    }


def test_leaks_count_leases_pins_and_slots_no_block_owns() -> None:
    clean = soak.leaks_of(_stats(dram_used=3 * 4096, dram_blocks=3), 4096)
    assert clean == {"leases": 0, "pinned_blocks": 0, "orphan_slot_bytes": 0}
    assert soak.leaks_of(_stats(leases=2), 4096)["leases"] == 2
    assert soak.leaks_of(_stats(pinned=1), 4096)["pinned_blocks"] == 1
    orphan = soak.leaks_of(_stats(dram_used=4 * 4096, dram_blocks=3), 4096)
    assert orphan["orphan_slot_bytes"] == 4096


def test_schedule_is_seeded_and_gives_every_kind_its_turn() -> None:
    kinds = list(C.FAULT_KINDS)
    nodes = ["node0", "node1", "node2"]
    a = C.schedule(7, 600, kinds, nodes, 20.0)
    assert a == C.schedule(7, 600, kinds, nodes, 20.0)
    assert a != C.schedule(8, 600, kinds, nodes, 20.0)
    counts = {k: sum(p.kind == k for p in a) for k in kinds}
    assert min(counts.values()) >= max(counts.values()) - 1  # kinds cycle
    assert all(p.target == "indexer" for p in a if p.kind == "indexer_kill")
    assert all(p.target == "node0" for p in a if p.kind == "disk_full")
    assert all(0 < p.at_s < 600 for p in a)
    assert [p.at_s for p in a] == sorted(p.at_s for p in a)


def test_a_summary_with_any_wrong_byte_leak_or_hang_fails() -> None:
    ok = {
        "wrong_blocks": 0,
        "wrong_bytes": 0,
        "leaks": {"total": 0},
        "leaks_by_node": {},
        "hangs": 0,
        "over_cap_samples": 0,
        "faults": {"kill9": {"not_converged": 0, "failed": 0}},
        "final_staleness_s": 0.1,
        "loads_ok": 10,
        "fault_log": [],
        "unexpected_exits": [],
    }
    assert soak.passed(ok) == []
    for key, value in (
        ("wrong_bytes", 1),
        ("leaks", {"total": 1}),
        ("hangs", 1),
        ("over_cap_samples", 1),
        ("final_staleness_s", None),
        ("loads_ok", 0),
        ("unexpected_exits", [{"node": "node1", "rc": 1, "log_tail": "boom"}]),
        ("faults", {"kill9": {"not_converged": 1, "failed": 0}}),
        (
            "fault_log",
            [
                {
                    "kind": "sigterm",
                    "target": "node0",
                    "detail": {"probe_blocks_before": 8, "probe_blocks_after": 4},
                }
            ],
        ),
    ):
        assert soak.passed({**ok, key: value}), key


def test_daemon_counters_are_summed_across_restarts() -> None:
    rows = [
        {"node": "a", "evicted_blocks": 5},
        {"node": "b", "evicted_blocks": 1},
        {"node": "a", "evicted_blocks": 9},
        {"node": "a", "evicted_blocks": 2},  # a restarted: 9 before, 2 since
        {"node": "a", "evicted_blocks": 3},
    ]
    assert soak.counters_over_restarts(rows, ("evicted_blocks",)) == {"evicted_blocks": 13}


def test_quick_schedule_has_every_kind_once_inside_the_load() -> None:
    plan = C.schedule(0, 120, C.FAULT_KINDS, ["node0", "node1", "node2"], 0, once=True)
    assert sorted(p.kind for p in plan) == sorted(C.FAULT_KINDS)
    assert all(6 <= p.at_s <= 102 for p in plan)
