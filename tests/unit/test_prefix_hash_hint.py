"""PromptBytesCache's KnownPrefix hint to PrefixHashCache: the same hashes, the same
chain found (reused blocks, previous node) as without it, and a hint that is not
about the array being hashed, or whose source is no stored chain, is not trusted."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvstore.hashing import BlockHasher
from kvstore.router.prompt_cache import PromptBytesCache
from kvstore_router_client import KnownPrefix, PrefixHashCache

BS = 16


def _raw(ids: list[int]) -> bytes:
    return json.dumps(ids).encode()


@pytest.mark.parametrize("seed", range(4))
def test_hashes_with_the_hint_equal_hashes_without_it_over_random_edits(seed: int) -> None:
    rng = np.random.default_rng(seed)
    hasher = BlockHasher(BS, "sha256")
    prompts = PromptBytesCache()
    hinted, plain = PrefixHashCache(hasher), PrefixHashCache(hasher)
    system = [int(x) for x in rng.integers(0, 150_000, 300)]  # shared by every conversation
    convs = [system + [int(x) for x in rng.integers(0, 150_000, 1500)] for _ in range(3)]
    salts: list[str | None] = [None, "tenant-a", "tenant-b"]
    loras: list[tuple[str, str] | None] = [None, ("adapter", "1")]
    for step in range(60):
        c = int(rng.integers(len(convs)))  # conversations interleaved
        ids = convs[c]
        op = rng.random()
        if op < 0.5:  # the next turn: everything again plus a new tail
            ids = ids + [int(x) for x in rng.integers(0, 150_000, int(rng.integers(1, 400)))]
        elif op < 0.7:  # an edit inside the prefix (a compacted or rewritten context)
            ids = ids.copy()
            ids[int(rng.integers(len(ids)))] = int(rng.integers(150_000))
        elif op < 0.8:  # cut back (a retried turn)
            ids = ids[: int(rng.integers(BS, len(ids)))]
        convs[c] = ids
        salt = salts[int(rng.integers(len(salts)))] if rng.random() < 0.3 else salts[c]
        lora = loras[int(rng.integers(len(loras)))] if rng.random() < 0.2 else None
        tok, known = prompts.token_ids_known(_raw(ids))
        a = hinted.hash(tok, cache_salt=salt, lora=lora, owned=True, known=known)
        b = plain.hash(tok.copy(), cache_salt=salt, lora=lora, owned=True)
        want = hasher.hash_tokens_int(ids, cache_salt=salt, lora=lora)
        assert np.array_equal(a.hashes, want), step
        assert np.array_equal(b.hashes, want), step
        assert (a.reused_blocks, a.previous_node) == (b.reused_blocks, b.previous_node), step
        node = f"node-{step % 5}"
        PrefixHashCache.routed(a, node)
        PrefixHashCache.routed(b, node)
    assert (hinted.hits, hinted.reused_blocks) == (plain.hits, plain.reused_blocks)
    assert hinted.hinted >= 5  # the hint was taken, not merely ignored every time
    assert plain.hinted == 0


def _stored(hasher: BlockHasher, n: int) -> tuple[PrefixHashCache, np.ndarray]:
    cache = PrefixHashCache(hasher)
    first = np.random.default_rng(7).integers(0, 150_000, n)
    cache.hash(first, owned=True)  # the chain holds ``first``'s own memory
    return cache, first


def test_a_hint_about_another_array_is_not_trusted() -> None:
    hasher = BlockHasher(BS, "sha256")
    cache, first = _stored(hasher, 100 * BS)
    edited = np.concatenate([first, first[:BS]])
    edited[40] += 1  # differs in block 2: only blocks 0-1 are the stored chain's
    stale = KnownPrefix(np.concatenate([first, first[:BS]]), first, first.size)
    got = cache.hash(edited, owned=True, known=stale)  # a hint made for another array
    assert np.array_equal(got.hashes, hasher.hash_tokens_int(edited))
    assert got.reused_blocks == 2
    assert cache.hinted == 0


def test_a_hint_whose_claim_does_not_hold_at_its_ends_is_not_trusted() -> None:
    hasher = BlockHasher(BS, "sha256")
    cache, first = _stored(hasher, 100 * BS)
    edited = first.copy()
    edited[-1] += 1  # the last block differs
    for count in (first.size, first.size + 1, 0, -5):  # the last id disagrees; out of range
        got = cache.hash(edited, remember=False, known=KnownPrefix(edited, first, count))
        assert np.array_equal(got.hashes, hasher.hash_tokens_int(edited)), count
        assert got.reused_blocks == 99, count
    assert cache.hinted == 0


def test_a_hint_whose_source_is_no_stored_chain_is_compared_in_full() -> None:
    hasher = BlockHasher(BS, "sha256")
    cache, first = _stored(hasher, 100 * BS)
    edited = first.copy()
    edited[BS * 50] += 1
    other = first.copy()  # equal ids, other memory: not the chain's own bytes
    other[BS * 50] += 1  # and what it claims (as a wrong producer would) is consistent
    got = cache.hash(edited, remember=False, known=KnownPrefix(edited, other, other.size))
    assert np.array_equal(got.hashes, hasher.hash_tokens_int(edited))
    assert got.reused_blocks == 50
    assert cache.hinted == 0
    # the same hint for a request under another salt: no chain there, every block hashed
    salted = cache.hash(edited, cache_salt="t", known=KnownPrefix(edited, first, 10))
    assert np.array_equal(salted.hashes, hasher.hash_tokens_int(edited, cache_salt="t"))
    assert salted.reused_blocks == 0


def test_the_router_path_takes_the_hint_for_a_resent_context() -> None:
    hasher = BlockHasher(BS, "sha256")
    prompts, cache = PromptBytesCache(), PrefixHashCache(hasher)
    turn = [int(x) for x in np.random.default_rng(3).integers(0, 150_000, 5000)]
    tok, known = prompts.token_ids_known(_raw(turn))
    assert known is None  # a miss: nothing known
    cache.hash(tok, owned=True, known=known)
    turn = turn + [1, 2, 3] * 200
    tok, known = prompts.token_ids_known(_raw(turn))
    assert known is not None and known.ids is tok and known.count == 4999
    got = cache.hash(tok, owned=True, known=known)
    assert np.array_equal(got.hashes, hasher.hash_tokens_int(turn))
    assert got.reused_blocks == 5000 // BS
    assert got.hinted and cache.hinted == 1
