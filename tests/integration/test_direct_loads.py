"""Direct loads (docs/presence.md "Direct loads") against real daemons: a local client
reads DRAM blocks found in the presence table with no call and no lease, then checks
after its copy that every block stayed in its slot.

What each case gets: a get of held DRAM blocks makes no round trip and the daemon
counts the loads; a block deleted, evicted or moved while it is read is never
trusted (the get reads it again the leased way, a two-phase caller's ``intact``
says so); readers racing a writer process that churns every slot never see a
wrong byte; blocks on disk go through the daemon (promoted); a warm restart or a
kill -9 leaves no old handle intact and no answer from a dead daemon's table; a
bad ``loaded_direct`` message gets the gRPC service's error; hits read directly
keep their blocks warm for eviction.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import termios
import textwrap
import threading
import time
import urllib.request

import numpy as np
import pytest

from kvstore import client as client_module
from kvstore import errors, local_wire
from kvstore.client import Client, LoadHandle, gather
from kvstore.v1 import store_pb2 as pb
from tests.conftest import make_spec
from tests.integration.test_local_channel import Raw

BLOCK = 4096
MiB = 1 << 20


def content(hashes: np.ndarray | list[int]) -> np.ndarray:
    """Each hash's block: its 8 bytes, then a byte pattern that depends on it."""
    hs = np.asarray(hashes, dtype=np.uint64)
    out = np.empty((len(hs), BLOCK), dtype=np.uint8)
    out[:] = (hs % np.uint64(251)).astype(np.uint8)[:, None]
    out[:, :8] = hs.view(np.uint8).reshape(len(hs), 8)
    return out


def _metric(d, name: str) -> float:
    text = urllib.request.urlopen(f"http://{d.metrics_address}/metrics", timeout=5).read()
    for line in text.decode().splitlines():
        if line.split("{")[0].split(" ")[0] in (name, name + "_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not on /metrics")


def test_a_get_of_dram_blocks_makes_no_round_trip_and_the_daemon_counts_it(
    daemon_factory, monkeypatch
):
    monkeypatch.setattr(client_module, "NOTICE_DELAY_S", 60.0)  # no notice on its own here
    d = daemon_factory(metrics=True)
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        hashes = list(range(100, 164))
        c.put(ns, hashes, content(hashes))
        local = c.local
        assert local is not None and local.direct_loads
        waits, frames = local.waits, local.frames_sent
        for n in (1, 16, 17, 64):  # Python-int and numpy probes
            got = c.get(ns, hashes[:n] + [9999])
            assert got.found == n and np.array_equal(got.data, content(hashes[:n]))
        assert local.waits == waits, "a direct get waited for an answer"
        # Nothing sent during the loads: one unanswered loaded_direct each, queued
        assert local.frames_sent == frames and local.queued == 4
        assert c.direct_loaded_blocks == 1 + 16 + 17 + 64 and c.direct_lost_blocks == 0
        # This client's next call (gRPC too) sends them first: its stats count them.
        assert c.stats().loaded_blocks == 98
        assert local.frames_sent == frames + 1 and local.queued == 0
        assert c.stats().active_leases == 0
        assert _metric(d, "kvstore_load_direct_blocks") == 98
        # a miss at the first block: nothing read, nothing sent
        assert c.get(ns, [1, 2]).found == 0 and local.frames_sent == frames + 1
        assert local.queued == 0


