"""kvstore.hashing: vLLM's chained block hash, checked against its definition.

The reference is the definition itself (sha256 over pickle protocol 5 /
canonical CBOR of ``(parent, tuple(tokens), extra_keys)``) computed with the
standard library, plus pinned vectors so a silent change of either side
shows; the ``vllm`` tests compare against vLLM's own functions.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import InvalidRequest
from kvstore.hashing import (
    SHORT_DIGESTS,
    BlockHasher,
    cbor_dumps,
    hash_block,
    none_hash,
    to_int_hash,
    to_int_hashes,
)
from tests.vllm_python import vllm_python


def ref_pickle(parent: bytes, tokens: list[int], extra=None) -> bytes:
    return hashlib.sha256(pickle.dumps((parent, tuple(tokens), extra), protocol=5)).digest()


# Pinned: sha256(pickle.dumps("vllm-none-hash", protocol=5)) and the first
# block of tokens 0..15 under it (computed once with the stdlib reference).
NONE_HASH_SHA256 = "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
NONE_HASH_CBOR = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"


def test_none_hash_matches_the_definition_and_pinned_vector(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    expected = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
    assert none_hash("sha256") == expected
    assert expected.hex() == NONE_HASH_SHA256
    assert none_hash("sha256_cbor").hex() == NONE_HASH_CBOR
    # CBOR of a text string: major type 3, length 14
    assert none_hash("sha256_cbor") == hashlib.sha256(b"\x6e" + b"vllm-none-hash").digest()


def test_pythonhashseed_seeds_none_hash(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert none_hash("sha256") == hashlib.sha256(pickle.dumps("42", protocol=5)).digest()
    assert BlockHasher(4).none_hash == none_hash("sha256", "42")


def test_chain_matches_reference_for_edge_token_values():
    # every pickle int opcode boundary: BININT1 / BININT2 / BININT and negatives
    edge = [0, 1, 255, 256, 65535, 65536, 2**31 - 1, -1, -(2**31), 7, 300, 70000]
    tokens = (edge * 8)[:96]
    for bs in (1, 2, 3, 4, 5, 16):
        h = BlockHasher(bs)
        got = h.hash_tokens(tokens)
        prev = none_hash()
        want = []
        for i in range(len(tokens) // bs):
            prev = ref_pickle(prev, tokens[i * bs : (i + 1) * bs])
            want.append(prev)
        assert got == want, bs


def test_large_random_prompt_fast_path_equals_generic():
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 200_000, 16 * 500 + 7)
    for algo in ("sha256", "sha256_cbor"):
        h = BlockHasher(16, algo)
        fast = h.hash_tokens(tokens)
        slow = h._generic(tokens[: 16 * 500], 500, None, None)
        assert len(fast) == 500  # the partial tail block is not hashed
        assert fast == slow


def test_tokens_beyond_int32():
    tokens = [2**40, 5, 6, 7] * 2
    h = BlockHasher(4)
    prev = none_hash()
    want = []
    for i in range(2):
        prev = ref_pickle(prev, tokens[i * 4 : (i + 1) * 4])
        want.append(prev)
    assert h.hash_tokens(tokens) == want


def test_extra_keys_cache_salt_and_lora():
    tokens = list(range(100, 132))
    h = BlockHasher(16)
    lora = ("lora", "adapter", "/path/a")
    got = h.hash_tokens(tokens, cache_salt="tenant-1", lora=("adapter", "/path/a"))
    b0 = ref_pickle(none_hash(), tokens[:16], (lora, ("cache_salt", "tenant-1")))
    b1 = ref_pickle(b0, tokens[16:], (lora,))
    assert got == [b0, b1]
    salted = h.hash_tokens(tokens, cache_salt="tenant-1")
    assert salted[0] == ref_pickle(none_hash(), tokens[:16], (("cache_salt", "tenant-1"),))
    assert salted[1] == ref_pickle(salted[0], tokens[16:], None)
    assert salted[0] != h.hash_tokens(tokens)[0]


def test_parent_continues_a_chain():
    tokens = list(range(64))
    h = BlockHasher(16)
    full = h.hash_tokens(tokens)
    assert h.hash_tokens(tokens[32:], parent=full[1]) == full[2:]


@pytest.mark.parametrize(
    ("obj", "hex_"),
    [  # RFC 8949 Appendix A
        (0, "00"),
        (23, "17"),
        (24, "1818"),
        (100, "1864"),
        (1000, "1903e8"),
        (1000000, "1a000f4240"),
        (1000000000000, "1b000000e8d4a51000"),
        (18446744073709551615, "1bffffffffffffffff"),
        (-1, "20"),
        (-100, "3863"),
        (-1000, "3903e7"),
        ("", "60"),
        ("IETF", "6449455446"),
        ("\u00fc", "62c3bc"),
        (b"\x01\x02\x03\x04", "4401020304"),
        ([], "80"),
        ((1, 2, 3), "83010203"),
        ([1, [2, 3], [4, 5]], "8301820203820405"),
        (None, "f6"),
        (True, "f5"),
        (False, "f4"),
    ],
)
def test_cbor_matches_rfc8949_vectors(obj, hex_):
    assert cbor_dumps(obj).hex() == hex_


def test_cbor_chain_matches_definition():
    tokens = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1] * 4
    h = BlockHasher(8, "sha256_cbor")
    prev = none_hash("sha256_cbor")
    want = []
    for i in range(4):
        prev = hashlib.sha256(cbor_dumps((prev, tuple(tokens[i * 8 : (i + 1) * 8]), None))).digest()
        want.append(prev)
    assert h.hash_tokens(tokens) == want
    assert hash_block("sha256_cbor", None, tokens[:8]) == want[0]


def test_int_form_is_low_eight_bytes_big_endian():
    d = bytes(range(32))
    assert to_int_hash(d) == int.from_bytes(d, "big") & (2**64 - 1)
    assert to_int_hash(d) == 0x18191A1B1C1D1E1F
    # a few digests (Python ints) and many (numpy), 32-byte and other lengths alike
    for tokens in (64, 16 * (SHORT_DIGESTS + 7)):
        digests = BlockHasher(16).hash_tokens(list(range(tokens)))
        for batch in (digests, [x + b"\x01" for x in digests], []):
            arr = to_int_hashes(batch)
            assert arr.dtype == np.uint64
            assert arr.tolist() == [to_int_hash(x) for x in batch]


def test_packed_int32_tokens_equal_list_input():
    tokens = np.arange(1000, 1064, dtype="<i4")
    h = BlockHasher(16)
    assert h.hash_tokens(tokens.tobytes()) == h.hash_tokens(tokens.tolist())


def test_bad_input_is_rejected_precisely():
    with pytest.raises(InvalidRequest, match="block_size"):
        BlockHasher(0)
    with pytest.raises(InvalidRequest, match="unknown block hash algorithm"):
        BlockHasher(16, "md5")
    h = BlockHasher(16)
    with pytest.raises(InvalidRequest, match="int32"):
        h.hash_tokens(b"\x00\x01\x02")
    with pytest.raises(InvalidRequest, match="integers"):
        h.hash_tokens(np.array([1.5] * 16))
    with pytest.raises(InvalidRequest, match="one-dimensional"):
        h.hash_tokens(np.zeros((2, 16), dtype=np.int64))
    with pytest.raises(InvalidRequest, match="not both"):
        h.hash_tokens(list(range(16)), cache_salt="x", extra_keys=[None])
    with pytest.raises(InvalidRequest, match="CBOR"):
        cbor_dumps({"a": 1})
    assert h.hash_tokens(list(range(15))) == []  # no full block


def test_max_blocks_bounds_work():
    h = BlockHasher(16)
    assert len(h.hash_tokens(np.zeros(16 * 100, dtype=np.int64), max_blocks=3)) == 3


# --- vLLM 0.33's lookahead hashes ---------------------------------------------------

_LOOKAHEAD_VECTORS = (
    Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "lookahead_vectors.json"
)


def test_lookahead_hashes_match_vllm_033_vectors():
    """Vectors from vLLM 0.33's own get_request_block_hasher(num_hash_lookahead_tokens)
    over real Requests (scripts/vllm_lookahead_vectors.py): sha256 and sha256_cbor,
    L = 0, 1, 3, with and without a cache salt, lengths that leave the last block
    with all, part or none of its lookahead tokens."""
    fx = json.loads(_LOOKAHEAD_VECTORS.read_text())
    assert len(fx["cases"]) == 36
    for case in fx["cases"]:
        # vLLM's default NONE_HASH seed (the vectors were made without PYTHONHASHSEED).
        hasher = BlockHasher(case["block_size"], case["algo"], none_hash_seed="vllm-none-hash")
        ours = hasher.hash_tokens(
            fx["tokens"][: case["num_tokens"]],
            cache_salt=case["cache_salt"],
            lookahead_tokens=case["lookahead_tokens"],
        )
        assert [h.hex() for h in ours] == case["hashes"], case


def test_lookahead_hashes_differ_and_wait_for_their_tokens():
    h = BlockHasher(16)
    toks = list(range(2, 2 + 16 * 3))
    legacy = h.hash_tokens(toks)
    ahead = h.hash_tokens(toks, lookahead_tokens=1)
    assert len(legacy) == 3 and len(ahead) == 2  # block 3 has no next token yet
    assert not set(legacy) & set(ahead)
    # A block's lookahead hash depends on the tokens after it, its legacy one does not.
    other = h.hash_tokens([*toks[:16], 999, *toks[17:]], lookahead_tokens=1)
    assert other[0] != ahead[0] and h.hash_tokens([*toks[:16], 999])[0] == legacy[0]
    for bad in (-1, 1.5):
        with pytest.raises(InvalidRequest, match="lookahead_tokens"):
            h.hash_tokens(toks, lookahead_tokens=bad)  # type: ignore[arg-type]


# --- against vLLM itself ---------------------------------------------------------


_VLLM_SCRIPT = r"""
import json, sys
import numpy as np
from vllm.utils.hashing import sha256, sha256_cbor
from vllm.v1.core import kv_cache_utils as K
from kvstore.hashing import BlockHasher, to_int_hash
rng = np.random.default_rng(3)
toks = rng.integers(0, 150000, 16 * 40).tolist() + [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 24] * 2
out = {}
for name, fn in (("sha256", sha256), ("sha256_cbor", sha256_cbor)):
    K.init_none_hash(fn)
    prev = None
    ref = []
    for i in range(len(toks) // 16):
        extra = (("cache_salt", "s1"),) if i == 0 else None
        prev = K.hash_block_tokens(fn, prev, toks[i * 16:(i + 1) * 16], extra)
        ref.append(prev)
    ours = BlockHasher(16, name).hash_tokens(toks, cache_salt="s1")
    assert ours == ref, name
    assert BlockHasher(16, name).none_hash == K.NONE_HASH, name
    ints = [K.maybe_convert_block_hash(x) for x in ref]
    assert ints == [to_int_hash(x) for x in ours], name
    out[name] = len(ref)
print(json.dumps(out))
"""


@pytest.mark.vllm
def test_block_hashes_equal_vllms_own():
    py = vllm_python()
    if py is None:
        pytest.skip("vLLM (CPU build) is not installed")
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    env = {**os.environ, "PYTHONPATH": root, "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1"}
    env.pop("PYTHONHASHSEED", None)
    proc = subprocess.run(
        [py, "-c", _VLLM_SCRIPT], capture_output=True, text=True, timeout=240, env=env, cwd=root
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"sha256": 41' in proc.stdout and '"sha256_cbor": 41' in proc.stdout
