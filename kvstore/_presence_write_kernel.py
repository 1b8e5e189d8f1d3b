"""The presence table's writes compiled, the daemon's only (see ``kvstore.presence``);
imports numba. Apart from the probes (``kvstore._presence_kernel``): a client
never compiles these.

The daemon's writes (``put``, ``remove``, ``set_checksums``; clients never
write) follow the rules of ``PresenceTable.put_few``, ``remove_one`` and
``set_checksum``, one block after the other:

- ``put``: a block recorded already gets its word rewritten in place (unless
  ``new``: the caller knows none is); a new one takes the first free way of the
  emptier of its two buckets (the first bucket on a tie), or is refused when
  both are full. Its location and checksum are written before its key word.
- ``remove``: the key word is cleared first (a reader stops finding it), then
  its location and checksum.

Those orders are what a reader of the shared table relies on; x86 keeps stores
in program order, and ``_release_fence`` keeps the compiler from moving one
store past another (an LLVM ``fence release``: no instruction on x86).
"""

from __future__ import annotations

import numba
import numpy as np
from numba.extending import intrinsic

from kvstore._presence_kernel import WAYS, buckets_of, find_way, key_of


@intrinsic
def _release_fence(typingctx):  # type: ignore[no-untyped-def]
    """No store before it moves after a store behind it (compiler only on x86)."""
    sig = numba.types.void()

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        builder.fence("release")
        return context.get_dummy_value()

    return sig, codegen


_BODY = numba.types.Array(numba.uint64, 1, "C")
_U64 = [numba.types.Array(numba.uint64, 1, "C", readonly=ro) for ro in (False, True)]
_I64 = numba.types.Array(numba.int64, 1, "C")
# A write's first arguments: the file's words, keys_at (the key words' first
# index), n_words (key words = locations = checksums), shift and mask (a key's
# buckets: key >> shift, (key >> 2) & mask), the salt (presence.namespace_salt).
_GEOMETRY = (_BODY, numba.int64, numba.int64, numba.uint64, numba.uint64, numba.uint64)
# Explicit signatures: compiled when this module is imported (in kvstore.native's
# thread), and a call with other types is a TypeError, never a compile on the
# hot path.
PUT_SIGNATURES = [
    numba.int64(
        *_GEOMETRY,
        hashes,
        numba.uint64,  # tier bits
        _I64,  # DRAM slot offsets (-1: no location); empty: none has one
        _U64[0],  # checksums; empty: 0
        numba.int64,  # new: 1 when none of them is recorded
        numba.int64,  # loc_unit_shift: log2(LOC_UNIT_BYTES)
        numba.int64,  # stamp_bits (LOC_STAMP_BITS)
        _I64,  # state: [0] the last stamp (in and out), [1] refused (out)
    )
    for hashes in _U64
]
SET_CHECKSUMS_SIGNATURES = [numba.int64(*_GEOMETRY, hashes, _U64[0]) for hashes in _U64]
REMOVE_SIGNATURES = [numba.int64(*_GEOMETRY, hashes) for hashes in _U64]


@numba.njit(cache=True, nogil=True, inline="always")
def _free(body: np.ndarray, keys_at: int, base: int) -> np.int64:
    n = 0
    for i in range(WAYS):
        if body[keys_at + base + i] == 0:
            n += 1
    return np.int64(n)


@numba.njit(cache=True, nogil=True, inline="always")
def _first_free(body: np.ndarray, keys_at: int, base: int) -> np.int64:
    for i in range(WAYS):
        if body[keys_at + base + i] == 0:
            return np.int64(base + i)
    return np.int64(-1)


@numba.njit(PUT_SIGNATURES, cache=True, nogil=True)
def put(
    body: np.ndarray,
    keys_at: int,
    n_words: int,
    shift: np.uint64,
    mask: np.uint64,
    salt: np.uint64,
    hashes: np.ndarray,
    tier: np.uint64,
    offsets: np.ndarray,
    checksums: np.ndarray,
    new: int,
    loc_unit_shift: int,
    stamp_bits: int,
    state: np.ndarray,
) -> int:
    """Record ``hashes``; returns how many took a new entry (``state[1]``: refused)."""
    stamp_mask = (np.int64(1) << stamp_bits) - 1
    stamp = state[0]
    added = 0
    refused = 0
    with_offsets = offsets.shape[0] > 0
    with_sums = checksums.shape[0] > 0
    for i in range(hashes.shape[0]):
        key = key_of(hashes[i], salt)
        at = np.int64(-1) if new else find_way(body, keys_at, key, shift, mask)
        fresh = at < 0
        if fresh:
            base1, base2 = buckets_of(key, shift, mask)
            if _free(body, keys_at, base2) > _free(body, keys_at, base1):
                at = _first_free(body, keys_at, base2)
            else:
                at = _first_free(body, keys_at, base1)
            if at < 0:
                refused += 1
                continue
        loc = np.uint64(0)
        if with_offsets and offsets[i] >= 0:
            stamp = (stamp + 1) & stamp_mask
            loc = np.uint64(((offsets[i] >> loc_unit_shift) << stamp_bits) | stamp)
        body[keys_at + n_words + at] = loc
        body[keys_at + 2 * n_words + at] = checksums[i] if with_sums else np.uint64(0)
        _release_fence()
        body[keys_at + at] = key | tier
        if fresh:
            added += 1
    state[0] = stamp
    state[1] = refused
    return added


@numba.njit(REMOVE_SIGNATURES, cache=True, nogil=True)
def remove(
    body: np.ndarray,
    keys_at: int,
    n_words: int,
    shift: np.uint64,
    mask: np.uint64,
    salt: np.uint64,
    hashes: np.ndarray,
) -> int:
    """Forget ``hashes`` (those not recorded: nothing); returns how many were."""
    removed = 0
    for i in range(hashes.shape[0]):
        at = find_way(body, keys_at, key_of(hashes[i], salt), shift, mask)
        if at < 0:
            continue
        body[keys_at + at] = 0
        _release_fence()
        body[keys_at + n_words + at] = 0
        body[keys_at + 2 * n_words + at] = 0
        removed += 1
    return removed


@numba.njit(SET_CHECKSUMS_SIGNATURES, cache=True, nogil=True)
def set_checksums(
    body: np.ndarray,
    keys_at: int,
    n_words: int,
    shift: np.uint64,
    mask: np.uint64,
    salt: np.uint64,
    hashes: np.ndarray,
    checksums: np.ndarray,
) -> int:
    """The checksum beside each recorded one of ``hashes`` (nothing for the others);
    returns how many were recorded."""
    done = 0
    for i in range(hashes.shape[0]):
        at = find_way(body, keys_at, key_of(hashes[i], salt), shift, mask)
        if at >= 0:
            body[keys_at + 2 * n_words + at] = checksums[i]
            done += 1
    return done
