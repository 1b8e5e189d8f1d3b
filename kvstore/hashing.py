"""vLLM-compatible chained block hashes from token ids.

A router, the indexer and the tests must compute exactly the hash vLLM's
prefix cache computes, or scores point at blocks the engine will never hit.
vLLM (0.32, ``vllm/v1/core/kv_cache_utils.py``) defines, per full block of
``block_size`` tokens::

    hash_i = hash_fn((hash_{i-1} or NONE_HASH, tuple(tokens_i), extra_keys_i))
    NONE_HASH = hash_fn(PYTHONHASHSEED or "vllm-none-hash")

with ``hash_fn`` either ``sha256`` over ``pickle.dumps(obj, protocol=5)``
(the default, ``--prefix-caching-hash-algo sha256``) or ``sha256_cbor`` over
canonical CBOR. ``extra_keys_i`` is ``None`` or a tuple of tagged keys in the
order lora, multi-modal, cache_salt (first block only), prompt-embeds:
``("lora", name, path)``, ``("mm", identifier, offset)``,
``("cache_salt", salt)``. vLLM 0.33 adds lookahead hashes
(``num_hash_lookahead_tokens`` L > 0, EAGLE/MTP drafters with prefix caching
and no KV connector): ``extra_keys_i = (extra_keys_i, *tokens[end_i : end_i + L])``
and a block is hashed only once its L next tokens exist (``lookahead_tokens``).
KV events carry ``int.from_bytes(digest, "big") &
(2**64 - 1)``: the low 8 bytes as an unsigned int, which is also how kvstore
keys blocks.

Speed (195k tokens, 12k blocks of 16): vLLM's own loop slices a list, builds
a tuple, pickles and hashes per block; here ``zip`` cuts all block tuples in
C first, leaving one ``pickle.dumps`` and one ``sha256`` per block (~1.2x).
For ``sha256_cbor`` the CBOR bytes of every block are laid out by numpy in
one pass (~4x over encoding each block in Python); blocks it cannot
express (tokens outside uint32, huge blocks) take the generic path. Both
are checked byte for byte against ``pickle`` / RFC 8949 and vLLM itself.

Primitives: ``BlockHasher(block_size, algo).hash_tokens(ids) -> list[bytes]``,
``.hash_tokens_int(ids) -> np.ndarray[uint64]``, ``to_int_hash(digest)``,
``none_hash(algo, seed)``, ``hash_block(...)`` (the one-block reference).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec
import numpy as np

from kvstore.errors import InvalidRequest

HashAlgo = Literal["sha256", "sha256_cbor"]
ALGOS: tuple[str, ...] = ("sha256", "sha256_cbor")
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_U64_MASK = (1 << 64) - 1
# the CBOR layout path pads every token to 5 bytes; bound its scratch memory
_FAST_MAX_BLOCK_TOKENS = 4096


# --- serializers -------------------------------------------------------------


# the hash algorithms vLLM's --prefix-caching-hash-algo takes
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


class HashScheme(msgspec.Struct, frozen=True):
    """How an engine turns token ids into block hashes (what a router must redo);
    a namespace's layout records it (``kvstore.namespace.layout_hash_scheme``)."""

    algo: str = "sha256"
    """vLLM's --prefix-caching-hash-algo."""
    lookahead_tokens: int = 0
    """vLLM 0.33's num_hash_lookahead_tokens: 0 = the legacy scheme (block alone)."""


def _cbor_head(major: int, n: int) -> bytes:
    m = major << 5
    if n < 24:
        return bytes((m | n,))
    if n < 0x100:
        return bytes((m | 24, n))
    if n < 0x10000:
        return bytes((m | 25,)) + n.to_bytes(2, "big")
    if n < 0x100000000:
        return bytes((m | 26,)) + n.to_bytes(4, "big")
    if n <= _U64_MASK:
        return bytes((m | 27,)) + n.to_bytes(8, "big")
    raise InvalidRequest(f"integer {n} does not fit CBOR's 64-bit heads")


def cbor_dumps(obj: Any) -> bytes:
    """Canonical CBOR (RFC 8949 core deterministic) of the types block hashes use.

    Matches ``cbor2.dumps(obj, canonical=True)`` for None, bool, int, str,
    bytes, tuple and list; kvstore does not depend on cbor2 for this.
    """
    out: list[bytes] = []
    _cbor_into(obj, out, 0)
    return b"".join(out)


