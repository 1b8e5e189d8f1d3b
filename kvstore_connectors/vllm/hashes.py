"""vLLM's per-request block hashes -> the uint64 keys kvstore stores blocks under.

vLLM hashes a request's tokens in chunks of ``hash_block_size`` tokens
(``request.block_hashes``, digests as bytes, chained over the whole prefix);
the KV cache's block may be a multiple of that. The hash of KV block ``i`` is
then the last chunk hash inside it, which already covers the whole prefix
(vLLM's ``BlockHashListWithBlockSize`` does the same). kvstore keys blocks by
the int form vLLM's KV events carry: the low 8 bytes of the digest.

``RequestHashes`` converts incrementally: a request's hash list only grows, so
each digest is converted once however often the scheduler asks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvstore.hashing import to_int_hashes

# vLLM's non-cryptographic prefix hashes: without PYTHONHASHSEED each process
# draws a random seed for them (vllm.v1.core.kv_cache_utils.resolve_none_hash_seed).
RANDOM_SEED_ALGOS = frozenset({"xxhash", "xxhash_cbor"})


def hash_seed_fingerprint(algo: str, pythonhashseed: str | None, default_seed: str) -> str:
    """``<algo>:<12 hex>`` naming what vLLM seeds NONE_HASH (the first block's parent)
    with, or ``<algo>:random`` when each process draws its own seed.

    A one-way digest, never the seed or NONE_HASH: with xxhash a known seed
    lets anyone precompute colliding blocks. Engines agree on every block hash
    only if their fingerprints are equal. Every process of an engine computes
    the same value (from the inherited environment and the engine config).
    """
    seed = pythonhashseed
    if seed is None:
        if algo in RANDOM_SEED_ALGOS:
            return f"{algo}:random"
        seed = default_seed
    digest = hashlib.sha256(b"kvstore-vllm-none-hash-seed\0" + seed.encode()).hexdigest()
    return f"{algo}:{digest[:12]}"


def block_hash_stride(block_size: int, hash_block_size: int) -> int:
    """How many vLLM hash chunks make one KV block."""
    if hash_block_size <= 0 or block_size % hash_block_size:
        raise ValueError(
            f"block size {block_size} is not a multiple of the hash block size {hash_block_size}"
        )
    return block_size // hash_block_size


class RequestHashes:
    """The request's KV-block hashes as uint64, converted as the request grows."""

    __slots__ = ("_converted", "_last_digest", "_stride", "_values")

    def __init__(self, stride: int) -> None:
        self._stride = stride
        self._converted = 0  # KV blocks converted so far
        self._last_digest: bytes | None = None
        self._values = np.empty(0, dtype=np.uint64)

    def update(self, block_hashes: Sequence[bytes]) -> np.ndarray:
        """All KV-block hashes known for ``block_hashes`` (vLLM's list for the request)."""
        total = len(block_hashes) // self._stride
        s = self._stride
        if self._converted and (
            total < self._converted or block_hashes[self._converted * s - 1] != self._last_digest
        ):
            # vLLM truncated or rewrote the list (a resumed or edited request): start over.
            self._converted = 0
            self._values = np.empty(0, dtype=np.uint64)
        if total > self._converted:
            digests = [bytes(block_hashes[(i + 1) * s - 1]) for i in range(self._converted, total)]
            more = to_int_hashes(digests)
            self._values = np.concatenate([self._values, more]) if self._converted else more
            self._converted = total
            self._last_digest = digests[-1]
        return self._values
