"""Batched copies between vLLM's paged KV cache and the daemon's shared region.

A stored block is every layer's pages of one vLLM block, layer by layer in the
model's order; within a layer, the engine's own page bytes, ``outer`` pages
of ``page_bytes`` each (CPU: one page ``[heads, block, 2*head_dim]``; a
K/V-outermost GPU cache: two pages, K then V).

Both sides are viewed as rows of ``U`` bytes (the largest unit dividing every
page and every offset in the batch), so one step's copy is, per layer, one
``index_select`` gather into a staging buffer and one ``index_copy_`` scatter,
over all blocks of all requests at once; int64 rows make both run near memcpy
speed (environment.md: 8-12 GB/s here vs 1.7 GB/s on byte rows). No Python
loop runs per block or per page.

Primitives:
    PagedKV.from_layers(layers, num_blocks)     learn the layout, check it is dense
    BlockCopier(kv).load(region, offsets, ids)  region slots -> vLLM blocks
    BlockCopier(kv).save(region, offsets, ids)  vLLM blocks -> region slots
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from kvstore import memcopy
from kvstore.errors import ConfigError, InvalidRequest

if TYPE_CHECKING:
    import torch

# Largest row unit tried: bigger rows mean fewer index entries, and 4 KiB is
# where index overhead stops mattering (an int64 index per 4 KiB row).
_MAX_ROW_BYTES = 4096


@dataclass(frozen=True, slots=True)
class LayerPages:
    """One layer's cache as ``[outer, num_blocks, page_bytes]`` bytes."""

    name: str
    pages: torch.Tensor  # uint8 [outer, num_blocks, page_bytes], aliases the cache
    outer: int
    page_bytes: int
    offset_in_block: int  # where this layer starts inside a stored block

    @property
    def bytes_per_block(self) -> int:
        return self.outer * self.page_bytes


class PageGroup(NamedTuple):
    """Layers whose pages share one shape: where each layer's pages start."""

    outer: int
    page_bytes: int
    outer_stride: int  # bytes from one K/V half's page to the other's, in the cache
    block_stride: int  # bytes from one block's page to the next block's
    bases: np.ndarray  # int64 per layer: the address of its page (0, block 0)
    in_block: np.ndarray  # int64 per layer: where it starts inside a stored block


class PagedKV:
    """vLLM's per-layer KV tensors seen as pages per block."""

    def __init__(self, layers: Sequence[LayerPages], num_blocks: int) -> None:
        self.layers = list(layers)
        self.num_blocks = num_blocks
        self.block_bytes = sum(layer.bytes_per_block for layer in self.layers)
        self.device = self.layers[0].pages.device if self.layers else None
        unit = 0
        for layer in self.layers:
            unit = math.gcd(unit, layer.page_bytes, layer.offset_in_block)
        self.row_unit_max = math.gcd(unit, _MAX_ROW_BYTES) if unit else 1
        # The page addresses of every layer, grouped by shape (one group in every
        # model seen): a CPU batch's pages are then a few numpy ops and one copy
        # call, whatever the number of layers. Read once: vLLM allocates its KV
        # cache once (sleep mode unregisters, and a new PagedKV comes with the new one).
        shapes: dict[tuple[int, int, int, int], list[LayerPages]] = {}
        for layer in self.layers:
            so, sb, _ = layer.pages.stride()  # uint8 pages: strides in bytes
            shapes.setdefault((layer.outer, layer.page_bytes, so, sb), []).append(layer)
        self.page_groups = [
            PageGroup(
                outer,
                page_bytes,
                so,
                sb,
                np.array([layer.pages.data_ptr() for layer in group], dtype=np.int64),
                np.array([layer.offset_in_block for layer in group], dtype=np.int64),
            )
            for (outer, page_bytes, so, sb), group in shapes.items()
        ]

    @classmethod
    def from_layers(cls, layers: Sequence[tuple[str, torch.Tensor]], num_blocks: int) -> PagedKV:
        out: list[LayerPages] = []
        offset = 0
        for name, tensor in layers:
            pages, outer = _pages_view(name, tensor, num_blocks)
            page_bytes = pages.shape[2]
            out.append(LayerPages(name, pages, outer, page_bytes, offset))
            offset += outer * page_bytes
        if not out:
            raise ConfigError("vLLM registered no KV cache layers")
        return cls(out, num_blocks)


