"""The compiled prefix walk (see ``kvstore.indexer.walk``); imports numba.

Imported only by ``walk.available()`` (numba's import and the compile are paid
by the index's users that walk, never by a plain ``import kvstore``).
"""

from __future__ import annotations

import numba
import numpy as np

from kvstore.indexer.backend import CPU, DISK, ENGINE_GPU, KVSTORE_GPU

# Counter planes: a block count up to 2**PLANES - 1 (a request is bounded far below).
PLANES = 40
# Blocks looked up ahead of the walk (see walk_blocks).
CHUNK = 512
# the medium indexes the walk reads rows by (fixed: the index's layout)
assert (ENGINE_GPU, CPU, DISK, KVSTORE_GPU) == (0, 1, 2, 3)

# de Bruijn sequence: index of the lowest set bit of a word without a loop
DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
LOW_BIT = np.zeros(64, dtype=np.int64)
for _i in range(64):
    LOW_BIT[(((1 << _i) * 0x03F79D71B4CB0A89) & (2**64 - 1)) >> 58] = _i
assert sorted(LOW_BIT.tolist()) == list(range(64))


def _walk_blocks(
    keys: np.ndarray,
    state: np.ndarray,
    bits: np.ndarray,
    n_w: int,
    mult: np.uint64,
    shift: np.uint64,
    mask: np.int64,
    hashes: np.ndarray,
    alive: np.ndarray,
    pairs: np.ndarray,
    prefix: np.ndarray,
    gpu: np.ndarray,
    disk: np.ndarray,
) -> int:
    """Fill prefix/gpu/disk (per node id) for ``hashes``; returns the blocks walked.

    ``bits`` is the table's (slot, medium x word) view: word ``w`` of medium
    ``m`` at column ``m * n_w + w``; ``state`` 0 empty, 1 full, 2 deleted."""
    width = bits.shape[1]
    n_m = width // n_w
    zero = np.uint64(0)
    one = np.uint64(1)
    running = alive.copy()
    g_cnt = np.zeros((n_w, PLANES), dtype=np.uint64)
    d_cnt = np.zeros((n_w, PLANES), dtype=np.uint64)
    n = hashes.shape[0]
    cap = keys.shape[0]
    # Blocks are looked up a chunk ahead of the walk: a probe loop alone, then
    # a copy loop alone, have independent iterations whose cache misses the
    # CPU overlaps; inside the walk's loop they would be taken one at a time.
    chunk = max(1, min(n, CHUNK))
    slots = np.empty(chunk, dtype=np.int64)
    rows = np.empty((chunk, width), dtype=np.uint64)
    i = 0
    while i < n:
        j = i % chunk
        if j == 0:
            todo = min(n - i, chunk)
            for x in range(todo):
                h = hashes[i + x]
                slot = np.int64((h * mult) >> shift)
                found = np.int64(-1)
                for _ in range(cap):  # bounded: a table always has empty slots
                    st = state[slot]
                    if st == 0:
                        break
                    if st == 1 and keys[slot] == h:
                        found = slot
                        break
                    slot = (slot + 1) & mask
                slots[x] = found
            for x in range(todo):
                found = slots[x]
                if found >= 0:
                    for r in range(width):
                        rows[x, r] = bits[found, r]
                else:
                    for r in range(width):
                        rows[x, r] = zero
            for p in range(pairs.shape[0]):  # a rank holds its node's entries too
                nb = pairs[p, 0]
                rb = pairs[p, 1]
                nb_shift = np.uint64(nb & 63)
                rb_bit = one << np.uint64(rb & 63)
                for x in range(todo):
                    for m in range(n_m):
                        if (rows[x, m * n_w + (nb >> 6)] >> nb_shift) & one:
                            rows[x, m * n_w + (rb >> 6)] |= rb_bit
        any_left = False
        for w in range(n_w):
            held = zero
            for m in range(n_m):
                held |= rows[j, m * n_w + w]
            held &= running[w]
            lost = running[w] & ~held
            while lost:  # these nodes' prefixes end before block i
                low = lost & (~lost + one)
                prefix[(w << 6) + LOW_BIT[(low * DEBRUIJN) >> np.uint64(58)]] = i
                lost ^= low
            running[w] = held
            if held:
                any_left = True
                g = rows[j, w]
                if n_m > 3:
                    g |= rows[j, 3 * n_w + w]
                c = rows[j, n_w + w]
                d = rows[j, 2 * n_w + w] & ~(g | c) & held
                g &= held
                k = 0
                while g and k < PLANES:  # bit-sliced add: each node's counter += bit
                    t = g_cnt[w, k] & g
                    g_cnt[w, k] ^= g
                    g = t
                    k += 1
                k = 0
                while d and k < PLANES:
                    t = d_cnt[w, k] & d
                    d_cnt[w, k] ^= d
                    d = t
                    k += 1
        if not any_left:
            break
        i += 1
    for w in range(n_w):
        rest = running[w]
        while rest:  # held to the end
            low = rest & (~rest + one)
            prefix[(w << 6) + LOW_BIT[(low * DEBRUIJN) >> np.uint64(58)]] = i
            rest ^= low
        for b in range(64):
            gb = np.int64(0)
            db = np.int64(0)
            for k in range(PLANES):
                gb += np.int64((g_cnt[w, k] >> np.uint64(b)) & one) << k
                db += np.int64((d_cnt[w, k] >> np.uint64(b)) & one) << k
            gpu[(w << 6) + b] = gb
            disk[(w << 6) + b] = db
    return i


# The GIL stays held (no nogil): the walk is short (< 1 ms), and a thread that
# released it waits up to the switch interval (5 ms) to take it back from a
# busy one (the index's ingestion thread): the router's decision would pay that.
try:
    walk_blocks = numba.njit(cache=True)(_walk_blocks)
except RuntimeError:
    # no writable place for numba's cache (a read-only install under systemd's
    # ProtectSystem/ProtectHome): compiled at each start instead (~1-2 s)
    walk_blocks = numba.njit(_walk_blocks)