def _cbor_into(obj: Any, out: list[bytes], depth: int) -> None:
    if depth > 64:
        raise InvalidRequest("extra key nesting deeper than 64")
    if obj is None:
        out.append(b"\xf6")
    elif obj is True:
        out.append(b"\xf5")
    elif obj is False:
        out.append(b"\xf4")
    elif isinstance(obj, int):
        out.append(_cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj))
    elif isinstance(obj, bytes):
        out.append(_cbor_head(2, len(obj)))
        out.append(obj)
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        out.append(_cbor_head(3, len(raw)))
        out.append(raw)
    elif isinstance(obj, tuple | list):
        out.append(_cbor_head(4, len(obj)))
        for item in obj:
            _cbor_into(item, out, depth + 1)
    else:
        raise InvalidRequest(f"cannot CBOR-encode a {type(obj).__name__} in a block hash key")


def sha256_pickle(obj: Any) -> bytes:
    """vLLM's ``sha256``: SHA-256 of ``pickle.dumps(obj, HIGHEST_PROTOCOL)``."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """vLLM's ``sha256_cbor``: SHA-256 of canonical CBOR."""
    return hashlib.sha256(cbor_dumps(obj)).digest()


def hash_fn(algo: str) -> Callable[[Any], bytes]:
    if algo == "sha256":
        return sha256_pickle
    if algo == "sha256_cbor":
        return sha256_cbor
    raise InvalidRequest(f"unknown block hash algorithm {algo!r}; expected one of {ALGOS}")


def none_hash_seed() -> str:
    """The seed vLLM derives NONE_HASH from: PYTHONHASHSEED if set, else fixed."""
    return os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)


def none_hash(algo: str = "sha256", seed: str | None = None) -> bytes:
    """The parent hash of a prompt's first block."""
    return hash_fn(algo)(none_hash_seed() if seed is None else seed)


def hash_block(
    algo: str,
    parent: bytes | None,
    tokens: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
    *,
    none: bytes | None = None,
) -> bytes:
    """One block, exactly as vLLM's ``hash_block_tokens`` (the reference path)."""
    if not parent:
        parent = none if none is not None else none_hash(algo)
    return hash_fn(algo)((parent, tuple(int(t) for t in tokens), extra_keys))


def to_int_hash(digest: bytes) -> int:
    """The int form KV events carry: low 8 bytes of the digest, big-endian."""
    return int.from_bytes(digest[-8:], "big")


# Up to this many digests are converted in Python ints, then one array: a new
# request's or a step's few blocks (numpy's path is ~5 calls, each a few µs when
# a forward has just evicted the caches); more go through numpy at once.
SHORT_DIGESTS = 32


def to_int_hashes(digests: Sequence[bytes]) -> np.ndarray:
    """``to_int_hash`` of many digests, as a uint64 array."""
    if len(digests) <= SHORT_DIGESTS:
        return np.array([int.from_bytes(d[-8:], "big") for d in digests], dtype=np.uint64)
    if all(len(d) == 32 for d in digests):
        words = np.frombuffer(b"".join(digests), dtype=">u8").reshape(-1, 4)
        return words[:, 3].astype(np.uint64)
    return np.fromiter((to_int_hash(d) for d in digests), dtype=np.uint64, count=len(digests))


# --- token encodings for the fast path ---------------------------------------


