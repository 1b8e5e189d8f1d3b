"""The presence table's probes compiled (see ``kvstore.presence``); imports numba.

Imported only when the kernel is built (``kvstore.native``): a plain
``import kvstore`` never pays numba's import. The daemon's writes are compiled
apart (``kvstore._presence_write_kernel``, which shares ``key_of``,
``buckets_of`` and ``find_way`` from here), so a client compiles only this.

One kernel for the three probes (one compile), over the whole table file as
one array of words (header, key words, locations, checksums: the layout of
``kvstore.presence``), each hash looked up in its two buckets in turn:

- LOOKUP: the longest present prefix; ``out[0, t]`` counts its blocks by tier
  bits ``t``. Returns the prefix's length.
- PRESENT: ``out[0, i]`` is 1 where hash ``i`` is held (any tier). Returns how
  many are.
- LOCATE: the longest prefix held in DRAM with a location; for each of its
  blocks ``out[0..3, i]`` = its word's index in the key words, the key word,
  the location, the checksum. Returns ``found * 2 + elsewhere`` (elsewhere: the
  block after the prefix is held, in a tier a client cannot read).

LOOKUP and LOCATE read a block's key word again after ``find_way`` found its way,
and go on only where it still holds the key: a block that left in between may
have had its way taken by another block, whose word and location ``intact``
would pass (docs/presence.md "Direct loads").

A location is read after its key word, as the numpy path reads them; the
compiler may load them in either order, and either is safe: ``intact`` after
the copy compares both with what this read, so a word and location that were
not one entry's together never pass (kvstore.presence, module doc).
"""

from __future__ import annotations

import numba
import numpy as np

LOOKUP, PRESENT, LOCATE = 0, 1, 2

_C1 = np.uint64(0xFF51AFD7ED558CCD)  # murmur3's fmix64, as presence.mix_keys
_C2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_S2 = np.uint64(2)
_LOW = np.uint64(3)
_SET = np.uint64(4)
WAYS = 8
_DRAM = np.uint64(2)


_TABLE = numba.types.Array(numba.uint64, 1, "C", readonly=True)
_OUT = numba.types.Array(numba.uint64, 2, "C")
# Explicit signatures: compiled when this module is imported (in kvstore.native's
# thread), and a call with other types is a TypeError, never a compile on the
# hot path. The caller passes C-contiguous uint64 hashes, writable or not.
SIGNATURES = [
    numba.int64(
        _TABLE,
        numba.int64,
        numba.int64,
        numba.uint64,
        numba.uint64,
        numba.uint64,
        numba.types.Array(numba.uint64, 1, "C", readonly=readonly),
        numba.int64,
        _OUT,
    )
    for readonly in (False, True)
]


@numba.njit(cache=True, nogil=True, inline="always")
def key_of(block_hash: np.uint64, salt: np.uint64) -> np.uint64:
    """presence.mix_key: fmix64(hash ^ salt), the tier's 2 bits cleared, bit 2 set."""
    x = block_hash ^ salt
    x ^= x >> _S33
    x *= _C1
    x ^= x >> _S33
    x *= _C2
    x ^= x >> _S33
    return (x & ~_LOW) | _SET


@numba.njit(cache=True, nogil=True, inline="always")
def buckets_of(key: np.uint64, shift: np.uint64, mask: np.uint64) -> tuple[np.int64, np.int64]:
    """The first key word's index of each of ``key``'s two buckets (presence.buckets_of)."""
    return np.int64(key >> shift) * WAYS, np.int64((key >> _S2) & mask) * WAYS


@numba.njit(cache=True, nogil=True, inline="always")
def find_way(
    body: np.ndarray, keys_at: int, key: np.uint64, shift: np.uint64, mask: np.uint64
) -> np.int64:
    """The index (in the key words) of the word holding ``key``, or -1."""
    base1, base2 = buckets_of(key, shift, mask)
    for i in range(WAYS):
        if body[keys_at + base1 + i] ^ key < _SET:
            return base1 + i
    base = base2
    for i in range(WAYS):
        if body[keys_at + base + i] ^ key < _SET:
            return base + i
    return np.int64(-1)


@numba.njit(SIGNATURES, cache=True, nogil=True)
def probe(
    body: np.ndarray,
    keys_at: int,
    n_words: int,
    shift: np.uint64,
    mask: np.uint64,
    salt: np.uint64,
    hashes: np.ndarray,
    mode: int,
    out: np.ndarray,
) -> int:
    done = 0
    for i in range(hashes.shape[0]):
        key = key_of(hashes[i], salt)
        at = find_way(body, keys_at, key, shift, mask)
        if mode == PRESENT:
            if at >= 0:
                out[0, i] = 1
                done += 1
            continue
        if at < 0:
            return done * 2 if mode == LOCATE else done
        word = body[keys_at + at]
        if word ^ key >= _SET:
            # The block left between find_way's read and this one, and another block
            # took its way: this word (and the location beside it) is that block's,
            # which intact would find unchanged. Held nowhere readable now: the
            # daemon answers (LOCATE), or the prefix ends here (LOOKUP).
            return done * 2 + 1 if mode == LOCATE else done
        if mode == LOOKUP:
            out[0, word & _LOW] += 1
            done += 1
            continue
        loc = body[keys_at + n_words + at]
        if word & _LOW != _DRAM or loc == 0:
            return done * 2 + 1
        out[0, i] = at
        out[1, i] = word
        out[2, i] = loc
        out[3, i] = body[keys_at + 2 * n_words + at]
        done += 1
    return done * 2 if mode == LOCATE else done
