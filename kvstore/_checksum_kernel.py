"""Block checksums compiled (see ``kvstore.checksums``); imports numba.

Imported only when the kernel is built (``kvstore.native``): a plain
``import kvstore`` never pays numba's import.

``hash_blocks`` calls libxxhash's XXH3-64 (the very function python-xxhash's
``xxh3_64_intdigest`` runs, seed 0: its runtime-dispatched entry where the
extension exports it, ``kvstore.checksums``) once per block, from compiled
code with the interpreter lock released for the whole batch. The
function's address is an argument, not a constant of the code: numba cannot
cache code that embeds a ctypes pointer (it would recompile, ~1 s, in every
process), and the address differs per process anyway.
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba.extending import intrinsic


@intrinsic
def _call_xxh3(typingctx, fn_addr, data_addr, nbytes):  # type: ignore[no-untyped-def]
    """``((uint64 (*)(const void *, size_t)) fn_addr)(data_addr, nbytes)``."""
    sig = numba.uint64(numba.uint64, numba.uint64, numba.uint64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        fn, data, length = args
        word = ir.IntType(64)
        byte_ptr = ir.IntType(8).as_pointer()
        fn_type = ir.FunctionType(word, [byte_ptr, word])
        target = builder.inttoptr(fn, fn_type.as_pointer())
        return builder.call(target, [builder.inttoptr(data, byte_ptr), length])

    return sig, codegen


_OFFSETS = [numba.types.Array(numba.uint64, 1, "C", readonly=ro) for ro in (False, True)]
# Explicit signatures: compiled when this module is imported (in kvstore.native's
# thread), and a call with other types is a TypeError, never a compile on the
# hot path.
SIGNATURES = [
    numba.void(
        numba.uint64,
        numba.uint64,
        offsets,
        numba.uint64,
        numba.types.Array(numba.uint64, 1, "C"),
    )
    for offsets in _OFFSETS
]


@numba.njit(SIGNATURES, cache=True, nogil=True)
def hash_blocks(fn_addr, base_addr, offsets, block_bytes, out):  # type: ignore[no-untyped-def]
    """``out[i]`` = xxh3-64 of the ``block_bytes`` at ``base_addr + offsets[i]``.
    The caller has checked every block lies inside the mapping at ``base_addr``."""
    for i in range(offsets.shape[0]):
        out[i] = _call_xxh3(fn_addr, base_addr + offsets[i], block_bytes)
