"""Block copies near memcpy speed: the fastest of three copy methods, measured.

Three ways to copy a large block, and which is fastest depends on the machine:

- ``memmove`` (glibc). It streams (non-temporal stores) only above
  ``x86_non_temporal_threshold``, derived from the shared cache size, and
  below that takes ``rep movsb`` or a vector loop as its tunables say.
- ``nt``: a loop of our own with non-temporal stores, the way glibc's
  ``large_memcpy_4x`` does it (four 4 KiB pages interleaved, ``movdqu``
  loads, ``movntdq`` stores, ``sfence`` at the end). On the Intel VMs of the
  first sessions (480 MiB L3, so glibc never streamed a block) it ran 2 MiB
  blocks at 1.7x of memmove.
- ``vec``: the same 64-byte loop with ordinary stores, what glibc's vector path
  does. On the AMD EPYC VMs of 2026-12-02 (Zen, 32 MiB L3) glibc copies 64 KiB
  with ``rep movsb``, which reads the 4 KiB-paged shared region at 1.8 GB/s
  against 5.5 GB/s for this loop, and non-temporal stores run at a third of
  memmove's speed there (2.3 GB/s against 10 GB/s on 256 MiB).

So the first copy of ``NT_MIN_BYTES`` or more in a process times all three,
in both directions, between a shared anonymous mapping (what the region is)
and private memory, on 64 KiB and on 2 MiB pieces (~0.35 s, once), and
keeps the fastest for each of the two size classes; a log line says what was
chosen and the figures. ``KVSTORE_NT_COPY=1`` takes the non-temporal loop for
every large copy without measuring, ``0`` never loads the loops (memmove).
The ``GLIBC_TUNABLES`` knobs would fix glibc's own choice, but a library cannot
set them for the engine's process (they are read at startup).

The loops are machine code (``kvstore/memcopy_x86_64.S``, SSE2 only: every
x86-64 has it, no CPU probe needed) placed in an anonymous mapping made
executable with ``mprotect`` and called through ctypes, which releases the
GIL for the call. No compiler at install time, no new package. Where that is
unavailable (not x86-64 Linux, an exec mapping refused by a hardened kernel,
the self-test failing) every copy is a plain ``memmove``, and a log line says
so once.

Copies below ``NT_MIN_BYTES``, overlapping copies and the unaligned head and
tail of a large one stay plain ``memmove``: below 64 KiB the ctypes call and
the alignment split cost more than the loops save, and ``memmove`` is the
one correct answer for overlap. Measurements: docs/tiers.md "Block copies".

A batch of small pieces (``copy_pieces``: a step's blocks of 64 KiB to 1 MiB)
goes to a grouped loop, one ctypes call a group of up to ``GROUP_BYTES``: a
call from Python costs ~3.5 us, which for 64 KiB pieces was a third of the
copy (scattered 64 KiB blocks out of the shared region: 6.3 GB/s one call
each, 7.4-7.8 GB/s grouped). Two loops can take a group: the non-temporal
pieces loop (``nt_copy_pieces``) and the ordinary-store list loop
(``vec_copy_list``, pieces of one length). Which one, if any, is measured
for each direction (``load``: out of the shared region; a store: into it),
each loop timed as it runs (``GROUPED``, ``GROUPED_VEC``) against the small
method one call a piece: on the AMD VM the non-temporal loop won stores (14
against 11-12 GB/s) and lost loads (8.5 against 11-13); nt and vec one call
a piece measured within 2% of each other on the Intel VM, so tying grouping
to nt winning that toss turned it off in about half of the processes.

Large batches are also split between the calling thread and one helper thread
(``copy_pieces``): on these VMs one core does not saturate memory bandwidth
(2 MiB blocks, 128 MiB: 1.5x of one thread). Only batches of at least
``PARALLEL_MIN_BYTES`` whose pieces average ``PARALLEL_MIN_PIECE_BYTES`` are
split (below that the hand-off costs more than it saves: one 2 MiB block, or
64 KiB pieces that each take the GIL between copies); ``KVSTORE_COPY_THREADS=1``
turns it off.

Primitives:
    copy(dst, src)       dst[...] = src bytes (C-contiguous arrays, same nbytes)
    copy_raw(dst_address, src_address, nbytes)
    copy_list(dst_addresses, src_addresses, nbytes)   many small equal pieces, one call
    copy_pieces(pieces, deadline_s=..., fence_reads=..., load=...) -> pieces copied in time
                         (grouped into one call of the loop measured fastest that way)
    copy_with(method, dst_address, src_address, nbytes)   one named method
    fast_copy_available() -> bool   the loops are loaded and run here
    copy_methods() -> (small, large)   the methods chosen (measured on first call)
"""

