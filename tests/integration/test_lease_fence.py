"""Lease expiry is fenced, and leases belong to their owner (issue 19 bug 4, issue 13 defect 5).

Real daemons. Where a copy must outlive its lease, the copy routine is slowed
(wrapped so that it first waits, boundedly, until the daemon reports the lease
expired, and lets another client act meanwhile): the timing is forced, never
hoped for.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

import kvstore.client as client_mod
from kvstore.client import Client, StoreHandle
from kvstore.errors import KVStoreError, LeaseNotFound, NotFound
from kvstore.namespace import Namespace
from tests.conftest import make_spec

BLOCK = 4096
SLOTS = 16  # the whole DRAM tier: one 64 KiB chunk of 4 KiB slots


def blocks(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8)


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.fixture
def tiny(daemon_factory):
    return daemon_factory(
        dram_bytes=SLOTS * BLOCK,
        chunk_bytes=SLOTS * BLOCK,
        settings={"leases.default_ttl_s": 0.3, "leases.reap_interval_s": 0.02},
    )


def _put_for_long(c: Client, ns: Namespace, hashes: list[int], data: np.ndarray) -> int:
    """A put whose store lease outlives any stall (the daemon's default here is
    0.3 s, for the operation each test stalls): the blocks committed."""
    h = c.prepare_store(ns, hashes, lease_ttl_s=30.0)
    for i in h.allocated.tolist():
        c.view(int(h.offsets[i]), BLOCK)[:] = data[i]
    return c.commit_store(h)


def _assert_nothing_stranded(c: Client) -> None:
    c.flush_releases()
    wait_until(lambda: c.stats().active_leases == 0)  # quarantines end too
    dram = c.stats().tiers[0]
    assert dram.pinned_blocks == 0 and dram.used_bytes == dram.blocks * BLOCK


@pytest.mark.parametrize("direct", [False, True], ids=["leased", "direct"])
def test_get_whose_copy_outlived_its_lease_reports_the_blocks_not_found(tiny, monkeypatch, direct):
    """Bug 4a: a get whose copy took longer than the TTL returned found=4 with
    another block's bytes (the reaper had unpinned them; another store reused the slots).
    A direct load (no lease, docs/presence.md) meets the same race without waiting
    for an expiry: the slots go to another block mid-copy, the check after the copy
    refuses them, and the get then finds what the daemon holds (nothing)."""
    mine, theirs = blocks(1, 4), blocks(2, SLOTS)
    with Client(tiny.address, direct_loads=direct) as a, Client(tiny.address) as b:
        ns = a.declare_namespace(make_spec(BLOCK))
        nb = b.declare_namespace(make_spec(BLOCK))
        assert _put_for_long(a, ns, [1, 2, 3, 4], mine) == 4
        real_gather = client_mod.gather
        stalled: list[bool] = []

        def stalled_gather(*args, **kw):  # the copy thread stalls past the lease
            if not stalled:  # (the first copy: a direct get's second is its leased retry)
                stalled.append(True)
                if not direct:
                    wait_until(lambda: b.stats().expired_leases >= 1)
                _put_for_long(b, nb, list(range(100, 100 + SLOTS)), theirs)  # every slot
            return real_gather(*args, **kw)

        monkeypatch.setattr(client_mod, "gather", stalled_gather)
        got = a.get(ns, [1, 2, 3, 4])
        monkeypatch.undo()
        # Never found with wrong bytes: a copy past the lease counts as not found.
        np.testing.assert_array_equal(got.data, mine[: got.found])
        assert got.found == 0
        assert a.direct_lost_blocks == (4 if direct else 0)
        _assert_nothing_stranded(a)
        # The daemon kept serving the right bytes to everyone.
        again = a.get(ns, [1, 2, 3, 4])
        np.testing.assert_array_equal(again.data, mine[: again.found])
        theirs_now = b.get(nb, list(range(100, 100 + SLOTS)))
        for i in range(theirs_now.found):
            np.testing.assert_array_equal(theirs_now.data[i], theirs[i])


def test_put_whose_copy_outlived_its_lease_changes_no_committed_bytes(tiny, monkeypatch):
    """Bug 4b: a writer whose store lease expired wrote into slots already given to,
    and committed by, another client; only its own commit failed."""
    late, theirs = blocks(3, 4), blocks(4, SLOTS)
    with Client(tiny.address) as a, Client(tiny.address) as b:
        ns = a.declare_namespace(make_spec(BLOCK))
        nb = b.declare_namespace(make_spec(BLOCK, model="other"))
        real_scatter = client_mod.scatter
        stored: list[int] = []

        def stalled_scatter(*args, **kw):
            if not stored:  # A's copy stalls; B's own put (inside) copies at once
                wait_until(lambda: b.stats().expired_leases >= 1)
                stored.append(0)
                stored[0] = _put_for_long(b, nb, list(range(200, 200 + SLOTS)), theirs)
            return real_scatter(*args, **kw)

        monkeypatch.setattr(client_mod, "scatter", stalled_scatter)
        with pytest.raises(LeaseNotFound) as late_error:
            a.put(ns, [1, 2, 3, 4], late)
        monkeypatch.undo()
        assert stored and stored[0] > 0
        got = b.get(nb, list(range(200, 200 + SLOTS)))
        assert got.found == stored[0]
        np.testing.assert_array_equal(got.data, theirs[: got.found])  # not one byte changed
        assert "lease expired" in str(late_error.value)  # the late writer is told why
        assert a.lookup(ns, [1, 2, 3, 4]).prefix_blocks == 0
        _assert_nothing_stranded(a)
        # After the quarantine the slots are everyone's again.
        assert a.put(ns, [1, 2, 3, 4], late).stored + a.stats().evicted_blocks >= 4


def test_lease_ids_cannot_be_guessed_or_used_by_another_client(daemon_factory):
    """Issue 13 defect 5: ids were sequential, so a client could commit another's store
    lease before it wrote (readers then got zeros) or release its load lease."""
    # Data calls over TCP need the cluster secret (docs/security.md).
    daemon = daemon_factory(settings={"peer.secret": "lease-test-secret"})
    with (
        Client(daemon.tcp_address, secret="lease-test-secret", map_region=True) as a,
        Client(daemon.address) as b,
    ):
        ns = a.declare_namespace(make_spec(BLOCK))
        nb = b.declare_namespace(make_spec(BLOCK))
        assert a.put(ns, [50], blocks(5, 1)).stored == 1
        pinned = a.prepare_load(ns, [50])
        victim = a.prepare_store(ns, [1, 2])
        own = b.prepare_store(nb, [9])
        # B guesses around its own id (old ids were consecutive).
        hits = 0
        for guess in range(own.lease_id - 200, own.lease_id + 201):
            if guess in (0, own.lease_id):
                continue
            fake = StoreHandle(guess, nb, own.hashes, own.statuses, own.offsets)
            for attempt, arg in ((b.commit_store, fake), (b.release, guess)):
                try:
                    attempt(arg)  # type: ignore[operator]
                    hits += 1
                except NotFound:
                    pass  # the answer for an id never issued
                except KVStoreError:
                    hits += 1  # any other answer: the id named a live lease
        assert hits == 0
        assert b.lookup(nb, [1, 2]).prefix_blocks == 0  # nobody published A's empty slots
        # Even A's exact ids (as if leaked) answer only A: B is another caller.
        with pytest.raises(LeaseNotFound, match="never issued"):
            b.commit_store(
                StoreHandle(victim.lease_id, nb, victim.hashes, victim.statuses, victim.offsets)
            )
        with pytest.raises(LeaseNotFound, match="never issued"):
            b.release(pinned.lease_id)
        assert a.stats().tiers[0].pinned_blocks == 1  # A's pin held
        data = blocks(6, 2)
        a.view(int(victim.offsets[0]), BLOCK)[:] = data[0]
        a.view(int(victim.offsets[1]), BLOCK)[:] = data[1]
        assert a.commit_store(victim) == 2
        a.release(pinned)
        b.commit_store(own)
        np.testing.assert_array_equal(b.get(nb, [1, 2]).data, data)
