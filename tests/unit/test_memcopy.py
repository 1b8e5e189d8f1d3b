"""kvstore.memcopy: bit-exact around every size and alignment boundary, overlap, errors."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
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


def test_switched_off_by_environment_falls_back_to_memmove_and_says_so():
    code = (
        "import logging, numpy as np; logging.basicConfig(level=logging.INFO);"
        "from kvstore import memcopy; a = np.arange(1 << 21, dtype=np.uint8); b = np.empty_like(a);"
        "memcopy.copy(b, a); assert (a == b).all(); print(memcopy.fast_copy_available())"
    )
    env = {**os.environ, "KVSTORE_NT_COPY": "0", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
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
