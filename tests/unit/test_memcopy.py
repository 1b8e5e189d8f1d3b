"""kvstore.memcopy: bit-exact around every size and alignment boundary, overlap, errors."""

from __future__ import annotations

import ctypes
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore import errors, memcopy

ROOT = Path(__file__).resolve().parents[2]
X86_LINUX = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")
GUARD = 256  # bytes either side of each destination that must stay untouched

T = memcopy.NT_MIN_BYTES
SIZES = sorted(
    {
        0, 1, 63, 64, 65, 4095, 16383, 16384, 16385,
        T - 1, T, T + 1, T + 63, T + 64, T + 16383, T + 16384, T + 16385,
        (1 << 20) - 1, 1 << 20, (1 << 20) + 4097, (2 << 20) + 129,
    }
)  # fmt: skip


def _src(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def test_the_non_temporal_loop_is_in_use_on_x86_64_linux():
    # Where it can run it must: a broken loader would silently cost 1.7x.
    assert memcopy.fast_copy_available() == (
        X86_LINUX and os.environ.get("KVSTORE_NT_COPY", "1") != "0"
    )


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize(("dst_skew", "src_skew"), [(0, 0), (1, 0), (0, 7), (16, 33), (63, 1)])
def test_copy_is_bit_exact_and_stays_inside_the_destination(nbytes, dst_skew, src_skew):
    src_buf = _src(nbytes + 128, nbytes)
    dst_buf = np.full(nbytes + 128 + 2 * GUARD, 0xA5, np.uint8)
    # Offsets from a 64-byte line, whatever numpy's own alignment is.
    d0 = GUARD + (-(dst_buf.ctypes.data + GUARD)) % 64 + dst_skew
    s0 = (-src_buf.ctypes.data) % 64 + src_skew
    src = src_buf[s0 : s0 + nbytes]
    memcopy.copy(dst_buf[d0 : d0 + nbytes], src)
    np.testing.assert_array_equal(dst_buf[d0 : d0 + nbytes], src)
    assert (dst_buf[:d0] == 0xA5).all() and (dst_buf[d0 + nbytes :] == 0xA5).all()


@pytest.mark.parametrize("shift", [1, 64, 4096, 100_000])
@pytest.mark.parametrize("nbytes", [T, 3 << 20])
def test_overlapping_copies_behave_as_memmove(nbytes, shift):
    for forward in (True, False):
        buf = _src(nbytes + shift, shift)
        want = buf.copy()
        if forward:  # destination after the source
            want[shift:] = buf[:nbytes].copy()
            memcopy.copy(buf[shift:], buf[:nbytes])
        else:
            want[:nbytes] = buf[shift:].copy()
            memcopy.copy(buf[:nbytes], buf[shift:])
        np.testing.assert_array_equal(buf, want)


def test_copy_takes_any_dtype_as_bytes():
    src = np.arange(T // 8 + 3, dtype=np.uint64)
    dst = np.zeros((T // 8 + 3) * 2, dtype=np.uint32)
    memcopy.copy(dst, src)
    assert dst.tobytes() == src.tobytes()


def test_bad_arguments_get_precise_errors_and_write_nothing():
    dst = np.zeros(T, np.uint8)
    with pytest.raises(errors.BlockSizeMismatch, match=f"{T + 1} bytes into a {T}-byte"):
        memcopy.copy(dst, np.ones(T + 1, np.uint8))
    with pytest.raises(errors.InvalidRequest, match="C-contiguous"):
        memcopy.copy(dst[::2], np.ones(T // 2, np.uint8))
    ro = np.zeros(T, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(errors.InvalidRequest, match="read-only"):
        memcopy.copy(ro, np.ones(T, np.uint8))
    assert not dst.any() and not ro.any()


def _fresh_python(code: str, **env: str | None) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new interpreter (memcopy measures once per process) with
    these environment variables set, or removed where None; it must succeed."""
    full = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name, value in env.items():
        if value is None:
            full.pop(name, None)
        else:
            full[name] = value
    return subprocess.run(
        [sys.executable, "-c", code], env=full, capture_output=True, text=True, check=True
    )


def test_switched_off_by_environment_falls_back_to_memmove_and_says_so():
    code = (
        "import logging, numpy as np; logging.basicConfig(level=logging.INFO);"
        "from kvstore import memcopy; a = np.arange(1 << 21, dtype=np.uint8); b = np.empty_like(a);"
        "memcopy.copy(b, a); assert (a == b).all(); print(memcopy.fast_copy_available())"
    )
    out = _fresh_python(code, KVSTORE_NT_COPY="0")
    assert out.stdout.strip() == "False"
    assert "block copies: plain memmove (KVSTORE_NT_COPY=0)" in out.stderr


def test_machine_code_is_the_assembly_source(tmp_path):
    """The bytes in memcopy.py are kvstore/memcopy_x86_64.S assembled (binutils)."""
    if not X86_LINUX:
        pytest.skip("x86-64 Linux only")  # nothing to check where the loop never runs
    as_, objcopy = shutil.which("as"), shutil.which("objcopy")
    if as_ is None or objcopy is None:
        pytest.skip("binutils (as, objcopy) not installed")
    obj, raw = tmp_path / "m.o", tmp_path / "m.bin"
    subprocess.run([as_, str(ROOT / "kvstore/memcopy_x86_64.S"), "-o", str(obj)], check=True)
    subprocess.run([objcopy, "-O", "binary", "-j", ".text", str(obj), str(raw)], check=True)
    text = (ROOT / "kvstore/memcopy.py").read_text()
    block = re.search(r"_CODE = bytes\.fromhex\((.*?)\n\)", text, re.S)
    assert block is not None
    code = bytes.fromhex("".join(re.findall(r'"([0-9a-f]+)"', block.group(1))))
    assert raw.read_bytes() == code
    nm = subprocess.run(["nm", str(obj)], capture_output=True, text=True, check=True).stdout
    assert f"{memcopy.NT_COPY_64_OFFSET:016x} T nt_copy_64" in nm
    assert f"{memcopy.VEC_COPY_64_OFFSET:016x} T vec_copy_64" in nm
    assert f"{memcopy.VEC_COPY_LIST_OFFSET:016x} T vec_copy_list" in nm


# ------------------------------------------------------------ lists of pieces


@pytest.mark.parametrize("nbytes", [64, 192, 4096, 4096 + 64, 100, 4095, T, T + 64])
@pytest.mark.parametrize("skew", [0, 1, 17])
def test_a_list_of_pieces_is_bit_exact_and_touches_nothing_else(nbytes, skew):
    """Scattered pieces in a shuffled order, unaligned by ``skew``: every piece lands
    where its destination says and not one byte around it changes (multiples of 64
    below NT_MIN_BYTES take the list loop; the others copy_raw per piece)."""
    count = 9
    src = _src(count * nbytes + 64, nbytes + skew)
    stride = nbytes + GUARD
    dst = np.full(count * stride + GUARD, 0xA5, np.uint8)
    order = np.random.default_rng(nbytes).permutation(count)
    srcs = np.array([src.ctypes.data + skew + k * nbytes for k in order], dtype=np.uint64)
    dsts = np.array([dst.ctypes.data + GUARD + skew + k * stride for k in range(count)])
    memcopy.copy_list(dsts, srcs, nbytes)
    want = np.full_like(dst, 0xA5)
    for k, s in enumerate(order.tolist()):
        at = GUARD + skew + k * stride
        want[at : at + nbytes] = src[skew + s * nbytes : skew + (s + 1) * nbytes]
    np.testing.assert_array_equal(dst, want)


def test_a_list_with_unequal_lengths_is_refused_and_copies_nothing():
    src, dst = _src(128, 1), np.zeros(128, np.uint8)
    with pytest.raises(errors.InvalidRequest, match="2 destinations for 1 sources"):
        memcopy.copy_list(
            np.array([dst.ctypes.data, dst.ctypes.data + 64]), np.array([src.ctypes.data]), 64
        )
    assert not dst.any()
    memcopy.copy_list(np.array([], np.uint64), np.array([], np.uint64), 64)  # empty: no-op


# ------------------------------------------------------------ the method, measured


def test_auto_mode_measures_both_methods_once_and_says_which_it_keeps():
    code = (
        "import logging, numpy as np; logging.basicConfig(level=logging.INFO);"
        "from kvstore import memcopy; a = np.arange(1 << 21, dtype=np.uint8); b = np.empty_like(a);"
        "memcopy.copy(b, a); memcopy.copy(b, a); assert (a == b).all();"
        "print(memcopy.fast_copy_available(), *memcopy.copy_methods())"
    )
    out = _fresh_python(code, KVSTORE_NT_COPY=None)
    loaded, small, large = out.stdout.split()
    assert loaded == str(X86_LINUX)
    lines = [ln for ln in out.stderr.splitlines() if "measured on 64 KiB / 2 MiB" in ln]
    if not X86_LINUX:
        assert (small, large) == ("memmove", "memmove") and not lines
        return
    assert len(lines) == 1, out.stderr  # measured once, on the first large copy
    assert small in memcopy.METHODS and large in memcopy.METHODS
    assert f"block copies: {small} below 1024 KiB, {large} from there" in lines[0]
    for method in memcopy.METHODS:  # every figure is printed
        assert re.search(rf"{method} [0-9.]+ / [0-9.]+", lines[0]), lines[0]
    # and the grouped loops', timed on their own each way: a choice of its own
    assert re.search(
        r"64 KiB pieces grouped, loads nt [0-9.]+ vec [0-9.]+, stores nt [0-9.]+ vec [0-9.]+;",
        lines[0],
    ), lines[0]
    way = r"(grouped \((nt|vec)\)|one call each)"
    assert re.search(rf"a step's small pieces: loads {way}, stores {way} \(", lines[0])


@pytest.mark.parametrize(
    ("nt_grouped", "vec_grouped", "group"),
    [
        # vec a hair faster than nt one call a piece, the pieces loop far faster
        # both ways: vec for single copies, a step's pieces grouped by nt
        ((0.3, 0.3), (0.4, 0.4), {"load": "nt", "store": "nt"}),
        # each loop faster one way (the AMD VM: nt stores, vec loads)
        ((0.45, 0.2), (0.3, 0.35), {"load": "vec", "store": "nt"}),
        # both slower than vec one call a piece (0.5 each way): no grouping
        ((0.51, 0.6), (0.55, 0.52), {"load": None, "store": None}),
        # one way only
        ((0.51, 0.3), (0.55, 0.52), {"load": None, "store": "nt"}),
    ],
)
def test_grouping_is_measured_each_way_against_the_small_method_one_call_a_piece(
    monkeypatch, nt_grouped, vec_grouped, group
):
    if not memcopy.fast_copy_available():
        pytest.skip("the copy loops are x86-64 Linux only")
    memcopy.copy_methods()  # settled first: no measuring thread races this one
    for name in ("_small_method", "_large_method", "_way_methods", "_group_loop", "_settled"):
        monkeypatch.setattr(memcopy, name, getattr(memcopy, name))
    monkeypatch.delenv("KVSTORE_NT_COPY", raising=False)
    times = {memcopy.MEMMOVE: 1.4, memcopy.NT: 1.01, memcopy.VEC: 1.0}
    for m, t in list(times.items()):  # each way half of the round trip
        times[f"{m}:load"] = times[f"{m}:store"] = t / 2
    for name, (load_s, store_s) in (
        (memcopy.GROUPED, nt_grouped),
        (memcopy.GROUPED_VEC, vec_grouped),
    ):
        times[f"{name}:load"], times[f"{name}:store"] = load_s, store_s
    # 2 MiB pieces: nt both ways (0.8), yet vec reads faster and nt writes faster
    large = {memcopy.MEMMOVE: 1.0, memcopy.NT: 0.8, memcopy.VEC: 0.9}
    large |= {"memmove:load": 0.5, "nt:load": 0.45, "vec:load": 0.3}
    large |= {"memmove:store": 0.5, "nt:store": 0.35, "vec:store": 0.6}
    monkeypatch.setattr(memcopy, "_calibrate", lambda *a: [times, large])
    memcopy._measure()
    assert memcopy.copy_methods() == ("vec", memcopy.NT)  # both ways (copy_raw's default)
    assert memcopy._way_methods == {"load": ("vec", "vec"), "store": ("vec", "nt")}
    assert memcopy._group_loop == group


def test_forced_on_takes_the_loop_without_measuring():
    code = (
        "import logging, numpy as np; logging.basicConfig(level=logging.INFO);"
        "from kvstore import memcopy; a = np.arange(1 << 21, dtype=np.uint8); b = np.empty_like(a);"
        "memcopy.copy(b, a); assert (a == b).all(); print(*memcopy.copy_methods())"
    )
    out = _fresh_python(code, KVSTORE_NT_COPY="1")
    assert out.stdout.split() == (["nt", "nt"] if X86_LINUX else ["memmove", "memmove"])
    assert "measured on" not in out.stderr


@pytest.mark.parametrize("method", ["memmove", "nt", "vec"])
@pytest.mark.parametrize("nbytes", [T, T + 1, T + 16385, (1 << 20) + 4097, (2 << 20) + 129])
@pytest.mark.parametrize("dst_skew", [0, 1, 63])
def test_every_method_is_bit_exact_and_stays_inside_the_destination(method, nbytes, dst_skew):
    # Whichever the measurement picks on a machine, each one is checked here.
    src_buf = _src(nbytes + 128, nbytes + dst_skew)
    dst_buf = np.full(nbytes + 128 + 2 * GUARD, 0xA5, np.uint8)
    d0 = GUARD + (-(dst_buf.ctypes.data + GUARD)) % 64 + dst_skew
    memcopy.copy_with(method, dst_buf.ctypes.data + d0, src_buf.ctypes.data + 3, nbytes)
    np.testing.assert_array_equal(dst_buf[d0 : d0 + nbytes], src_buf[3 : 3 + nbytes])
    assert (dst_buf[:d0] == 0xA5).all() and (dst_buf[d0 + nbytes :] == 0xA5).all()


# ------------------------------------------------------------ batches in two threads

MIB = 1 << 20


def _pieces(dst: np.ndarray, src: np.ndarray, sizes: list[int], order: list[int]):
    """Pieces of the given sizes, taken from src in `order` and laid out in dst in turn."""
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
    out, pos = [], 0
    for k in order:
        out.append((dst.ctypes.data + pos, src.ctypes.data + int(starts[k]), sizes[k]))
        pos += sizes[k]
    return out


@pytest.mark.parametrize(
    "sizes",
    [
        [2 * MIB] * 8,  # split between the threads
        [2 * MIB] * 3,  # under PARALLEL_MIN_BYTES: one thread
        [64 << 10] * 160,  # small pieces: one thread
        [40 * MIB + 4097],  # one long run, cut into sub-pieces
        [3 * MIB + 5, 7 * MIB + 1, MIB - 3, 5 * MIB],
    ],
)
def test_batches_copy_every_byte_exactly_wherever_they_run(sizes):
    src = _src(sum(sizes), len(sizes))
    dst = np.full(sum(sizes) + GUARD, 0xA5, np.uint8)
    order = list(range(len(sizes)))[::-1]
    assert memcopy.copy_pieces(_pieces(dst, src, sizes, order)) == len(sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
    want = np.concatenate([src[starts[k] : starts[k] + sizes[k]] for k in order])
    np.testing.assert_array_equal(dst[: sum(sizes)], want)
    assert (dst[sum(sizes) :] == 0xA5).all()


def test_a_split_batch_counts_only_leading_pieces_copied_in_time(monkeypatch):
    # 8 pieces of 2 MiB: two threads, 4 each. The clock passes the deadline at
    # its 4th reading; whichever thread reads it, the answer is a leading count
    # of pieces all of whose bytes were copied, and no piece starts late.
    # (One piece a call here; groups have their own test below.)
    monkeypatch.setattr(memcopy, "GROUP_BYTES", 0)
    sizes = [2 * MIB] * 8
    src = _src(sum(sizes), 3)
    dst = np.zeros(sum(sizes), np.uint8)
    reads = iter(range(1000))
    lock = threading.Lock()

    def clock() -> float:
        with lock:
            return float(next(reads))

    got = memcopy.copy_pieces(
        _pieces(dst, src, sizes, list(range(8))), deadline_s=3.0, clock=clock, fence_reads=True
    )
    assert got < 8
    np.testing.assert_array_equal(dst[: got * 2 * MIB], src[: got * 2 * MIB])
    # at most 4 clock readings were in time: no more than 4 pieces were started
    started = sum(bool(dst[k * 2 * MIB : (k + 1) * 2 * MIB].any()) for k in range(8))
    assert started <= 4


def test_one_thread_when_switched_off():
    code = (
        "import numpy as np, threading; from kvstore import memcopy;"
        "a = np.ones(32 << 20, np.uint8); b = np.zeros_like(a);"
        "p = [(b.ctypes.data + i * (2 << 20), a.ctypes.data + i * (2 << 20), 2 << 20) for i in range(16)];"
        "assert memcopy.copy_pieces(p) == 16 and (b == 1).all();"
        "print(any(t.name.startswith('kvstore-copy_') for t in threading.enumerate()))"
    )
    for threads, helper in (("1", False), ("2", len(os.sched_getaffinity(0)) > 1)):
        out = _fresh_python(code, KVSTORE_COPY_THREADS=threads)
        assert out.stdout.strip() == str(helper), out.stdout


def test_a_bad_thread_count_is_a_config_error():
    env = {**os.environ, "KVSTORE_COPY_THREADS": "8", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", "import kvstore.memcopy"], env=env, capture_output=True, text=True
    )
    assert out.returncode != 0 and "KVSTORE_COPY_THREADS='8': expected 1 or 2" in out.stderr


def test_a_forked_child_copies_without_the_parents_helper_thread():
    # The parent's helper thread does not survive fork: the child must start its
    # own, not queue work for a thread that is not there (it would hang).
    sizes = [2 * MIB] * 8
    src = _src(sum(sizes), 5)
    dst = np.zeros(sum(sizes), np.uint8)
    assert memcopy.copy_pieces(_pieces(dst, src, sizes, list(range(8)))) == 8
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        dst[:] = 0
        ok = memcopy.copy_pieces(_pieces(dst, src, sizes, list(range(8)))) == 8
        os._exit(0 if ok and np.array_equal(dst, src) else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    pytest.fail("the forked child's copy hung")


@pytest.mark.skipif(not X86_LINUX, reason="the loops exist on x86-64 Linux only")
def test_the_measured_choice_holds_for_a_transfer_past_the_caches():
    # The measurement once timed a working set the CPU cached (16 MiB): ordinary
    # stores won there, and memmove was kept for 2 MiB pieces at ~0.6x of the
    # non-temporal loop on a 256 MiB transfer (Intel VMs, 2026-12-05). Whatever
    # it keeps must be near the best on such a transfer, in both directions.
    code = (
        "import mmap, time, numpy as np; from kvstore import memcopy as m;"
        "_, large = m.copy_methods(); N = 128 << 20; P = 2 << 20;"
        "sh = mmap.mmap(-1, N); r = np.frombuffer(sh, np.uint8); r[:] = 1;"
        "p = np.ones(N, np.uint8); r0, p0 = m._address(r), m._address(p);"
        "best = dict.fromkeys(m.METHODS, float('inf'))\n"
        "for _ in range(5):\n"
        "    for meth in m.METHODS:\n"
        "        t0 = time.perf_counter()\n"
        "        for o in range(0, N, P): m.copy_with(meth, r0 + o, p0 + o, P)\n"
        "        for o in range(0, N, P): m.copy_with(meth, p0 + o, r0 + o, P)\n"
        "        best[meth] = min(best[meth], time.perf_counter() - t0)\n"
        "print(large, *(f'{k}={v:.4f}' for k, v in best.items()))"
    )
    out = _fresh_python(code, KVSTORE_NT_COPY=None)
    kept, *pairs = out.stdout.split()
    times = {k: float(v) for k, v in (x.split("=") for x in pairs)}
    # The methods take turns, best of 5 each: a burst of load elsewhere slows one
    # round of each, not all of one method. 0.7 still fails the 0.6x choice above.
    assert min(times.values()) / times[kept] >= 0.7, (kept, times)


# ------------------------------------------------------------ groups: one call, many pieces


@pytest.fixture
def pieces_calls(monkeypatch):
    """The settled non-temporal choice with grouping by the pieces loop both ways,
    one thread, and every call of the pieces loop recorded (how many pieces each)."""
    if not memcopy.fast_copy_available():
        pytest.skip("the copy loops are x86-64 Linux only")
    memcopy.copy_methods()
    monkeypatch.setattr(memcopy, "_small_method", memcopy.NT)
    monkeypatch.setattr(memcopy, "_large_method", memcopy.NT)
    monkeypatch.setattr(memcopy, "_group_loop", {"load": memcopy.NT, "store": memcopy.NT})
    monkeypatch.setattr(memcopy, "_THREADS", 1)
    calls: list[int] = []
    loops = memcopy._LOADED
    assert loops is not None

    def counted(table: int, count: int) -> None:
        calls.append(count)
        loops.nt_pieces(table, count)

    monkeypatch.setattr(memcopy, "_LOADED", loops._replace(nt_pieces=counted))
    return calls


def test_a_steps_scattered_blocks_are_one_call_and_bit_exact(pieces_calls):
    # 64 blocks of 64 KiB from scattered places into rows 16 bytes past a line
    # (where numpy's large arrays start), then pieces the loop does not take:
    # an odd length, a destination off 16 bytes, one below NT_MIN_BYTES.
    block, n = 64 << 10, 64
    src = _src(n * block, 21)
    dst = np.full(n * block + 3 * T + 4 * GUARD, 0xA5, np.uint8)
    d0 = GUARD + (-(dst.ctypes.data + GUARD)) % 64 + 16
    order = np.random.default_rng(5).permutation(n).tolist()
    pieces = [
        (dst.ctypes.data + d0 + i * block, src.ctypes.data + k * block, block)
        for i, k in enumerate(order)
    ]
    want = np.concatenate([src[k * block : (k + 1) * block] for k in order])
    assert memcopy.copy_pieces(pieces) == n
    assert pieces_calls == [n]
    np.testing.assert_array_equal(dst[d0 : d0 + n * block], want)
    assert (dst[:d0] == 0xA5).all()

    tail = d0 + n * block + GUARD
    odd = [
        (dst.ctypes.data + tail, src.ctypes.data, T + 1),
        (dst.ctypes.data + tail + T + 72, src.ctypes.data + 5, T),  # dst 8 bytes off
        (dst.ctypes.data + tail + 2 * T + 160, src.ctypes.data + 9, T - 64),
    ]
    pieces_calls.clear()
    assert memcopy.copy_pieces(odd) == 3
    assert pieces_calls == []  # each one call of its own, as before
    for d, s, nbytes in odd:
        got = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(d))
        want_piece = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(s))
        np.testing.assert_array_equal(got, want_piece)
    assert (dst[d0 + n * block : tail] == 0xA5).all()


def test_groups_end_at_group_bytes_and_take_only_small_pieces_of_the_loop(
    pieces_calls, monkeypatch
):
    k = 512 << 10
    sizes = [k] * 33 + [2 * MIB, 2 * MIB]  # 16 pieces make 8 MiB; 2 MiB is a large piece
    src = _src(sum(sizes), 22)
    dst = np.zeros(sum(sizes), np.uint8)
    assert memcopy.copy_pieces(_pieces(dst, src, sizes, list(range(len(sizes))))) == len(sizes)
    np.testing.assert_array_equal(dst, src)
    assert pieces_calls == [16, 16]  # the 33rd and the large ones: one call each

    # where grouping was not measured faster, small pieces are one call each
    monkeypatch.setattr(memcopy, "_group_loop", {"load": None, "store": None})
    pieces_calls.clear()
    small = [64 << 10] * 8
    dst[:] = 0
    assert memcopy.copy_pieces(_pieces(dst, src, small, list(range(8)))) == 8
    np.testing.assert_array_equal(dst[: sum(small)], src[: sum(small)])
    assert pieces_calls == []


def test_a_group_is_never_started_late_and_counts_only_if_done_in_time(pieces_calls):
    # 64 pieces of 512 KiB, groups of 16. Each group reads the clock before and
    # (fence_reads) after; the clock passes the deadline at its 4th reading,
    # the one after the second group: that group was started in time but ended
    # late, so only the first group's 16 pieces count, and no later group starts.
    k = 512 << 10
    sizes = [k] * 64
    src = _src(sum(sizes), 23)
    dst = np.zeros(sum(sizes), np.uint8)
    reads = iter(range(1000))
    got = memcopy.copy_pieces(
        _pieces(dst, src, sizes, list(range(64))),
        deadline_s=2.0,
        clock=lambda: float(next(reads)),
        fence_reads=True,
    )
    assert got == 16
    assert pieces_calls == [16, 16]
    np.testing.assert_array_equal(dst[: 32 * k], src[: 32 * k])
    assert not dst[32 * k :].any()  # never started


def test_loads_grouped_by_the_list_loop_take_runs_of_one_length_bit_exact(monkeypatch):
    # Where the ordinary-store list loop won loads (the AMD VM): a load's
    # scattered 64 KiB pieces in one call, a run of another length in the next,
    # a piece of a third length alone (a run of one); a store of the same pieces goes to the
    # non-temporal loop. Every byte lands, nothing around them is touched.
    if not memcopy.fast_copy_available():
        pytest.skip("the copy loops are x86-64 Linux only")
    memcopy.copy_methods()
    monkeypatch.setattr(memcopy, "_group_loop", {"load": memcopy.VEC, "store": memcopy.NT})
    monkeypatch.setattr(memcopy, "_THREADS", 1)
    loops = memcopy._LOADED
    assert loops is not None
    lists: list[tuple[int, int]] = []
    tables: list[int] = []

    def listed(dsts: int, srcs: int, count: int, nbytes: int) -> None:
        lists.append((count, nbytes))
        loops.vec_list(dsts, srcs, count, nbytes)

    def pieced(table: int, count: int) -> None:
        tables.append(count)
        loops.nt_pieces(table, count)

    monkeypatch.setattr(memcopy, "_LOADED", loops._replace(vec_list=listed, nt_pieces=pieced))
    block = 64 << 10
    sizes = [block] * 6 + [2 * block] * 3 + [T + 64]
    src = _src(sum(sizes), 24)
    dst = np.full(sum(sizes) + 2 * GUARD, 0xA5, np.uint8)
    inner = dst[GUARD : GUARD + sum(sizes)]
    order = [3, 0, 5, 1, 4, 2, 7, 6, 8, 9]  # scattered within each run of one length
    pieces = _pieces(inner, src, sizes, order)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
    want = np.concatenate([src[starts[k] : starts[k] + sizes[k]] for k in order])
    assert memcopy.copy_pieces(pieces, load=True) == len(sizes)
    np.testing.assert_array_equal(inner, want)
    assert (dst[:GUARD] == 0xA5).all() and (dst[GUARD + sum(sizes) :] == 0xA5).all()
    assert lists == [(6, block), (3, 2 * block)] and tables == []  # the odd one: alone

    inner[:] = 0
    lists.clear()
    assert memcopy.copy_pieces(pieces) == len(sizes)  # a store: the other loop
    np.testing.assert_array_equal(inner, want)
    assert lists == [] and tables == [10]  # any lengths: one call for all


def test_a_piece_alone_takes_the_method_of_its_way(monkeypatch):
    """copy_pieces' lone pieces (a large one, a small one not grouped) go by the
    method measured for their direction; copy_raw without a way, by the one
    measured both ways."""
    if not memcopy.fast_copy_available():
        pytest.skip("the copy loops are x86-64 Linux only")
    memcopy.copy_methods()
    monkeypatch.setattr(memcopy, "_way_methods", {"load": ("vec", "vec"), "store": ("nt", "nt")})
    monkeypatch.setattr(memcopy, "_small_method", memcopy.MEMMOVE)
    monkeypatch.setattr(memcopy, "_large_method", memcopy.MEMMOVE)
    monkeypatch.setattr(memcopy, "_group_loop", {"load": None, "store": None})
    monkeypatch.setattr(memcopy, "_THREADS", 1)
    used: list[str] = []
    real = memcopy.copy_with

    def recording(method, d, s, n):  # type: ignore[no-untyped-def]
        used.append(method)
        real(method, d, s, n)

    monkeypatch.setattr(memcopy, "copy_with", recording)
    sizes = [2 * MIB, 64 << 10]
    src = _src(sum(sizes), 25)
    dst = np.zeros(sum(sizes), np.uint8)
    pieces = _pieces(dst, src, sizes, [0, 1])
    assert memcopy.copy_pieces(pieces, load=True) == 2
    assert used == ["vec", "vec"]
    np.testing.assert_array_equal(dst, src)
    used.clear()
    assert memcopy.copy_pieces(pieces) == 2
    assert used == ["nt", "nt"]
    used.clear()
    memcopy.copy_raw(*pieces[0])
    assert used == ["memmove"]