from __future__ import annotations

import array
import ctypes
import functools
import itertools
import logging
import math
import mmap
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

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
_STORE_ALIGN_BYTES = 16  # movntdq's

# kvstore/memcopy_x86_64.S assembled (GNU as, objcopy -O binary; the unit test
# reassembles it where binutils are installed and compares):
#   nt_copy_4x(dst rdi, src rsi, n rdx) at +0x000: n > 0, n % 16384 == 0
#   nt_copy_64(dst rdi, src rsi, n rdx) at +0x139: n > 0, n % 64 == 0
#   vec_copy_64(dst rdi, src rsi, n rdx) at +0x171: n > 0, n % 64 == 0 (ordinary stores)
#   vec_copy_list(dsts rdi, srcs rsi, pieces rdx, n rcx) at +0x1a6: pieces > 0,
#     n > 0, n % 64 == 0; piece i from srcs[i] to dsts[i], any alignment
#   nt_copy_pieces(pieces rdi, count rsi) at +0x1fd: count > 0; pieces: count
#     (dst, src, n) triples of uint64, each dst 16-byte aligned, n > 0, n % 64 == 0
# all: dst 16-byte aligned, src any; the two nt_ ones sfence before ret.
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
    "feffff0faef8c3f30f6f06f30f6f4e10f30f6f5620f30f6f5e30660fe707660fe74f"
    "10660fe75720660fe75f304883c6404883c7404883ea4075cc0faef8c3f30f6f06f3"
    "0f6f4e10f30f6f5620f30f6f5e30660f7f07660f7f4f10660f7f5720660f7f5f3048"
    "83c6404883c7404883ea4075ccc34989f84989f14989d24989cb498b38498b314c89"
    "daf30f6f06f30f6f4e10f30f6f5620f30f6f5e30f30f7f07f30f7f4f10f30f7f5720"
    "f30f7f5f304883c6404883c7404883ea4075cc4983c0084983c10849ffca75b6c349"
    "89f84989f1498b38498b70084d8b50104c89d24881e200c0ffff7405e8e1fdffff4c"
    "89d24881e2ff3f00007405e809ffffff4983c01849ffc975cac3"
)
NT_COPY_64_OFFSET = 0x139
VEC_COPY_64_OFFSET = 0x171
VEC_COPY_LIST_OFFSET = 0x1A6
NT_COPY_PIECES_OFFSET = 0x1FD

_Copy = Callable[[int, int, int], object]
_CFUNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_CFUNC_LIST = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t
)
_CFUNC_PIECES = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t)
_memmove: _Copy = ctypes.memmove  # C memmove through ctypes: the GIL is released


def _address(arr: np.ndarray) -> int:
    return int(arr.__array_interface__["data"][0])


class Loops(NamedTuple):
    nt_4x: _Copy
    nt_64: _Copy
    vec_64: _Copy
    vec_list: Callable[[int, int, int, int], object]
    nt_pieces: Callable[[int, int], object]


