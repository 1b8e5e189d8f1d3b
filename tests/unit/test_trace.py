"""The trace generator: determinism, published shape, file round trip, bad files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvstore.errors import InvalidRequest
from kvstore_bench import trace as T


def _small(**kw: int) -> T.TraceParams:
    return T.preset_params("cybergym", agents=40, tasks=10, turns=10, **kw)


def test_same_seed_same_trace_other_seed_differs() -> None:
    a = T.generate(_small(), seed=7)
    b = T.generate(_small(), seed=7)
    c = T.generate(_small(), seed=8)
    assert a.requests == b.requests
    assert a.requests != c.requests


def test_presets_match_published_shape() -> None:
    cyber = T.generate(T.preset_params("cybergym"), seed=0)
    s = T.stats(cyber)
    assert s.agents >= 400 and s.requests >= 4000  # 400 agents x 10 turns + subagents
    # ~376k characters at ~4 chars/token of context; ~317 output tokens
    assert 75_000 <= s.input_tokens_median <= 100_000
    assert 280 <= s.output_tokens_median <= 360
    assert s.reuse_ge_90_share >= 0.96
    assert s.burst_children > 0
    agentx = T.stats(T.generate(T.preset_params("agentx"), seed=0))
    assert 175_000 <= agentx.input_tokens_median <= 215_000
    assert agentx.reuse_ge_90_share >= 0.96


def test_turns_extend_previous_input_and_dependencies_are_ordered() -> None:
    trace = T.generate(_small(), seed=1)
    by_id = {r.id: r for r in trace.requests}
    seen: set[str] = set()
    for r in trace.requests:
        assert all(dep in seen for dep in r.after)
        seen.add(r.id)
        if r.after and r.agent == by_id[r.after[0]].agent:
            prev = by_id[r.after[0]]
            assert r.segments[: len(prev.segments)] == prev.segments
            assert r.input_tokens > prev.input_tokens
    children = [r for r in trace.requests if ".c" in r.agent and r.id.endswith(".t0")]
    assert children, "expected subagent bursts"
    for child in children:
        parent = by_id[child.after[0]]
        assert child.segments[: len(parent.segments)] == parent.segments


def test_jsonl_round_trip(tmp_path) -> None:
    trace = T.generate(_small(), seed=3, preset="cybergym")
    path = tmp_path / "t.jsonl"
    T.write(trace, path)
    back = T.read(path)
    assert back.requests == trace.requests
    assert back.seed == 3 and back.params == trace.params
    header = json.loads(path.read_text().splitlines()[0])
    assert header["format"] == T.FORMAT


def test_user_trace_with_token_ids(tmp_path) -> None:
    path = tmp_path / "mine.jsonl"
    lines = [
        {"format": T.FORMAT, "seed": 0},
        {"id": "r0", "agent": "x", "token_ids": list(range(40)), "output_tokens": 5},
        {"id": "r1", "agent": "x", "after": ["r0"], "token_ids": list(range(48))},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    trace = T.read(path)
    src = T.TokenSource(0)
    h0 = T.block_hashes(src.token_ids(trace.requests[0]), 16)
    h1 = T.block_hashes(src.token_ids(trace.requests[1]), 16)
    assert len(h0) == 2 and len(h1) == 3
    assert list(h1[:2]) == list(h0)  # shared prefix -> same chained hashes


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([], "empty trace"),
        ([{"format": "other/9", "seed": 0}], "format"),
        ([{"format": T.FORMAT, "seed": 0}, {"id": "a", "agent": "x"}], "exactly one"),
        (
            [
                {"format": T.FORMAT, "seed": 0},
                {"id": "a", "agent": "x", "segments": [["s", 4]], "after": ["zz"]},
            ],
            "waits for 'zz'",
        ),
        (
            [
                {"format": T.FORMAT, "seed": 0},
                {"id": "a", "agent": "x", "segments": [["s", 4]]},
                {"id": "a", "agent": "x", "segments": [["s", 4]]},
            ],
            "duplicate",
        ),
        (
            [{"format": T.FORMAT, "seed": 0}, {"id": "a", "agent": "x", "segments": [["s", 0]]}],
            "> 0",
        ),
        ([{"format": T.FORMAT, "seed": 0}, {"id": "a", "agnt": "x"}], ":2:"),
    ],
)
def test_bad_trace_files_name_the_problem(tmp_path, lines, message) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    with pytest.raises(InvalidRequest, match=message):
        T.read(path)


def test_block_hashes_chain_and_tokens_deterministic() -> None:
    src_a, src_b = T.TokenSource(5), T.TokenSource(5)
    a = src_a.segment_token_ids("task1", 1000)
    assert np.array_equal(a, src_b.segment_token_ids("task1", 1000))
    assert not np.array_equal(a, T.TokenSource(6).segment_token_ids("task1", 1000))
    h = T.block_hashes(a, 256)
    assert len(h) == 3 and len(set(h.tolist())) == 3
    changed = a.copy()
    changed[300] += 1
    h2 = T.block_hashes(changed, 256)
    assert h2[0] == h[0] and h2[1] != h[1] and h2[2] != h[2]  # the change propagates


def test_unknown_preset() -> None:
    with pytest.raises(InvalidRequest, match="unknown preset"):
        T.preset_params("nope")
