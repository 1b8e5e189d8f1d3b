"""The connector's CUDA copy path (needs a GPU; skipped without CUDA)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NUM_BLOCKS = 16


def _layers(device, seed=0):
    # FlashAttention-style [2, num_blocks, block_size, kv_heads, head_dim] per layer.
    g = torch.Generator().manual_seed(seed)
    return [
        (f"layers.{i}.attn", torch.randn(2, NUM_BLOCKS, 16, 4, 64, generator=g).half().to(device))
        for i in range(3)
    ]


def test_cuda_save_and_load_match_the_cpu_path_byte_for_byte():
    from kvstore_connectors.vllm.copier import BlockCopier, PagedKV
    from kvstore_connectors.vllm.cuda import CudaBlockCopier

    gpu_layers = _layers("cuda")
    cpu_layers = [(n, t.cpu()) for n, t in gpu_layers]
    gpu_kv = PagedKV.from_layers(gpu_layers, NUM_BLOCKS)
    cpu_kv = PagedKV.from_layers(cpu_layers, NUM_BLOCKS)
    assert gpu_kv.block_bytes == cpu_kv.block_bytes
    ids = np.array([3, 15, 0, 7])
    offsets = np.array([0, 2, 5, 9]) * gpu_kv.block_bytes + 4096
    region_gpu = torch.zeros(12 * gpu_kv.block_bytes, dtype=torch.uint8)
    region_cpu = torch.zeros_like(region_gpu)

    copier = CudaBlockCopier(gpu_kv)
    copier.begin_save(region_gpu, offsets, ids)
    for name, _ in gpu_layers:  # as vLLM calls save_kv_layer after each layer
        copier.save_layer(name)
    copier.finish_save()
    BlockCopier(cpu_kv).save(region_cpu, offsets, ids)
    assert torch.equal(region_gpu, region_cpu)

    target = [(n, torch.zeros_like(t)) for n, t in gpu_layers]
    loader = CudaBlockCopier(PagedKV.from_layers(target, NUM_BLOCKS))
    new_ids = np.array([1, 2, 4, 8])
    loader.load(region_gpu, offsets, new_ids)
    for name, _ in target:
        loader.wait_layer(name)  # what the attention layer does before reading
    torch.cuda.synchronize()
    for (_, src), (_, dst) in zip(gpu_layers, target, strict=True):
        assert torch.equal(dst[:, new_ids.tolist()], src[:, ids.tolist()])
        others = [b for b in range(NUM_BLOCKS) if b not in new_ids.tolist()]
        assert dst[:, others].abs().sum().item() == 0


def test_gpu_tier_copier_is_device_to_device_and_matches_the_cpu_path():
    """tier="gpu": BlockCopier between a CUDA cache and a pool on the same device
    gives the same bytes as the CPU path; a pool on another device is refused."""
    from kvstore.errors import InvalidRequest
    from kvstore_connectors.vllm.copier import BlockCopier, PagedKV

    gpu_layers = _layers("cuda", seed=1)
    cpu_layers = [(n, t.cpu()) for n, t in gpu_layers]
    gpu_kv = PagedKV.from_layers(gpu_layers, NUM_BLOCKS)
    ids = np.array([2, 9, 11])
    offsets = np.array([1, 4, 6]) * gpu_kv.block_bytes
    pool = torch.zeros(8 * gpu_kv.block_bytes, dtype=torch.uint8, device="cuda")
    BlockCopier(gpu_kv).save(pool, offsets, ids)
    region_cpu = torch.zeros(8 * gpu_kv.block_bytes, dtype=torch.uint8)
    BlockCopier(PagedKV.from_layers(cpu_layers, NUM_BLOCKS)).save(region_cpu, offsets, ids)
    assert torch.equal(pool.cpu(), region_cpu)
    target = [(n, torch.zeros_like(t)) for n, t in gpu_layers]
    BlockCopier(PagedKV.from_layers(target, NUM_BLOCKS)).load(pool, offsets, np.array([0, 1, 3]))
    for (_, src), (_, dst) in zip(gpu_layers, target, strict=True):
        assert torch.equal(dst[:, [0, 1, 3]], src[:, ids.tolist()])
    with pytest.raises(InvalidRequest, match="KV cache on"):
        BlockCopier(gpu_kv).save(region_cpu, offsets, ids)