def _load() -> Loops | None:
    """The loops, callable, or None (and why, logged once) where not available."""
    if os.environ.get("KVSTORE_NT_COPY", "auto") == "0":
        log.info("block copies: plain memmove (KVSTORE_NT_COPY=0)")
        return None
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        log.info("block copies: plain memmove (the copy loops are x86-64 Linux only)")
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
    loops = Loops(
        _CFUNC(page),
        _CFUNC(page + NT_COPY_64_OFFSET),
        _CFUNC(page + VEC_COPY_64_OFFSET),
        _CFUNC_LIST(page + VEC_COPY_LIST_OFFSET),
        _CFUNC_PIECES(page + NT_COPY_PIECES_OFFSET),
    )
    if not (
        _self_test(loops.nt_4x, loops.nt_64)
        and _self_test(loops.vec_64, loops.vec_64)
        and _self_test_list(loops.vec_list)
        and _self_test_pieces(loops.nt_pieces)
    ):
        log.warning("block copies: plain memmove (a copy loop failed its self-test)")
        return None
    return loops


def _self_test(x4: _Copy, x64: _Copy) -> bool:
    """The loops copy a known pattern exactly, and write nothing past the end."""
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


def _self_test_list(vec_list: Callable[[int, int, int, int], object]) -> bool:
    """The list loop copies three scattered, unaligned pieces exactly, in any
    order, and writes nothing around them."""
    piece, gap = 3 * _LINE_BYTES, 100
    src = np.random.default_rng(13).integers(0, 256, 3 * piece + 7, dtype=np.uint8)
    dst = np.zeros(3 * (piece + gap) + gap, dtype=np.uint8)
    srcs = np.array([_address(src) + 7 + k * piece for k in (2, 0, 1)], dtype=np.uint64)
    dsts = np.array([_address(dst) + gap + k * (piece + gap) for k in range(3)], dtype=np.uint64)
    vec_list(_address(dsts), _address(srcs), 3, piece)
    want = np.zeros_like(dst)
    for k, s in enumerate((2, 0, 1)):
        at = gap + k * (piece + gap)
        want[at : at + piece] = src[7 + s * piece : 7 + (s + 1) * piece]
    return bool(np.array_equal(dst, want))


def _self_test_pieces(nt_pieces: Callable[[int, int], object]) -> bool:
    """The pieces loop copies pieces of three lengths (whole 16 KiB chunks, lines
    only, both) out of order exactly, and writes nothing around them."""
    lengths, gap = (_CHUNK_4X_BYTES, 3 * _LINE_BYTES, _CHUNK_4X_BYTES + _LINE_BYTES), 128
    total = sum(lengths)
    src = np.random.default_rng(14).integers(0, 256, total + 5, dtype=np.uint8)
    dst = np.zeros(total + 4 * gap + _LINE_BYTES, dtype=np.uint8)
    base = _address(dst) + (-_address(dst)) % _LINE_BYTES + gap
    starts = np.cumsum((0, *lengths[:-1]))
    triples, want = [], np.zeros_like(dst)
    at = base
    for k in (2, 0, 1):  # sources taken out of order
        triples += [at, _address(src) + 5 + int(starts[k]), lengths[k]]
        off = at - _address(dst)
        want[off : off + lengths[k]] = src[5 + starts[k] : 5 + starts[k] + lengths[k]]
        at += lengths[k] + gap
    table = np.array(triples, dtype=np.uint64)
    nt_pieces(_address(table), 3)
    return bool(np.array_equal(dst, want))


_LOADED = _load()

