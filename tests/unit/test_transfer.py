"""Transport pieces that need no peer: descriptor batches, stream chunking, read pieces."""

from __future__ import annotations

import asyncio
import itertools
import sys
import time

import numpy as np
import pytest

from kvstore import checksums
from kvstore.checksums import checksums_of
from kvstore.errors import InvalidRequest
from kvstore.transfer.base import SHORT_BATCH, ReadBatch
from kvstore.transfer.grpc_stream import iter_chunks
from kvstore.transfer.puller import (
    MAX_PIECES,
    PIECE_MIN_BYTES,
    _PieceHasher,
    _pieces,
)


def test_read_batch_checks_shapes_and_bounds() -> None:
    b = ReadBatch.of([0, 4096], [8192, 0], [4096, 4096])
    assert len(b) == 2 and b.nbytes == 8192
    b.check_bounds(8192, 12288)
    with pytest.raises(InvalidRequest, match="peer's region"):
        b.check_bounds(8191, 12288)
    with pytest.raises(InvalidRequest, match="local region"):
        b.check_bounds(8192, 12287)
    with pytest.raises(InvalidRequest):
        ReadBatch.of([0], [0, 1], [1])


@pytest.mark.parametrize("n", [1, SHORT_BATCH, SHORT_BATCH + 1, 300])
def test_bounds_are_checked_alike_on_short_and_long_batches(n: int) -> None:
    # The block that reaches furthest is in the middle, on either side: short
    # batches are checked as Python ints, long ones with numpy.
    offsets = np.arange(n, dtype=np.uint64) * 4096
    far = np.array(offsets)
    far[n // 2] = 1 << 30
    end, roomy = (1 << 30) + 4096, 1 << 40
    remote_far = ReadBatch.of(far, offsets, [4096] * n)
    remote_far.check_bounds(end, roomy)
    with pytest.raises(InvalidRequest, match="peer's region"):
        remote_far.check_bounds(end - 1, roomy)
    local_far = ReadBatch.of(offsets, far, [4096] * n)
    local_far.check_bounds(roomy, end)
    with pytest.raises(InvalidRequest, match="local region"):
        local_far.check_bounds(roomy, end - 1)


@pytest.mark.parametrize(
    "block_bytes,chunk_bytes",
    [(4096, 1 << 20), (96 << 10, 1 << 20), (3 << 20, 1 << 20), (1000, 333)],
)
def test_iter_chunks_concatenates_blocks_in_order(block_bytes: int, chunk_bytes: int) -> None:
    rng = np.random.default_rng(3)
    region = rng.integers(0, 256, 64 * block_bytes, dtype=np.uint8)
    offsets = rng.choice(64, size=17, replace=False).astype(np.uint64) * np.uint64(block_bytes)
    chunks = list(iter_chunks(region, offsets, block_bytes, chunk_bytes))
    assert all(0 < len(c) <= chunk_bytes for c in chunks)
    assert all(len(c) == chunk_bytes for c in chunks[:-1])
    want = b"".join(region[o : o + block_bytes].tobytes() for o in offsets.tolist())
    assert b"".join(chunks) == want


@pytest.mark.parametrize(
    "n,block_bytes,expect",
    [
        (1, 2 << 20, 1),
        (16, 2 << 20, 1),
        (512, 2 << 20, MAX_PIECES),
        (16384, 64 << 10, MAX_PIECES),
        (3, 64 << 20, 3),
    ],
)
def test_pieces_cover_every_block_once(n: int, block_bytes: int, expect: int) -> None:
    pieces = _pieces(n, block_bytes)
    assert len(pieces) == expect
    assert pieces[0][0] == 0 and pieces[-1][1] == n
    assert all(a < b for a, b in pieces)
    assert all(p[1] == q[0] for p, q in itertools.pairwise(pieces))
    if len(pieces) > 1:
        assert min(b - a for a, b in pieces) * block_bytes >= PIECE_MIN_BYTES // 2


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python-xxhash"])
def test_piece_hasher_hands_the_gil_over_while_it_hashes_small_blocks(compiled: bool) -> None:
    """python-xxhash keeps the GIL while it hashes a 64 KiB block, so a thread
    hashing a piece of them kept it for the whole piece, and the event loop
    (posting the next READs) waited a switch interval each time it wanted it
    back. With the switch interval made huge, only the hasher's own hand-offs
    (python-xxhash) or the compiled kernel, which hashes without the GIL, let
    the loop's thread run while a piece is hashed.

    What the loop's thread sees is counted, not how often it ran: a hasher that
    kept the GIL for the piece shows it no half-hashed piece at all, while one
    that hands it over shows it several. (A count of turns depended on how fast
    the machine hashed against how long a 0.1 ms sleep took: 7 under load.)"""
    assert checksums.compiled_checksums(120.0), "numba is a dependency of the nixl extra"
    block = 64 << 10
    # 128 MiB: hashed in ~10-40 ms, long next to the slices a loaded machine's
    # scheduler hands out (32 MiB went by unseen with 3 busy processes on 2 cores)
    region = np.frombuffer(np.random.default_rng(3).bytes(128 << 20), dtype=np.uint8)
    offsets = np.arange(0, len(region), block, dtype=np.uint64)
    out = np.zeros(len(offsets), dtype=np.uint64)

    async def main() -> set[int]:
        hasher = _PieceHasher(region, offsets, block, out)
        seen: set[int] = set()
        old = sys.getswitchinterval()
        sys.setswitchinterval(30.0)  # no forced switch during the test: hand-offs only
        try:
            hasher.submit(0, len(offsets))
            while hasher.pending:
                time.sleep(0.0001)  # drops the GIL; coming back needs the hasher to hand it over
                seen.add(int(np.count_nonzero(out)))
        finally:
            sys.setswitchinterval(old)
        await hasher.finish()
        return seen

    if compiled:
        seen = asyncio.run(main())
    else:
        with checksums.python_only():
            seen = asyncio.run(main())
    with checksums.python_only():
        assert out.tolist() == checksums_of(region, offsets, block)
    # Blocks hashed so far, as seen between the piece's start and its end: none
    # when the hasher kept the GIL for the whole piece.
    partial = sum(0 < n < len(offsets) for n in seen)
    assert partial >= 2, sorted(seen)