def test_a_direct_loads_notice_rides_the_next_frame_or_goes_within_the_delay(
    daemon_factory, monkeypatch
):
    """What a direct load tells the daemon is never lost and never waits long: it
    rides in the client's next lean frame; a client that makes no next call sends
    it on its own within NOTICE_DELAY_S; close() sends what is still queued."""
    d = daemon_factory()
    with Client(d.address) as w:
        ns = w.declare_namespace(make_spec(BLOCK))
        w.put(ns, list(range(1, 33)), content(list(range(1, 33))))
        base = w.stats().loaded_blocks

        def loaded() -> int:  # asked by another client: no flush of the reader's queue
            return int(w.stats().loaded_blocks) - base

        monkeypatch.setattr(client_module, "NOTICE_DELAY_S", 60.0)
        with Client(d.address) as c:
            cns = c.declare_namespace(make_spec(BLOCK))
            local = c.local
            assert local is not None
            frames = local.frames_sent
            assert c.get(cns, [1, 2, 3]).found == 3 and local.queued == 1
            assert loaded() == 0  # not sent yet
            c.put(cns, [40], content([40]))  # a call: prepare, then commit
            assert local.frames_sent == frames + 2 and local.queued == 0
            assert loaded() == 3  # rode in the prepare's frame
            assert c.get(cns, [7, 8]).found == 2 and local.queued == 1
        assert loaded() == 5  # close() sent it

        monkeypatch.setattr(client_module, "NOTICE_DELAY_S", 0.05)
        threads = _notice_threads()
        with Client(d.address) as c:
            # started with the channel, not by the first notice: a thread's start
            # (0.3-0.6 ms) is not paid by the engine step that queues one
            assert _notice_threads() == threads + 1
            cns = c.declare_namespace(make_spec(BLOCK))
            t0 = time.monotonic()
            assert c.get(cns, [10, 11, 12, 13]).found == 4
            while loaded() < 9 and time.monotonic() - t0 < 5.0:
                time.sleep(0.01)
            assert loaded() == 9, "the notice was not sent on its own"
            assert c.local is not None and c.local.queued == 0
            assert _notice_threads() == threads + 1
        assert _notice_threads() == threads  # close() stopped it


def _notice_threads() -> int:
    return sum(t.name == "kvstore-notices" and t.is_alive() for t in threading.enumerate())


def test_a_load_after_commits_sent_without_waiting_reads_their_answers_and_goes_direct(
    daemon_factory, monkeypatch
):
    """A store step's commits go out without waiting (commit_store_later); the next
    step's load reads the answers that have arrived (no call, no wait: their
    on_done run) and then loads directly, its own blocks included (the daemon
    wrote its presence table before answering). A commit still unanswered, or a
    hung-up daemon, sends the load to the daemon instead."""
    monkeypatch.setattr(client_module, "NOTICE_DELAY_S", 60.0)
    d = daemon_factory()
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        local = c.local
        assert local is not None and local.direct_loads
        committed: list[object] = []
        handles = []
        for first in (100, 200):
            hashes = list(range(first, first + 8))
            handles.append(h := c.prepare_store(ns, hashes))
            for off, row in zip(h.offsets.tolist(), content(hashes), strict=True):
                c.view(off, BLOCK)[:] = row
        for h in handles:  # two commits sent, neither answer read
            c.commit_store_later(h, on_done=committed.append)
        assert committed == [] and local.unanswered == 2
        # Both answers here, unread: the socket holds at least their bytes (as
        # one frame; as two, it is more). Small writes arrive whole.
        seqs = [seq for seq, _ in local._unanswered]
        answers_bytes = len(local_wire.frame([local_wire.Committed(s, 8) for s in seqs]))
        deadline = time.monotonic() + 5.0
        while _unread_bytes(local._sock) < answers_bytes:
            assert time.monotonic() < deadline, "the daemon did not answer"
            time.sleep(0.001)
        waits, frames = local.waits, local.frames_sent
        wanted = list(range(100, 108)) + list(range(200, 208))
        h = c.prepare_load(ns, wanted, pin=False)
        assert h.lease_id == 0 and h.found == 16, "not a direct load"
        assert committed == [8, 8] and local.unanswered == 0
        assert (local.waits, local.frames_sent) == (waits, frames), "a call was made"
        got = c.get(ns, wanted)
        assert got.found == 16 and np.array_equal(got.data, content(wanted))
        assert c.direct_lost_blocks == 0
        # A commit whose answer has not been read because it is not here: the
        # daemon is stopped (SIGSTOP) before it can answer, so the load is sent
        # to the daemon (answered once it runs again), never read from the table.
        hashes = list(range(300, 304))
        h = c.prepare_store(ns, hashes)
        for off, row in zip(h.offsets.tolist(), content(hashes), strict=True):
            c.view(off, BLOCK)[:] = row
        # The load is made while the daemon is still stopped: resumed first, the
        # daemon could answer the commit before the load looks (then rightly direct).
        os.kill(d.pid, signal.SIGSTOP)
        loaded: list[LoadHandle] = []
        try:
            c.commit_store_later(h, on_done=committed.append)
            time.sleep(0.05)
            assert not local.settle() and local.unanswered == 1
            waits, frames = local.waits, local.frames_sent
            loader = threading.Thread(
                target=lambda: loaded.append(c.prepare_load(ns, hashes, pin=False))
            )
            loader.start()
            deadline = time.monotonic() + 5.0
            while local.frames_sent == frames:  # the load went to the daemon
                assert time.monotonic() < deadline, "the load sent no call"
                time.sleep(0.001)
        finally:
            os.kill(d.pid, signal.SIGCONT)
        loader.join(timeout=10.0)
        assert loaded, "the load got no answer"
        h = loaded[0]
        assert h.lease_id != 0 and h.found == 4 and local.waits == waits + 1
        c.release(h)
        assert committed == [8, 8, 4]


