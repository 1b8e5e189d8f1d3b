"""SGLang HiCache page keys -> the uint64 block hashes kvstore stores pages under.

SGLang names every page of a sequence by a SHA-256 hex string chained over
the tokens (``sglang.srt.mem_cache.utils.get_hash_str``, a C++ extension in
0.5.23): ``digest_i = sha256(digest_{i-1} + tokens of page i as uint32 LE)``,
the first page seeded by the request namespace (``storage_namespace_seed``:
extra_key / cache_salt) or by nothing. ``page_hashes`` is that scheme in
Python, for tests and tools; the backend never hashes tokens itself, it gets
the keys from SGLang.

kvstore keys a page by the first 8 bytes of the digest, big-endian: the same
64 bits SGLang's own KV events carry (``hash_str_to_int64``, which reads them
as a signed int64), so an indexer sees SGLang's GPU-tier events and kvstore's
events for one page under one number (mod 2**64). Keys that are not 64 hex
characters (a sidecar pool's suffixed key, a test's name) are hashed with
SHA-256 first, so every string maps to a well-spread value.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

HEX_DIGEST_CHARS = 64


def key_to_block_hash(key: str) -> int:
    """The uint64 kvstore keys SGLang page ``key`` under."""
    if len(key) == HEX_DIGEST_CHARS:
        try:
            return int(key[:16], 16)
        except ValueError:
            pass
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


def keys_to_block_hashes(keys: Sequence[str]) -> np.ndarray:
    """``key_to_block_hash`` of every key, as a uint64 array."""
    out = np.empty(len(keys), dtype=np.uint64)
    for i, key in enumerate(keys):
        out[i] = key_to_block_hash(key)
    return out


def page_hashes(tokens: Sequence[int], prior_hash: str | None, page_size: int) -> list[str]:
    """SGLang 0.5.23's page keys of ``tokens`` (plain token ids < 2**32), chained
    from ``prior_hash`` (hex; None: the first page has no parent). A short last
    page is hashed as it is, as SGLang does."""
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")
    digest = bytes.fromhex(prior_hash) if prior_hash else b""
    out = []
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("token ids must fit in uint32 (SGLang hashes wider ids another way)")
    words = arr.astype("<u4")
    for start in range(0, len(words), page_size):
        digest = hashlib.sha256(digest + words[start : start + page_size].tobytes()).digest()
        out.append(digest.hex())
    return out