MEMMOVE, NT, VEC = "memmove", "nt", "vec"
METHODS = (MEMMOVE, NT, VEC)
# The loops that copy a whole group of a step's small pieces in one call
# (copy_pieces): the non-temporal pieces loop (nt_copy_pieces, pieces of any
# lengths) and the ordinary-store list loop (vec_copy_list, pieces of one
# length). Timed beside the methods, in each direction, never what a single
# copy is made with: on the AMD VM of 2026-12-07, 64 KiB pieces read out of a
# shared mapping ran 8.5 GB/s with the first and 11-13 GB/s with the second,
# and written into it 14 GB/s against 11-12 (docs/tiers.md "Block copies").
GROUPED = "nt-grouped"
GROUPED_VEC = "vec-grouped"
_GROUP_LOOPS = {GROUPED: NT, GROUPED_VEC: VEC}
# A batch's direction: read out of the shared region (a load) or written into
# it (a store); the grouped loop is chosen for each.
LOAD, STORE = "load", "store"
# Copies of at least this many bytes are "large" (timed on 2 MiB pieces);
# from NT_MIN_BYTES up to it "small" (timed on 64 KiB pieces).
LARGE_MIN_BYTES = 1 << 20
# Bytes copied per method, direction, piece size and round (the same bytes for
# both piece sizes). The working set (3x this: a shared mapping twice its size,
# a private one its size) must be past what the CPU caches, or the copies are
# timed in cache, where ordinary stores win and non-temporal ones lose: on the
# Intel VMs of 2026-12-05, 16 MiB chose memmove for 2 MiB pieces at 14.1 GB/s
# against nt's 6.2, while copies of a 256 MiB transfer ran memmove 6.9, nt 11.3
# GB/s (2 MiB and 4 MiB pieces, both directions). From 64 MiB the measurement
# agrees with the transfer (memmove 6.6, nt 10.3).
CALIBRATION_BYTES = 64 << 20
CALIBRATION_ROUNDS = 2
# A loop is chosen over memmove only when at least 5% faster (memmove is the
# safe answer: it is what every other program on the machine uses).
MUST_WIN_BY = 0.95

# The methods chosen for small and large copies: memmove until measured, then
# set once by _measure() (a plain read per copy: no lock on the copy path).
_small_method = _large_method = MEMMOVE
# The same choice made for each direction apart (copy_raw's ``way``: a batch of
# copy_pieces knows whether it reads out of the region or writes into it): the
# AMD VM of 2026-12-07 read 1-4 MiB pieces out of a shared mapping at 8.2-8.6
# GB/s with nt and 12.6-13.1 with vec, and wrote them at 14 against 11-12.
_way_methods: dict[str, tuple[str, str]] = {LOAD: (MEMMOVE, MEMMOVE), STORE: (MEMMOVE, MEMMOVE)}
# The loop copy_pieces hands a step's small pieces to in groups, per direction
# (NT, VEC, or None: one call a piece; measured against the small method one
# call a piece).
_group_loop: dict[str, str | None] = {LOAD: None, STORE: None}
_settled = _LOADED is None
_measuring: threading.Thread | None = None
_settle_lock = threading.Lock()


def _forget_measuring() -> None:
    # a fork keeps the flag but not the thread: the child measures anew
    global _measuring, _settle_lock
    _measuring, _settle_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_measuring)


def fast_copy_available() -> bool:
    """Whether the copy loops are loaded and passed their self-tests here."""
    return _LOADED is not None


def copy_methods() -> tuple[str, str]:
    """The methods of small and of large copies (waits for the measurement)."""
    thread = _start_measuring()
    if thread is not None:
        thread.join()
    return _small_method, _large_method


def _start_measuring() -> threading.Thread | None:
    """Start the one measurement of this process (in the background: copies use
    memmove until it is done, ~0.35 s, rather than stall the first store)."""
    global _measuring
    if _settled:
        return None
    with _settle_lock:
        if _measuring is None and not _settled:
            _measuring = threading.Thread(target=_measure, name="kvstore-copy-measure", daemon=True)
            _measuring.start()
        return _measuring


