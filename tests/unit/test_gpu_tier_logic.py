"""The GPU tier's slot logic over a CPU tensor (CUDA-only paths are in tests/gpu)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore.errors import BackendError, ConfigError, InvalidRequest  # noqa: E402
from kvstore.tiers.gpu import GpuTier  # noqa: E402

CHUNK = 64 * 1024


def pattern(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def test_blocks_round_trip_through_slots():
    tier = GpuTier(4 * CHUNK, CHUNK, "cpu")
    offsets = {}
    for seed, nbytes in [(1, 4096), (2, 4096), (3, 10_000), (4, 4096)]:
        offset = tier.allocate(nbytes)
        assert offset is not None
        tier.copy_in(offset, pattern(seed, nbytes))
        offsets[seed] = (offset, nbytes)
    assert len({o for o, _ in offsets.values()}) == 4
    for seed, (offset, nbytes) in offsets.items():
        out = np.empty(nbytes, dtype=np.uint8)
        tier.copy_out(offset, out)
        assert np.array_equal(out, pattern(seed, nbytes))
        assert np.array_equal(tier.view(offset, nbytes).numpy(), pattern(seed, nbytes))


def test_tensor_blocks_of_any_dtype():
    tier = GpuTier(CHUNK, CHUNK, "cpu")
    block = torch.randn(2, 16, 64, dtype=torch.float16)
    offset = tier.allocate(block.numel() * 2)
    assert offset is not None
    tier.copy_in(offset, block)
    back = torch.empty_like(block)
    tier.copy_out(offset, back)
    assert torch.equal(back, block)
    with pytest.raises(InvalidRequest, match="contiguous"):
        tier.copy_in(offset, block.transpose(0, 2))


def test_capacity_is_a_hard_cap_and_slots_are_reused():
    tier = GpuTier(2 * CHUNK, CHUNK, "cpu")
    slots = [tier.allocate(CHUNK // 4) for _ in range(8)]
    assert None not in slots
    assert tier.allocate(CHUNK // 4) is None
    assert tier.used_bytes == tier.capacity_bytes
    tier.free(slots[3])
    assert tier.allocate(CHUNK // 4) == slots[3]
    with pytest.raises(InvalidRequest):
        tier.allocate(CHUNK + 1)


def test_view_cannot_overrun_its_slot():
    tier = GpuTier(CHUNK, CHUNK, "cpu")
    offset = tier.allocate(4096)
    assert offset is not None
    with pytest.raises(InvalidRequest, match="overrun"):
        tier.view(offset, 8192)


def test_ipc_export_needs_cuda():
    tier = GpuTier(CHUNK, CHUNK, "cpu")
    with pytest.raises(BackendError, match="CUDA"):
        tier.export_handle()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_device_without_cuda_is_a_config_error():
    with pytest.raises(ConfigError, match="cuda"):
        GpuTier(CHUNK, CHUNK, "cuda:0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_mapping_a_cuda_pool_without_cuda_is_one_clear_error():
    """A client without CUDA that meets a daemon's IPC handle gets a BackendError
    naming the device, not a traceback from inside torch."""
    from kvstore.tiers.gpu import GpuPoolHandle, open_handle

    handle = GpuPoolHandle(
        device_index=0,
        nbytes=CHUNK,
        storage_handle=b"\0" * 64,
        storage_size_bytes=CHUNK,
        storage_offset_bytes=0,
        ref_counter_handle=b"/torch_0_0",
        ref_counter_offset=0,
        event_handle=b"",
        event_sync_required=False,
        tensor_offset=0,
    )
    with pytest.raises(BackendError, match=r"pool is on cuda:0, but this process sees no CUDA"):
        open_handle(handle)


def test_page_locking_without_cuda_declines():
    from kvstore.tiers.gpu import pin_host_memory, unpin_host_memory

    buf = np.zeros(1 << 20, dtype=np.uint8)
    if torch.cuda.is_available():
        assert pin_host_memory(buf)
    else:
        assert pin_host_memory(buf) is False
    unpin_host_memory(buf)  # best effort either way: never raises
