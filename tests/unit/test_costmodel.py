"""The documented cost model: derived figures and monotonicity."""

from __future__ import annotations

import pytest

from kvstore_bench.costmodel import CostModel


def test_defaults_derive_documented_figures() -> None:
    m = CostModel()
    assert m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    # 80 GB * 0.9 - 16 GB weights - 4 GB reserve = 52 GB of KV
    assert m.gpu_cache_tokens() == int(52e9 // 131072)
    # 100k cold tokens: linear 1.6e15 + attention 4*32*4096*~5e9 FLOPs at 445 TFLOP/s
    assert m.prefill_s(0, 100_000) == pytest.approx(9.49, rel=0.01)
    assert m.load_s(dram_tokens=100_000) == pytest.approx(100_000 * 131072 / 50e9)


def test_cached_tokens_are_far_cheaper_than_recompute() -> None:
    m = CostModel()
    kw = {"input_tokens": 90_000, "output_tokens": 300, "peer_tokens": 0}
    cold = m.service(gpu_tokens=0, dram_tokens=0, disk_tokens=0, **kw)
    dram = m.service(gpu_tokens=0, dram_tokens=89_000, disk_tokens=0, **kw)
    gpu = m.service(gpu_tokens=89_000, dram_tokens=0, disk_tokens=0, **kw)
    disk = m.service(gpu_tokens=0, dram_tokens=0, disk_tokens=89_000, **kw)
    assert gpu[0] < dram[0] < disk[0] < cold[0]
    assert cold[0] / dram[0] > 5


def test_peer_pull_limited_by_slower_link() -> None:
    m = CostModel(nic_bytes_per_s=10e9, host_link_bytes_per_s=50e9)
    assert m.load_s(peer_tokens=1000) == pytest.approx(1000 * m.kv_bytes_per_token / 10e9)


def test_prefill_superlinear_in_context() -> None:
    m = CostModel()
    assert m.prefill_s(100_000, 1000) > m.prefill_s(0, 1000)
    assert m.prefill_s(0, 0) == 0.0


def test_cached_more_than_input_is_a_bug() -> None:
    with pytest.raises(AssertionError):
        CostModel().service(
            input_tokens=10,
            output_tokens=1,
            gpu_tokens=11,
            dram_tokens=0,
            disk_tokens=0,
            peer_tokens=0,
        )
