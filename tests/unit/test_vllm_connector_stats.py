"""The connector's stats for vLLM (deltas, aggregation, the log summary) and its
hash-seed fingerprint."""

from __future__ import annotations

import pytest

from kvstore.namespace import layout_hash_seed, layout_with_hash_seed
from kvstore_connectors.vllm.hashes import hash_seed_fingerprint
from kvstore_connectors.vllm.namespace import EngineLayout

DEFAULT_SEED = "vllm-none-hash"


def test_fingerprint_names_algo_and_seed_without_revealing_it() -> None:
    fp = hash_seed_fingerprint("sha256", "1234", DEFAULT_SEED)
    assert fp.startswith("sha256:") and len(fp) == len("sha256:") + 12
    assert "1234" not in fp
    assert fp == hash_seed_fingerprint("sha256", "1234", DEFAULT_SEED)  # every process agrees
    assert fp != hash_seed_fingerprint("sha256", "1235", DEFAULT_SEED)
    assert fp != hash_seed_fingerprint("sha256_cbor", "1234", DEFAULT_SEED)
    # No PYTHONHASHSEED: vLLM's fixed default for sha256, a per-process random seed for xxhash.
    assert hash_seed_fingerprint("sha256", None, DEFAULT_SEED) == hash_seed_fingerprint(
        "sha256", DEFAULT_SEED, DEFAULT_SEED
    )
    assert hash_seed_fingerprint("xxhash", None, DEFAULT_SEED) == "xxhash:random"
    assert hash_seed_fingerprint("xxhash", "7", DEFAULT_SEED).startswith("xxhash:")


def test_the_seed_separates_namespaces_and_is_readable_from_the_layout() -> None:
    kw = dict(
        model="m",
        dtype="float32",
        block_size_tokens=32,
        num_layers=2,
        num_kv_heads=2,
        head_dim=32,
        block_bytes=32768,
        page_layout="vllm-cpu-LBHNC",
    )
    a = EngineLayout(**kw, hash_seed="sha256:aaaaaaaaaaaa").spec(None)  # type: ignore[arg-type]
    b = EngineLayout(**kw, hash_seed="sha256:bbbbbbbbbbbb").spec(None)  # type: ignore[arg-type]
    plain = EngineLayout(**kw).spec(None)  # type: ignore[arg-type]
    assert len({a.namespace_id(), b.namespace_id(), plain.namespace_id()}) == 3
    assert layout_hash_seed(a.layout) == "sha256:aaaaaaaaaaaa"
    assert layout_hash_seed(plain.layout) is None
    assert layout_with_hash_seed("x", "") == "x"


def test_stats_are_per_step_increases_that_aggregate_and_reduce() -> None:
    pytest.importorskip("vllm")
    from kvstore_connectors.vllm.stats import COUNTER_NAMES, Deltas, KVStoreConnectorStats

    d = Deltas()
    first = d.take({"scheduler_hit_blocks": 6, "scheduler_lookups": 1, "scheduler_time_ns": 0})
    assert first is not None and first.data == {"scheduler_hit_blocks": 6, "scheduler_lookups": 1}
    assert d.take({"scheduler_hit_blocks": 6, "scheduler_lookups": 1}) is None  # nothing new
    second = d.take({"scheduler_hit_blocks": 9, "scheduler_lookups": 2})
    assert second is not None and second.data == {"scheduler_hit_blocks": 3, "scheduler_lookups": 1}

    worker = KVStoreConnectorStats(data={"worker_loaded_blocks": 6, "worker_time_ns": 2_500_000})
    total = worker.aggregate(first).aggregate(second)
    assert total.reduce() == {
        "scheduler_hit_blocks": 9,
        "scheduler_lookups": 2,
        "worker_loaded_blocks": 6,
        "worker_time_ms": 2.5,
    }
    assert not total.is_empty()
    assert KVStoreConnectorStats(data={}).is_empty()
    # Every counter the connector reports has a metric.
    assert {"scheduler_hit_blocks", "worker_loaded_blocks", "worker_checksum_failures"} <= set(
        COUNTER_NAMES
    )


def test_a_step_that_moved_only_hook_time_and_steps_reports_nothing_until_it_adds_up() -> None:
    """Hook time and the step count move every step, also on one with nothing to do:
    alone they must not hand vLLM a stats object per step; they are carried by the
    next report, and reported alone once the held-back time reaches hold_ns."""
    pytest.importorskip("vllm")
    from kvstore_connectors.vllm.stats import Deltas

    d = Deltas(hold_ns=1_000_000)
    quiet = {"worker_saved_blocks": 0, "worker_time_ns": 5_000, "worker_steps": 1}
    assert d.take(quiet) is None
    assert d.take({**quiet, "worker_time_ns": 9_000, "worker_steps": 2}) is None
    moved = d.take({"worker_saved_blocks": 2, "worker_time_ns": 20_000, "worker_steps": 3})
    assert moved is not None
    assert moved.data == {"worker_saved_blocks": 2, "worker_time_ns": 20_000, "worker_steps": 3}
    assert d.take({"worker_saved_blocks": 2, "worker_time_ns": 30_000, "worker_steps": 4}) is None
    held = d.take({"worker_saved_blocks": 2, "worker_time_ns": 1_020_000, "worker_steps": 9})
    assert held is not None and held.data == {"worker_time_ns": 1_000_000, "worker_steps": 6}
