"""Namespaces from the engine's configuration: one per (KV layout, tenant).

A block is only meaningful to an engine with the same model, KV dtype, block
size, layer/head geometry, parallel rank and physical page layout, so all of
these go into the namespace the daemon keys blocks under; vLLM's
``cache_salt`` is the tenant, so tenants never see each other's blocks even if
their hashes matched. The scheduler and every worker derive the same spec from
the same engine config (the scheduler looks up TP rank 0's namespace; each
worker loads and stores its own rank's).
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvstore.namespace import NamespaceSpec, layout_with_hash_seed

# The bytes of one stored block are every layer's pages of that block, layer
# by layer in the model's order; within a layer, the engine's own page bytes
# (``kvstore_connectors.vllm.copier``). Bump when that serialisation changes.
BLOCK_FORMAT = "kvstore-pages-v1"


class EngineLayout(msgspec.Struct, frozen=True, kw_only=True):
    """What fixes the bytes of one block, for one model shard."""

    model: str
    dtype: str
    block_size_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_bytes: int
    page_layout: str  # the engine's physical page layout, e.g. "vllm-cpu-LBHNC"
    tp_rank: int = 0
    tp_world_size: int = 1
    pp_rank: int = 0
    pp_world_size: int = 1
    hash_seed: str = ""  # kvstore_connectors.vllm.hashes.hash_seed_fingerprint; "" = not told
    # vLLM 0.33's num_hash_lookahead_tokens as this engine's block hashes use it
    # (recorded in the layout: kvstore.namespace.layout_hash_scheme)
    hash_lookahead_tokens: int = 0

    def for_rank(self, *, tp_rank: int, pp_rank: int) -> EngineLayout:
        return msgspec.structs.replace(self, tp_rank=tp_rank, pp_rank=pp_rank)

    def spec(self, tenant: str | None) -> NamespaceSpec:
        return NamespaceSpec(
            model=self.model,
            dtype=self.dtype,
            block_size_tokens=self.block_size_tokens,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_bytes=self.block_bytes,
            tp_rank=self.tp_rank,
            tp_world_size=self.tp_world_size,
            pp_rank=self.pp_rank,
            pp_world_size=self.pp_world_size,
            tenant=tenant or "",
            # Engines seeded differently get different namespaces (they could never
            # share a block anyway), so the daemon sees and reports the mismatch.
            layout=layout_with_hash_seed(
                f"{BLOCK_FORMAT}/{self.page_layout}", self.hash_seed, self.hash_lookahead_tokens
            ),
        )


def dtype_name(dtype: Any) -> str:
    """'float16' for torch.float16 or 'float16'; KV dtypes only."""
    name = str(dtype)
    return name.removeprefix("torch.")
