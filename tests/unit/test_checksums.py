"""Block checksums: the compiled batch (kvstore._checksum_kernel) answers what
python-xxhash answers, refuses blocks outside the region, and hashes without
the interpreter lock."""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import numpy as np
import pytest
import xxhash

from kvstore import checksums
from kvstore.errors import InvalidRequest


@pytest.fixture(scope="module", autouse=True)
def compiled() -> None:
    # numba comes with the nixl and router extras; CI installs both: compiled here.
    assert checksums.compiled_checksums(120.0), "the checksum kernel did not compile"


@pytest.mark.parametrize("block_bytes", [1, 63, 4096, 65536, 65537, 2 << 20])
def test_compiled_batch_matches_python_xxhash(block_bytes: int) -> None:
    rng = np.random.default_rng(block_bytes)
    region = rng.integers(0, 256, 8 * block_bytes + 129, dtype=np.uint8)
    # scattered, unaligned, repeated, and the region's last byte
    offsets = np.asarray(
        [0, 5 * block_bytes + 3, 3, 5 * block_bytes + 3, len(region) - block_bytes] * 2,
        dtype=np.uint64,
    )
    assert len(offsets) >= checksums.KERNEL_MIN_BLOCKS  # the compiled path answers
    got = np.zeros(len(offsets), dtype=np.uint64)
    checksums.checksums_into(region, offsets, block_bytes, got)
    want = [xxhash.xxh3_64_intdigest(region[o : o + block_bytes]) for o in offsets.tolist()]
    assert got.tolist() == want
    with checksums.python_only():
        assert checksums.checksums_of(region, offsets, block_bytes) == want
    # read-only offsets (np.frombuffer of a reply) take the same kernel
    frozen = np.frombuffer(offsets.tobytes(), dtype=np.uint64)
    assert checksums.checksums_of(region, frozen, block_bytes) == want


@pytest.mark.parametrize("python", [False, True], ids=["compiled", "python-xxhash"])
def test_blocks_outside_the_region_are_refused_before_any_read(python: bool) -> None:
    region = np.zeros(1 << 16, dtype=np.uint8)
    out = np.zeros(1, dtype=np.uint64)
    with checksums.python_only() if python else contextlib.nullcontext():
        with pytest.raises(InvalidRequest, match="leave the 65536-byte region"):
            checksums.checksums_into(region, np.asarray([1], np.uint64), 1 << 16, out)
        with pytest.raises(InvalidRequest, match="leave"):
            checksums.checksums_into(region, np.asarray([0], np.uint64), 0, out)
        with pytest.raises(InvalidRequest, match="2 offsets for 1 checksums"):
            checksums.checksums_into(region, np.asarray([0, 1], np.uint64), 8, out)
        # a batch the compiled kernel would hash, its last block leaving the region
        many = np.arange(checksums.KERNEL_MIN_BLOCKS, dtype=np.uint64) * 8192
        out_many = np.zeros(len(many), dtype=np.uint64)
        with pytest.raises(InvalidRequest, match="leave the 65536-byte region"):
            checksums.checksums_into(region, many, 16384, out_many)
        assert not out_many.any()
    assert out.tolist() == [0]  # nothing written
    empty = np.zeros(0, dtype=np.uint64)
    checksums.checksums_into(region, empty, 1 << 20, empty)  # nothing to hash: no check needed


def test_compiled_batch_holds_no_interpreter_lock() -> None:
    """A thread that sleeps in a loop gets the lock back while another hashes
    128 MiB of 64 KiB blocks in one compiled call (python-xxhash would keep the
    lock for each block; with a 30 s switch interval the sleeper would wait for
    the whole batch). What the sleeper sees is counted, not how often it ran:
    a call that kept the lock shows it no half-hashed batch, one that does not
    shows it several (a count of turns fell short on a loaded machine)."""
    block = 64 << 10
    region = np.frombuffer(np.random.default_rng(1).bytes(128 << 20), dtype=np.uint8)
    offsets = np.arange(0, len(region), block, dtype=np.uint64)
    out = np.zeros(len(offsets), dtype=np.uint64)
    done = threading.Event()

    def hash_all() -> None:
        checksums.checksums_into(region, offsets, block, out)
        done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    seen: set[int] = set()
    try:
        worker = threading.Thread(target=hash_all)
        worker.start()
        while not done.is_set():
            time.sleep(0.0001)
            seen.add(int(np.count_nonzero(out)))
        worker.join()
    finally:
        sys.setswitchinterval(old)
    assert np.count_nonzero(out) == len(offsets)
    half_hashed = {n for n in seen if 0 < n < len(offsets)}
    assert len(half_hashed) >= 2, sorted(seen)
