"""Store slots reserved ahead (reserve_store, CommitStore.positions) against a real
daemon over the lean channel: bytes, events, bad input, races, a killed client."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvstore import client as client_module
from kvstore import errors
from kvstore.client import Client
from tests.conftest import make_spec

BLOCK = 4096
BS = 16  # make_spec's block_size_tokens


def _wait_until(cond, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s}s"
        time.sleep(0.02)


def _write(c: Client, handle, position: int, value: int) -> None:
    c.view(int(handle.offsets[position]), BLOCK)[:] = value


def test_bytes_written_into_a_reserve_are_what_a_load_reads(daemon):
    with Client(daemon.address) as c:
        assert c.using_local_channel and c.reserves
        ns = c.declare_namespace(make_spec(BLOCK))
        used = c.stats().tiers[0].used_bytes
        h = c.reserve_store(ns, 4)
        assert h.reserve and len(h.allocated) == 4 and h.deadline_s > time.monotonic()
        _write(c, h, 3, 71)
        _write(c, h, 1, 72)
        assert c.stats().tiers[0].blocks == 0  # slots held, no block shown
        assert c.commit_store(h, [501, 502], positions=[3, 1], token_ids=list(range(2 * BS))) == 2
        got = c.get(ns, [501, 502])
        assert got.found == 2 and [int(r[0]) for r in got.data] == [71, 72]
        assert bool((got.data[0] == 71).all()) and bool((got.data[1] == 72).all())
        s = c.stats()
        assert s.tiers[0].blocks == 2 and s.tiers[0].used_bytes == used + 2 * ns.block_bytes
        assert s.active_leases == 0


@pytest.mark.parametrize(
    ("hashes", "positions", "error"),
    [
        ([1, 2], [0, 9], errors.InvalidRequest),  # out of range
        ([1, 2], [1, 1], errors.InvalidRequest),  # repeated position
        ([1, 2], [0], errors.InvalidRequest),  # lengths differ
        ([1, 1], [0, 1], errors.InvalidRequest),  # repeated hash
        ([1, 2], None, errors.StateConflict),  # a reserve committed without positions
    ],
)
def test_bad_commits_get_their_status_and_the_reserve_stays_usable(
    daemon, hashes, positions, error
):
    with Client(daemon.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        h = c.reserve_store(ns, 4)
        with pytest.raises(error):
            c.commit_store(h, hashes, positions=positions)
        assert c.stats().active_leases == 1
        _write(c, h, 2, 9)
        assert c.commit_store(h, [11], positions=[2]) == 1
        assert int(c.get(ns, [11]).data[0][0]) == 9


def test_positions_on_a_prepared_store_and_reserves_over_grpc_are_refused(daemon):
    with Client(daemon.address) as lean, Client(daemon.address, local_channel=False) as rpc:
        ns = lean.declare_namespace(make_spec(BLOCK))
        prepared = lean.prepare_store(ns, [21, 22])
        with pytest.raises(errors.StateConflict):
            lean.commit_store(prepared, [21, 22], positions=[0, 1])
        assert lean.commit_store(prepared) == 2  # it still stands
        assert not rpc.reserves
        with pytest.raises(errors.StateConflict):
            rpc.reserve_store(rpc.declare_namespace(make_spec(BLOCK)), 2)
        h = lean.reserve_store(ns, 2)
        with pytest.raises(errors.StateConflict):
            rpc.commit_store(h, [23])  # gRPC has no positions: refused, not misbound
        assert lean.commit_store(h, [23], positions=[0]) == 1


def test_a_reserve_committed_in_parts_over_the_lean_channel(daemon):
    # Three store steps into one reserve of 6 slots, commits not waited for: each
    # keeps the rest, the last one (no keep) frees what is left. Bytes exact.
    with Client(daemon.address) as c:
        assert c.reserve_keep
        ns = c.declare_namespace(make_spec(BLOCK))
        used = c.stats().tiers[0].used_bytes
        h = c.reserve_store(ns, 6)
        done: list[int | errors.KVStoreError] = []
        _write(c, h, 0, 31)
        _write(c, h, 1, 32)
        c.commit_store_later(h, [601, 602], positions=[0, 1], keep_rest=True, on_done=done.append)
        _write(c, h, 2, 33)
        c.commit_store_later(h, [603], positions=[2], keep_rest=True, on_done=done.append)
        _write(c, h, 4, 35)
        c.commit_store_later(h, [605], positions=[4], on_done=done.append)  # the rest freed
        c.flush()
        assert done == [2, 1, 1]
        got = c.get(ns, [601, 602, 603, 605])
        assert got.found == 4 and [int(r[0]) for r in got.data] == [31, 32, 33, 35]
        assert all(bool((r == r[0]).all()) for r in got.data)
        s = c.stats()
        assert s.active_leases == 0 and s.tiers[0].used_bytes == used + 4 * ns.block_bytes
        # a position committed already is refused: InvalidRequest, the lease stands
        h2 = c.reserve_store(ns, 3)
        assert c.commit_store(h2, [611], positions=[0], keep_rest=True) == 1
        with pytest.raises(errors.InvalidRequest, match="committed already"):
            c.commit_store(h2, [612], positions=[0], keep_rest=True)
        assert c.stats().active_leases == 1
        _write(c, h2, 1, 41)
        assert c.commit_store(h2, [612], positions=[1]) == 1
        assert int(c.get(ns, [612]).data[0][0]) == 41 and c.stats().active_leases == 0


def test_keep_rest_is_refused_where_it_could_be_misread(daemon):
    with Client(daemon.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        prepared = c.prepare_store(ns, [621])
        with pytest.raises(errors.InvalidRequest, match="names positions"):
            c.commit_store(prepared, [621], keep_rest=True)  # not a reserve's commit
        assert c.commit_store(prepared) == 1
        h = c.reserve_store(ns, 2)
        # A daemon that does not say it serves keep_rest (an older one) would free
        # the rest: refused before anything is sent, the reserve still usable.
        local = c.local
        assert local is not None
        local.reserve_keep = False
        sent = local.frames_sent
        for later in (False, True):
            with pytest.raises(errors.StateConflict, match="keep_rest"):
                if later:
                    c.commit_store_later(h, [622], positions=[0], keep_rest=True)
                else:
                    c.commit_store(h, [622], positions=[0], keep_rest=True)
        assert local.frames_sent == sent
        assert c.commit_store(h, [622], positions=[0]) == 1


def test_a_release_queued_for_later_rides_in_the_next_frame(daemon, monkeypatch):
    # The queued release would go on its own after 5 ms: a stall of the test
    # before its next call would send it first.
    monkeypatch.setattr(client_module, "NOTICE_DELAY_S", 60.0)
    with Client(daemon.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        h = c.reserve_store(ns, 2)
        local = c.local
        assert local is not None
        sent = local.frames_sent
        c.release_all([h], wait=False, now=False)
        assert local.frames_sent == sent and local.queued == 1  # nothing sent yet
        other = c.reserve_store(ns, 1)  # the next frame carries it, ahead of this call
        assert local.frames_sent == sent + 1 and local.queued == 0
        assert c.stats().active_leases == 1  # the first reserve is gone, this one stands
        c.release_all([other], wait=False)
        _wait_until(lambda: c.stats().active_leases == 0, what="the release")


def test_binding_onto_a_present_or_in_flight_hash_commits_nothing_for_it(daemon):
    with Client(daemon.address) as a, Client(daemon.address) as b:
        ns = a.declare_namespace(make_spec(BLOCK))
        a.put(ns, [31], np.full((1, BLOCK), 1, np.uint8))
        flying = b.prepare_store(b.declare_namespace(make_spec(BLOCK)), [32])
        used = a.stats().tiers[0].used_bytes
        h = a.reserve_store(ns, 3)
        for i in range(3):
            _write(a, h, i, 50 + i)
        assert a.commit_store(h, [31, 32, 33], positions=[0, 1, 2]) == 1
        assert a.stats().tiers[0].used_bytes == used + BLOCK  # two slots freed
        got = a.get(ns, [31])
        assert int(got.data[0][0]) == 1  # the stored block is untouched
        assert int(a.get(ns, [33]).data[0][0]) == 52
        b.view(int(flying.offsets[0]), BLOCK)[:] = 7
        assert b.commit_store(flying) == 1
        assert int(a.get(ns, [32]).data[0][0]) == 7


def test_two_clients_binding_the_same_hash_exactly_one_commits(daemon):
    with Client(daemon.address) as a, Client(daemon.address) as b:
        ns_a = a.declare_namespace(make_spec(BLOCK))
        ns_b = b.declare_namespace(make_spec(BLOCK))
        ha, hb = a.reserve_store(ns_a, 2), b.reserve_store(ns_b, 2)
        _write(a, ha, 0, 1)
        _write(b, hb, 1, 2)
        got: list[int | errors.KVStoreError] = []
        a.commit_store_later(ha, [41], positions=[0], on_done=got.append)
        b.commit_store_later(hb, [41], positions=[1], on_done=got.append)
        a.flush()
        b.flush()
        assert sorted(got) == [0, 1]  # type: ignore[type-var]
        value = int(a.get(ns_a, [41]).data[0][0])
        assert value == (1 if got[0] == 1 else 2)
        assert a.stats().active_leases == 0


def test_a_commit_asks_for_the_next_reserve_in_the_same_frame(daemon):
    with Client(daemon.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        first = c.reserve_store(ns, 2)
        local = c.local
        assert local is not None
        frames, waits = local.frames_sent, local.waits
        committed: list = []
        reserved: list = []
        _write(c, first, 0, 5)
        c.commit_store_later(
            first,
            [61],
            positions=[0],
            on_done=committed.append,
            reserve_blocks=3,
            on_reserved=reserved.append,
        )
        assert (local.frames_sent, local.waits) == (frames + 1, waits)  # one send, no wait
        assert committed == reserved == []
        c.flush()
        assert committed == [1]
        (nxt,) = reserved
        assert nxt.reserve and len(nxt.allocated) == 3 and nxt.deadline_s > time.monotonic()
        assert c.stats().active_leases == 1
        _write(c, nxt, 2, 6)
        assert c.commit_store(nxt, [62], positions=[2]) == 1
        assert int(c.get(ns, [62]).data[0][0]) == 6


def test_placeholders_never_appear_in_events(daemon_factory):
    from kvstore.events.wire import BlockStored, full_decoder
    from kvstore_bench.ports import free_port
    from tests.integration._events import EventTap

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    d = daemon_factory(
        settings={
            "events.enabled": True,
            "events.publish_address": endpoint,
            "events.replay_address": "",
        }
    )
    tap = EventTap(d.address, endpoint, b"kv@", BLOCK)
    dec = full_decoder()
    try:
        with Client(d.address) as c:
            ns = c.declare_namespace(make_spec(BLOCK))
            c.put(ns, [70], np.zeros((1, BLOCK), np.uint8))
            h = c.reserve_store(ns, 8)
            # 70 is there already: the chain's event starts after it, parented on it
            n = c.commit_store(
                h, [70, 71, 72], positions=[5, 0, 1], parent_block_hash=69, token_ids=range(3 * BS)
            )
            assert n == 2
            released = c.reserve_store(ns, 4)
            c.release(released)

        stored: list[BlockStored] = []

        def arrived() -> bool:
            stored.clear()
            for topic, _, payload in tap.frames:
                if topic.endswith(b"@tiny"):
                    stored.extend(
                        e for e in dec.decode(payload).events if isinstance(e, BlockStored)
                    )
            return any(72 in e.block_hashes for e in stored)

        tap.collect(arrived)
        tap.drain(0.3)
        arrived()
    finally:
        tap.close()
    hashes = [[int(x) for x in e.block_hashes] for e in stored]
    assert hashes == [[70], [71, 72]]
    assert stored[1].parent_block_hash == 70
    assert stored[1].token_ids == list(range(BS, 3 * BS))


def test_a_client_killed_holding_a_reserve_gets_its_slots_back(daemon_factory):
    d = daemon_factory(
        settings={
            "leases.default_ttl_s": 0.5,
            "leases.max_ttl_s": 1.0,
            "leases.quarantine_s": 0.0,
            "leases.reap_interval_s": 0.02,
        }
    )
    with Client(d.address) as c:
        c.declare_namespace(make_spec(BLOCK))
        before = c.stats()
    script = textwrap.dedent(
        f"""
        import os, signal
        from kvstore.client import Client
        from tests.conftest import make_spec
        c = Client({d.address!r})
        ns = c.declare_namespace(make_spec({BLOCK}))
        h = c.reserve_store(ns, 5)
        got = []
        c.reserve_store_later(ns, 3, on_done=got.append)
        c.flush()
        assert len(h.allocated) == 5 and len(got[0].allocated) == 3
        c.view(int(h.offsets[0]), {BLOCK})[:] = 1
        print("reserved", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == -9 and "reserved" in out.stdout, out.stderr
    with Client(d.address) as c:
        _wait_until(
            lambda: c.stats().active_leases == 0, what="the killed client's reserves expire"
        )
        s = c.stats()
        assert s.expired_leases == 2
        assert s.tiers[0].used_bytes == before.tiers[0].used_bytes  # the 8 slots came back
        assert s.tiers[0].blocks == before.tiers[0].blocks
