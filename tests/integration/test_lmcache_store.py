"""kvstore_connectors.lmcache's daemon link (store, blocks, keys) against a real daemon, in
the main venv: no LMCache needed (the LMCache side: test_lmcache.py)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kvstore import errors
from kvstore.client import Client
from kvstore.namespace import MAX_NAME_CHARS
from kvstore_connectors.lmcache.blocks import PREFIX_BYTES, read_block, slot_bytes, write_block
from kvstore_connectors.lmcache.keys import ChunkLayout, block_hash, tenant_of
from kvstore_connectors.lmcache.store import Chunk, ChunkStore, PutReport

META = 28  # LMCache's RemoteMetadata for one group
FULL = 2048


def layout() -> ChunkLayout:
    return ChunkLayout(
        dtype="float16",
        chunk_tokens=16,
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        block_bytes=slot_bytes(META, FULL),
        shapes="float16[2, 2, 16, 16]",
        fmt="KV_2LTD",
    )


def chunk(spec, h: int, nbytes: int = FULL) -> Chunk:
    rng = np.random.default_rng(h)
    meta = rng.integers(0, 256, META, dtype=np.uint8).tobytes()
    return Chunk(spec, h, meta, rng.integers(0, 256, nbytes, dtype=np.uint8))


def made(meta: bytes, payload: np.ndarray) -> tuple[bytes, bytes]:
    return meta, payload.tobytes()


@pytest.mark.parametrize("map_region", [True, False], ids=["region", "inline"])
def test_chunks_round_trip_with_prefix_semantics_across_namespaces(daemon, map_region):
    a = layout().spec("m", 1, 0, "")
    b = layout().spec("m", 1, 0, "cache_salt=t1")
    assert a.namespace_id() != b.namespace_id()
    store = ChunkStore(daemon.address, meta_bytes=META, map_region=map_region)
    try:
        run_a = [chunk(a, h) for h in (11, 12)]
        run_b = [chunk(b, 21), chunk(b, 22, nbytes=FULL // 4)]  # a partial last chunk
        assert store.put(run_a + run_b[:1]).stored == 3
        assert store.put(run_a).stored == 0  # already there: skipped, not rewritten
        keys = [(c.spec, c.block_hash) for c in run_a + run_b]
        assert store.prefix(keys) == 3  # stops at the first missing one
        assert store.put(run_b).stored == 1
        assert store.prefix(keys) == 4
        # same hash, other tenant: a miss
        assert store.prefix([(b, 11)]) == 0

        dropped: list[object] = []
        got = store.get(keys, made, dropped.append)
        assert got == [(c.meta, c.payload.tobytes()) for c in run_a + run_b]
        assert not dropped
        # make() saying "no memory" stops the prefix there
        assert store.get(keys, lambda m, p: None, dropped.append) == []
        # a key run per namespace: b's run reversed is found whole, a's then too
        rev = list(reversed(keys))
        assert store.get(rev, made, dropped.append) == [
            (c.meta, c.payload.tobytes()) for c in reversed(run_a + run_b)
        ]
        assert store.delete(keys[:1]) == 1
        assert store.prefix(keys) == 0
    finally:
        store.close()


def test_a_slot_without_the_header_is_a_miss_and_a_warning_not_bytes(daemon, caplog):
    spec = layout().spec("m", 1, 0, "")
    with Client(daemon.address) as c:
        ns = c.declare_namespace(spec)
        c.put(ns, [5], np.full((1, ns.block_bytes), 7, np.uint8))  # not an LMCache chunk
    store = ChunkStore(daemon.address, meta_bytes=META)
    try:
        assert store.prefix([(spec, 5)]) == 1
        with caplog.at_level(logging.WARNING):
            assert store.get([(spec, 5)], made, lambda x: None) == []
        assert "unreadable LMCache chunk" in caplog.text
    finally:
        store.close()


def test_daemon_gone_means_misses_and_one_warning(tmp_path, caplog):
    spec = layout().spec("m", 1, 0, "")
    store = ChunkStore(f"unix:{tmp_path}/none.sock", meta_bytes=META, timeout_s=0.5)
    with caplog.at_level(logging.WARNING):
        assert store.put([chunk(spec, 1)]) == PutReport(0, False)
        assert store.prefix([(spec, 1)]) == 0
        assert store.get([(spec, 1)], made, lambda x: None) == []
    assert caplog.text.count("unusable") == 1
    store.close()


def test_block_header_checks():
    slot = np.zeros(slot_bytes(META, 64), np.uint8)
    payload = np.arange(40, dtype=np.uint8)
    write_block(slot, b"m" * META, payload)
    meta, got = read_block(slot, META)
    assert meta == b"m" * META and got.tobytes() == payload.tobytes()
    with pytest.raises(errors.InvalidRequest, match="does not fit"):
        write_block(slot, b"m" * META, np.zeros(65, np.uint8))
    slot[:4] = 0
    with pytest.raises(errors.DataCorruption, match="magic"):
        read_block(slot, META)
    write_block(slot, b"m" * META, payload)
    slot[8:16] = np.frombuffer((10**6).to_bytes(8, "little"), np.uint8)
    with pytest.raises(errors.DataCorruption, match="payload bytes"):
        read_block(slot, META)
    assert PREFIX_BYTES == 16


def test_keys_map_hashes_and_tenants():
    assert block_hash(-1) == 2**64 - 1
    assert block_hash(2**70 + 5) == 5
    assert block_hash(b"\x00" * 24 + (7).to_bytes(8, "big")) == 7
    assert tenant_of(None) == tenant_of(()) == ""
    assert tenant_of((("b", 2), ("a", "x"))) == tenant_of((("a", "x"), ("b", 2))) == "a=x&b=2"
    long = tenant_of((("cache_salt", "s" * 400),))
    assert long.startswith("sha256:") and len(long) <= MAX_NAME_CHARS
    spec = layout().spec("m", 4, 3, "a=x")
    assert (spec.tp_rank, spec.tp_world_size, spec.tenant) == (3, 4, "a=x")
    assert spec.layout.startswith("lmcache/v1;fmt=KV_2LTD")
