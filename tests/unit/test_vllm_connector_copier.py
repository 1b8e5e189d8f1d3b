"""Batched block copies between paged KV caches and a region (CPU, torch)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore import memcopy  # noqa: E402
from kvstore.errors import ConfigError, InvalidRequest  # noqa: E402
from kvstore_connectors.vllm.copier import (  # noqa: E402
    BlockCopier,
    PagedKV,
    plan_batch,
    row_indices,
)

NUM_BLOCKS = 12


def _cpu_layers(n_layers=3, heads=2, block=32, head_dim=32, dtype=torch.float32, seed=0):
    """vLLM CPU layout: [num_blocks, kv_heads, block_size, 2 * head_dim] per layer."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            f"model.layers.{i}.self_attn.attn",
            torch.randn(NUM_BLOCKS, heads, block, 2 * head_dim, generator=g).to(dtype),
        )
        for i in range(n_layers)
    ]


def _expected_block(layers, block_id, kv_outer=False):
    parts = []
    for _, t in layers:
        if kv_outer:
            parts += [
                t[0, block_id].contiguous().view(torch.uint8).reshape(-1),
                t[1, block_id].contiguous().view(torch.uint8).reshape(-1),
            ]
        else:
            parts.append(t[block_id].contiguous().view(torch.uint8).reshape(-1))
    return torch.cat(parts)


def test_cpu_layout_round_trip_is_byte_exact():
    layers = _cpu_layers()
    kv = PagedKV.from_layers(layers, NUM_BLOCKS)
    assert kv.block_bytes == 3 * 2 * 32 * 64 * 4
    region = torch.zeros(8 * kv.block_bytes + 4096, dtype=torch.uint8)
    ids = np.array([5, 0, 11, 7])
    offsets = np.array([3, 0, 6, 1]) * kv.block_bytes + 64  # scattered, cache-line aligned
    BlockCopier(kv).save(region, offsets, ids)
    for off, block_id in zip(offsets.tolist(), ids.tolist(), strict=True):
        assert torch.equal(region[off : off + kv.block_bytes], _expected_block(layers, block_id))
    # Load them into other blocks of a fresh cache: exactly those blocks change.
    target = [(name, torch.zeros_like(t)) for name, t in layers]
    BlockCopier(PagedKV.from_layers(target, NUM_BLOCKS)).load(
        region, offsets, np.array([1, 2, 3, 4])
    )
    for (_, src), (_, dst) in zip(layers, target, strict=True):
        for s, d in zip([5, 0, 11, 7], [1, 2, 3, 4], strict=True):
            assert torch.equal(dst[d], src[s])
        untouched = [b for b in range(NUM_BLOCKS) if b not in (1, 2, 3, 4)]
        assert dst[untouched].abs().sum() == 0


def test_kv_outermost_layout_and_odd_offsets():
    # A GPU-style [2, num_blocks, block, heads, head_dim] layer: two pages per block.
    t = torch.randn(2, NUM_BLOCKS, 16, 2, 8, dtype=torch.float16)
    kv = PagedKV.from_layers([("l0", t)], NUM_BLOCKS)
    assert (kv.layers[0].outer, kv.layers[0].page_bytes) == (2, 16 * 2 * 8 * 2)
    region = torch.zeros(64 * 1024, dtype=torch.uint8)
    offsets = np.array([2, 2048 + 2])  # only 2-byte aligned: byte-row fallback
    BlockCopier(kv).save(region, offsets, np.array([3, 9]))
    for off, b in ((2, 3), (2050, 9)):
        assert torch.equal(
            region[off : off + kv.block_bytes], _expected_block([("l0", t)], b, kv_outer=True)
        )
    back = torch.zeros_like(t)
    BlockCopier(PagedKV.from_layers([("l0", back)], NUM_BLOCKS)).load(
        region, offsets, np.array([3, 9])
    )
    assert torch.equal(back[:, [3, 9]], t[:, [3, 9]])


def test_permuted_but_dense_layout_is_read_in_physical_order():
    base = torch.randn(NUM_BLOCKS, 4, 2, 8)  # physical [blocks, tokens, heads, dim]
    logical = base.permute(0, 2, 1, 3)  # logical [blocks, heads, tokens, dim]
    kv = PagedKV.from_layers([("l", logical)], NUM_BLOCKS)
    region = torch.zeros(16 * 1024, dtype=torch.uint8)
    BlockCopier(kv).save(region, np.array([0]), np.array([6]))
    assert torch.equal(region[: kv.block_bytes], base[6].reshape(-1).view(torch.uint8))


def test_layout_errors_are_precise():
    with pytest.raises(ConfigError, match="not dense"):
        PagedKV.from_layers([("l", torch.randn(NUM_BLOCKS, 8, 4)[:, ::2])], NUM_BLOCKS)
    with pytest.raises(ConfigError, match="no block dimension of size 12"):
        PagedKV.from_layers([("l", torch.randn(5, 8, 4))], NUM_BLOCKS)
    with pytest.raises(ConfigError, match="no KV cache layers"):
        PagedKV.from_layers([], NUM_BLOCKS)


def test_bad_batches_are_refused_before_any_copy():
    layers = _cpu_layers(n_layers=1)
    kv = PagedKV.from_layers(layers, NUM_BLOCKS)
    region = torch.zeros(4 * kv.block_bytes, dtype=torch.uint8)
    copier = BlockCopier(kv)
    with pytest.raises(InvalidRequest, match="block id outside"):
        copier.save(region, np.array([0]), np.array([NUM_BLOCKS]))
    with pytest.raises(InvalidRequest, match="outside the region"):
        copier.save(region, np.array([4 * kv.block_bytes - 64]), np.array([0]))
    with pytest.raises(InvalidRequest, match="2 offsets for 1 blocks"):
        copier.load(region, np.array([0, 64]), np.array([0]))
    assert region.sum() == 0
    copier.save(region, np.array([], dtype=np.int64), np.array([], dtype=np.int64))  # empty: no-op


