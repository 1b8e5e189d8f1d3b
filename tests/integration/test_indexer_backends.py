"""Both index backends (in-memory, real Redis) against one reference model."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvstore.errors import InvalidRequest
from kvstore.indexer.backend import NodeScore, RankScore
from kvstore.indexer.memory import MemoryIndex
from tests.integration._redis import RedisProcess, redis_server  # noqa: F401

MEDIUMS = ("GPU", "CPU", "DISK")


@pytest.fixture(
    params=[
        "memory",
        "memory-numpy",  # the numpy walk ("memory": the compiled one, tests/unit/test_index_walk.py)
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("mirror", marks=pytest.mark.redis),
    ]
)
def backend(request, tmp_path):
    if request.param.startswith("memory"):
        yield MemoryIndex(
            initial_capacity=1024, native=None if request.param == "memory" else False
        )
        return
    from kvstore.indexer.redis_index import RedisIndex

    server = RedisProcess(tmp_path)
    index = RedisIndex(server.url)
    if request.param == "mirror":
        from kvstore.indexer.mirror import MirroredIndex

        index = MirroredIndex(index)
    try:
        yield index
    finally:
        index.close()
        server.stop()


class Reference:
    """The index spelled out: hash -> {(node, medium)} per model."""

    def __init__(self) -> None:
        self.d: dict[tuple[str, int], set[tuple[str, str]]] = {}

    def add(self, model, node, medium, hashes):
        for h in hashes.tolist():
            self.d.setdefault((model, h), set()).add((node, medium))

    def remove(self, model, node, medium, hashes):
        for h in hashes.tolist():
            self.d.get((model, h), set()).discard((node, medium))

    def clear(self, node, model=None, mediums=None):
        for (m, _), s in self.d.items():
            if model is None or m == model:
                for med in mediums or MEDIUMS:
                    s.discard((node, med))

    def score(self, model, hashes, nodes):
        out = []
        for node in nodes:
            p = g = c = d = 0
            for h in hashes.tolist():
                tiers = {med for n, med in self.d.get((model, h), ()) if n == node}
                if not tiers:
                    break
                p += 1
                if "GPU" in tiers:
                    g += 1
                elif "CPU" in tiers:
                    c += 1
                else:
                    d += 1
            if p:
                out.append(NodeScore(node, p, g, c, d))
        return sorted(out, key=lambda s: (-s.prefix_blocks, s.node))


def H(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.uint64)


def test_prefix_and_tier_split(backend):
    backend.add("m", "a", "CPU", H(1, 2, 3, 4))
    backend.add("m", "a", "GPU", H(1, 2))
    backend.add("m", "b", "DISK", H(1, 2, 3))
    backend.add("m", "b", "CPU", H(5))  # not contiguous: block 4 missing
    backend.add("m", "c", "CPU", H(2, 3))  # no block 1: no prefix
    req = H(1, 2, 3, 4, 5)
    assert backend.score("m", req) == [
        NodeScore("a", 4, gpu_blocks=2, cpu_blocks=2, disk_blocks=0),
        NodeScore("b", 3, gpu_blocks=0, cpu_blocks=0, disk_blocks=3),
    ]
    assert backend.score("m", req, ["b", "c", "unknown"]) == [NodeScore("b", 3, 0, 0, 3)]
    assert backend.score("other-model", req) == []
    assert backend.score("m", H()) == []
    # the same hash under another model is another block
    assert backend.score("m2", H(1)) == []


def test_remove_and_medium_scoped_clear(backend):
    backend.add("m", "a", "CPU", H(1, 2, 3))
    backend.add("m", "a", "GPU", H(1, 2, 3))
    backend.remove("m", "a", "CPU", H(2))
    assert backend.score("m", H(1, 2, 3)) == [NodeScore("a", 3, 3, 0, 0)]
    backend.clear("a", "m", ["GPU"])  # an engine's cache went away; DRAM stays
    assert backend.score("m", H(1, 2, 3)) == [NodeScore("a", 1, 0, 1, 0)]
    backend.remove("m", "a", "CPU", H(99))  # unknown hash: no effect, no error
    backend.remove("m", "zz", "CPU", H(1))  # unknown node: no effect
    backend.clear("a", None)
    assert backend.score("m", H(1, 2, 3)) == []


def test_drop_node_then_node_returns(backend):
    backend.add("m", "a", "CPU", H(1, 2))
    backend.add("m", "b", "CPU", H(1))
    backend.drop_node("a")
    assert "a" not in backend.nodes()
    assert backend.score("m", H(1, 2)) == [NodeScore("b", 1, 0, 1, 0)]
    backend.add("m", "a", "CPU", H(1))
    assert backend.score("m", H(1, 2)) == [NodeScore("a", 1, 0, 1, 0), NodeScore("b", 1, 0, 1, 0)]
    assert set(backend.nodes()) == {"a", "b"}


def test_unknown_medium_is_rejected(backend):
    with pytest.raises(InvalidRequest, match="medium"):
        backend.add("m", "a", "TAPE", H(1))


def test_random_operations_match_reference(backend):
    rng = np.random.default_rng(11)
    rnd = random.Random(11)
    ref = Reference()
    universe = rng.integers(0, 2**64, 600, dtype=np.uint64)
    chain = universe[:80]  # a long shared prefix, so scores are non-trivial
    nodes = [f"n{i}" for i in range(70)]  # > 64: node bitsets span two words
    for step in range(250):
        node, med = rnd.choice(nodes), rnd.choice(MEDIUMS)
        if step % 3 == 0:
            hs = chain[: rnd.randrange(1, 80)]
        else:
            hs = universe[rng.integers(0, 600, rnd.randrange(1, 60))]
        if rnd.random() < 0.7:
            backend.add("m", node, med, hs)
            ref.add("m", node, med, hs)
        else:
            backend.remove("m", node, med, hs)
            ref.remove("m", node, med, hs)
        if step % 60 == 59:
            victim = rnd.choice(nodes)
            backend.clear(victim, "m")
            ref.clear(victim, "m")
    for trial in range(12):
        req = np.concatenate([chain[: rnd.randrange(0, 80)], universe[rng.integers(0, 600, 3)]])
        cands = rnd.sample(nodes, 20) if trial % 2 else nodes
        want = ref.score("m", req, cands)
        got = backend.score("m", req, None if trial % 2 == 0 else cands)
        assert got == want, trial
    assert sum(s.prefix_blocks for s in backend.score("m", chain)) > 0


def test_gpu_entries_per_rank_dram_per_node(backend):
    """DP ranks share the node's DRAM/disk but each has its own GPU cache."""
    backend.add("m", "a", "CPU", H(1, 2, 3))  # the node's daemon: every rank reads it
    backend.add("m", "a", "GPU", H(1, 2, 3, 4), rank=0)
    backend.add("m", "a", "GPU", H(1), rank=1)
    backend.add("m", "b", "GPU", H(1, 2), rank=1)  # a node known by one rank alone
    req = H(1, 2, 3, 4, 5)
    a = NodeScore(
        "a",
        4,
        4,
        0,
        0,
        rank=0,
        ranks=(RankScore(-1, 3, 0, 3, 0), RankScore(0, 4, 4, 0, 0), RankScore(1, 3, 1, 2, 0)),
    )
    b = NodeScore("b", 2, 2, 0, 0, rank=1, ranks=(RankScore(-1, 0), RankScore(1, 2, 2, 0, 0)))
    assert backend.score("m", req) == [a, b]
    assert backend.score("m", req, ["b"]) == [b]
    assert backend.nodes() == ["a", "b"]  # ranks are not nodes
    # rank 0's engine cleared its cache: rank 0 keeps what the node shares
    backend.clear("a", "m", ["GPU"], rank=0)
    assert backend.score("m", req, ["a"]) == [
        NodeScore(
            "a",
            3,
            1,
            2,
            0,
            rank=1,
            ranks=(RankScore(-1, 3, 0, 3, 0), RankScore(0, 3, 0, 3, 0), RankScore(1, 3, 1, 2, 0)),
        )
    ]
    backend.remove("m", "a", "GPU", H(1), rank=1)
    backend.remove("m", "a", "CPU", H(1))
    assert backend.score("m", req, ["a"]) == []
    # a dropped node takes its ranks along; coming back, it starts clean
    backend.add("m", "a", "GPU", H(1), rank=2)
    backend.drop_node("a")
    assert backend.nodes() == ["b"]
    assert backend.score("m", req, ["a"]) == []
    backend.add("m", "a", "CPU", H(1))
    assert backend.score("m", req, ["a"]) == [NodeScore("a", 1, 0, 1, 0)]
    with pytest.raises(InvalidRequest, match="rank"):
        backend.add("m", "a", "GPU", H(1), rank=-2)


