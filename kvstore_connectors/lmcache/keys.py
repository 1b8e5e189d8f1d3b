"""LMCache keys -> kvstore namespaces and block hashes (no LMCache import).

A ``CacheEngineKey`` names a chunk by model, world size, worker id, the
chunk's chained hash, its dtype and the request's ``lmcache.tag.*`` tags
(where LMCache carries per-user isolation such as a ``cache_salt``). Here:

- everything but the hash selects the namespace: model, rank (worker id /
  world size as the namespace's tp rank / world size), the engine's KV
  layout, and the tags as the tenant. Two tenants' keys land in two
  namespaces, so they never share a block even when their hashes agree;
- the chunk hash becomes the block's 64-bit hash (ints: the low 64 bits;
  bytes: the last 8, big-endian, as llm-d reads byte hashes).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from kvstore.namespace import MAX_NAME_CHARS, NamespaceSpec

U64_MASK = (1 << 64) - 1
# Bumped when the bytes a slot holds change meaning (kvstore_connectors.lmcache.blocks).
LAYOUT_VERSION = 1


def block_hash(chunk_hash: int | bytes) -> int:
    """The kvstore block hash of an LMCache chunk hash."""
    if isinstance(chunk_hash, bytes | bytearray):
        return int.from_bytes(bytes(chunk_hash[-8:]), "big")
    return int(chunk_hash) & U64_MASK


def tenant_of(tags: Iterable[tuple[str, object]] | None) -> str:
    """The namespace tenant of a key's tags: "" without tags, else "k=v&k=v" sorted
    (a digest when that would not fit the daemon's name limit)."""
    if not tags:
        return ""
    text = "&".join(f"{k}={v}" for k, v in sorted((str(k), str(v)) for k, v in tags))
    if len(text) <= MAX_NAME_CHARS:
        return text
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """What an engine's chunks look like: fixed for one LMCache engine."""

    dtype: str
    chunk_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_bytes: int  # one slot: header + the largest chunk (kvstore_connectors.lmcache.blocks)
    shapes: str  # the full chunk's shapes and dtypes as LMCache lists them
    fmt: str  # LMCache's MemoryFormat name (KV_2LTD, KV_MLA_FMT...)

    def layout(self) -> str:
        return f"lmcache/v{LAYOUT_VERSION};fmt={self.fmt};shapes={self.shapes}"

    def spec(self, model: str, world_size: int, worker_id: int, tenant: str) -> NamespaceSpec:
        return NamespaceSpec(
            model=model,
            dtype=self.dtype,
            block_size_tokens=self.chunk_tokens,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_bytes=self.block_bytes,
            tp_rank=worker_id,
            tp_world_size=world_size,
            tenant=tenant,
            layout=self.layout(),
        )