def test_save_is_deferred_to_finish_save():
    layers = _cpu_layers(n_layers=2)
    kv = PagedKV.from_layers(layers, NUM_BLOCKS)
    region = torch.zeros(2 * kv.block_bytes, dtype=torch.uint8)
    copier = BlockCopier(kv)
    copier.begin_save(region, np.array([kv.block_bytes]), np.array([4]))
    for name, _ in layers:
        copier.save_layer(name)
    assert region.sum() == 0  # nothing moves until the step's forward is over
    copier.finish_save()
    assert torch.equal(region[kv.block_bytes :], _expected_block(layers, 4))


def _row_path_save(kv, region, offsets, ids):
    """What the torch row path (the CUDA copiers' plan) writes for a save."""
    unit, offsets, ids = plan_batch(kv, region, offsets, ids)
    rows = region.view(-1)[: region.shape[0] // unit * unit].view(-1, unit)
    for layer in kv.layers:
        kv_idx, reg_idx = row_indices(layer, kv.num_blocks, unit, offsets, ids)
        src = layer.pages.reshape(-1).view(-1, unit)
        rows[torch.from_numpy(reg_idx)] = src[torch.from_numpy(kv_idx)]


def test_cpu_page_lists_write_what_the_row_path_writes():
    """Layers of two page shapes (two groups of addresses), both K/V layouts, odd
    slot offsets: the CPU copier's one-call page lists put every byte where the
    row-index plan of the CUDA copiers puts it, and load it back exactly."""
    g = torch.Generator().manual_seed(4)
    layers = [
        ("a0", torch.randn(2, NUM_BLOCKS, 16, 2, 8, generator=g).half()),  # 512 B pages x2
        ("b0", torch.randn(NUM_BLOCKS, 2, 32, 64, generator=g)),  # 16 KiB pages
        ("a1", torch.randn(2, NUM_BLOCKS, 16, 2, 8, generator=g).half()),
    ]
    kv = PagedKV.from_layers(layers, NUM_BLOCKS)
    assert len(kv.page_groups) == 2
    ids = np.array([11, 2, 7, 0, 5])
    offsets = np.array([4, 0, 2, 6, 1]) * kv.block_bytes + 2
    got = torch.zeros(8 * kv.block_bytes, dtype=torch.uint8)
    want = torch.zeros_like(got)
    BlockCopier(kv).save(got, offsets, ids)
    _row_path_save(kv, want, offsets, ids)
    assert torch.equal(got, want) and got.any()
    target = [(name, torch.zeros_like(t)) for name, t in layers]
    BlockCopier(PagedKV.from_layers(target, NUM_BLOCKS)).load(got, offsets, ids)
    for (_, src), (_, dst) in zip(layers, target, strict=True):
        pick = (slice(None), ids) if src.shape[0] == 2 else (ids,)
        assert torch.equal(dst[pick], src[pick])


_ROW_PATH_CHILD = """
import numpy as np, torch
from kvstore import memcopy
from kvstore_connectors.vllm.copier import BlockCopier, PagedKV
t = torch.randn(2, 12, 16, 2, 8, generator=torch.Generator().manual_seed(1)).half()
kv = PagedKV.from_layers([("l0", t)], 12)
copier = BlockCopier(kv)
region = torch.zeros(4 * kv.block_bytes, dtype=torch.uint8)
copier.save(region, np.array([kv.block_bytes]), np.array([7]))
want = torch.cat([t[0, 7].reshape(-1).view(torch.uint8), t[1, 7].reshape(-1).view(torch.uint8)])
got = region[kv.block_bytes : 2 * kv.block_bytes]
print(memcopy.fast_copy_available(), copier.uses_page_lists, bool(torch.equal(got, want)),
      int(region[: kv.block_bytes].sum()))
"""


def test_without_the_copy_loops_the_cpu_copier_takes_the_row_path():
    """No list loop (KVSTORE_NT_COPY=0, or not x86-64): a Python call per small page
    would be slower than torch's index ops, so the copier keeps those, and writes
    the same bytes."""
    layers = _cpu_layers(n_layers=2)
    assert BlockCopier(PagedKV.from_layers(layers, NUM_BLOCKS)).uses_page_lists == (
        memcopy.fast_copy_available()
    )
    env = dict(os.environ, KVSTORE_NT_COPY="0")
    out = subprocess.run(
        [sys.executable, "-c", _ROW_PATH_CHILD], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "True", "0"]


def test_a_save_past_its_deadline_writes_nothing():
    layers = _cpu_layers(n_layers=2)
    kv = PagedKV.from_layers(layers, NUM_BLOCKS)
    region = torch.zeros(2 * kv.block_bytes, dtype=torch.uint8)
    copier = BlockCopier(kv)
    copier.begin_save(region, np.array([0]), np.array([4]))
    assert copier.finish_save(deadline_s=time.monotonic() - 1) is False
    assert region.sum() == 0


def test_cuda_copier_refuses_cpu_caches():
    from kvstore_connectors.vllm.cuda import CudaBlockCopier

    with pytest.raises(ConfigError, match="CUDA caches"):
        CudaBlockCopier(PagedKV.from_layers(_cpu_layers(n_layers=1), NUM_BLOCKS))
