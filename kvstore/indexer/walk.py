"""The Score's prefix walk in one compiled pass (numba), when numba is installed.

Why: ``MemoryIndex.score`` in numpy is a dozen array passes per probe round
and per reduction; for a re-sent 195k-token context (12,187 hashes, 8 nodes,
a 43 MB table) it cost ~3.0 ms here, ~1.4 ms of it linear-probing rounds (the
few keys far from their home slot keep a round going, and every round costs
the fixed overhead of a dozen numpy calls), ~0.9 ms gathering rows, ~0.4 ms
the reductions. The walk below probes, folds ranks, ANDs and counts tiers
block by block in one loop (looking 512 blocks ahead, so the cache misses of
independent lookups overlap), and stops at the first block no candidate holds:
0.6-0.8 ms for the same request at load 2-3, 0.95 ms vs 3.9 ms numpy at load
9.6 (docs/router.md, "With the compiled prefix walk").

Same semantics as the numpy path (``MemoryIndex.score`` with
``native=False``: ``_Table.rows`` + ``fold_ranks`` + ``prefix_scores``),
checked against it on random operations and against a real indexer's Score
(tests/unit/test_index_walk.py, tests/integration/test_local_index_walk.py):

- a block is held by a node in any medium; a node's prefix is the number of
  leading blocks it holds (the running AND over blocks);
- a rank member's column also holds what its node's column holds (fold);
- per node, its prefix blocks' fastest tier: GPU (engine GPU or the daemon's
  GPU tier), else CPU, else DISK; the walk counts GPU and DISK-only blocks per
  node with bit-sliced counters (64 nodes per word added in ~2 word ops), and
  CPU is the rest.

numba is optional (``kvstore.native``): without it, with
``KVSTORE_NATIVE_WALK=0``, or if the kernel fails to compile, the numpy path
answers; also while the kernel compiles (``start``: in a thread).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from kvstore.native import CompiledKernel

log = logging.getLogger("kvstore.indexer")


def _build() -> Any:
    from kvstore.indexer import _walk_kernel

    kernel = _walk_kernel.walk_blocks
    prefix = np.zeros(64, dtype=np.int64)
    # compile now (or load numba's cache), with the argument types the index passes
    kernel(
        np.zeros(8, dtype=np.uint64),
        np.zeros(8, dtype=np.uint8),
        np.zeros((8, 4), dtype=np.uint64),
        1,
        np.uint64(1),
        np.uint64(61),
        np.int64(7),
        np.zeros(1, dtype=np.uint64),
        np.ones(1, dtype=np.uint64),
        np.zeros((0, 2), dtype=np.int64),
        prefix,
        prefix.copy(),
        prefix.copy(),
    )
    return kernel


_compiled = CompiledKernel(
    _build,
    name="the Score's prefix walk",
    off_env="KVSTORE_NATIVE_WALK",
    fallback="the Score walks in numpy",
    log=log,
)
# Compile in the background, once per process (idempotent); the numpy walk
# answers until it is done (kvstore.native says why not at the first Score).
start = _compiled.start
ready = _compiled.ready  # whether the compiled walk answers now (never waits)
# Whether it answers once compiled (waits up to timeout_s, None: until done):
# numba importable, not turned off, the kernel compiled.
available = _compiled.available


def walk(
    keys: np.ndarray,
    state: np.ndarray,
    bits: np.ndarray,
    n_w: int,
    mult: np.uint64,
    shift: np.uint64,
    mask: np.int64,
    hashes: np.ndarray,
    alive: np.ndarray,
    pairs: np.ndarray,
    prefix: np.ndarray,
    gpu: np.ndarray,
    disk: np.ndarray,
) -> int:
    """The compiled walk (``available()`` first); ``bits`` the table's
    (slot, medium x word) view, ``n_w`` its words. Per node id ``b`` it writes
    ``prefix[b]`` (leading blocks held; 0 where not a candidate), ``gpu[b]`` and
    ``disk[b]`` (of those, GPU and DISK-only blocks); returns the blocks walked."""
    return int(
        _compiled.kernel(
            keys, state, bits, n_w, mult, shift, mask, hashes, alive, pairs, prefix, gpu, disk
        )
    )