def test_rank_prefix_spans_score_chunks(backend):
    """A rank's prefix, GPU first and DRAM after, runs past the first lookup chunks."""
    chain = np.random.default_rng(5).integers(0, 2**64, 3000, dtype=np.uint64)
    backend.add("m", "a", "GPU", chain[:1500], rank=1)
    backend.add("m", "a", "CPU", chain[1400:2800])
    (s,) = backend.score("m", chain)
    assert (s.prefix_blocks, s.gpu_blocks, s.cpu_blocks, s.rank) == (2800, 1500, 1300, 1)
    assert s.ranks[0] == RankScore(-1, 0)


class RankReference(Reference):
    """The index with DP ranks spelled out: a rank's column is its own GPU
    entries plus everything its node holds (see backend.fold_ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.ranks: dict[str, set[int]] = {}

    def add(self, model, node, medium, hashes, rank=None):
        if rank is not None:
            self.ranks.setdefault(node, set()).add(rank)
            node = f"{node}@{rank}"
        super().add(model, node, medium, hashes)

    def clear_rank(self, node, model, rank):
        super().clear(f"{node}@{rank}", model, ["GPU"])

    def _column(self, model, hashes, members):
        p = g = c = d = 0
        for h in hashes.tolist():
            tiers = {med for n, med in self.d.get((model, h), ()) if n in members}
            if not tiers:
                break
            p += 1
            if "GPU" in tiers:
                g += 1
            elif "CPU" in tiers:
                c += 1
            else:
                d += 1
        return p, g, c, d

    def score(self, model, hashes, nodes):
        out = []
        for node in nodes:
            own = self._column(model, hashes, {node})
            ranks = sorted(self.ranks.get(node, ()))
            if not ranks:
                if own[0]:
                    out.append(NodeScore(node, *own))
                continue
            cols = [(r, self._column(model, hashes, {node, f"{node}@{r}"})) for r in ranks]
            listed = tuple(RankScore(r, *col) for r, col in cols if col[0])
            if not listed:
                continue
            best = min(listed, key=lambda x: (-x.prefix_blocks, -x.gpu_blocks, x.rank))
            out.append(
                NodeScore(
                    node,
                    best.prefix_blocks,
                    best.gpu_blocks,
                    best.cpu_blocks,
                    best.disk_blocks,
                    rank=best.rank,
                    ranks=(RankScore(-1, *own), *listed),
                )
            )
        return sorted(out, key=lambda s: (-s.prefix_blocks, s.node))


def test_random_rank_operations_match_reference(backend):
    """Ranks and nodes across two bitset words; GPU per rank, the rest per node."""
    rng = np.random.default_rng(23)
    rnd = random.Random(23)
    ref = RankReference()
    universe = rng.integers(0, 2**64, 400, dtype=np.uint64)
    chain = universe[:60]
    nodes = [f"n{i}" for i in range(40)]  # 40 nodes + their ranks: > 64 members
    for step in range(300):
        node = rnd.choice(nodes)
        rank = rnd.choice([None, 0, 1]) if int(node[1:]) % 2 else None
        med = "GPU" if rank is not None else rnd.choice(("CPU", "DISK", "GPU"))
        hs = (
            chain[: rnd.randrange(1, 60)]
            if step % 2
            else universe[rng.integers(0, 400, rnd.randrange(1, 40))]
        )
        if rnd.random() < 0.75:
            backend.add("m", node, med, hs, rank=rank)
            ref.add("m", node, med, hs, rank)
        elif rank is not None:
            backend.remove("m", node, med, hs, rank=rank)
            ref.remove("m", f"{node}@{rank}", med, hs)
        else:
            backend.remove("m", node, med, hs)
            ref.remove("m", node, med, hs)
        if step % 50 == 49:
            victim = rnd.choice(nodes)
            backend.clear(victim, "m", ["GPU"], rank=1)
            ref.clear_rank(victim, "m", 1)
    for trial in range(10):
        req = np.concatenate([chain[: rnd.randrange(0, 60)], universe[rng.integers(0, 400, 3)]])
        cands = rnd.sample(nodes, 15) if trial % 2 else nodes
        want = ref.score("m", req, cands)
        got = backend.score("m", req, None if trial % 2 == 0 else cands)
        assert got == want, trial
    assert any(s.ranks for s in backend.score("m", chain))


@pytest.mark.redis
def test_redis_replicas_agree_and_survive_restart(redis_server):  # noqa: F811
    from kvstore.indexer.redis_index import RedisIndex

    a = RedisIndex(redis_server.url, "kvt")
    b = RedisIndex(redis_server.url, "kvt")  # a second indexer replica
    a.add("m", "n1", "CPU", H(1, 2, 3))
    a.add("m", "n2", "GPU", H(1, 2))
    assert a.score("m", H(1, 2, 3)) == b.score("m", H(1, 2, 3)) != []
    a.save_cursor("src", 41)
    a.close()
    c = RedisIndex(redis_server.url, "kvt")  # "restarted"
    assert c.score("m", H(1, 2, 3)) == [NodeScore("n1", 3, 0, 3, 0), NodeScore("n2", 2, 2, 0, 0)]
    assert c.load_cursor("src") == 41
    # memory follows the live index: cleared blocks leave no keys behind
    c.clear("n1", None)
    c.clear("n2", None)
    assert c.score("m", H(1, 2, 3)) == []
    keys = [k for k in c._r.scan_iter(match="kvt:m:*")]
    assert keys == []
    b.close()
    c.close()


@pytest.mark.redis
def test_redis_layout_mismatch_is_refused(redis_server):  # noqa: F811
    from kvstore.indexer.redis_index import RedisIndex

    RedisIndex(redis_server.url, "kvl", max_nodes=128).close()
    with pytest.raises(InvalidRequest, match="layout"):
        RedisIndex(redis_server.url, "kvl", max_nodes=256)


@pytest.mark.redis
def test_redis_unreachable_is_unavailable():
    from kvstore.errors import Unavailable
    from kvstore.indexer.redis_index import RedisIndex
    from kvstore_bench.ports import free_port

    with pytest.raises(Unavailable):
        RedisIndex(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)


@pytest.mark.redis
def test_mirror_loads_what_redis_holds(redis_server):  # noqa: F811
    from kvstore.indexer.mirror import MirroredIndex
    from kvstore.indexer.redis_index import RedisIndex

    r = RedisIndex(redis_server.url, "kvm")
    rng = np.random.default_rng(4)
    chain = rng.integers(0, 2**64, 300, dtype=np.uint64)
    for i in range(70):
        r.add("m", f"n{i}", MEDIUMS[i % 3], chain[: 1 + i * 4])
    r.add("other", "n1", "CPU", chain[:5])
    r.drop_node("n0")
    r.add("m", "n1", "GPU", chain[:9], rank=3)  # a DP rank's own entries
    m = MirroredIndex(RedisIndex(redis_server.url, "kvm"))
    assert m.loaded_blocks == (1 + 69 * 4) + 5  # distinct blocks of "m" and "other"
    assert m.score("m", chain) == r.score("m", chain)
    assert [x.rank for x in m.score("m", chain, ["n1"])[0].ranks] == [-1, 3]
    (other,) = m.score("other", chain)
    assert (other.node, other.prefix_blocks, other.cpu_blocks) == ("n1", 5, 5)
    assert "n0" not in m.nodes()
    m.add("m", "n1", "GPU", chain[:2])  # writes reach Redis too
    (n1,) = r.score("m", chain[:2], ["n1"])
    assert (n1.prefix_blocks, n1.gpu_blocks, n1.ranks[0]) == (2, 2, RankScore(-1, 2, 2, 0, 0))
    m.close()
    r.close()