def test_direct_loads_can_be_turned_off(daemon, monkeypatch):
    with Client(daemon.address) as w:
        ns = w.declare_namespace(make_spec(BLOCK))
        w.put(ns, [1, 2], content([1, 2]))
    for client in (
        Client(daemon.address, direct_loads=False),
        _with_env(monkeypatch, "KVSTORE_DIRECT_LOADS", "0", lambda: Client(daemon.address)),
    ):
        with client as c:
            ns = c.declare_namespace(make_spec(BLOCK))
            assert c.local is not None
            waits = c.local.waits
            assert np.array_equal(c.get(ns, [1, 2]).data, content([1, 2]))
            assert c.local.waits == waits + 1  # a PrepareLoad
            handle = c.prepare_load(ns, [1, 2], pin=False)
            assert handle.lease_id and handle.located is None
            c.release(handle)
            assert c.direct_loaded_blocks == 0


def _unread_bytes(sock: socket.socket) -> int:
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]


def _with_env(monkeypatch, key: str, value: str, make):  # type: ignore[no-untyped-def]
    monkeypatch.setenv(key, value)
    try:
        return make()
    finally:
        monkeypatch.delenv(key)


def test_a_block_that_leaves_its_slot_during_the_copy_is_never_trusted(daemon_factory):
    """The race made deterministic: located, then deleted and its slot handed to
    another block before the copy. The copy reads the other block's bytes; intact
    says 0, and get() answers what the daemon holds now."""
    d = daemon_factory(dram_bytes=1 * MiB, chunk_bytes=1 * MiB)  # one chunk: slots reused
    reader, writer = Client(d.address), Client(d.address)
    try:
        ns = reader.declare_namespace(make_spec(BLOCK))
        wns = writer.declare_namespace(make_spec(BLOCK))
        old = list(range(1, 9))
        writer.put(wns, old, content(old))
        handle = reader.prepare_load(ns, old, pin=False)
        assert handle.lease_id == 0 and handle.found == 8 and handle.located is not None
        writer.delete(wns, old)
        new = list(range(1001, 1009))
        writer.put(wns, new, content(new))
        out = np.empty((8, BLOCK), dtype=np.uint8)
        assert reader.region is not None
        gather(reader.region, handle.offsets, out, BLOCK)
        # the slots went to the new blocks: the bytes copied are theirs, not the old ones
        reused = [i for i in range(8) if np.array_equal(out[i], content(new)[i])]
        assert reused, "the freed slots were not reused (the case is not shown)"
        assert reader.intact(handle) == 0 and reader.direct_lost_blocks == 8
        assert reader.get(ns, old).found == 0
        # evicted instead of deleted: the same
        handle = reader.prepare_load(ns, new, pin=False)
        flood = list(range(5000, 5000 + 300))  # 1 MiB holds 256 blocks
        for i in range(0, len(flood), 50):
            writer.put(wns, flood[i : i + 50], content(flood[i : i + 50]))
        assert reader.intact(handle) == 0
        got = reader.get(ns, new)
        assert got.found == writer.lookup(wns, new).prefix_blocks
    finally:
        reader.close()
        writer.close()


