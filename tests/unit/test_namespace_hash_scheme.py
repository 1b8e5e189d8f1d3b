"""The namespace layout records the engine's hash scheme (algorithm, lookahead L),
additively: layouts written before it parse as the legacy scheme and keep their ids."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidRequest
from kvstore.hashing import HashScheme
from kvstore.namespace import (
    NamespaceSpec,
    layout_hash_scheme,
    layout_hash_seed,
    layout_with_hash_seed,
)
from kvstore_connectors.vllm.namespace import EngineLayout

LAYOUT = dict(
    model="m",
    dtype="float32",
    block_size_tokens=32,
    num_layers=2,
    num_kv_heads=2,
    head_dim=32,
    block_bytes=32768,
    page_layout="vllm-cpu-LBHNC",
)


def test_layouts_from_before_the_scheme_parse_as_legacy() -> None:
    old = "kvstore-pages-v1/vllm-cpu-LBHNC;hash=sha256_cbor:0123456789ab"
    assert layout_hash_scheme(old) == HashScheme("sha256_cbor", 0)
    assert layout_hash_scheme("kvstore-pages-v1/vllm-cpu-LBHNC") is None  # not told
    # the legacy scheme writes exactly the old string: same namespace id as before
    assert (
        layout_with_hash_seed("kvstore-pages-v1/vllm-cpu-LBHNC", "sha256_cbor:0123456789ab") == old
    )


def test_lookahead_is_recorded_and_old_readers_still_read_the_seed() -> None:
    lay = layout_with_hash_seed("base", "sha256:aaaaaaaaaaaa", lookahead_tokens=4)
    assert lay == "base;lookahead=4;hash=sha256:aaaaaaaaaaaa"
    assert layout_hash_scheme(lay) == HashScheme("sha256", 4)
    assert layout_hash_seed(lay) == "sha256:aaaaaaaaaaaa"  # what a reader of ";hash=" sees


def test_the_connector_records_its_scheme_and_schemes_never_share_a_namespace() -> None:
    legacy = EngineLayout(**LAYOUT, hash_seed="sha256:aaaaaaaaaaaa").spec(None)  # type: ignore[arg-type]
    ahead = EngineLayout(  # type: ignore[arg-type]
        **LAYOUT, hash_seed="sha256:aaaaaaaaaaaa", hash_lookahead_tokens=3
    ).spec(None)
    assert layout_hash_scheme(legacy.layout) == HashScheme("sha256", 0)
    assert layout_hash_scheme(ahead.layout) == HashScheme("sha256", 3)
    assert legacy.namespace_id() != ahead.namespace_id()


def test_bad_scheme_records_are_refused_precisely() -> None:
    with pytest.raises(InvalidRequest, match="lookahead must be a positive int"):
        layout_hash_scheme("base;lookahead=x;hash=sha256:aa")
    with pytest.raises(InvalidRequest, match="unknown hash algorithm 'md5'"):
        layout_hash_scheme("base;hash=md5:aa")
    with pytest.raises(InvalidRequest, match="needs the hash-seed fingerprint"):
        layout_with_hash_seed("base", "", lookahead_tokens=2)
    with pytest.raises(InvalidRequest, match="already carries"):
        layout_with_hash_seed("base;hash=sha256:aa", "sha256:bb")
    with pytest.raises(InvalidRequest, match="lookahead_tokens must be"):
        layout_with_hash_seed("base", "sha256:aa", lookahead_tokens=-1)
    spec = NamespaceSpec(
        model="m",
        dtype="float32",
        block_size_tokens=32,
        num_layers=2,
        num_kv_heads=2,
        head_dim=32,
        block_bytes=1024,
        layout="base;lookahead=0;hash=sha256:aa",
    )
    with pytest.raises(InvalidRequest, match=r"bad namespace spec: .*lookahead"):
        spec.validate(1 << 20)
