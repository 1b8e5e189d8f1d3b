"""The Score's compiled prefix walk answers exactly as the numpy walk does.

``MemoryIndex(native=True)`` walks in ``kvstore.indexer._walk_kernel``;
``native=False`` in numpy (``_Table.rows`` + ``fold_ranks`` + ``prefix_scores``),
the path the reference tests (tests/integration/test_indexer_backends.py) pin
down. Both indexes get the same random operations: tiers, DP ranks, removals,
medium-scoped clears, dropped nodes (ids reused), more than 64 nodes (several
bitset words), tombstoned slots, hash 0, duplicate and absent hashes; every
Score must be equal, candidates or all nodes. numba is a dependency of the
``router`` extra (and of vLLM): missing, this fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore.indexer import walk
from kvstore.indexer.memory import MemoryIndex

REPO = Path(__file__).resolve().parents[2]
MEDIUMS = ("GPU", "CPU", "DISK", "KVSTORE_GPU", "STORAGE", None)


def test_the_compiled_walk_is_available():
    index = MemoryIndex()  # starts the compile in the background; numpy answers meanwhile
    assert walk.available(), "numba missing or the kernel failed to compile (see the log)"
    assert index.native and MemoryIndex().native
    assert not MemoryIndex(native=False).native


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_operations_score_alike_both_walks(seed):
    assert walk.available()
    rng = np.random.default_rng(seed)
    native = MemoryIndex(initial_capacity=1024, native=True)
    numpy_ = MemoryIndex(initial_capacity=1024, native=False)
    nodes = [f"n{i}" for i in range(70)]  # > 64: node ids in two words
    pool = rng.integers(0, 2**64, 4000, dtype=np.uint64)
    pool[17] = 0
    compared = nonempty = 0
    for step in range(2500):
        node = nodes[int(rng.integers(0, 12 if step < 1200 else len(nodes)))]
        rank = None if rng.random() < 0.6 else int(rng.integers(0, 3))
        medium = "GPU" if rank is not None else MEDIUMS[int(rng.integers(0, len(MEDIUMS)))]
        lo = int(rng.integers(0, 3900))
        hs = pool[lo : lo + int(rng.integers(1, 120))]
        op = rng.random()
        if op < 0.6:
            for ix in (native, numpy_):
                ix.add("m", node, medium, hs, rank)
        elif op < 0.9:
            for ix in (native, numpy_):
                ix.remove("m", node, medium, hs, rank)
        elif op < 0.93:
            for ix in (native, numpy_):
                ix.drop_node(node)
        else:
            mediums = None if rng.random() < 0.5 else [medium or "GPU"]
            for ix in (native, numpy_):
                ix.clear(node, "m", mediums, rank)
        if step % 7 == 0:
            start = int(rng.integers(0, 3900))
            q = pool[start : start + int(rng.integers(0, 4000))]
            if rng.random() < 0.2:  # absent and repeated hashes inside a prefix
                q = np.concatenate([q[:5], q[:3], rng.integers(0, 2**64, 4, dtype=np.uint64), q])
            cand = None if rng.random() < 0.3 else [str(n) for n in rng.choice(nodes, 6)]
            got, want = native.score("m", q, cand), numpy_.score("m", q, cand)
            assert got == want, (step, got, want)
            compared += 1
            nonempty += bool(want)
    assert compared > 300 and nonempty > 100  # the walks compared on real prefixes


def test_long_prefix_counts_and_early_stop():
    """A prefix of 70,000 blocks (many lookahead chunks of 512; tier counts past
    2**16, 17 counter planes); a request nobody holds walks no further than its
    first block."""
    native = MemoryIndex(native=True)
    numpy_ = MemoryIndex(native=False)
    hs = np.arange(1, 70_001, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    for ix in (native, numpy_):
        ix.add("m", "a", "CPU", hs)
        ix.add("m", "a", "GPU", hs[:40_000:2])
        ix.add("m", "b", "DISK", hs[:1_234])
        ix.add("m", "c", "GPU", hs[1:])
    got = native.score("m", hs, ["a", "b", "c"])
    assert got == numpy_.score("m", hs, ["a", "b", "c"])
    assert [(s.node, s.prefix_blocks, s.gpu_blocks, s.disk_blocks) for s in got] == [
        ("a", 70_000, 20_000, 0),
        ("b", 1_234, 0, 1_234),
    ]
    assert native.score("m", hs[::-1] + np.uint64(1), None) == []


def test_turned_off_the_numpy_walk_answers_and_native_is_refused():
    """``KVSTORE_NATIVE_WALK=0`` (a fresh process: the choice is made once per
    process): the index walks in numpy, and asking for the compiled walk is a
    ConfigError naming why it may be missing."""
    code = (
        "import numpy as np\n"
        "from kvstore.errors import ConfigError\n"
        "from kvstore.indexer import walk\n"
        "from kvstore.indexer.memory import MemoryIndex\n"
        "ix = MemoryIndex()\n"
        "assert not walk.available() and not ix.native\n"
        "ix.add('m', 'a', 'CPU', np.arange(1, 9, dtype=np.uint64))\n"
        "assert ix.score('m', np.arange(1, 5, dtype=np.uint64))[0].prefix_blocks == 4\n"
        "try:\n"
        "    MemoryIndex(native=True)\n"
        "except ConfigError as e:\n"
        "    assert 'KVSTORE_NATIVE_WALK=0' in str(e)\n"
        "else:\n"
        "    raise AssertionError('native=True was accepted')\n"
    )
    env = dict(os.environ, KVSTORE_NATIVE_WALK="0", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