def test_a_get_that_loses_blocks_mid_copy_reads_the_rest_through_a_lease(daemon_factory):
    d = daemon_factory(dram_bytes=1 * MiB, chunk_bytes=1 * MiB)
    with Client(d.address) as c, Client(d.address) as w:
        ns = c.declare_namespace(make_spec(BLOCK))
        hashes = list(range(1, 33))
        c.put(ns, hashes, content(hashes))
        handle = c.prepare_load(ns, hashes, pin=False)
        assert handle.located is not None
        # one block of the prefix moves off and back: a new location, not the one read
        w.delete(w.declare_namespace(make_spec(BLOCK)), hashes[20:21])
        w.put(w.declare_namespace(make_spec(BLOCK)), hashes[20:21], content(hashes[20:21]))
        assert c.intact(handle) == 20
        got = c.get(ns, hashes)  # a fresh direct load: all 32, right
        assert got.found == 32 and np.array_equal(got.data, content(hashes))


READER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from kvstore.client import Client
    from tests.conftest import make_spec
    from tests.integration.test_direct_loads import BLOCK, content

    address, seconds = sys.argv[1], float(sys.argv[2])
    rng = np.random.default_rng(int(sys.argv[3]))
    universe = np.arange(1, 2001, dtype=np.uint64)
    with Client(address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        reads = found = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            start = int(rng.integers(0, 1950))
            want = universe[start : start + int(rng.integers(1, 40))]
            got = c.get(ns, want)
            if not np.array_equal(got.data, content(want[: got.found])):
                print("WRONG", start, got.found, flush=True)
                sys.exit(3)
            reads += 1
            found += got.found
        print(reads, found, c.direct_loaded_blocks, c.direct_lost_blocks, flush=True)
    """
)


def test_readers_racing_a_writer_that_churns_every_slot_get_no_wrong_byte(daemon_factory):
    """Two reader processes get random prefixes while this process stores, deletes
    and evicts through a region of 128 slots (every slot reused many times): every
    byte read is the block's own."""
    d = daemon_factory(dram_bytes=512 << 10, chunk_bytes=512 << 10)
    seconds = 4.0
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", READER_SCRIPT, d.address, str(seconds), str(seed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for seed in (1, 2)
    ]
    rng = np.random.default_rng(0)
    universe = np.arange(1, 2001, dtype=np.uint64)
    writes = 0
    with Client(d.address) as w:
        ns = w.declare_namespace(make_spec(BLOCK))
        deadline = time.monotonic() + seconds + 1.0
        while time.monotonic() < deadline and any(r.poll() is None for r in readers):
            start = int(rng.integers(0, 1960))
            # runs of the universe, so readers' prefixes are often held
            w.put(ns, universe[start : start + 40], content(universe[start : start + 40]))
            w.delete(ns, universe[start + 35 : start + 40])
            writes += 1
    lost = 0
    for r in readers:
        out, err = r.communicate(timeout=60)
        assert r.returncode == 0, (out, err[-3000:])
        reads, found, direct, lost_here = map(int, out.split())
        assert reads > 50 and found > 0 and direct > 0, out
        lost += lost_here
    assert writes > 50
    print(f"writes {writes}, blocks found gone after their copy: {lost}")


def test_blocks_on_disk_are_loaded_through_the_daemon(daemon_factory, tmp_path):
    (tmp_path / "disk").mkdir()
    d = daemon_factory(
        dram_bytes=1 * MiB,
        chunk_bytes=1 * MiB,
        settings={
            "disk.path": str(tmp_path / "disk"),
            "disk.capacity_bytes": "16MiB",
            "disk.slab_bytes": "1MiB",
            "disk.demote_free_fraction": 1.0,
        },
    )
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        hashes = list(range(1, 401))  # more than DRAM's 256: the oldest go to disk only
        for i in range(0, 400, 100):
            c.put(ns, hashes[i : i + 100], content(hashes[i : i + 100]))
            # the demoter writes copies behind the stores: a clean block is demoted
            # when evicted, a dirty one dropped; let it catch up
            deadline = time.monotonic() + 20
            while _disk_blocks(c) < min(i + 100, 256):
                assert time.monotonic() < deadline, "the demoter did not write"
                time.sleep(0.05)
        assert c.lookup(ns, hashes[:50]).by_tier == {"disk": 50}
        handle = c.prepare_load(ns, hashes[:8], pin=False)  # on disk: the daemon promotes
        assert handle.lease_id and handle.located is None
        c.release(handle)
        before = c.direct_loaded_blocks
        got = c.get(ns, hashes[:50])
        assert got.found == 50 and np.array_equal(got.data, content(hashes[:50]))
        assert c.direct_loaded_blocks == before  # promoted and pinned, not read directly


