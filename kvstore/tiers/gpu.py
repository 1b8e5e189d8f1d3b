"""The GPU tier: a pool in spare HBM, carved into slots like the DRAM region.

The pool is one ``torch.uint8`` tensor of ``capacity_bytes`` on ``cuda:N``,
allocated once at start (a hard cap). Slots come from the same
``SlabAllocator`` as the DRAM tier and are addressed by byte offset, so the
manager moves a block between tiers with one ``copy_`` of a slice. Local
engines map the pool through a CUDA IPC handle (``export_handle`` ->
``open_handle`` in the engine's process) and copy device to device.

The slot logic never looks at the device: unit tests run it over a CPU tensor,
only ``export_handle``/``open_handle`` and ``pin_host_memory`` need CUDA.

torch is imported here and only here in the daemon, when a GPU tier is
configured.

Primitives:
    GpuTier(capacity_bytes, chunk_bytes, device)
    allocate(nbytes) -> offset | None    free(offset)
    view(offset, nbytes) -> tensor       a slice of the pool
    copy_in(offset, src)                 host (numpy/tensor) or device bytes -> slot
    copy_out(offset, dst)                slot -> host or device bytes
    export_handle() -> GpuPoolHandle     open_handle(handle) -> tensor (engine side)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from kvstore.errors import BackendError, ConfigError, InvalidRequest
from kvstore.tiers.dram import SlabAllocator, slot_bytes_for

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class GpuPoolHandle(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine on this node needs to map the pool (CUDA IPC), wire-safe.

    Two exports of the same memory, so an engine maps it with whichever works
    there (``open_handle`` tries them in order):

    - torch's (``torch.UntypedStorage._share_cuda_()``'s fields): the producer's
      reference counter keeps the pool alive while any consumer maps it;
    - cupy's public ``cudaIpcGetMemHandle`` of the allocation holding the pool,
      and the pool's offset in it: for an engine where torch's private API changed.
    An empty handle means that export was not possible in the daemon.
    """

    device_index: int
    nbytes: int
    storage_handle: bytes = b""
    storage_size_bytes: int = 0
    storage_offset_bytes: int = 0
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0
    event_handle: bytes = b""
    event_sync_required: bool = False
    tensor_offset: int = 0
    cuda_ipc_handle: bytes = b""
    cuda_ipc_offset_bytes: int = 0


def _as_tensor(data: Any) -> torch.Tensor:
    import torch

    if isinstance(data, torch.Tensor):
        if not data.is_contiguous():
            raise InvalidRequest("block buffers must be contiguous")
        return data.reshape(-1).view(torch.uint8)
    array = np.asarray(data)
    if not array.flags.c_contiguous:
        raise InvalidRequest("block buffers must be contiguous")
    return torch.from_numpy(array.reshape(-1).view(np.uint8))


