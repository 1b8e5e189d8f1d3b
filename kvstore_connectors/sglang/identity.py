"""Which kvstore namespace an SGLang host pool's pages go in.

A page is only meaningful to an engine whose model, KV dtype, page size,
geometry, parallel shard and physical page byte order match, so all of these
go into the namespace (``NamespaceSpec``), as they do for vLLM:

- model, dtype, page size (``block_size_tokens``), layers, heads, head dim,
  page bytes;
- TP rank and size for TP-sharded KV; MLA KV is replicated over the TP ranks
  (SGLang's ``is_mla_model``), so MLA ranks share one namespace (rank 0/1),
  as SGLang's own file backend shares one file per page. A Mamba pool is
  TP-sharded even in an MLA model;
- PP rank and size, attention-CP and decode-CP rank and size (each holds a
  disjoint slice of every page);
- the layout string: the host pool's class and memory layout (``layer_first``,
  ``page_first``, ``page_first_direct``... serialise one page in different
  orders at equal sizes), the pool name (kv, mamba, draft...), the pool's own
  ``storage_format_tag`` and the MLA flag;
- a tenant from the extra config (``kvstore_tenant``), so tenants never share.

The DP rank is left out on purpose: with DP attention each DP group computes
the same KV shard for the same attention-TP rank with the same weights, so the
bytes are equal and sharing them across DP groups is what a shared cache is
for (SGLang puts ``dp_rank`` into file paths only so two writers never write
one file at once; kvstore's store leases already make concurrent stores of one
block safe).
"""

from __future__ import annotations

from typing import Any

from kvstore.namespace import NamespaceSpec

# The bytes of a block: one host page in the pool's flat-page order
# (kvstore_connectors.sglang.pages). Bump when that changes.
BLOCK_FORMAT = "sglang-hicache-page-v1"
KV_POOL = "kv"
# Pools whose state is TP-sharded even when the model's KV is MLA-replicated.
_TP_SHARDED_POOLS = frozenset({"mamba"})


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def namespace_spec(
    storage_config: Any,
    host_pool: Any,
    *,
    pool_name: str,
    page_bytes: int,
    model: str,
    tenant: str = "",
) -> NamespaceSpec:
    """The namespace of ``host_pool``'s pages for one engine rank (duck-typed:
    ``storage_config`` is SGLang's HiCacheStorageConfig, ``host_pool`` a HostKVCache)."""
    cfg = storage_config
    replicated = bool(cfg.is_mla_model) and pool_name not in _TP_SHARDED_POOLS
    tp_rank, tp_size = (0, 1) if replicated else (int(cfg.tp_rank), int(cfg.tp_size))
    heads = getattr(host_pool, "head_num", None) or 1
    head_dim = getattr(host_pool, "head_dim", None) or getattr(host_pool, "kv_cache_dim", None) or 1
    layout_parts = [
        BLOCK_FORMAT,
        type(host_pool).__name__,
        str(getattr(host_pool, "layout", "")),
        f"pool={pool_name}",
        f"mla={int(bool(cfg.is_mla_model))}",
        f"cp={getattr(cfg, 'attn_cp_rank', 0)}/{getattr(cfg, 'attn_cp_size', 1)}",
        f"dcp={getattr(cfg, 'dcp_rank', 0)}/{getattr(cfg, 'dcp_size', 1)}",
    ]
    fmt = getattr(host_pool, "storage_format_tag", None)
    if fmt:
        layout_parts.append(f"fmt={fmt}")
    if getattr(cfg, "should_split_heads", False):
        layout_parts.append(f"split_heads_lcm={cfg.tp_lcm_size}")
    return NamespaceSpec(
        model=model,
        dtype=dtype_name(getattr(host_pool, "dtype", "uint8")),
        block_size_tokens=int(host_pool.page_size),
        num_layers=int(getattr(host_pool, "layer_num", 1) or 1),
        num_kv_heads=int(heads),
        head_dim=int(head_dim),
        block_bytes=int(page_bytes),
        tp_rank=tp_rank,
        tp_world_size=tp_size,
        pp_rank=int(cfg.pp_rank),
        pp_world_size=int(cfg.pp_size),
        tenant=tenant,
        layout="/".join(layout_parts),
    )