def _disk_blocks(c: Client) -> int:
    return sum(t.blocks for t in c.stats().tiers if t.tier == pb.TIER_DISK)


def test_a_warm_restart_leaves_no_old_handle_intact(daemon_factory):
    d = daemon_factory(dram_bytes=2 * MiB, chunk_bytes=1 * MiB)
    c = Client(d.address)
    ns = c.declare_namespace(make_spec(BLOCK))
    hashes = list(range(1, 17))
    c.put(ns, hashes, content(hashes))
    handle = c.prepare_load(ns, hashes, pin=False)
    assert handle.located is not None
    assert d.stop(keep_region=True) == 0
    d.start()  # the same region file: its slots are the new daemon's to hand out
    assert c.intact(handle) == 0
    got = c.get(ns, hashes)  # follows the new daemon (its table, its region)
    assert got.found == 16 and np.array_equal(got.data, content(hashes))
    c.close()


def test_a_killed_daemon_answers_no_direct_load(daemon_factory):
    d = daemon_factory(dram_bytes=2 * MiB, chunk_bytes=1 * MiB)
    c = Client(d.address, timeout_s=2.0)
    ns = c.declare_namespace(make_spec(BLOCK))
    hashes = list(range(1, 17))
    c.put(ns, hashes, content(hashes))
    assert c.get(ns, hashes).found == 16
    before = c.direct_loaded_blocks
    d.kill(keep_region=True)
    # its table still reads as current, but the lean connection's end is closed: the
    # load goes to the call, which meets the dead daemon
    with pytest.raises(errors.Unavailable):
        c.get(ns, hashes)
    assert c.direct_loaded_blocks == before
    c.close()


def test_bad_loaded_direct_messages_get_the_grpc_services_errors(daemon_factory):
    d = daemon_factory(settings={"limits.max_blocks_per_request": 16})
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        c.put(ns, [1, 2], content([1, 2]))
    raw = Raw(d)
    raw.hello()
    one = np.array([1], dtype="<u8").tobytes()
    raw.send(["loaded_direct", 1, ns.namespace_id, one + np.array([2], "<u8").tobytes()])
    assert raw.read() == [["loads_counted", 1, 2]]
    raw.send(["loaded_direct", 2, ns.namespace_id, b"\x00" * 7])
    assert raw.read() == [
        [
            "error",
            2,
            "invalid_request",
            "block_hashes must be packed uint64 (a multiple of 8 bytes), got 7 bytes",
        ]
    ]
    raw.send(["loaded_direct", 3, ns.namespace_id, b"\x00" * 8 * 17])
    assert raw.read() == [
        [
            "error",
            3,
            "invalid_request",
            "17 blocks in one request exceeds limits.max_blocks_per_request=16",
        ]
    ]
    raw.send(["loaded_direct", 4, "0" * 32, one])
    ((tag, seq, reason, _),) = raw.read()
    assert (tag, seq, reason) == ("error", 4, "namespace_not_found")
    # unknown hashes count nothing; seq 0 asks for no answer, even for an error
    raw.send(["loaded_direct", 0, "0" * 32, one], ["loaded_direct", 5, ns.namespace_id, b""])
    assert raw.read() == [["loads_counted", 5, 0]]
    raw.close()
    with Client(d.address) as c:
        assert c.stats().loaded_blocks == 2  # only the two held blocks of seq 1


def test_blocks_read_directly_stay_warm_for_eviction(daemon_factory):
    """The daemon's eviction order sees direct hits: a block read directly again
    and again survives a flood that evicts the blocks nobody read."""
    d = daemon_factory(dram_bytes=1 * MiB, chunk_bytes=1 * MiB)  # 256 slots
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        hot, cold = [1, 2, 3, 4], list(range(10, 110))
        c.put(ns, hot, content(hot))
        c.put(ns, cold, content(cold))
        flood = list(range(10_000, 10_400))
        for i in range(0, len(flood), 20):
            assert c.get(ns, hot).found == 4  # direct, every round
            c.put(ns, flood[i : i + 20], content(flood[i : i + 20]))
        c.flush()
        assert c.direct_loaded_blocks >= 4 * 20
        assert c.lookup(ns, hot).prefix_blocks == 4
        assert c.lookup(ns, cold[:1]).prefix_blocks == 0
