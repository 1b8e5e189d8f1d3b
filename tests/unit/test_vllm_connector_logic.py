"""The vLLM connector's own logic without vLLM: config, hashes, namespaces."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import ConfigError
from kvstore.hashing import BlockHasher, to_int_hash
from kvstore_connectors.vllm.config import DEFAULT_ADDRESS, ConnectorConfig
from kvstore_connectors.vllm.hashes import RequestHashes, block_hash_stride
from kvstore_connectors.vllm.namespace import EngineLayout, dtype_name


def test_config_defaults_and_overrides(monkeypatch):
    monkeypatch.delenv("KVSTORE_ADDRESS", raising=False)
    config = ConnectorConfig.from_extra(None)
    assert config.resolved_address() == DEFAULT_ADDRESS
    monkeypatch.setenv("KVSTORE_ADDRESS", "unix:/run/k.sock")
    assert config.resolved_address() == "unix:/run/k.sock"
    config = ConnectorConfig.from_extra(
        {"address": "127.0.0.1:5", "timeout_s": 0.2, "save_decode": False}
    )
    assert (config.resolved_address(), config.timeout_s, config.save_decode) == (
        "127.0.0.1:5",
        0.2,
        False,
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"adress": "x"}, "unknown field `adress`"),
        ({"timeout_s": "fast"}, "Expected `float`"),
        ({"timeout_s": 0}, "timeout_s must be > 0"),
        ({"retry_initial_s": 5, "retry_max_s": 1}, "retry_initial_s <= retry_max_s"),
        ({"min_hit_blocks": 0}, "min_hit_blocks must be >= 1"),
    ],
)
def test_config_errors_are_precise(extra, message):
    with pytest.raises(ConfigError, match="kv_connector_extra_config") as info:
        ConnectorConfig.from_extra(extra)
    assert message in str(info.value)


def test_request_hashes_are_the_event_int_form_of_vllm_digests():
    ids = list(range(100, 100 + 16 * 5 + 7))
    digests = BlockHasher(16).hash_tokens(ids)
    hashes = RequestHashes(stride=1)
    assert hashes.update(digests[:2]).tolist() == [to_int_hash(d) for d in digests[:2]]
    # Growing lists convert only the new part; the result is the whole list.
    assert hashes.update(digests).tolist() == [to_int_hash(d) for d in digests]
    assert hashes.update(digests).dtype == np.uint64


def test_request_hashes_with_coarser_kv_blocks_take_the_last_chunk():
    # vLLM hashes 16-token chunks; a 32-token KV block's key is its second chunk's hash,
    # which chains over the whole prefix (vLLM's BlockHashListWithBlockSize).
    ids = list(range(7, 7 + 16 * 7))
    chunks = BlockHasher(16).hash_tokens(ids)
    hashes = RequestHashes(stride=block_hash_stride(32, 16))
    assert hashes.update(chunks).tolist() == [to_int_hash(chunks[i]) for i in (1, 3, 5)]


def test_request_hashes_restart_when_vllm_rewrites_the_list():
    a = BlockHasher(16).hash_tokens(list(range(64)))
    b = BlockHasher(16).hash_tokens(list(range(1, 65)))
    hashes = RequestHashes(stride=1)
    hashes.update(a)
    assert hashes.update(b[:3]).tolist() == [to_int_hash(d) for d in b[:3]]
    assert hashes.update(b[:1]).tolist() == [to_int_hash(b[0])]


def test_block_hash_stride_rejects_misaligned_sizes():
    with pytest.raises(ValueError, match="not a multiple"):
        block_hash_stride(48, 32)


def _layout(**kw) -> EngineLayout:
    fields = dict(
        model="m",
        dtype=dtype_name("torch.float32"),
        block_size_tokens=32,
        num_layers=2,
        num_kv_heads=2,
        head_dim=32,
        block_bytes=32768,
        page_layout="vllm-cpu-LBHNC",
        tp_world_size=2,
    )
    fields.update(kw)
    return EngineLayout(**fields)  # type: ignore[arg-type]


def test_namespaces_separate_tenants_ranks_and_layouts():
    layout = _layout()
    base = layout.spec(None)
    assert base.dtype == "float32" and base.tenant == "" and base.layout.endswith("vllm-cpu-LBHNC")
    assert layout.spec("") == base
    ids = {
        base.namespace_id(),
        layout.spec("tenant-a").namespace_id(),
        layout.spec("tenant-b").namespace_id(),
        layout.for_rank(tp_rank=1, pp_rank=0).spec(None).namespace_id(),
        _layout(page_layout="vllm-cuda-NHD").spec(None).namespace_id(),
        _layout(dtype="bfloat16").spec(None).namespace_id(),
    }
    assert len(ids) == 6
    # The same engine config gives the same id in every process (scheduler and workers).
    assert _layout().spec("tenant-a").namespace_id() == layout.spec("tenant-a").namespace_id()


@pytest.mark.parametrize("python_blocks", [64, 0])  # Python ints / numpy
def test_chain_order_splits_chains_and_puts_parents_first(monkeypatch, python_blocks):
    from kvstore_connectors.vllm import worker
    from kvstore_connectors.vllm.worker import chain_order

    monkeypatch.setattr(worker, "PYTHON_CHAIN_BLOCKS", python_blocks)

    u = lambda *xs: np.array(xs, dtype=np.uint64)  # noqa: E731
    # A step's kept blocks: request A's blocks 2-3 (parent 11), then B's blocks
    # 0-1 (A's 2-3 again were dropped as copies), then C's own chain, then a
    # block of A whose predecessor was not stored this time (a gap).
    hashes = u(12, 13, 10, 11, 20, 21, 15)
    parents = u(11, 12, 0, 10, 0, 20, 14)
    has_parent = np.array([1, 1, 0, 1, 0, 1, 1], dtype=bool)
    perm, chains = chain_order(hashes, parents, has_parent)
    assert hashes[perm].tolist() == [10, 11, 12, 13, 20, 21, 15]
    assert chains == [(2, None), (2, 11), (2, None), (1, 14)]
    perm, chains = chain_order(u(), u(), np.zeros(0, dtype=bool))
    assert perm.tolist() == [] and chains == []
    # colliding hashes that form a cycle of chains end the walk instead of looping
    has = np.array([1, 1, 0, 1, 1], dtype=bool)
    perm, chains = chain_order(u(1, 3, 7, 5, 6), u(6, 1, 0, 3, 5), has)
    assert perm.tolist() == [3, 4, 0, 1, 2] and chains == [(2, 3), (2, 6), (1, None)]


@pytest.mark.parametrize("seed", range(6))
def test_a_steps_save_batch_keeps_each_block_once_with_its_own_parent_and_tokens(seed):
    """_SaveBatch.of over several requests' saves (decode steps: one block each;
    shared prefixes: the same block from two requests): each hash once, at its
    first request, with that request's parent and that block's tokens."""
    from kvstore_connectors.vllm.metadata import SaveSpec
    from kvstore_connectors.vllm.worker import _SaveBatch

    rng = np.random.default_rng(seed)
    bs = 4
    specs = []
    for r in range(int(rng.integers(1, 9))):
        n = int(rng.integers(1, 4))
        hashes = rng.choice(np.arange(1, 12, dtype=np.uint64), n, replace=False)
        parent = None if rng.integers(0, 3) == 0 else int(rng.integers(100, 200))
        specs.append(
            SaveSpec(
                f"r{r}",
                "t",
                rng.integers(0, 500, n).astype(np.int64),
                hashes,
                parent,
                (hashes.astype(np.int32)[:, None] * 10 + np.arange(bs, dtype=np.int32)).reshape(-1),
            )
        )
    want: dict[int, tuple[int, int, bool]] = {}  # hash -> (block id, parent, has parent)
    for s in specs:
        parent = s.parent_block_hash
        for h, b in zip(s.block_hashes.tolist(), s.block_ids.tolist(), strict=True):
            want.setdefault(h, (b, 0 if parent is None else parent, parent is not None))
            parent = h
    got = _SaveBatch.of("t", specs, bs)
    assert got.block_hashes.dtype == np.uint64 and got.block_ids.dtype == np.int64
    assert got.block_hashes.tolist() == list(want)
    assert got.block_ids.tolist() == [w[0] for w in want.values()]
    assert got.has_parent.tolist() == [w[2] for w in want.values()]
    assert [p for p, w in zip(got.parents.tolist(), want.values(), strict=True) if w[2]] == [
        w[1] for w in want.values() if w[2]
    ]
    assert got.token_ids.reshape(-1, bs).tolist() == [[h * 10 + k for k in range(bs)] for h in want]


def test_chain_order_is_the_same_in_python_ints_and_numpy(monkeypatch):
    """Random steps of chains that continue each other, in shuffled order, with
    gaps and repeated hashes: both ways give the same permutation and chains."""
    from kvstore_connectors.vllm import worker

    rng = np.random.default_rng(5)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        hashes = rng.integers(1, 60, n).astype(np.uint64)
        parents = np.where(rng.random(n) < 0.6, np.roll(hashes, 1), rng.integers(1, 60, n))
        parents = parents.astype(np.uint64)
        has_parent = rng.random(n) < 0.8
        answers = []
        for python_blocks in (64, 0):
            monkeypatch.setattr(worker, "PYTHON_CHAIN_BLOCKS", python_blocks)
            perm, chains = worker.chain_order(hashes, parents, has_parent)
            answers.append((perm.tolist(), chains))
        assert answers[0] == answers[1]
        assert sorted(answers[0][0]) == list(range(n))
