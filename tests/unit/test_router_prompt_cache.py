"""PromptBytesCache: token-id prompts parsed past the previous turn's bytes only,
always the same ids as a full parse."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvstore.errors import InvalidRequest
from kvstore.router.prompt_cache import MIN_PROMPT_BYTES, PromptBytesCache, parse_token_ids
from kvstore.router.proxy import RouteError, decode_body


def _ids(seed: int, n: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 150_000, n)]


def _check(cache: PromptBytesCache, ids: list[int], **dump: object) -> np.ndarray:
    raw = json.dumps(ids, **dump).encode()  # type: ignore[arg-type]
    got = cache.token_ids(raw)
    assert got.dtype == np.int64
    assert got.tolist() == ids
    return got


def test_a_resent_context_parses_only_its_tail_and_equals_a_full_parse() -> None:
    cache = PromptBytesCache()
    turn = _ids(0, 5000)
    _check(cache, turn)
    assert (cache.hits, cache.misses) == (0, 1)
    for i in range(1, 4):  # each turn: everything again plus a new tail
        turn = turn + _ids(i, 700)
        _check(cache, turn)
    assert (cache.hits, cache.misses) == (3, 1)
    # every token but each remembered prompt's last was reused, never parsed again
    assert cache.reused_tokens == 4999 + 5699 + 6399
    # one entry per conversation: each turn replaced the one it extended
    assert cache.stored_tokens == len(turn) - 1


@pytest.mark.parametrize("dump", [{}, {"separators": (",", ":")}])
def test_other_edits_and_spacings_still_parse_exactly(dump: dict[str, object]) -> None:
    cache = PromptBytesCache()
    base = _ids(1, 3000)
    _check(cache, base, **dump)
    edited = base.copy()
    edited[2500] += 1  # a middle edit: the stored prefix no longer matches
    _check(cache, edited, **dump)
    _check(cache, base[:2000], **dump)  # shorter than the stored one
    _check(cache, base + [7], **dump)
    # the same ids spaced otherwise: no stored prefix matches, a full parse
    other = {"separators": (", ", ": ")} if dump else {"separators": (",", ":")}
    before = cache.misses
    _check(cache, base + [7, 8], **other)
    assert cache.misses == before + 1
    # a token that merely starts like the stored last one is not confused with it
    prefix_bytes = json.dumps(base[:1500], **dump)  # type: ignore[arg-type]
    cache2 = PromptBytesCache()
    _check(cache2, base[:1500] + [12], **dump)
    raw = (prefix_bytes[:-1] + ("," if dump else ", ") + "123456]").encode()
    assert cache2.token_ids(raw).tolist() == [*base[:1500], 123456]


def test_small_prompts_are_parsed_and_not_stored() -> None:
    cache = PromptBytesCache()
    ids = list(range(100))
    assert len(json.dumps(ids)) < MIN_PROMPT_BYTES
    _check(cache, ids)
    assert cache.stored_tokens == 0 and cache.misses == 0


@pytest.mark.parametrize(
    "raw", [b'[1, 2, "x"]', b"[1, 2, null]", b"[1, [2]]", b"[1, 99999999999999999999999]"]
)
def test_ids_that_are_not_integers_are_refused(raw: bytes) -> None:
    with pytest.raises(InvalidRequest, match="integers"):
        parse_token_ids(raw)
    # also past a stored prefix
    cache = PromptBytesCache()
    ids = _ids(2, 2000)
    _check(cache, ids)
    bad = json.dumps(ids).encode()[:-1] + b", " + raw[1:]
    with pytest.raises(InvalidRequest, match="integers"):
        cache.token_ids(bad)


def test_memory_is_bounded_by_tokens() -> None:
    cache = PromptBytesCache(max_tokens=10_000)
    for seed in range(20):  # distinct conversations (distinct first bytes)
        _check(cache, _ids(100 + seed, 3000))
    assert cache.stored_tokens <= 10_000
    # the most recent ones are kept and still reused
    last = _ids(119, 3000)
    cache.token_ids(json.dumps(last + [5]).encode())
    assert cache.hits == 1


def test_the_body_keeps_a_token_prompt_raw_and_decodes_the_rest() -> None:
    body = decode_body(b'{"model": "m", "prompt": [1, 2, 3], "stream": true, "n": null}')
    assert body["model"] == "m" and body["stream"] is True and body["n"] is None
    assert bytes(body["prompt"]) == b"[1, 2, 3]"
    for prompt in (b'"text"', b'["a", "b"]', b"[[1, 2], [3]]", b"[]"):
        body = decode_body(b'{"prompt": ' + prompt + b"}")
        assert body["prompt"] == json.loads(prompt)
    with pytest.raises(RouteError, match="malformed JSON"):
        decode_body(b'{"prompt": [1, 2,]}')
    with pytest.raises(RouteError, match="JSON object"):
        decode_body(b"[1, 2]")
