"""The client's copy loops stop at the lease deadline (issue 19 bug 4), on an injected clock."""

from __future__ import annotations

import itertools

import numpy as np

import kvstore.client as client_mod
from kvstore.client import gather, scatter

BLOCK = 4096


def ticking(times: list[float]):
    it = itertools.chain(times, itertools.repeat(times[-1]))
    return lambda: next(it)


def test_gather_counts_only_pieces_copied_before_the_deadline(monkeypatch):
    monkeypatch.setattr(client_mod, "COPY_CHUNK_BYTES", 2 * BLOCK)  # pieces of 2 blocks
    region = np.arange(8 * BLOCK, dtype=np.uint64).view(np.uint8)[: 8 * BLOCK].copy()
    offsets = np.arange(6, dtype=np.uint64) * BLOCK
    out = np.zeros((6, BLOCK), np.uint8)
    # Checks before and after each piece: piece 1 in time, piece 2 ends past the deadline.
    clock = ticking([0.0, 1.0, 2.0, 9.0])
    assert gather(region, offsets, out, BLOCK, deadline_s=5.0, clock=clock) == 2
    np.testing.assert_array_equal(out[:2], region[: 2 * BLOCK].reshape(2, BLOCK))
    assert gather(region, offsets, out, BLOCK) == 6  # no deadline: everything


def test_scatter_starts_no_piece_past_the_deadline(monkeypatch):
    monkeypatch.setattr(client_mod, "COPY_CHUNK_BYTES", 2 * BLOCK)
    region = np.zeros(8 * BLOCK, np.uint8)
    data = np.full((6, BLOCK), 7, np.uint8)
    offsets = np.arange(6, dtype=np.uint64) * BLOCK
    rows = np.arange(6, dtype=np.int64)
    clock = ticking([0.0, 1.0, 9.0])  # the third piece would start past the deadline
    assert scatter(region, offsets, data, rows, BLOCK, deadline_s=5.0, clock=clock) == 4
    assert (region[: 4 * BLOCK] == 7).all() and not region[4 * BLOCK :].any()


def test_small_batches_find_the_same_runs_as_the_numpy_path(monkeypatch):
    """Up to SMALL_RUNS_BLOCKS the runs are found in Python ints: same answer as numpy's."""
    rng = np.random.default_rng(7)
    cases = []
    for n in range(client_mod.SMALL_RUNS_BLOCKS + 1):
        for _ in range(40):
            slots = rng.permutation(64)[:n] if rng.random() < 0.5 else np.sort(rng.choice(64, n))
            offsets = slots.astype(np.uint64) * BLOCK
            rows = None
            if rng.random() < 0.5:
                rows = np.where(rng.random(n) < 0.8, np.arange(n), rng.integers(0, 30, n))
            cases.append((offsets, rows))
    small = [client_mod._runs(o, r, BLOCK) for o, r in cases]
    monkeypatch.setattr(client_mod, "SMALL_RUNS_BLOCKS", 0)  # numpy for every batch
    assert small == [client_mod._runs(o, r, BLOCK) for o, r in cases]
    offsets = np.array([0, 1, 2, 5, 6, 9], dtype=np.uint64) * BLOCK
    assert small and client_mod._runs(offsets, None, BLOCK) == [(0, 3), (3, 5), (5, 6)]


def test_gather_copies_as_a_load_and_scatter_as_a_store(monkeypatch):
    """The grouped loop is chosen per direction (kvstore.memcopy): a gather reads
    out of the region (a load), a scatter writes into it (a store)."""
    from kvstore import memcopy

    seen: list[bool] = []
    real = memcopy.copy_pieces

    def recording(pieces, **kw):  # type: ignore[no-untyped-def]
        seen.append(kw.get("load", False))
        return real(pieces, **kw)

    monkeypatch.setattr(memcopy, "copy_pieces", recording)
    region = np.zeros(8 * BLOCK, np.uint8)
    offsets = np.array([5, 1, 3], dtype=np.uint64) * BLOCK
    data = np.arange(3 * BLOCK, dtype=np.uint8).reshape(3, BLOCK)
    assert scatter(region, offsets, data, np.arange(3), BLOCK) == 3
    out = np.zeros_like(data)
    assert gather(region, offsets, out, BLOCK) == 3
    np.testing.assert_array_equal(out, data)
    assert seen == [False, True]
