"""The GPU path: vLLM's CUDA KV cache <-> the daemon's DRAM region, layer by layer.

Same byte format and row indexing as ``copier.BlockCopier``. The region is a
shared file mapped by the daemon; DMA needs page-locked memory, so the bytes
go through a pinned host staging buffer:

    load   region --(CPU index_select)--> pinned --(H2D, side stream)--> GPU rows
           --(index_copy_ on the GPU)--> cache; one CUDA event per layer, so
           layer i's attention waits only for layer i (``wait_layer``).
    save   after layer i's forward: cache --(index_select on the GPU)--> GPU
           rows --(D2H, side stream)--> pinned; after the step: wait, then
           pinned --(CPU index_copy_)--> region.

Loads and saves of a step overlap the forward; nothing waits on the host
except the final scatter into the region. Tests: tests/gpu (marked ``gpu``).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import numpy as np

from kvstore.errors import ConfigError
from kvstore_connectors.vllm.copier import PagedKV, _rows, plan_batch, row_indices

if TYPE_CHECKING:
    import torch


class CudaBlockCopier:
    layer_wise = True  # layer i's attention waits for layer i's load; saves queued per layer

    def __init__(self, kv: PagedKV) -> None:
        import torch

        if kv.device is None or kv.device.type != "cuda":
            raise ConfigError(f"CudaBlockCopier copies CUDA caches; this one is on {kv.device}")
        self.kv = kv
        self.device = kv.device
        self._stream = torch.cuda.Stream(device=self.device)
        # Loads and saves of one step are in flight together: separate buffers.
        self._pinned: dict[str, torch.Tensor] = {}
        self._last_load: torch.cuda.Event | None = None
        self._load_events: dict[str, torch.cuda.Event] = {}
        # pending save: region rows, and per layer (cache index on GPU, region index, pinned rows)
        self._save: (
            tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] | None
        ) = None
        self._save_events: list[torch.cuda.Event] = []
        self._saved: set[str] = set()
        self._save_unit = 1
        self._layers = {layer.name: layer for layer in kv.layers}

    # ------------------------------------------------------------ staging

    def _pinned_rows(
        self, kind: str, nrows_per_layer: int, width: int, dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """Per-layer row views of the pinned buffer for ``kind`` ("load" or "save")."""
        import torch

        need = nrows_per_layer * width * len(self.kv.layers)
        buf = self._pinned.get(kind)
        if buf is None or buf.dtype != dtype or buf.numel() < need:
            buf = self._pinned[kind] = torch.empty(max(need, 1), dtype=dtype, pin_memory=True)
        per = nrows_per_layer * width
        return [
            buf[i * per : (i + 1) * per].view(nrows_per_layer, width)
            for i in range(len(self.kv.layers))
        ]

    # ------------------------------------------------------------ loads

    def load(self, region: torch.Tensor, offsets: np.ndarray, block_ids: np.ndarray) -> None:
        """Queue the load; ``wait_layer`` / ``wait_loads`` order the forward after it."""
        import torch

        batch = plan_batch(self.kv, region, offsets, block_ids)
        if batch is None:
            return
        unit, offsets, block_ids = batch
        region_rows = _rows(region, unit)
        plans = []
        for layer in self.kv.layers:
            kv_idx, reg_idx = row_indices(layer, self.kv.num_blocks, unit, offsets, block_ids)
            plans.append((layer, kv_idx, reg_idx))
        if self._last_load is not None:
            # The previous step's H2D copies may still read the pinned buffer.
            self._last_load.synchronize()
        staging = self._pinned_rows(
            "load", len(plans[0][1]), region_rows.shape[1], region_rows.dtype
        )
        # On the CPU, now: the region's bytes are read when load() returns (a direct
        # load is checked, a pin released, right after: copier.Copier).
        for (_, _, reg_idx), host in zip(plans, staging, strict=True):
            torch.index_select(region_rows, 0, torch.from_numpy(reg_idx), out=host)
        # The cache blocks may still be read by the previous step's kernels.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for (layer, kv_idx, _), host in zip(plans, staging, strict=True):
                kv_rows = _rows(layer.pages.reshape(-1), unit)
                dev_rows = host.to(self.device, non_blocking=True)
                kv_index = torch.from_numpy(kv_idx).to(self.device, non_blocking=True)
                kv_rows.index_copy_(0, kv_index, dev_rows)
                event = torch.cuda.Event()
                event.record(self._stream)
                self._load_events[layer.name] = event
                self._last_load = event

    def wait_layer(self, name: str) -> None:
        import torch

        event = self._load_events.pop(name, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def wait_loads(self) -> None:
        for name in list(self._load_events):
            self.wait_layer(name)

    # ------------------------------------------------------------ saves

    def begin_save(self, region: torch.Tensor, offsets: np.ndarray, block_ids: np.ndarray) -> None:
        """Plan a save of ``block_ids`` into ``region`` at ``offsets``; before the forward."""
        import torch

        self._save = None
        self._save_events = []
        self._saved = set()
        batch = plan_batch(self.kv, region, offsets, block_ids)
        if batch is None:
            return
        unit, offsets, block_ids = batch
        region_rows = _rows(region, unit)
        indices = [
            row_indices(layer, self.kv.num_blocks, unit, offsets, block_ids)
            for layer in self.kv.layers
        ]
        staging = self._pinned_rows(
            "save", len(indices[0][0]), region_rows.shape[1], region_rows.dtype
        )
        self._save_unit = unit
        self._save = (
            region_rows,
            {
                layer.name: (
                    torch.from_numpy(kv_idx).to(self.device),
                    torch.from_numpy(reg_idx),
                    host,
                )
                for layer, (kv_idx, reg_idx), host in zip(
                    self.kv.layers, indices, staging, strict=True
                )
            },
        )

    def save_layer(self, name: str) -> None:
        """Queue layer ``name``'s D2H copy; call after its forward wrote the cache."""
        import torch

        if self._save is None or name not in self._save[1] or name in self._saved:
            return
        kv_index, _, host = self._save[1][name]
        kv_rows = _rows(self._layers[name].pages.reshape(-1), self._save_unit)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host.copy_(kv_rows.index_select(0, kv_index), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._save_events.append(event)
        self._saved.add(name)

    def finish_save(self, deadline_s: float = math.inf) -> bool:
        """Wait for the queued D2H copies, then scatter the pinned rows into the region
        (starting no layer past ``deadline_s``: False when it stopped)."""
        if self._save is None:
            return True
        region_rows, layers = self._save
        for name in layers:  # layers whose save_layer never ran are copied now
            self.save_layer(name)
        for event in self._save_events:
            event.synchronize()
        done = True
        for _, reg_index, host in layers.values():
            if time.monotonic() > deadline_s:
                done = False  # a lease ran out: write no more into its slots
                break
            region_rows.index_copy_(0, reg_index, host)
        self._save = None
        self._save_events = []
        return done

    def cancel_save(self) -> None:
        for event in self._save_events:
            event.synchronize()  # the pinned rows are reused by the next save
        self._save = None
        self._save_events = []