class GpuTier:
    """Block slots over one device tensor."""

    def __init__(
        self,
        capacity_bytes: int,
        chunk_bytes: int,
        device: str | torch.device,
        *,
        pool: torch.Tensor | None = None,
    ) -> None:
        """pool: memory to carve instead of allocating (a shared-memory tensor in host mode)."""
        import torch

        self.device = torch.device(device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(f"gpu tier on {self.device}: CUDA is not available")
            index = self.device.index if self.device.index is not None else 0
            if index >= torch.cuda.device_count():
                raise ConfigError(
                    f"gpu tier on {self.device}: only {torch.cuda.device_count()} CUDA devices"
                )
            self.device = torch.device("cuda", index)
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
            if capacity_bytes > free_bytes:
                raise ConfigError(
                    f"gpu tier on {self.device}: capacity_bytes {capacity_bytes} exceeds the "
                    f"{free_bytes} bytes of free device memory"
                )
        if capacity_bytes < chunk_bytes:
            raise ConfigError("gpu tier: capacity_bytes must be at least chunk_bytes")
        self.allocator = SlabAllocator(capacity_bytes, chunk_bytes)
        self.capacity_bytes = self.allocator.capacity_bytes
        self._handle: GpuPoolHandle | None = None  # exported once, on first ask
        if pool is not None:
            if pool.dtype != torch.uint8 or pool.numel() < self.capacity_bytes:
                raise ConfigError(f"gpu tier: the pool must be >= {self.capacity_bytes} uint8")
            self.pool = pool[: self.capacity_bytes]
            return
        try:
            self.pool = torch.empty(self.capacity_bytes, dtype=torch.uint8, device=self.device)
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
            raise ConfigError(
                f"gpu tier on {self.device}: cannot allocate the pool: {exc}"
            ) from None

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    @property
    def max_block_bytes(self) -> int:
        return self.allocator.chunk_bytes

    def can_allocate(self, nbytes: int) -> bool:
        return self.allocator.can_alloc_without_eviction(slot_bytes_for(nbytes))

    def allocate(self, nbytes: int) -> int | None:
        if nbytes <= 0 or nbytes > self.allocator.chunk_bytes:
            raise InvalidRequest(
                f"block of {nbytes} bytes: must be 1..{self.allocator.chunk_bytes}"
            )
        return self.allocator.alloc(slot_bytes_for(nbytes))

    def free(self, offset: int) -> None:
        self.allocator.free(offset)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        if nbytes > self.allocator.slot_bytes_at(offset):
            raise InvalidRequest(f"{nbytes} bytes overrun the slot at {offset}")
        return self.pool[offset : offset + nbytes]

    def copy_in(self, offset: int, src: Any, *, non_blocking: bool = False) -> None:
        """Copy a block (host numpy/tensor or device tensor) into its slot."""
        data = _as_tensor(src)
        self.view(offset, data.numel()).copy_(data, non_blocking=non_blocking)

    def copy_out(self, offset: int, dst: Any, *, non_blocking: bool = False) -> None:
        """Copy a slot's block into ``dst`` (host numpy/tensor or device tensor)."""
        out = _as_tensor(dst)
        out.copy_(self.view(offset, out.numel()), non_blocking=non_blocking)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def export_handle(self) -> GpuPoolHandle:
        """A CUDA IPC handle for the whole pool, for an engine process on this node.

        Exported once and cached: every ``_share_cuda_`` call wraps the storage in
        one more reference-counted layer with a new counter slot, and Hello (which
        hands this out) runs once per client connection.
        """
        if self.device.type != "cuda":
            raise BackendError(f"gpu tier on {self.device}: IPC export needs a CUDA pool")
        if self._handle is None:
            try:
                self._handle = self._export()
            except (AttributeError, TypeError, ValueError, RuntimeError) as exc:
                raise BackendError(
                    f"gpu tier on {self.device}: CUDA IPC export of the pool failed "
                    f"(torch {torch_version()}): {exc}"
                ) from exc
        return self._handle

    def _export(self) -> GpuPoolHandle:
        fields: dict[str, Any] = {}
        reasons = []
        try:
            fields.update(self._torch_export())
        except (AttributeError, TypeError, ValueError, RuntimeError) as exc:
            reasons.append(f"torch: {exc}")
        try:
            fields.update(self._cupy_export())
        except Exception as exc:  # ImportError, cupy's CUDARuntimeError, no segment found
            reasons.append(f"cupy: {exc}")
        if not fields:
            raise RuntimeError("; ".join(reasons))
        for reason in reasons:
            log.info("gpu tier: one IPC export of the pool is not available (%s)", reason)
        return GpuPoolHandle(
            device_index=self.device.index or 0, nbytes=self.capacity_bytes, **fields
        )

    def _torch_export(self) -> dict[str, Any]:
        # torch.multiprocessing's own path for every CUDA tensor it sends (private but
        # stable): it adds the producer-side reference count that keeps the pool's
        # memory alive while an engine maps it, and the event a consumer waits on.
        storage = self.pool.untyped_storage()
        (
            _device_index,
            handle,
            size_bytes,
            offset_bytes,
            ref_handle,
            ref_offset,
            event_handle,
            event_sync,
        ) = storage._share_cuda_()
        return {
            "storage_handle": bytes(handle),
            "storage_size_bytes": int(size_bytes),
            "storage_offset_bytes": int(offset_bytes),
            "ref_counter_handle": bytes(ref_handle),
            "ref_counter_offset": int(ref_offset),
            "event_handle": bytes(event_handle) if event_handle else b"",
            "event_sync_required": bool(event_sync),
            "tensor_offset": int(self.pool.storage_offset()),
        }

    def _cupy_export(self) -> dict[str, Any]:
        # cudaIpcGetMemHandle names the whole cudaMalloc allocation holding the
        # pointer and the importer gets that allocation's base: the pool's offset
        # in it (from torch's allocator, a public API) travels with the handle.
        import cupy
        import torch

        ptr = self.pool.data_ptr()
        base = next(
            (
                int(seg["address"])
                for seg in torch.cuda.memory_snapshot()
                if seg["address"] <= ptr < seg["address"] + seg["total_size"]
            ),
            None,
        )
        if base is None:
            raise LookupError("the pool is in no segment of torch's allocator")
        with cupy.cuda.Device(self.device.index or 0):
            handle = cupy.cuda.runtime.ipcGetMemHandle(base)
        return {"cuda_ipc_handle": bytes(handle), "cuda_ipc_offset_bytes": ptr - base}


def torch_version() -> str:
    try:
        import torch
    except ImportError:
        return "absent"
    return f"{torch.__version__}, CUDA {torch.version.cuda}"


def open_handle(handle: GpuPoolHandle, *, via: tuple[str, ...] = ("torch", "cupy")) -> torch.Tensor:
    """Map a daemon's GPU pool in this (engine) process: a uint8 tensor on its device.

    Tries the handle's exports in the order of ``via`` ("torch", "cupy"); a
    ``BackendError`` names why each failed. Must run in another process than the
    daemon's (CUDA refuses to open an IPC handle in the process that exported it)."""
    try:
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor
    except ImportError as exc:
        raise BackendError(f"mapping the daemon's GPU pool needs torch with CUDA: {exc}") from None
    if not torch.cuda.is_available():
        raise BackendError(
            f"the daemon's GPU pool is on cuda:{handle.device_index}, "
            f"but this process sees no CUDA device (torch {torch_version()})"
        )
    reasons = []
    for api in via:
        try:
            if api == "torch" and handle.storage_handle:
                return _rebuild(handle, torch, rebuild_cuda_tensor)
            if api == "cupy" and handle.cuda_ipc_handle:
                return _open_with_cupy(handle, torch)
            reasons.append(f"{api}: the daemon sent no such export")
        except Exception as exc:  # torch's RuntimeError, cupy's CUDARuntimeError, ImportError
            reasons.append(f"{api}: {type(exc).__name__}: {exc}")
    raise BackendError(
        f"cannot map the daemon's GPU pool on cuda:{handle.device_index} through CUDA IPC "
        f"(torch {torch_version()}): {'; '.join(reasons)}"
    )


def _open_with_cupy(handle: GpuPoolHandle, torch: Any) -> torch.Tensor:
    import cupy

    with cupy.cuda.Device(handle.device_index):
        # Mapped until this process exits: one mapping per client, like torch's.
        base = cupy.cuda.runtime.ipcOpenMemHandle(handle.cuda_ipc_handle)
    mem = cupy.cuda.UnownedMemory(
        base + handle.cuda_ipc_offset_bytes, handle.nbytes, None, handle.device_index
    )
    array = cupy.ndarray((handle.nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
    return torch.from_dlpack(array)


def _rebuild(handle: GpuPoolHandle, torch: Any, rebuild_cuda_tensor: Any) -> torch.Tensor:
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size([handle.nbytes]),
        (1,),
        handle.tensor_offset,
        torch.UntypedStorage,
        torch.uint8,
        handle.device_index,
        handle.storage_handle,
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        False,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle or None,
        handle.event_sync_required,
    )


def pin_host_memory(array: np.ndarray) -> bool:
    """Page-lock a host buffer (the DRAM region) so copies to and from HBM are DMA.

    Best effort: False when CUDA is absent or registration fails; copies then
    stage through pageable memory, slower but correct. torch's binding of
    cudaHostRegister first, cupy's where torch lacks it.
    """
    try:
        import torch

        if not torch.cuda.is_available():
            return False
    except ImportError:
        return False
    try:
        rc = int(torch.cuda.cudart().cudaHostRegister(array.ctypes.data, array.nbytes, 0))
    except (AttributeError, AssertionError, TypeError, RuntimeError):
        return _cupy_host_register(array)
    if rc != 0:
        log.warning(
            "cudaHostRegister of %d bytes failed (error %d): copies stage through pageable memory",
            array.nbytes,
            rc,
        )
        _clear_cuda_error(torch)
    return rc == 0


def unpin_host_memory(array: np.ndarray) -> None:
    """Undo ``pin_host_memory`` (before the buffer is unmapped)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return
    except ImportError:
        return
    try:
        torch.cuda.cudart().cudaHostUnregister(array.ctypes.data)
    except (AttributeError, AssertionError, TypeError, RuntimeError):
        try:
            import cupy

            cupy.cuda.runtime.hostUnregister(array.ctypes.data)
        except Exception:  # best effort, like the registration
            pass


def _cupy_host_register(array: np.ndarray) -> bool:
    try:
        import cupy

        cupy.cuda.runtime.hostRegister(array.ctypes.data, array.nbytes, 0)
    except Exception as exc:  # ImportError, or cupy's CUDARuntimeError
        log.warning("page-locking the region failed (torch has no cudaHostRegister): %s", exc)
        return False
    return True


def _clear_cuda_error(torch: Any) -> None:
    """Consume the error a failed cudaHostRegister leaves in cudaGetLastError.

    Otherwise the next kernel launch of any torch op in this process reports it
    as its own failure. A tiny kernel launch reads (and so clears) it here."""
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError as exc:
        log.debug("cleared a pending CUDA error: %s", exc)