def _pages_view(name: str, tensor: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, int]:
    """``tensor`` as uint8 ``[outer, num_blocks, page_bytes]`` in physical order (a view).

    The block dimension is the outermost one of size ``num_blocks`` with at
    most a K/V split (size <= 2) outside it; the tensor must be dense in its
    stride order, so each (outer, block) page is contiguous.
    """
    import torch

    strides_all = tuple(tensor.stride())
    order = sorted(range(tensor.dim()), key=lambda d: -strides_all[d])
    sizes = [tensor.shape[d] for d in order]
    strides = [strides_all[d] for d in order]
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides), strict=True):
        if size != 1 and stride != expected:
            raise ConfigError(
                f"KV cache layer {name}: shape {tuple(tensor.shape)} strides {tuple(tensor.stride())} "
                "is not dense; the kvstore connector needs each block's pages contiguous"
            )
        expected *= size
    for pos, size in enumerate(sizes):
        outer = math.prod(sizes[:pos])
        if size == num_blocks and outer <= 2:
            page_elems = math.prod(sizes[pos + 1 :])
            break
    else:
        raise ConfigError(
            f"KV cache layer {name}: no block dimension of size {num_blocks} in shape {tuple(tensor.shape)}"
        )
    pages = torch.as_strided(
        tensor, (outer, num_blocks, page_elems), (num_blocks * page_elems, page_elems, 1)
    )
    return pages.view(torch.uint8), outer


def _row_unit(limit: int, offsets: np.ndarray) -> int:
    unit = limit
    if len(offsets):
        unit = math.gcd(unit, int(np.gcd.reduce(offsets.astype(np.int64))))
    return unit


