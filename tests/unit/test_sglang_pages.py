"""kvstore_connectors.sglang without SGLang: page runs, zero-copy copies, keys, namespaces."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore_connectors.sglang.identity import namespace_spec  # noqa: E402
from kvstore_connectors.sglang.keys import key_to_block_hash, page_hashes  # noqa: E402
from kvstore_connectors.sglang.pages import PageLayout, pages_to_region, region_to_pages  # noqa: E402

# The page views SGLang's host pools hand out (get_data_page(i, flat=False)).
VIEWS = {
    "mha layer_first": lambda b: b[:, :, 8:12],  # (2, L, size, H, D)
    "mha page_first": lambda b: b.permute(0, 2, 1, 3, 4)[:, 8:12],  # (2, size, L, H, D)
    "mla layer_first": lambda b: b[0, :, 8:12],  # (L, size, 1, D)
    "whole": lambda b: b,
}


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_runs_read_the_view_in_flatten_order(name):
    buf = torch.arange(2 * 3 * 16 * 2 * 8, dtype=torch.int16).reshape(2, 3, 16, 2, 8)
    view = VIEWS[name](buf)
    layout = PageLayout.of_view(view)
    assert layout.page_bytes == view.numel() * view.element_size()
    region = np.zeros(3 * layout.page_bytes, dtype=np.uint8)
    offsets = np.array([layout.page_bytes * 2], dtype=np.int64)
    pages_to_region(layout, [view.data_ptr()], region.ctypes.data, offsets)
    want = view.flatten().view(torch.uint8).numpy()
    assert bytes(region[offsets[0] :]) == want.tobytes()
    # ...and back into another place of the same shape, strides kept.
    other = torch.zeros_like(buf)
    dst = VIEWS[name](other)
    region_to_pages(layout, [dst.data_ptr()], region.ctypes.data, offsets)
    assert torch.equal(dst, view)
    untouched = other.flatten().count_nonzero() - dst.flatten().count_nonzero()
    assert untouched == 0  # nothing outside the page was written


def test_page_hashes_follow_sglangs_chained_sha256():
    tokens = list(range(10))
    keys = page_hashes(tokens, None, 4)
    assert len(keys) == 3  # a short last page is hashed as it is
    first = hashlib.sha256(np.array(tokens[:4], "<u4").tobytes()).digest()
    second = hashlib.sha256(first + np.array(tokens[4:8], "<u4").tobytes()).digest()
    assert keys[:2] == [first.hex(), second.hex()]
    assert page_hashes(tokens[4:], keys[0], 4)[0] == keys[1]  # resumes from a prior hash
    with pytest.raises(ValueError, match="uint32"):
        page_hashes([2**32], None, 4)


def test_block_hash_is_the_64_bits_sglang_events_carry():
    key = page_hashes([1, 2, 3, 4], None, 4)[0]
    signed = int(key[:16], 16)
    signed = signed - (1 << 64) if signed >= 1 << 63 else signed  # hash_str_to_int64
    assert key_to_block_hash(key) == signed % (1 << 64)
    # Other strings (sidecar suffixes, names) still get a spread-out 64-bit value.
    assert key_to_block_hash(key + ".mamba") != key_to_block_hash(key)
    assert 0 <= key_to_block_hash("x") < 1 << 64


def _cfg(**kw):
    base = dict(
        tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, dcp_rank=0, dcp_size=1, should_split_heads=False,
    )  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def _pool(**kw):
    base = dict(page_size=4, layer_num=3, head_num=2, head_dim=32, dtype=torch.bfloat16,
                layout="page_first", storage_format_tag=None)  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def test_namespace_separates_layouts_ranks_and_pools_but_not_dp_groups():
    def spec(cfg=None, pool=None, name="kv"):
        return namespace_spec(
            cfg or _cfg(), pool or _pool(), pool_name=name, page_bytes=1536, model="m"
        )

    base = spec()
    assert (base.tp_rank, base.tp_world_size, base.block_size_tokens) == (1, 2, 4)
    different = [
        spec(cfg=_cfg(tp_rank=0)),
        spec(cfg=_cfg(pp_size=2, pp_rank=1)),
        spec(cfg=_cfg(attn_cp_size=2, attn_cp_rank=1)),
        spec(pool=_pool(layout="page_first_direct")),
        spec(pool=_pool(page_size=8)),
        spec(pool=_pool(dtype=torch.float16)),
        spec(name="mamba"),
        spec(cfg=_cfg(is_mla_model=True)),
    ]
    ids = {s.namespace_id() for s in different}
    assert len(ids) == len(different) and base.namespace_id() not in ids
    assert spec(cfg=_cfg(dp_rank=3)).namespace_id() == base.namespace_id()
    # MLA KV is rank-replicated: one namespace over TP ranks; a Mamba pool is not.
    mla = [spec(cfg=_cfg(is_mla_model=True, tp_rank=r)) for r in (0, 1)]
    assert mla[0].namespace_id() == mla[1].namespace_id()
    mamba = [spec(cfg=_cfg(is_mla_model=True, tp_rank=r), name="mamba") for r in (0, 1)]
    assert mamba[0].namespace_id() != mamba[1].namespace_id()