def _measure() -> None:
    global _small_method, _large_method, _way_methods, _group_loop, _settled
    assert _LOADED is not None
    if os.environ.get("KVSTORE_NT_COPY", "auto") == "1":
        small_m = large_m = NT
        ways = {LOAD: (NT, NT), STORE: (NT, NT)}
        group: dict[str, str | None] = {LOAD: NT, STORE: NT}
        log.info("block copies: non-temporal loop (KVSTORE_NT_COPY=1)")
    else:
        small, large = _calibrate(_LOADED, (64 << 10, 2 << 20), CALIBRATION_BYTES)
        small_m, large_m = _fastest(small), _fastest(large)
        ways = {d: (_fastest(small, d), _fastest(large, d)) for d in (LOAD, STORE)}
        # Grouping is its own choice, per direction, timed as copy_pieces runs
        # it, against the small method one call a piece in that direction: the
        # per-call figures of nt and vec were a toss on the Intel VM (9.2-9.8
        # GB/s each), and a toss won by vec used to turn grouping off. No
        # margin: it is one of our loops against another.
        group = {d: _grouped_choice(small, ways[d][0], d) for d in (LOAD, STORE)}
        gbps = CALIBRATION_BYTES / 1e9
        log.info(
            "block copies: %s below %d KiB, %s from there; loads %s / %s, stores %s / %s; "
            "a step's small pieces: loads %s, stores %s (GB/s measured on 64 KiB / 2 MiB "
            "pieces, both ways: %s; 64 KiB pieces grouped, loads nt %.1f vec %.1f, stores "
            "nt %.1f vec %.1f; KVSTORE_NT_COPY=0/1 overrides)",
            small_m,
            LARGE_MIN_BYTES >> 10,
            large_m,
            *ways[LOAD],
            *ways[STORE],
            _grouped_words(group[LOAD]),
            _grouped_words(group[STORE]),
            ", ".join(
                f"{m} {CALIBRATION_BYTES * 2 / small[m] / 1e9:.1f} / "
                f"{CALIBRATION_BYTES * 2 / large[m] / 1e9:.1f}"
                for m in METHODS
            ),
            *(gbps / small[f"{g}:{d}"] for d in (LOAD, STORE) for g in _GROUP_LOOPS),
        )
    _small_method, _large_method, _way_methods, _group_loop = small_m, large_m, ways, group
    _settled = True


def _grouped_choice(small: dict[str, float], small_m: str, direction: str) -> str | None:
    """The faster grouped loop in ``direction`` (NT or VEC), if it beats the small
    method one call a piece there; else None."""
    name = min(_GROUP_LOOPS, key=lambda g: small[f"{g}:{direction}"])
    return (
        _GROUP_LOOPS[name]
        if small[f"{name}:{direction}"] < small[f"{small_m}:{direction}"]
        else None
    )


def _grouped_words(loop: str | None) -> str:
    return f"grouped ({loop})" if loop is not None else "one call each"


def _fastest(times: dict[str, float], way: str = "") -> str:
    """The loop of ``times`` (both ways, or one ``way`` alone) at least 5% faster
    than memmove, else memmove."""
    key = (lambda m: f"{m}:{way}") if way else (lambda m: m)
    best = min((NT, VEC), key=lambda m: times[key(m)])
    return best if times[key(best)] < MUST_WIN_BY * times[key(MEMMOVE)] else MEMMOVE