def _as_token_array(token_ids: Any) -> np.ndarray:
    if isinstance(token_ids, bytes | bytearray | memoryview):
        if len(token_ids) % 4:
            raise InvalidRequest(f"packed token ids must be int32 LE; got {len(token_ids)} bytes")
        return np.frombuffer(token_ids, dtype="<i4").astype(np.int64)
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise InvalidRequest(f"token ids must be one-dimensional; got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidRequest(f"token ids must be integers; got {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise InvalidRequest("token id out of int64 range")
    return arr.astype(np.int64, copy=False)


def _cbor_token_records(tok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Canonical CBOR of each token (0 <= t < 2**32) as a 5-byte record + length."""
    n = tok.size
    be = tok.astype(">u4").view(np.uint8).reshape(n, 4)
    lens = np.full(n, 5, dtype=np.int64)
    rec = np.empty((n, 5), dtype=np.uint8)
    rec[:, 0] = 0x1A
    rec[:, 1:5] = be
    for length, head, hi in ((3, 0x19, 0x10000), (2, 0x18, 0x100)):
        m = tok < hi
        lens[m] = length
        rec[m, 0] = head
        # the payload is the value's low bytes, big-endian, right after the head
        rec[m, 1:length] = be[m, 4 - (length - 1) :]
    m = tok < 24
    lens[m] = 1
    rec[m, 0] = be[m, 3]
    return rec, lens


def _lookahead_keys(
    tok: np.ndarray,
    n_blocks: int,
    block_size: int,
    lookahead: int,
    keys: list[tuple[Any, ...] | None] | None,
) -> list[tuple[Any, ...] | None]:
    """vLLM 0.33's lookahead extra keys: ``(E_i, *tokens after block i)``."""
    out: list[tuple[Any, ...] | None] = []
    for i in range(n_blocks):
        end = (i + 1) * block_size
        ahead = tok[end : end + lookahead].tolist()
        out.append((keys[i] if keys else None, *ahead))
    return out


class BlockHasher:
    """Chained vLLM block hashes of a token sequence for one block size/algorithm.

    ``none_hash_seed`` defaults to what vLLM uses (PYTHONHASHSEED or
    "vllm-none-hash"), read once at construction.
    """

    def __init__(
        self, block_size: int, algo: str = "sha256", none_hash_seed: str | None = None
    ) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise InvalidRequest(f"block_size must be a positive int; got {block_size!r}")
        self.block_size = block_size
        self.algo = algo
        self._fn = hash_fn(algo)
        self.none_hash = none_hash(algo, none_hash_seed)

    def hash_tokens(
        self,
        token_ids: Any,
        *,
        parent: bytes | None = None,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
        max_blocks: int | None = None,
        lookahead_tokens: int = 0,
    ) -> list[bytes]:
        """Digests of every full block of ``token_ids`` (a partial tail is not hashed).

        ``parent`` continues a chain (None starts at NONE_HASH). ``cache_salt``
        (first block only) and ``lora`` ``(name, path)`` build vLLM's extra
        keys; ``extra_keys`` gives them per block explicitly instead.

        ``lookahead_tokens`` (L, vLLM 0.33's ``num_hash_lookahead_tokens``: EAGLE
        or MTP drafters with prefix caching and no KV connector): each block's
        hash also covers the L tokens after it, so a block is hashed only once
        those exist, and its extra keys become ``(E, *next L tokens)`` with ``E``
        the block's extra keys as above (or None). ``token_ids`` then includes
        the lookahead tokens; the hashed blocks' tokens are unchanged.
        """
        if not isinstance(lookahead_tokens, int) or lookahead_tokens < 0:
            raise InvalidRequest(
                f"lookahead_tokens must be a non-negative int; got {lookahead_tokens!r}"
            )
        tok = _as_token_array(token_ids)
        n_blocks = max(tok.size - lookahead_tokens, 0) // self.block_size
        if max_blocks is not None:
            n_blocks = min(n_blocks, max_blocks)
        if extra_keys is not None:
            if cache_salt is not None or lora is not None:
                raise InvalidRequest("give either extra_keys or cache_salt/lora, not both")
            if len(extra_keys) < n_blocks:
                raise InvalidRequest(
                    f"extra_keys has {len(extra_keys)} entries for {n_blocks} blocks"
                )
        if n_blocks == 0:
            return []
        keys = self._extra_keys(n_blocks, cache_salt, lora, extra_keys)
        if lookahead_tokens:
            keys = _lookahead_keys(tok, n_blocks, self.block_size, lookahead_tokens, keys)
        tok = tok[: n_blocks * self.block_size]
        if self.algo == "sha256":
            return self._pickle_chain(tok, n_blocks, parent, keys)
        fast = (
            self.block_size <= _FAST_MAX_BLOCK_TOKENS
            and (parent is None or len(parent) == 32)
            and int(tok.min()) >= 0
            and int(tok.max()) < (1 << 32)
        )
        if fast:
            return self._fast_cbor(tok, n_blocks, parent, keys)
        return self._generic(tok, n_blocks, parent, keys)

    def hash_tokens_int(self, token_ids: Any, **kw: Any) -> np.ndarray:
        """``hash_tokens`` in the int form used by KV events and kvstore (uint64)."""
        return to_int_hashes(self.hash_tokens(token_ids, **kw))

    # -- internals -------------------------------------------------------------

    def _extra_keys(
        self,
        n_blocks: int,
        cache_salt: str | None,
        lora: tuple[str, str] | None,
        extra_keys: Sequence[tuple[Any, ...] | None] | None,
    ) -> list[tuple[Any, ...] | None] | None:
        if extra_keys is not None:
            return list(extra_keys[:n_blocks])
        if cache_salt is None and lora is None:
            return None
        out: list[tuple[Any, ...] | None] = []
        for i in range(n_blocks):
            k: list[Any] = []
            if lora is not None:
                k.append(("lora", lora[0], lora[1]))
            if cache_salt and i == 0:
                k.append(("cache_salt", cache_salt))
            out.append(tuple(k) if k else None)
        return out

    def _generic(
        self,
        tok: np.ndarray,
        n_blocks: int,
        parent: bytes | None,
        keys: list[tuple[Any, ...] | None] | None,
    ) -> list[bytes]:
        fn, bs = self._fn, self.block_size
        ids = tok.tolist()
        prev = parent or self.none_hash
        out: list[bytes] = []
        for i in range(n_blocks):
            prev = fn((prev, tuple(ids[i * bs : (i + 1) * bs]), keys[i] if keys else None))
            out.append(prev)
        return out

    def _pickle_chain(
        self,
        tok: np.ndarray,
        n_blocks: int,
        parent: bytes | None,
        keys: list[tuple[Any, ...] | None] | None,
    ) -> list[bytes]:
        # zip(*[it] * bs) cuts the ids into block tuples in C; what is left
        # per block is one pickle.dumps and one sha256, both C.
        ids = tok[: n_blocks * self.block_size].tolist()
        blocks = zip(*[iter(ids)] * self.block_size, strict=False)
        dumps, sha, proto = pickle.dumps, hashlib.sha256, pickle.HIGHEST_PROTOCOL
        prev = parent or self.none_hash
        out: list[bytes] = []
        append = out.append
        if keys is None:
            for blk in blocks:
                prev = sha(dumps((prev, blk, None), proto)).digest()
                append(prev)
        else:
            for blk, k in zip(blocks, keys, strict=False):
                prev = sha(dumps((prev, blk, k), proto)).digest()
                append(prev)
        return out

    def _fast_cbor(
        self,
        tok: np.ndarray,
        n_blocks: int,
        parent: bytes | None,
        keys: list[tuple[Any, ...] | None] | None,
    ) -> list[bytes]:
        rec, lens = _cbor_token_records(tok)
        # [parent (bytes 32), [tokens], extra_keys]
        prefix = b"\x83\x58\x20" + bytes(32) + _cbor_head(4, self.block_size)
        msgs, starts = _layout(rec, lens, self.block_size, n_blocks, prefix, b"\xf6")

        def generic(prev: bytes, i: int) -> bytes:
            bs = self.block_size
            ids = tuple(tok[i * bs : (i + 1) * bs].tolist())
            return sha256_cbor((prev, ids, keys[i] if keys else None))

        return _chain(msgs, starts, 3, parent or self.none_hash, keys, generic)


def _layout(
    rec: np.ndarray, lens: np.ndarray, bs: int, n_blocks: int, prefix: bytes, suffix: bytes
) -> tuple[np.ndarray, np.ndarray]:
    """All blocks' messages, back to back: ``prefix + tokens_i + suffix`` each.

    ``rec``/``lens`` are the per-token encodings (see ``_cbor_token_records``).
    Returns the buffer and the start offset of each message (len n_blocks+1).
    One padded matrix (a row per block: prefix, 5 bytes per token, suffix) and
    one boolean compress: a per-byte scatter costs ~3x more here.
    """
    n = n_blocks * bs
    lens = lens[:n]
    p, q = len(prefix), len(suffix)
    width = p + 5 * bs + q
    rows = np.empty((n_blocks, width), dtype=np.uint8)
    rows[:, :p] = np.frombuffer(prefix, dtype=np.uint8)
    rows[:, p : p + 5 * bs] = rec[:n].reshape(n_blocks, 5 * bs)
    if q:
        rows[:, p + 5 * bs :] = np.frombuffer(suffix, dtype=np.uint8)
    keep = np.ones((n_blocks, width), dtype=bool)
    keep[:, p : p + 5 * bs] = (np.arange(5, dtype=np.int64) < lens[:, None]).reshape(
        n_blocks, 5 * bs
    )
    msgs = rows[keep]
    starts = np.zeros(n_blocks + 1, dtype=np.int64)
    np.cumsum(lens.reshape(n_blocks, bs).sum(axis=1) + (p + q), out=starts[1:])
    return msgs, starts


def _chain(
    msgs: np.ndarray,
    starts: np.ndarray,
    parent_at: int,
    prev: bytes,
    keys: list[tuple[Any, ...] | None] | None,
    generic: Callable[[bytes, int], bytes],
) -> list[bytes]:
    """Hash each message after writing the previous digest into its parent slot."""
    buf = memoryview(msgs.data).cast("B")
    sha = hashlib.sha256
    pos = starts.tolist()
    out: list[bytes] = []
    for i in range(len(pos) - 1):
        if keys is not None and keys[i] is not None:
            prev = generic(prev, i)
        else:
            p = pos[i]
            buf[p + parent_at : p + parent_at + 32] = prev
            prev = sha(buf[p : pos[i + 1]]).digest()
        out.append(prev)
    return out
