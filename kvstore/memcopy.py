"""Block copies near memcpy speed: non-temporal stores for large copies.

glibc's ``memcpy`` switches to non-temporal (cache-bypassing) stores only for
copies above ``x86_non_temporal_threshold``, derived from the shared cache
size: with this VM's 480 MiB L3 that is far above any block, so 2 MiB block
copies go through the cache, pay a read-for-ownership per line and evict
everything, and run at ~0.6x of one large copy of the same bytes. The
``GLIBC_TUNABLES`` knob fixes it, but a library cannot set it for the engine's
process (it is read at startup). So large copies here use a copy loop of their
own with non-temporal stores, the way glibc's ``large_memcpy_4x`` does: four
4 KiB pages interleaved, ``movdqu`` loads, ``movntdq`` stores, ``sfence`` at
the end (SSE2 only: every x86-64 has it, no CPU probe needed).

The loops are 0x171 bytes of machine code (``kvstore/memcopy_x86_64.S``)
placed in an anonymous mapping made executable with ``mprotect`` and called
through ctypes, which releases the GIL for the call. No compiler at
install time, no new package. Where that is unavailable (not x86-64 Linux, an
exec mapping refused by a hardened kernel, the self-test failing, or
``KVSTORE_NT_COPY=0``) every copy is a plain ``memmove``, and a log line says
so once.

Copies below ``NT_MIN_BYTES``, overlapping copies and the unaligned head and
tail of a large one stay plain ``memmove``: below 64 KiB the ctypes call and
the alignment split cost more than the stores save, and ``memmove`` is the
one correct answer for overlap. Measurements: docs/tiers.md "Block copies".

Primitives:
    copy(dst, src)       dst[...] = src bytes (C-contiguous arrays, same nbytes)
    copy_raw(dst_address, src_address, nbytes)
    fast_copy_available() -> bool
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import platform
import sys
from collections.abc import Callable

import numpy as np

from kvstore import errors

log = logging.getLogger(__name__)


@functools.cache
def libc_mmap() -> Callable[..., int | None]:
    """libc's mmap(2), typed (the address it returns, or None / MAP_FAILED): what
    Python's mmap module cannot do (an executable page here, MAP_FIXED over a
    reservation in kvstore.tiers.dram)."""
    fn = ctypes.CDLL(None, use_errno=True).mmap
    fn.restype = ctypes.c_void_p
    fn.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    return fn  # type: ignore[no-any-return]


NT_MIN_BYTES = 64 << 10
"""Copies of at least this many bytes use non-temporal stores. Measured here
(scattered shared-region slots -> private memory, docs/tiers.md): 0.8x of
memmove at 16 KiB, even at 32 KiB, 1.1x at 64 KiB, 1.35x at 128 KiB, 1.7x
from 1 MiB on (0.85-0.9x of one large copy)."""

_PAGE_BYTES = 4096
_CHUNK_4X_BYTES = 4 * _PAGE_BYTES  # what one trip of the 4-page loop copies
_LINE_BYTES = 64

# kvstore/memcopy_x86_64.S assembled (GNU as, objcopy -O binary; the unit test
# reassembles it where binutils are installed and compares):
#   nt_copy_4x(dst rdi, src rsi, n rdx) at +0x000: n > 0, n % 16384 == 0
#   nt_copy_64(dst rdi, src rsi, n rdx) at +0x139: n > 0, n % 64 == 0
# both: dst 16-byte aligned, src any; sfence before ret.
_CODE = bytes.fromhex(
    "48c7c1400000000f188e800000000f188e801000000f188e802000000f188e803000"
    "00f30f6f06f30f6f4e10f30f6f5620f30f6f5e30f30f6fa600100000f30f6fae1010"
    "0000f30f6fb620100000f30f6fbe30100000660fe707660fe74f10660fe75720660f"
    "e75f30660fe7a700100000660fe7af10100000660fe7b720100000660fe7bf301000"
    "00f30f6f8600200000f30f6f8e10200000f30f6f9620200000f30f6f9e30200000f3"
    "0f6fa600300000f30f6fae10300000f30f6fb620300000f30f6fbe30300000660fe7"
    "8700200000660fe78f10200000660fe79720200000660fe79f30200000660fe7a700"
    "300000660fe7af10300000660fe7b720300000660fe7bf303000004883c6404883c7"
    "4048ffc90f85edfeffff4881c6003000004881c7003000004881ea004000000f85cb"
    "feffff0faef8c3"
    "f30f6f06f30f6f4e10f30f6f5620f30f6f5e30660fe707660fe74f10660fe7572066"
    "0fe75f304883c6404883c7404883ea4075cc0faef8c3"
)
NT_COPY_64_OFFSET = 0x139

_Copy = Callable[[int, int, int], object]
_CFUNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memmove: _Copy = ctypes.memmove  # C memmove through ctypes: the GIL is released


def _address(arr: np.ndarray) -> int:
    return int(arr.__array_interface__["data"][0])


def _load() -> tuple[_Copy, _Copy] | None:
    """The two loops, callable, or None (and why, logged once) where not available."""
    if os.environ.get("KVSTORE_NT_COPY", "1") == "0":
        log.info("block copies: plain memmove (KVSTORE_NT_COPY=0)")
        return None
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        log.info("block copies: plain memmove (non-temporal copy is x86-64 Linux only)")
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        page = libc_mmap()(None, _PAGE_BYTES, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
        if page in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        ctypes.memmove(page, _CODE, len(_CODE))
        # Writable then executable, never both (W^X): what hardened kernels allow.
        if libc.mprotect(page, _PAGE_BYTES, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
            raise OSError(ctypes.get_errno(), "mprotect(PROT_EXEC)")
    except (OSError, AttributeError) as exc:
        log.warning("block copies: plain memmove (no executable mapping: %s)", exc)
        return None
    # The mapping is never unmapped: the functions live as long as the process.
    loops = (_CFUNC(page), _CFUNC(page + NT_COPY_64_OFFSET))
    if not _self_test(*loops):
        log.warning("block copies: plain memmove (the non-temporal copy failed its self-test)")
        return None
    return loops


def _self_test(x4: _Copy, x64: _Copy) -> bool:
    """Both loops copy a known pattern exactly, and write nothing past the end."""
    n = 2 * _CHUNK_4X_BYTES + 3 * _LINE_BYTES
    src = np.random.default_rng(12).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n + 2 * _LINE_BYTES, dtype=np.uint8)
    base = _address(dst) + (-_address(dst)) % _LINE_BYTES
    skip = base - _address(dst)
    body = 2 * _CHUNK_4X_BYTES
    x4(base, _address(src), body)
    x64(base + body, _address(src) + body, n - body)
    return bool(
        np.array_equal(dst[skip : skip + n], src)
        and not dst[:skip].any()
        and not dst[skip + n :].any()
    )


_LOOPS = _load()


def fast_copy_available() -> bool:
    """Whether large copies use the non-temporal loop (else all are memmove)."""
    return _LOOPS is not None


def copy_raw(dst_address: int, src_address: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``src_address`` to ``dst_address`` (raw addresses).

    Overlapping ranges are handled (memmove). The caller vouches that both
    ranges are mapped and that ``dst`` is writable.
    """
    if nbytes <= 0:
        return
    overlap = dst_address < src_address + nbytes and src_address < dst_address + nbytes
    if _LOOPS is None or nbytes < NT_MIN_BYTES or overlap:
        _memmove(dst_address, src_address, nbytes)
        return
    x4, x64 = _LOOPS
    # Align the destination to a cache line (movntdq needs 16 B; full lines
    # keep the write-combining buffers whole), then 16 KiB chunks, then lines.
    head = (-dst_address) % _LINE_BYTES
    if head:
        _memmove(dst_address, src_address, head)
    d, s, left = dst_address + head, src_address + head, nbytes - head
    big = left - left % _CHUNK_4X_BYTES
    if big:
        x4(d, s, big)
        d, s, left = d + big, s + big, left - big
    lines = left - left % _LINE_BYTES
    if lines:
        x64(d, s, lines)
        d, s, left = d + lines, s + lines, left - lines
    if left:
        _memmove(d, s, left)


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst``'s bytes = ``src``'s bytes: C-contiguous arrays of equal ``nbytes``.

    Any dtypes (the bytes are copied, not converted). Overlap is handled.
    """
    if not (dst.flags.c_contiguous and src.flags.c_contiguous):
        raise errors.InvalidRequest("memcopy.copy needs C-contiguous arrays")
    if not dst.flags.writeable:
        raise errors.InvalidRequest("memcopy.copy: the destination is read-only")
    if dst.nbytes != src.nbytes:
        raise errors.BlockSizeMismatch(
            f"memcopy.copy: {src.nbytes} bytes into a {dst.nbytes}-byte destination"
        )
    copy_raw(_address(dst), _address(src), dst.nbytes)