def _rows(flat: torch.Tensor, unit: int) -> torch.Tensor:
    """A 1-D uint8 tensor as ``[n, unit]`` rows: int64 elements when the unit allows."""
    import torch

    n = flat.shape[0] // unit
    flat = flat[: n * unit]
    if unit % 8 == 0 and flat.data_ptr() % 8 == 0:
        return flat.view(torch.int64).view(n, unit // 8)
    return flat.view(n, unit)


def checked_batch(
    kv: PagedKV, region: torch.Tensor, offsets: np.ndarray, block_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """Validate a batch: (offsets, block ids) as int64, or None when empty."""
    n = len(block_ids)
    if n == 0:
        return None
    if len(offsets) != n:
        raise InvalidRequest(f"{len(offsets)} offsets for {n} blocks")
    offsets = np.asarray(offsets, dtype=np.int64)
    block_ids = np.asarray(block_ids, dtype=np.int64)
    if block_ids.min() < 0 or block_ids.max() >= kv.num_blocks:
        raise InvalidRequest(f"block id outside 0..{kv.num_blocks - 1}")
    if offsets.min() < 0 or offsets.max() + kv.block_bytes > region.shape[0]:
        raise InvalidRequest("a block's slot lies outside the region")
    return offsets, block_ids


def plan_batch(
    kv: PagedKV, region: torch.Tensor, offsets: np.ndarray, block_ids: np.ndarray
) -> tuple[int, np.ndarray, np.ndarray] | None:
    """Validate a batch; (row unit, offsets, block ids) as int64, or None when empty."""
    batch = checked_batch(kv, region, offsets, block_ids)
    if batch is None:
        return None
    offsets, block_ids = batch
    return _row_unit(kv.row_unit_max, offsets), offsets, block_ids


def row_indices(
    layer: LayerPages, num_blocks: int, unit: int, offsets: np.ndarray, block_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Matching row indices (cache rows, region rows) of ``layer``'s pages of the batch.

    Ordered (block i, page o, row k) on both sides, so row j of one is row j of the other.
    """
    page_rows = layer.page_bytes // unit
    o = np.arange(layer.outer, dtype=np.int64)[None, :, None]
    k = np.arange(page_rows, dtype=np.int64)[None, None, :]
    kv_idx = ((o * num_blocks + block_ids[:, None, None]) * page_rows + k).reshape(-1)
    reg_idx = (
        (offsets[:, None, None] + layer.offset_in_block + o * layer.page_bytes) // unit + k
    ).reshape(-1)
    return kv_idx, reg_idx


def page_addresses(
    group: PageGroup, region_address: int, offsets: np.ndarray, block_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(cache addresses, region addresses) of every page of the batch in ``group``'s
    layers: page (layer, block i, half o) of the cache, and where it goes in block
    i's slot. The CPU copier's plan, as row_indices is the torch one's."""
    o = np.arange(group.outer, dtype=np.int64)
    cache = (
        group.bases[:, None, None]
        + block_ids[None, :, None] * group.block_stride
        + o[None, None, :] * group.outer_stride
    )
    region = (
        region_address
        + offsets[None, :, None]
        + group.in_block[:, None, None]
        + o[None, None, :] * group.page_bytes
    )
    return cache.reshape(-1), region.reshape(-1)


class Copier(Protocol):
    """A step's copies: loads before the forward, saves after each layer / the step.

    ``load`` must have read every byte it takes from the region when it returns
    (what it then does with them may still be in flight): a direct load is
    checked right after it (docs/presence.md), and a pin is released then.

    ``layer_wise``: whether ``wait_layer`` and ``save_layer`` do anything (a copier
    that overlaps its copies with the forward, layer by layer); where not, vLLM is
    told not to call them (``KVStoreConnector.has_connector_metadata``)."""

    layer_wise: bool

    def load(self, region: torch.Tensor, offsets: np.ndarray, block_ids: np.ndarray) -> None: ...
    def wait_layer(self, name: str) -> None: ...
    def wait_loads(self) -> None: ...
    def begin_save(
        self, region: torch.Tensor, offsets: np.ndarray, block_ids: np.ndarray
    ) -> None: ...
    def save_layer(self, name: str) -> None: ...
    def finish_save(self, deadline_s: float = math.inf) -> bool:
        """Write the planned save into the region, layer by layer, starting no layer
        after ``deadline_s`` (time.monotonic): False when it stopped (the slots may be
        another block's by now; the save must be abandoned)."""
        ...

    def cancel_save(self) -> None:
        """Drop the planned save: nothing more is written to the region."""
        ...


class BlockCopier:
    """Moves whole blocks between a ``PagedKV`` and a region on the same device, in batches.

    A CPU cache with the DRAM region (or a host-mode GPU pool), or a CUDA cache
    with the daemon's GPU pool (device to device). On the CPU the forward and the
    copies share the same cores, so there is nothing to overlap: loads complete
    inside ``load`` and saves run as one batch in ``finish_save``, after the
    step's forward. On CUDA the copies are queued on the current stream (after
    the forward) and waited for before leases are released or blocks committed.

    On the CPU a batch is one ``memcopy.copy_list`` call per page shape (where
    that is one loop: ``memcopy.list_copy_is_fast``; else the torch path): a
    step's pages are small (4-32 KiB), and torch's index ops cost ~100 µs per
    layer of dispatch when the forward has just evicted the caches (8 blocks,
    2 layers: 400 µs against 270 µs this way, ~100 of it the bytes themselves;
    docs/tiers.md).
    """

    layer_wise = False  # loads finish in load(), saves in finish_save()

    def __init__(self, kv: PagedKV) -> None:
        self.kv = kv
        self._staging: torch.Tensor | None = None
        self._pending_save: tuple[torch.Tensor, np.ndarray, np.ndarray] | None = None
        # The last region copied with, and its address. Held (not its id): a new
        # tensor can never be taken for it, so the address is never a stale one.
        self._region: torch.Tensor | None = None
        self._region_address = 0
        # Page lists on the CPU where memcopy moves them in one call; else (no copy
        # loops on this machine, page sizes not a multiple of 64) torch's row path.
        self.uses_page_lists = (
            kv.device is not None
            and kv.device.type == "cpu"
            and all(memcopy.list_copy_is_fast(group.page_bytes) for group in kv.page_groups)
        )

    def wait_layer(self, name: str) -> None:
        return  # loads are complete when load() returns

    def wait_loads(self) -> None:
        return

    def begin_save(self, region: torch.Tensor, offsets: np.ndarray, block_ids: np.ndarray) -> None:
        self._pending_save = (region, offsets, block_ids)

    def save_layer(self, name: str) -> None:
        return  # the whole step is saved in one batch by finish_save

    def finish_save(self, deadline_s: float = math.inf) -> bool:
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return True
        return self._copy(*pending, to_kv=False, deadline_s=deadline_s)

    def cancel_save(self) -> None:
        self._pending_save = None

    def load(self, region: torch.Tensor, offsets: np.ndarray, block_ids: np.ndarray) -> None:
        """vLLM block ``block_ids[i]`` <- the stored block at ``region[offsets[i]:]``."""
        self._copy(region, offsets, block_ids, to_kv=True)

    def save(self, region: torch.Tensor, offsets: np.ndarray, block_ids: np.ndarray) -> None:
        """The stored block at ``region[offsets[i]:]`` <- vLLM block ``block_ids[i]``."""
        self._copy(region, offsets, block_ids, to_kv=False)

    def _copy(
        self,
        region: torch.Tensor,
        offsets: np.ndarray,
        block_ids: np.ndarray,
        *,
        to_kv: bool,
        deadline_s: float = math.inf,
    ) -> bool:
        import torch

        device = self.kv.device or torch.device("cpu")
        if region is not self._region and region.device != device:
            raise InvalidRequest(
                f"the daemon's blocks are on {region.device}, the KV cache on {device}: "
                "a CUDA cache with tier=dram uses CudaBlockCopier"
            )
        if self.uses_page_lists:
            checked = checked_batch(self.kv, region, offsets, block_ids)
            if checked is None:
                return True
            if time.monotonic() > deadline_s:
                return False  # a lease ran out: write nothing into its slots
            if region is not self._region:  # (torch attribute reads cost, cold)
                self._region, self._region_address = region, region.data_ptr()
            for group in self.kv.page_groups:
                cache, slots = page_addresses(group, self._region_address, *checked)
                if to_kv:
                    memcopy.copy_list(cache, slots, group.page_bytes)
                else:
                    memcopy.copy_list(slots, cache, group.page_bytes)
            return True
        batch = plan_batch(self.kv, region, offsets, block_ids)
        if batch is None:
            return True
        unit, offsets, block_ids = batch
        region_rows = _rows(region, unit)
        for layer in self.kv.layers:
            if time.monotonic() > deadline_s:
                return False  # a lease ran out: write no more into its slots
            kv_idx, reg_idx = row_indices(layer, self.kv.num_blocks, unit, offsets, block_ids)
            kv_rows = _rows(layer.pages.reshape(-1), unit)
            kv_index = torch.from_numpy(kv_idx).to(device)
            reg_index = torch.from_numpy(reg_idx).to(device)
            staging = self._staging_for(len(kv_idx), kv_rows)
            if to_kv:
                torch.index_select(region_rows, 0, reg_index, out=staging)
                kv_rows.index_copy_(0, kv_index, staging)
            else:
                torch.index_select(kv_rows, 0, kv_index, out=staging)
                region_rows.index_copy_(0, reg_index, staging)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # leases end / commits follow right after
        return True

    def _staging_for(self, nrows: int, like: torch.Tensor) -> torch.Tensor:
        import torch

        width = like.shape[1]
        need = nrows * width
        buf = self._staging
        if buf is None or buf.dtype != like.dtype or buf.numel() < need:
            buf = self._staging = torch.empty(max(need, 1), dtype=like.dtype, device=like.device)
        return buf[:need].view(nrows, width)
