"""kvstore_router_client's policy (cache by tier against load, affinity, bursts), its
strategies, and incremental hashing of re-sent contexts against full hashing."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import InvalidRequest
from kvstore.hashing import BlockHasher
from kvstore_router_client import (
    NodeHit,
    NodeLoad,
    Policy,
    PrefixHashCache,
    ScoreResult,
    choose,
    make_strategy,
)
from kvstore_router_client.prefix_cache import MAX_CHAINS_PER_KEY
from kvstore_router_client.strategies import llmd_pick

NODES = ["a", "b", "c"]


def _burst(scores: ScoreResult, policy: Policy, n: int = 8, capacity: float = 4) -> list[str]:
    """n subagents arriving at once; each decision adds one in-flight request to its node."""
    inflight = dict.fromkeys(NODES, 0)
    picks = []
    for _ in range(n):
        load = {node: NodeLoad(inflight=inflight[node], capacity=capacity) for node in NODES}
        d = choose(scores, NODES, "a", load, policy)
        inflight[d.node] += 1
        picks.append(d.node)
    return picks


def test_a_burst_sharing_a_prefix_spreads_with_the_routers_own_inflight_counts():
    # a and b hold the parent's 100-block prefix in DRAM, c holds nothing.
    scores = ScoreResult(100, [NodeHit("a", 100, 0, 100, 0), NodeHit("b", 100, 0, 100, 0)])
    picks = _burst(scores, Policy())
    # spread over the holders by the load each decision adds, not piled on one
    assert picks.count("a") == picks.count("b") == 4, picks
    # With pulls credited (peer_weight), a node that can pull the prefix takes a share too.
    pulls = Policy(peer_weight=0.6, load_weight=0.5)
    spread = _burst(scores, pulls)
    assert set(spread) == {"a", "b", "c"}, spread
    assert spread.count("c") < spread.count("a")  # the holders still take the most
    # A non-holder chosen carries the pull hint; under default weights only a heavy load
    # on the holders sends work there.
    heavy = {n: NodeLoad(inflight=60, capacity=4) for n in ("a", "b")}
    d = choose(scores, NODES, "a", heavy)
    assert d.node == "c" and (d.peer, d.peer_blocks) == ("a", 100)
    # Cache-only ("precise-only") piles them all on the one holder, whatever its load.
    only = make_strategy("precise-only")
    one = ScoreResult(100, [NodeHit("a", 100, 0, 100, 0)])
    assert {
        only.choose(np.zeros(100, np.uint64), NODES, {"a": NodeLoad(inflight=k)}, one).node
        for k in range(8)
    } == {"a"}


def test_load_combines_engine_gauges_router_counts_and_kv_usage():
    p = Policy()
    # The engine's gauges lag: the router's own count wins when larger.
    assert NodeLoad(running=1, waiting=1, inflight=5, capacity=4).load(p) == pytest.approx(1.25)
    assert NodeLoad(running=3, waiting=5, inflight=2, capacity=4).load(p) == pytest.approx(2.0)
    assert NodeLoad(kv_usage=1.0).load(p) == pytest.approx(p.kv_usage_weight)
    # A full KV cache on the holder sends the request to an equal peer holder.
    scores = ScoreResult(10, [NodeHit("a", 10, 10, 0, 0), NodeHit("b", 10, 10, 0, 0)])
    assert choose(scores, ["a", "b"], "a", {"a": NodeLoad(kv_usage=0.95)}).node == "b"


def test_affinity_keeps_a_conversation_on_its_node_until_load_says_otherwise():
    # No cache signal yet (the previous turn's events have not arrived).
    empty = ScoreResult(50, [])
    load = {"a": NodeLoad(inflight=1, capacity=8), "b": NodeLoad(capacity=8)}
    d = choose(empty, ["a", "b"], "b", load, affinity="a")
    assert (d.node, d.reason) == ("a", "affinity")
    busy = {"a": NodeLoad(inflight=9, capacity=8), "b": NodeLoad(capacity=8)}
    assert choose(empty, ["a", "b"], "b", busy, affinity="a").node == "b"
    # No signal, no load, no affinity: the caller's default.
    d = choose(empty, ["a", "b"], "b")
    assert (d.node, d.reason) == ("b", "no_hit")


def test_strategies_by_name_and_llmd_weights():
    h = np.arange(4, dtype=np.uint64)
    rr = make_strategy("round-robin")
    assert [rr.choose(h, NODES, {}, None).node for _ in range(4)] == ["a", "b", "c", "a"]
    r1, r2 = make_strategy("random", seed=3), make_strategy("random", seed=3)
    assert [r1.choose(h, NODES, {}, None).node for _ in range(20)] == [
        r2.choose(h, NODES, {}, None).node for _ in range(20)
    ]
    ap = make_strategy("approximate", approximate_capacity_blocks=4)
    assert ap.choose(h[:3], NODES, {}, None).node == "a"  # nothing known: lowest index
    ap.routed("c", h[:3])
    assert ap.choose(h[:3], NODES, {}, None).node == "c"
    ap.routed("c", np.array([7, 8, 9], dtype=np.uint64))  # capacity 4: forgets 0 and 1
    assert ap.choose(h[:3], NODES, {}, None).node == "a"
    # llm-d's prefix 3 / queue 2: a full prefix beats an empty queue, 20% does not.
    assert llmd_pick([1.0, 0.0], [5, 0]) == 0
    assert llmd_pick([0.2, 0.0], [5, 0]) == 1
    # cache+load without an index answer balances on load alone.
    cl = make_strategy("cache+load")
    d = cl.choose(h, ["a", "b"], {"a": NodeLoad(waiting=3)}, None)
    assert (d.node, d.reason) == ("b", "fallback")
    with pytest.raises(InvalidRequest, match="unknown routing strategy"):
        make_strategy("precise")


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_incremental_hashes_equal_full_hashes(algo):
    bs = 16
    hasher = BlockHasher(bs, algo)
    cache = PrefixHashCache(hasher)
    rng = np.random.default_rng(1)
    turn1 = rng.integers(0, 100_000, 40 * bs + 5)
    turn2 = np.concatenate([turn1, rng.integers(0, 100_000, 7 * bs)])  # appends
    edited = turn2.copy()
    edited[20 * bs + 3] += 1  # a change inside block 20
    for salt in (None, "tenant-x"):
        first = cache.hash(turn1, cache_salt=salt)
        assert first.reused_blocks == 0
        np.testing.assert_array_equal(first.hashes, hasher.hash_tokens_int(turn1, cache_salt=salt))
        cache.routed(first, "node-b")
        second = cache.hash(turn2, cache_salt=salt)
        assert second.reused_blocks == 40 and second.previous_node == "node-b"
        np.testing.assert_array_equal(second.hashes, hasher.hash_tokens_int(turn2, cache_salt=salt))
        third = cache.hash(edited, cache_salt=salt)
        assert third.reused_blocks == 20
        np.testing.assert_array_equal(third.hashes, hasher.hash_tokens_int(edited, cache_salt=salt))
    # Another tenant's salt never reuses this tenant's chain.
    other = cache.hash(turn2, cache_salt="tenant-y")
    assert other.reused_blocks == 0
    np.testing.assert_array_equal(
        other.hashes, hasher.hash_tokens_int(turn2, cache_salt="tenant-y")
    )
    lora = ("adapter", "/a")
    lo = cache.hash(turn2, lora=lora)
    assert lo.reused_blocks == 0
    lo2 = cache.hash(np.concatenate([turn2, turn1[: 2 * bs]]), lora=lora)
    assert lo2.reused_blocks == 47
    np.testing.assert_array_equal(
        lo2.hashes, hasher.hash_tokens_int(np.concatenate([turn2, turn1[: 2 * bs]]), lora=lora)
    )


def test_prefix_cache_is_bounded_in_tokens_and_chains():
    bs = 4
    cache = PrefixHashCache(BlockHasher(bs), max_tokens=100)
    base = np.arange(bs)
    for i in range(50):  # 50 subagents: same first block, different rest
        cache.hash(np.concatenate([base, np.full(2 * bs, i + 1000)]))
        assert cache.stored_tokens <= 100
    assert cache.stored_tokens <= 100
    # a continuing conversation replaces its previous chain instead of adding one
    c2 = PrefixHashCache(BlockHasher(bs), max_tokens=10_000)
    ids = np.arange(8 * bs)
    for k in range(1, 9):
        c2.hash(ids[: k * bs])
    assert c2.stored_tokens == 8 * bs
    many = PrefixHashCache(BlockHasher(bs), max_tokens=10_000)
    for i in range(MAX_CHAINS_PER_KEY + 5):
        many.hash(np.concatenate([base, [i + 500] * bs]))
    assert many.stored_tokens == MAX_CHAINS_PER_KEY * 2 * bs
    with pytest.raises(InvalidRequest):
        cache.hash(np.zeros((2, 8), dtype=np.int64))
    with pytest.raises(InvalidRequest, match="integers"):
        cache.hash([1, 2, "x", 4])  # a JSON prompt with a string in it
    # a list (a parsed JSON prompt) hashes exactly like the same array
    ids = list(range(3 * bs + 1))
    np.testing.assert_array_equal(
        PrefixHashCache(BlockHasher(bs)).hash(ids).hashes, BlockHasher(bs).hash_tokens_int(ids)
    )
    with pytest.raises(InvalidRequest):
        PrefixHashCache(BlockHasher(bs), max_tokens=0)


def test_a_subagent_continues_while_its_siblings_chains_are_stored():
    """Two subagents share the parent's first block; the second one's next turn
    extends its own chain, which is not the first stored under that block:
    hashed incrementally, exactly (it raised ValueError: chains compared by
    their token arrays)."""
    bs = 4
    hasher = BlockHasher(bs)
    cache = PrefixHashCache(hasher)
    parent = np.arange(10 * bs)
    one = np.concatenate([parent, [1] * 3 * bs])
    two = np.concatenate([parent, [9] * 3 * bs])
    cache.hash(one)
    cache.routed(cache.hash(two), "node-b")
    turn = np.concatenate([two, [5] * 2 * bs])
    got = cache.hash(turn)
    assert got.reused_blocks == 13 and got.previous_node == "node-b"
    np.testing.assert_array_equal(got.hashes, hasher.hash_tokens_int(turn))
    assert cache.stored_tokens == one.size + turn.size  # "two" replaced by its next turn


def test_a_chain_extended_entirely_hands_its_digests_on_and_every_hash_stays_exact():
    """A re-sent context extends the stored chain entirely, and that chain is dropped:
    its digest list moves to the new chain (``Hashed.chain``) instead of being copied
    (12k references for a 195k-token context). Appends, a cut-back, an edit, a turn
    not remembered and a sibling each hash exactly as a full hash does."""
    bs = 4
    hasher = BlockHasher(bs)
    cache = PrefixHashCache(hasher)
    rng = np.random.default_rng(7)
    turn = rng.integers(0, 1000, 6 * bs)
    prev = cache.hash(turn)
    for _ in range(5):  # appends: each extends the last chain entirely
        turn = np.concatenate([turn, rng.integers(0, 1000, 3 * bs + 1)])
        got = cache.hash(turn)
        assert got.chain is not None and prev.chain is not None
        assert got.chain.digests is prev.chain.digests  # handed on, not copied
        np.testing.assert_array_equal(got.hashes, hasher.hash_tokens_int(turn))
        prev = got
    stored = cache.stored_tokens
    cut = turn[: 10 * bs]  # a cut-back: reuses part, the longer chain stays
    got = cache.hash(cut)
    assert got.reused_blocks == 10 and got.chain is not None
    assert got.chain.digests is not prev.chain.digests
    np.testing.assert_array_equal(got.hashes, hasher.hash_tokens_int(cut))
    edited = turn.copy()
    edited[7 * bs] += 1
    np.testing.assert_array_equal(cache.hash(edited).hashes, hasher.hash_tokens_int(edited))
    longer = np.concatenate([turn, [3] * 2 * bs])
    ghost = cache.hash(longer, remember=False)  # not stored: the stored chain is kept whole
    np.testing.assert_array_equal(ghost.hashes, hasher.hash_tokens_int(longer))
    assert cache.stored_tokens > stored
    again = cache.hash(turn)  # the full chain, unchanged by the turns after it
    assert again.reused_blocks == turn.size // bs
    np.testing.assert_array_equal(again.hashes, hasher.hash_tokens_int(turn))


def test_engine_metrics_are_read_as_vllm_writes_them():
    from kvstore.router.backends import parse_metrics

    text = "\n".join(
        [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
            'vllm:num_requests_running{engine="1",model_name="m"} 1.0',
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
            'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5',
            'vllm:cache_config_info{block_size="32",engine="0",prefix_caching_hash_algo='
            '"sha256_cbor",sliding_window="None"} 1.0',
        ]
    )
    running, waiting, kv, info = parse_metrics(text)
    assert (running, waiting, kv) == (4.0, 2.0, 0.5)
    assert (info.block_size, info.hash_algo) == (32, "sha256_cbor")
    assert info.dp_ranks == 2  # one engine label per data-parallel rank's engine core
    assert parse_metrics('vllm:num_requests_running{model_name="m"} 1.0')[3].dp_ranks == 0


def test_the_node_comes_with_the_rank_that_saves_most() -> None:
    from kvstore_router_client import RankHit

    # rank 0: 2 GPU + 2 DRAM; rank 1: 4 DRAM (the node's); rank 2: 3 GPU + 1 DRAM
    ranks = (
        RankHit(-1, 4, 0, 4, 0),
        RankHit(0, 4, 2, 2, 0),
        RankHit(1, 4, 0, 4, 0),
        RankHit(2, 4, 3, 1, 0),
    )
    a = NodeHit("a", 4, 3, 1, 0, rank=2, ranks=ranks)
    b = NodeHit("b", 2, 2, 0, 0)  # no ranks: any engine of the node
    d = choose(ScoreResult(8, [a, b]), ["a", "b"], "b")
    assert (d.node, d.rank) == ("a", 2)
    assert choose(ScoreResult(8, [b]), ["b"], "b").rank == -1
    # a DRAM hit is worth more than a GPU hit under these weights: rank 1 then
    flipped = Policy(gpu_weight=0.1, cpu_weight=1.0)
    assert choose(ScoreResult(8, [a]), ["a"], "a", policy=flipped).rank == 1