def _calibrate(loops: Loops, pieces: Sequence[int], nbytes: int) -> list[dict[str, float]]:
    """For each piece size, the best time of each method copying ``nbytes`` of
    such pieces out of a shared anonymous mapping and back into it (what the
    region is: shared memory in 4 KiB pages, read and written at scattered
    slots), one call a piece (key: the method; and each direction alone,
    "<method>:load" out of it, "<method>:store" into it); for sizes the grouped
    loops take (``_groupable``), also theirs, in groups of GROUP_BYTES, each
    direction alone ("nt-grouped:load", "vec-grouped:store", ...). One set of
    buffers for all sizes: its pages are touched once."""
    shared = mmap.mmap(-1, 2 * nbytes)
    try:
        region = np.frombuffer(shared, np.uint8)
        region[:] = 1  # every page touched first: no page faults timed
        private = np.ones(nbytes, np.uint8)
        r0, p0 = _address(region), _address(private)
        results = []
        for piece in pieces:
            # every other slot of the shared mapping, so reads and writes skip around
            pairs = [(p0 + i * piece, r0 + 2 * i * piece) for i in range(nbytes // piece)]
            best: dict[str, float] = {}
            # Each grouped loop's calls, each way, built once for all rounds.
            grouped: dict[str, list[Callable[[], object]]] = {}
            if _groupable(piece):
                per_group = max(1, GROUP_BYTES // piece)
                groups = [
                    [(p, r, piece) for p, r in pairs[g : g + per_group]]
                    for g in range(0, len(pairs), per_group)
                ]
                for name, loop in _GROUP_LOOPS.items():
                    grouped[f"{name}:{LOAD}"] = [_group_call(loops, loop, g) for g in groups]
                    grouped[f"{name}:{STORE}"] = [
                        _group_call(loops, loop, _swapped(g)) for g in groups
                    ]
            for _ in range(CALIBRATION_ROUNDS):
                for method in METHODS:
                    t0 = time.perf_counter()
                    for p, r in pairs:
                        copy_with(method, p, r, piece)
                    t1 = time.perf_counter()
                    for p, r in pairs:
                        copy_with(method, r, p, piece)
                    t2 = time.perf_counter()
                    _keep_best(best, method, t2 - t0)
                    _keep_best(best, f"{method}:{LOAD}", t1 - t0)
                    _keep_best(best, f"{method}:{STORE}", t2 - t1)
                for key, calls in grouped.items():
                    t0 = time.perf_counter()
                    for call in calls:
                        call()
                    _keep_best(best, key, time.perf_counter() - t0)
            results.append(best)
        del region, private
    finally:
        shared.close()
    return results


def _keep_best(best: dict[str, float], key: str, seconds: float) -> None:
    best[key] = min(best.get(key, math.inf), seconds)


def _swapped(group: Sequence[Piece]) -> list[Piece]:
    return [(s, d, n) for d, s, n in group]


def _group_call(loops: Loops, loop: str, group: Sequence[Piece]) -> Callable[[], object]:
    """One call of a grouped loop over ``group`` (its tables built now, not when called)."""
    if loop == NT:
        table = array.array("Q", itertools.chain.from_iterable(group))
        return lambda: loops.nt_pieces(table.buffer_info()[0], len(group))
    dsts = array.array("Q", [d for d, _, _ in group])
    srcs = array.array("Q", [s for _, s, _ in group])
    nbytes = group[0][2]
    return lambda: loops.vec_list(dsts.buffer_info()[0], srcs.buffer_info()[0], len(group), nbytes)


def _groupable(nbytes: int) -> bool:
    """Whether pieces of ``nbytes`` are of the size the pieces loop takes (_group_end)."""
    return NT_MIN_BYTES <= nbytes < LARGE_MIN_BYTES and nbytes % _LINE_BYTES == 0


def copy_raw(dst_address: int, src_address: int, nbytes: int, way: str = "") -> None:
    """Copy ``nbytes`` from ``src_address`` to ``dst_address`` (raw addresses).

    Overlapping ranges are handled (memmove). The caller vouches that both
    ranges are mapped and that ``dst`` is writable. ``way``: LOAD (read out of
    the shared region) or STORE (written into it) takes the method measured
    fastest that way; "" the one measured fastest both ways.
    """
    if nbytes <= 0:
        return
    if nbytes < NT_MIN_BYTES:
        _memmove(dst_address, src_address, nbytes)
        return
    if not _settled:
        _start_measuring()  # memmove meanwhile
    if _overlap(dst_address, src_address, nbytes):
        _memmove(dst_address, src_address, nbytes)
        return
    small, large = _way_methods[way] if way else (_small_method, _large_method)
    copy_with(large if nbytes >= LARGE_MIN_BYTES else small, dst_address, src_address, nbytes)


def _overlap(dst_address: int, src_address: int, nbytes: int) -> bool:
    return dst_address < src_address + nbytes and src_address < dst_address + nbytes


def copy_with(method: str, dst_address: int, src_address: int, nbytes: int) -> None:
    """A copy of non-overlapping ranges by the named method (one of ``METHODS``;
    the loops' fall back to memmove where they are not loaded): what copy_raw
    does once it has chosen, and what the tests check each method with."""
    loops = _LOADED
    if method == MEMMOVE or loops is None:
        _memmove(dst_address, src_address, nbytes)
        return
    # Align the destination to a cache line (the stores need 16 B; full lines
    # keep the write-combining buffers whole), then 16 KiB chunks, then lines.
    head = (-dst_address) % _LINE_BYTES
    if head:
        _memmove(dst_address, src_address, head)
    d, s, left = dst_address + head, src_address + head, nbytes - head
    if method == NT:
        big = left - left % _CHUNK_4X_BYTES
        if big:
            loops.nt_4x(d, s, big)
            d, s, left = d + big, s + big, left - big
    lines = left - left % _LINE_BYTES
    if lines:
        (loops.nt_64 if method == NT else loops.vec_64)(d, s, lines)
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


def _in_list_loop(nbytes: int) -> bool:
    """Whether copy_list takes pieces of ``nbytes`` in one call of the list loop."""
    return _LOADED is not None and nbytes % _LINE_BYTES == 0 and nbytes < NT_MIN_BYTES


def list_copy_is_fast(nbytes: int) -> bool:
    """Whether copy_list moves pieces of ``nbytes`` with no Python per piece (the
    list loop), or pieces large enough that a call each is nothing next to their
    bytes. Where not (no loops here, an odd size), a caller with a better plan
    for many small pieces (torch's index ops) should keep it."""
    return nbytes >= NT_MIN_BYTES or _in_list_loop(nbytes)


def copy_list(dst_addresses: np.ndarray, src_addresses: np.ndarray, nbytes: int) -> None:
    """Piece i: ``nbytes`` from ``src_addresses[i]`` to ``dst_addresses[i]`` (raw
    addresses, equal-length integer arrays), for many small equal pieces (a
    vLLM step's KV pages): one call into the list loop, no Python per piece.

    Pieces of ``NT_MIN_BYTES`` or more, sizes not a multiple of 64, or no loops
    loaded: copy_raw per piece. The caller vouches that every range is mapped,
    the destinations writable, and that no destination overlaps a source.
    """
    count = len(dst_addresses)
    if len(src_addresses) != count:
        raise errors.InvalidRequest(
            f"memcopy.copy_list: {count} destinations for {len(src_addresses)} sources"
        )
    if count == 0 or nbytes <= 0:
        return
    if not _in_list_loop(nbytes):
        for d, s in zip(dst_addresses.tolist(), src_addresses.tolist(), strict=True):
            copy_raw(d, s, nbytes)
        return
    assert _LOADED is not None
    dsts = np.ascontiguousarray(dst_addresses, dtype=np.uint64)
    srcs = np.ascontiguousarray(src_addresses, dtype=np.uint64)
    _LOADED.vec_list(_address(dsts), _address(srcs), count, nbytes)


# ------------------------------------------------------------ batches

PARALLEL_MIN_BYTES = 8 << 20
# Small pieces the non-temporal loop takes are handed to it in groups of at most
# this many bytes, one call a group: a step's 64 scattered 64 KiB blocks copied one
# call each ran at 6.3 GB/s out of the shared region, in one call 7.4 GB/s
# (docs/tiers.md "Block copies"). A group is far below COPY_CHUNK_BYTES, the
# most a copy may run past its deadline (kvstore.client).
GROUP_BYTES = 8 << 20
PARALLEL_MIN_PIECE_BYTES = 512 << 10
# A piece larger than this is cut so that both threads get a share of one long run.
_SPLIT_BYTES = 4 << 20

Piece = tuple[int, int, int]  # (dst_address, src_address, nbytes)


def _copy_threads() -> int:
    raw = os.environ.get("KVSTORE_COPY_THREADS", "2")
    try:
        want = int(raw)
    except ValueError:
        raise errors.ConfigError(f"KVSTORE_COPY_THREADS={raw!r}: expected 1 or 2") from None
    if want not in (1, 2):
        raise errors.ConfigError(f"KVSTORE_COPY_THREADS={raw!r}: expected 1 or 2")
    return min(want, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)


class _Helper:
    """The one helper thread of a process, started on first use, dropped in a forked
    child (a fork keeps the executor but not its thread: a job would never run)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._pool = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], int]) -> Future[int]:
        pool = self._pool
        if pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-copy")
                pool = self._pool
        return pool.submit(fn)


_helper = _Helper()
_THREADS = _copy_threads()


def _run(
    pieces: Sequence[Piece],
    deadline_s: float,
    clock: Callable[[], float],
    fence_reads: bool,
    way: str,
) -> int:
    """Copy pieces in order; how many leading ones were copied in time. Runs of
    pieces the grouped loop of ``way`` takes (NT, VEC; None: none) go to it in
    one call per group (``_group_end``), the others to the method of that way;
    the deadline is checked between groups as between pieces."""
    loop = _group_loop[way]
    k, count = 0, len(pieces)
    while k < count:
        if clock() > deadline_s:
            return k
        end = _group_end(pieces, k, loop)
        if end - k > 1:
            assert _LOADED is not None and loop is not None
            _group_call(_LOADED, loop, pieces[k:end])()
        else:
            copy_raw(*pieces[k], way=way)
        if fence_reads and clock() > deadline_s:
            return k  # read (in part) after the deadline: not valid
        k = end
    return count


def _group_end(pieces: Sequence[Piece], k: int, loop: str | None) -> int:
    """The end of the group of pieces from ``k`` that one call of the grouped
    ``loop`` takes: small pieces of whole lines (``_groupable``: from NT_MIN_BYTES
    to below LARGE_MIN_BYTES; for larger ones a call is nothing next to the
    bytes, and 2 MiB blocks' loads grouped measured 0.9x), no overlap, at most
    GROUP_BYTES in all; for NT a 16-byte aligned destination (what its stores
    need; copy_raw would first align to a line, which measured no faster:
    numpy's large arrays start 16 bytes past a page), for VEC pieces of one
    length (what its list takes). ``k + 1`` when piece k is not such, or no
    loop was measured faster than the small method one call a piece (None)."""
    if _LOADED is None or not _settled or loop is None:
        return k + 1
    end, total, first = k, 0, pieces[k][2]
    for d, s, n in itertools.islice(pieces, k, None):
        if (
            not _groupable(n)
            or (d % _STORE_ALIGN_BYTES if loop == NT else n != first)
            or _overlap(d, s, n)
            or total + n > GROUP_BYTES
        ):
            break
        end, total = end + 1, total + n
    return max(end, k + 1)


def copy_pieces(
    pieces: Sequence[Piece],
    *,
    deadline_s: float = math.inf,
    clock: Callable[[], float] = time.monotonic,
    fence_reads: bool = False,
    load: bool = False,
) -> int:
    """Copy each ``(dst_address, src_address, nbytes)`` piece, in order, until the deadline.

    ``load``: the pieces are read out of the shared region (else written into
    it): each is copied by the method, and small pieces grouped by the loop,
    measured fastest that way.

    Returns how many leading pieces were copied entirely in time: no piece is
    started after ``deadline_s`` (by ``clock``), and with ``fence_reads`` a piece
    that finished after it does not count either (its source may have changed
    under it). Large batches are split between this thread and a helper thread;
    the answer is the same as one thread's would be (the pieces are disjoint).
    """
    way = LOAD if load else STORE
    total = sum(p[2] for p in pieces)
    if _THREADS < 2 or total < PARALLEL_MIN_BYTES or total < PARALLEL_MIN_PIECE_BYTES * len(pieces):
        return _run(pieces, deadline_s, clock, fence_reads, way)
    # Sub-pieces of at most max(_SPLIT_BYTES, a quarter of the batch), each
    # remembering its piece, then cut in two halves of about equal bytes.
    cut = max(_SPLIT_BYTES, total // 4)
    subs: list[Piece] = []
    owner: list[int] = []
    for k, (d, s, n) in enumerate(pieces):
        for o in range(0, n, cut):
            subs.append((d + o, s + o, min(cut, n - o)))
            owner.append(k)
    half, acc = 0, 0
    while half < len(subs) and acc + subs[half][2] <= total // 2:
        acc += subs[half][2]
        half += 1
    half = max(1, min(half, len(subs) - 1))
    first, second = subs[:half], subs[half:]
    later = _helper.submit(lambda: _run(second, deadline_s, clock, fence_reads, way))
    try:
        done = _run(first, deadline_s, clock, fence_reads, way)
    finally:
        done_later = later.result()  # never leave a copy running past the return
    if done == len(first):
        done += done_later
    if done == len(subs):
        return len(pieces)
    return owner[done]  # the piece of the first sub-piece not copied in time
