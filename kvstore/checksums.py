"""Block checksums: xxh3-64 of each block's bytes, as every tier and peer keeps them.

``checksums_into`` hashes a batch of blocks of one region. Compiled
(``kvstore._checksum_kernel``, numba), the whole batch is hashed in one call
with the interpreter lock released; without numba, with ``KVSTORE_NATIVE_CHECKSUM=0``,
if the compile fails, or until it is done, python-xxhash hashes block by block
(same answers: the kernel calls the same libxxhash function, and its build
checks that against python-xxhash before it is used).

Why it matters (docs/peer-transfer.md, "The pull pipeline"): python-xxhash keeps
the interpreter lock while it hashes inputs below ~1 MiB, so a puller's hashing
thread and its NIXL poll loop took the lock from each other block by block
(with a 50 us sleep per ~1 MiB to hand it over); the compiled batch holds it
for none of the hashing.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from kvstore.errors import InvalidRequest
from kvstore.native import CompiledKernel

log = logging.getLogger(__name__)

# Fewer blocks are hashed by python-xxhash even when compiled: the kernel call's
# own cost (argument typing, ~5 us) is more than it saves below this (measured
# with 64 KiB blocks: 1 block 7.8 vs 8.0 us, 4 blocks 13.7 vs 15.4 us, 64 blocks
# 74 vs 90 us), and a few blocks hold the interpreter lock only briefly.
KERNEL_MIN_BLOCKS = 8


def checksum_of(data: Any) -> int:
    """xxh3-64 of one buffer (bytes, memoryview, contiguous array)."""
    return xxhash.xxh3_64_intdigest(data)


def _xxh3_address() -> int:
    """Address of libxxhash's XXH3-64 inside python-xxhash's own extension: its
    runtime-dispatched entry (AVX2 / AVX-512 where the CPU has them: 2x the
    plain one's speed on 64 KiB blocks here, and what ``xxh3_64_intdigest``
    runs), else the plain ``XXH3_64bits``; raises where neither is exported."""
    import xxhash._xxhash as ext

    lib = ctypes.CDLL(ext.__file__)
    for name in ("XXH3_64bits_dispatch", "XXH3_64bits"):
        fn = getattr(lib, name, None)
        if fn is not None:
            return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)
    raise OSError("no XXH3-64 entry exported by python-xxhash's extension")


def _build() -> tuple[int, Any]:
    from kvstore import _checksum_kernel  # numba compiles it here (or loads its cache)

    fn_addr = _xxh3_address()
    # Same answers as python-xxhash or not used at all: odd sizes and offsets.
    probe = np.random.default_rng(7).integers(0, 256, 3 << 17, dtype=np.uint8)
    for size in (1, 17, 240, 4099, 65536, 1 << 17):
        offsets = np.asarray([0, 3, len(probe) - size], dtype=np.uint64)
        got = np.zeros(len(offsets), dtype=np.uint64)
        _checksum_kernel.hash_blocks(fn_addr, probe.ctypes.data, offsets, np.uint64(size), got)
        want = [checksum_of(probe[o : o + size]) for o in offsets.tolist()]
        if got.tolist() != want:
            raise RuntimeError(f"compiled xxh3 differs from python-xxhash at {size} bytes")
    return fn_addr, _checksum_kernel.hash_blocks


_NATIVE = CompiledKernel(
    _build,
    name="the block checksum kernel",
    off_env="KVSTORE_NATIVE_CHECKSUM",
    fallback="blocks are hashed by python-xxhash, one call each",
    log=log,
)


def compile_checksums() -> None:
    """Start compiling the kernel now, in the background (once per process)."""
    _NATIVE.start()


def compiled_checksums(timeout_s: float | None = None) -> bool:
    """Whether batches are hashed compiled, once the compile is done (started here
    if it was not; waits up to ``timeout_s``, None: until done)."""
    return _NATIVE.available(timeout_s)


def python_only() -> contextlib.AbstractContextManager[None]:
    """Hash with python-xxhash inside the block (tests; A/B in one process)."""
    return _NATIVE.switched_off()


def lock_free() -> bool:
    """Whether ``checksums_into`` hashes without the interpreter lock now."""
    return _NATIVE.ready()


def checksums_into(
    region: np.ndarray, offsets: np.ndarray, block_bytes: int, out: np.ndarray
) -> None:
    """``out[i]`` = xxh3-64 of ``region[offsets[i] : offsets[i] + block_bytes]``.

    ``region``: a flat uint8 array (a DRAM region); ``offsets``: byte offsets;
    ``out``: uint64, as long as ``offsets``. A block outside the region is an
    ``InvalidRequest`` before anything is read."""
    offsets = np.ascontiguousarray(offsets, dtype=np.uint64)
    if len(offsets) != len(out):
        raise InvalidRequest(f"{len(offsets)} offsets for {len(out)} checksums")
    if not len(offsets):
        return
    compiled = _NATIVE.kernel
    if (
        compiled is not None
        and len(offsets) >= KERNEL_MIN_BLOCKS
        and out.dtype == np.uint64
        and out.flags.c_contiguous
    ):
        _check_inside(region, int(offsets.max()), block_bytes)
        fn_addr, hash_blocks = compiled
        hash_blocks(fn_addr, region.ctypes.data, offsets, np.uint64(block_bytes), out)
        return
    starts = offsets.tolist()  # block by block: a short batch, or no kernel (yet)
    _check_inside(region, max(starts), block_bytes)
    # Slices of a memoryview, not of the array: ~1 us less per block (measured:
    # 4096 blocks of 64 KiB hashed in 44-52 ms instead of 57-85).
    view = region.data.cast("B")
    out[:] = [xxhash.xxh3_64_intdigest(view[o : o + block_bytes]) for o in starts]


def _check_inside(region: np.ndarray, last_offset: int, block_bytes: int) -> None:
    """InvalidRequest unless blocks of ``block_bytes`` up to ``last_offset`` lie in ``region``."""
    if block_bytes <= 0 or last_offset + block_bytes > region.nbytes:
        raise InvalidRequest(
            f"blocks of {block_bytes} bytes at offsets up to {last_offset} "
            f"leave the {region.nbytes}-byte region"
        )


def checksums_of(
    region: np.ndarray, offsets: Sequence[int] | np.ndarray, block_bytes: int
) -> list[int]:
    """xxh3-64 of each block (as ``checksums_into``), as a list of ints."""
    out = np.zeros(len(offsets), dtype=np.uint64)
    checksums_into(region, np.asarray(offsets, dtype=np.uint64), block_bytes, out)
    return out.tolist()
