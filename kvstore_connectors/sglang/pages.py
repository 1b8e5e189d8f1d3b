"""Where a page of an SGLang host pool lies in memory, and copies of pages
between the pool and kvstore's shared region without staging.

A stored block is one host page's bytes in the order of the pool's own flat
page (``host_pool.get_data_page(index, flat=True)``, what SGLang's generic
``batch_set`` path hands a backend), so the zero-copy ``batch_*_v1`` path and
the tensor path (``get``/``set``/``batch_get``/``batch_set``) store the same
bytes. The zero-copy path never builds that flat tensor: it reads the strided
view ``get_data_page(index, flat=False)`` (a view into the pool for every
MHA/MLA layout) as a list of contiguous runs and memmoves each run straight
to or from the block's slot in the region. The run pattern is the same for
every page of a pool; only the page's base address moves.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

# Below this many runs per page the per-run Python loop is the cheap part.
_MEMMOVE = ctypes.memmove


class PageLayout:
    """The contiguous runs of one host page: offsets from the page's first byte.

    ``starts`` (bytes, relative to ``view.data_ptr()``) in the flat page's
    order, each ``run_bytes`` long; ``page_bytes`` = runs x run_bytes.
    """

    __slots__ = ("page_bytes", "run_bytes", "starts")

    def __init__(self, starts: np.ndarray, run_bytes: int) -> None:
        self.starts = starts
        self.run_bytes = run_bytes
        self.page_bytes = len(starts) * run_bytes

    @classmethod
    def of_view(cls, view: Any) -> PageLayout:
        """The runs of a strided torch tensor (C order, as ``flatten()`` reads it)."""
        shape = list(view.shape)
        strides = list(view.stride())
        itemsize = view.element_size()
        # Fold the innermost dimensions that are contiguous into one run.
        run = 1
        k = len(shape)
        while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == run):
            run *= shape[k - 1]
            k -= 1
        starts = np.zeros(1, dtype=np.int64)
        for dim in range(k):
            steps = np.arange(shape[dim], dtype=np.int64) * strides[dim]
            starts = (starts[:, None] + steps[None, :]).reshape(-1)
        return cls(starts * itemsize, run * itemsize)


def is_view_of(view: Any, owner: Any) -> bool:
    """Whether ``view`` lies inside ``owner``'s memory (not a copy of it)."""
    try:
        base = owner.data_ptr()
        end = base + owner.numel() * owner.element_size()
        first = view.data_ptr()
    except (AttributeError, RuntimeError):
        return False
    return base <= first < end


def pages_to_region(
    layout: PageLayout, page_addrs: list[int], region_addr: int, offsets: np.ndarray
) -> None:
    """Copy each page (``page_addrs[i]``) into the region slot at ``offsets[i]``."""
    rb = layout.run_bytes
    starts = layout.starts.tolist()
    for addr, off in zip(page_addrs, offsets.tolist(), strict=True):
        dst = region_addr + off
        for j, s in enumerate(starts):
            _MEMMOVE(dst + j * rb, addr + s, rb)


def region_to_pages(
    layout: PageLayout, page_addrs: list[int], region_addr: int, offsets: np.ndarray
) -> None:
    """Copy the region slot at ``offsets[i]`` into each page (``page_addrs[i]``)."""
    rb = layout.run_bytes
    starts = layout.starts.tolist()
    for addr, off in zip(page_addrs, offsets.tolist(), strict=True):
        src = region_addr + off
        for j, s in enumerate(starts):
            _MEMMOVE(addr + s, src + j * rb, rb)


def pages_to_rows(layout: PageLayout, page_addrs: list[int], rows: np.ndarray) -> None:
    """Copy pages into the rows of a (n, page_bytes) uint8 array (the inline path)."""
    pages_to_region(
        layout,
        page_addrs,
        rows.ctypes.data,
        np.arange(len(page_addrs), dtype=np.int64) * layout.page_bytes,
    )


def rows_to_pages(layout: PageLayout, page_addrs: list[int], rows: np.ndarray) -> None:
    region_to_pages(
        layout,
        page_addrs,
        rows.ctypes.data,
        np.arange(len(page_addrs), dtype=np.int64) * layout.page_bytes,
    )
