"""The presence table (kvstore.presence, docs/presence.md) against real daemons: a
client that maps it answers Lookup without a call, and its answer is the daemon's.

Every comparison is between two clients of one daemon: one probes the table
(map_region=True), the other calls Lookup (map_region=False maps nothing), after
stores, deletes, evictions, demotion to disk, GPU moves, clear, warm and cold
restarts; plus the file's mode, a garbage header, tenant regions (no table) and a
reader probing while the daemon rewrites the table under it.
"""

from __future__ import annotations

import grp
import os
import stat
import threading
import time

import numpy as np
import pytest

from kvstore import errors
from kvstore.client import Client
from kvstore.presence import HEADER_BYTES, MAGIC
from tests.conftest import make_spec

BLOCK = 4096
MiB = 1 << 20


def _table(d) -> str:
    return str(d.settings["dram.path"]) + ".presence"


def _data(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8)


def _same(prober: Client, caller: Client, ns, hashes) -> None:
    """The probe's answer is the daemon's, and it was a probe (no call)."""
    before = prober.probed_lookups
    probed = prober.lookup(ns, hashes)
    assert prober.probed_lookups == before + 1, "the lookup was not answered by the table"
    assert probed == caller.lookup(ns, hashes)


def _present_each(prober: Client, caller: Client, ns, hashes) -> int:
    """Block by block, the table and the daemon agree; returns how many are present."""
    present = 0
    for h in hashes:
        probed = prober.lookup(ns, [h])
        assert probed == caller.lookup(ns, [h]), h
        present += probed.prefix_blocks
    return present


def _pair(d) -> tuple[Client, Client]:
    prober, caller = Client(d.address), Client(d.address, map_region=False)
    assert prober.probes_lookups and not caller.probes_lookups
    return prober, caller


def test_stores_deletes_evictions_clear_and_other_namespaces(daemon_factory):
    d = daemon_factory(dram_bytes=2 * MiB, chunk_bytes=1 * MiB)  # 512 blocks
    prober, caller = _pair(d)
    ns = prober.declare_namespace(make_spec(BLOCK))
    other = prober.declare_namespace(make_spec(BLOCK, model="other"))
    hashes = list(range(1000, 1064))
    assert prober.put(ns, hashes, _data(64)).stored == 64
    _same(prober, caller, ns, hashes)
    _same(prober, caller, ns, hashes + [5, 6])
    _same(prober, caller, ns, [5] + hashes)  # the first miss ends the prefix
    _same(prober, caller, ns, [])
    assert prober.lookup(other, hashes).prefix_blocks == 0  # another namespace's blocks
    _same(prober, caller, other, hashes)
    # deletes, in the middle: the prefix stops there
    prober.delete(ns, hashes[10:12])
    _same(prober, caller, ns, hashes)
    assert prober.lookup(ns, hashes).prefix_blocks == 10
    # evictions: 900 more blocks through 512 slots
    more = list(range(5000, 5900))
    for i in range(0, len(more), 100):
        prober.put(ns, more[i : i + 100], _data(100, i))
    present = _present_each(prober, caller, ns, hashes + more)
    assert 0 < present <= 512
    _same(prober, caller, ns, more[-100:])
    # clear: nothing left (and the namespace is dropped and declared again)
    prober.clear(ns)
    assert _present_each(prober, caller, ns, more[-100:]) == 0
    _same(prober, caller, ns, more)


def test_demotion_to_disk_and_gpu_moves_report_the_daemons_tiers(daemon_factory, tmp_path):
    (tmp_path / "disk").mkdir()
    d = daemon_factory(
        dram_bytes=2 * MiB,
        chunk_bytes=1 * MiB,
        settings={
            "disk.path": str(tmp_path / "disk"),
            "disk.capacity_bytes": "32MiB",
            "disk.slab_bytes": "1MiB",
            "disk.demote_free_fraction": 1.0,  # every block is written to disk
            "gpu.device": "cpu",  # the GPU tier in host mode
            "gpu.capacity_bytes": "1MiB",
            "gpu.chunk_bytes": "1MiB",
            "gpu.demote_free_fraction": 0,
        },
    )
    prober, caller = _pair(d)
    ns = prober.declare_namespace(make_spec(BLOCK))
    hashes = list(range(1, 1001))  # twice the DRAM: the oldest are on disk only
    for i in range(0, len(hashes), 100):
        prober.put(ns, hashes[i : i + 100], _data(100, i))

    def settled() -> dict[str, int]:
        # the demoter writes in the background: wait until two looks agree
        while True:
            a = caller.lookup(ns, hashes).by_tier
            time.sleep(0.3)
            if caller.lookup(ns, hashes).by_tier == a:
                return a

    by_tier = settled()
    assert by_tier.get("disk", 0) > 0, by_tier
    _same(prober, caller, ns, hashes)
    # a load promotes disk blocks into DRAM; one into the GPU pool moves them there
    assert prober.get(ns, hashes[:8]).found == 8
    settled()
    _same(prober, caller, ns, hashes)
    handle = prober.prepare_load(ns, hashes[-8:], tier="gpu")
    prober.release(handle.lease_id)
    settled()
    assert caller.lookup(ns, hashes[-8:]).by_tier.get("gpu", 0) == 8
    _same(prober, caller, ns, hashes[-8:])
    _same(prober, caller, ns, hashes)


def test_warm_restart_rebuilds_the_table_and_the_old_one_is_never_probed(daemon_factory):
    d = daemon_factory(dram_bytes=2 * MiB, chunk_bytes=1 * MiB)
    prober, caller = _pair(d)
    ns = prober.declare_namespace(make_spec(BLOCK))
    hashes = list(range(1, 65))
    prober.put(ns, hashes, _data(64))
    old_path = _table(d)
    old_ino = os.stat(old_path).st_ino
    caller.close()
    assert d.stop(keep_region=True) == 0
    # the stopped daemon retired its table: the client stops probing it
    assert not prober.probes_lookups
    d.start()
    assert os.stat(_table(d)).st_ino != old_ino  # a new file, rebuilt from the index
    fresh, caller = _pair(d)
    ns2 = fresh.declare_namespace(make_spec(BLOCK))
    _same(fresh, caller, ns2, hashes)
    assert fresh.lookup(ns2, hashes).prefix_blocks == 64  # the warm restart kept them
    # the old client calls (answering right) until it follows the new daemon
    assert prober.lookup(ns, hashes) == caller.lookup(ns2, hashes)
    handle = prober.prepare_load(ns, hashes[:1])  # its answer names the new region
    prober.release(handle.lease_id)
    _same(prober, caller, ns, hashes)


def test_a_killed_daemons_table_is_retired_by_the_next_one(daemon_factory):
    d = daemon_factory(dram_bytes=2 * MiB, chunk_bytes=1 * MiB)
    prober = Client(d.address)
    ns = prober.declare_namespace(make_spec(BLOCK))
    hashes = list(range(1, 33))
    prober.put(ns, hashes, _data(32))
    assert prober.lookup(ns, hashes).prefix_blocks == 32
    d.kill(keep_region=True)  # no chance to retire its table
    assert prober.probes_lookups  # (it still looks current: nobody said otherwise)
    d.start()
    assert not prober.probes_lookups  # the new daemon retired it before replacing it
    caller = Client(d.address, map_region=False)
    assert prober.lookup(ns, hashes) == caller.lookup(ns, hashes)
    assert caller.lookup(ns, hashes).prefix_blocks == 0  # a cold start holds nothing


def test_a_killed_daemons_table_answers_no_lookup_of_a_client_whose_channel_it_closed(
    daemon_factory,
):
    # Between a kill -9 and the next start the table still reads as current; the
    # lean connection's end is closed by the kernel at once, so the client calls
    # (and meets the dead daemon) instead of reporting hits no load can serve.
    d = daemon_factory(dram_bytes=2 * MiB, chunk_bytes=1 * MiB)
    prober = Client(d.address, timeout_s=2.0)
    ns = prober.declare_namespace(make_spec(BLOCK))
    hashes = list(range(1, 17))
    prober.put(ns, hashes, _data(16))
    before = prober.probed_lookups
    assert prober.lookup(ns, hashes).prefix_blocks == 16
    assert prober.probed_lookups == before + 1
    d.kill(keep_region=True)
    with pytest.raises(errors.Unavailable):
        prober.lookup(ns, hashes)
    assert prober.probed_lookups == before + 1  # not answered by the dead daemon's table
    prober.close()


def test_the_file_is_the_regions_mode_and_owner(daemon_factory):
    d = daemon_factory(name="private")
    st = os.stat(_table(d))
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    assert stat.S_ISREG(st.st_mode)
    group = grp.getgrgid(os.getgid()).gr_name
    g = daemon_factory(name="grouped", settings={"server.file_group": group})
    st = os.stat(_table(g))
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == os.getgid()
    off = daemon_factory(name="off", settings={"server.presence_table": False})
    assert not os.path.exists(_table(off))
    c = Client(off.address)
    assert not c.info.presence_path and not c.probes_lookups
    ns = c.declare_namespace(make_spec(BLOCK))
    c.put(ns, [1, 2], _data(2))
    assert c.lookup(ns, [1, 2, 3]).prefix_blocks == 2 and c.probed_lookups == 0


def test_a_garbage_header_falls_back_to_the_call(daemon_factory):
    d = daemon_factory()
    prober, caller = _pair(d)
    ns = prober.declare_namespace(make_spec(BLOCK))
    prober.put(ns, [1, 2, 3], _data(3))
    _same(prober, caller, ns, [1, 2, 3])
    with open(_table(d), "r+b") as f:  # the daemon's user may scribble on it
        f.seek(16)
        f.write(b"\xff" * 8)  # the region id: no longer this daemon's
    assert prober.lookup(ns, [1, 2, 3]).prefix_blocks == 3
    assert not prober.probes_lookups
    with open(_table(d), "r+b") as f:
        f.write(os.urandom(HEADER_BYTES))  # garbage, magic included
    late = Client(d.address)  # maps nothing it cannot trust
    assert not late.probes_lookups
    assert late.lookup(ns, [1, 2, 3, 4]) == caller.lookup(ns, [1, 2, 3, 4])
    assert late.probed_lookups == 0
    with open(_table(d), "rb") as f:
        assert int.from_bytes(f.read(8), "little") != MAGIC


def test_tenant_regions_publish_no_table(daemon_factory):
    salt_a, salt_b = "a-secret-salt-3b9d", "b-secret-salt-c471"
    d = daemon_factory(
        dram_bytes=4 * MiB,
        chunk_bytes=1 * MiB,
        settings={
            "dram.tenant_regions": True,
            "quotas.tenants.alpha.tenant": salt_a,
            "quotas.tenants.alpha.dram_bytes": "1MiB",
            "quotas.tenants.beta.tenant": salt_b,
            "quotas.tenants.beta.dram_bytes": "1MiB",
        },
    )
    assert not os.path.exists(_table(d))
    a, b = Client(d.address), Client(d.address)
    assert not a.info.presence_path and not a.probes_lookups
    ns_a = a.declare_namespace(make_spec(BLOCK, tenant=salt_a))
    ns_b = b.declare_namespace(make_spec(BLOCK, tenant=salt_b))
    a.put(ns_a, [1, 2], _data(2))
    assert a.lookup(ns_a, [1, 2]).prefix_blocks == 2
    assert b.lookup(ns_b, [1, 2]).prefix_blocks == 0  # beta learns nothing of alpha's
    assert a.probed_lookups == b.probed_lookups == 0  # every lookup was a call


def test_probing_while_the_daemon_rewrites_the_table_never_invents_a_block(daemon_factory):
    d = daemon_factory(dram_bytes=2 * MiB, chunk_bytes=1 * MiB)  # 512 slots: evictions too
    writer, prober = Client(d.address), Client(d.address)
    ns = writer.declare_namespace(make_spec(BLOCK))
    stored = np.arange(1, 4001, dtype=np.uint64) * 2  # even hashes only, ever
    never = stored + 1
    stop = threading.Event()
    failures: list[BaseException] = []

    def churn() -> None:
        try:
            rng = np.random.default_rng(1)
            data = _data(64)
            while not stop.is_set():
                start = int(rng.integers(0, len(stored) - 64))
                writer.put(ns, stored[start : start + 64], data)
                writer.delete(ns, stored[start : start + 8])
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        deadline = time.monotonic() + 3.0
        probes = 0
        while time.monotonic() < deadline:
            assert prober.lookup(ns, never[:2000]).prefix_blocks == 0
            got = prober.lookup(ns, stored[:600])
            assert 0 <= got.prefix_blocks <= 600
            assert set(got.by_tier) <= {"dram"}
            for h in never[probes % 4000 : probes % 4000 + 50]:
                assert prober.lookup(ns, [int(h)]).prefix_blocks == 0
            probes += 1
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not failures, failures
    assert probes > 10 and prober.probes_lookups
    assert prober.probed_lookups >= probes * 2


@pytest.mark.parametrize("blocks", [1, 12000])
def test_long_and_short_lookups_agree(daemon_factory, blocks):
    d = daemon_factory(dram_bytes=64 * MiB, chunk_bytes=4 * MiB)
    prober, caller = _pair(d)
    ns = prober.declare_namespace(make_spec(BLOCK))
    hashes = np.arange(7, 7 + blocks, dtype=np.uint64)
    n = min(blocks, 8000)
    for i in range(0, n, 1000):
        prober.put(ns, hashes[i : min(i + 1000, n)], _data(min(1000, n - i)))
    _same(prober, caller, ns, hashes)
    assert prober.lookup(ns, hashes).prefix_blocks == n


def test_the_connectors_session_never_probes_a_dead_daemons_table(daemon_factory):
    """The vLLM connector's DaemonSession: kill -9 and a cold restart between two
    lookups; the one after the restart answers from the new daemon (nothing held),
    never from the table the dead one left mapped in this process."""
    from kvstore_connectors.vllm.session import DaemonSession

    d = daemon_factory(dram_bytes=2 * MiB, chunk_bytes=1 * MiB)
    session = DaemonSession(d.address, timeout_s=2.0, retry_initial_s=0.1, retry_max_s=0.5)
    spec = make_spec(BLOCK)
    hashes = list(range(1, 33))
    try:
        assert session.call_in("put", spec, lambda c, ns: c.put(ns, hashes, _data(32))) is not None
        first = session.client()
        assert first is not None and first.probes_lookups
        look = lambda c, ns: c.lookup(ns, hashes).prefix_blocks  # noqa: E731
        assert session.call_in("lookup", spec, look) == 32
        assert first.probed_lookups == 1
        d.kill()
        d.start()
        deadline = time.monotonic() + 10
        while session.call_in("lookup", spec, look) != 0:
            assert time.monotonic() < deadline, "still answering from the dead daemon"
            time.sleep(0.05)
        current = session.client()
        assert current is not None and current is not first and current.probes_lookups
        assert session.call_in("lookup", spec, look) == 0
        assert current.probed_lookups >= 1
    finally:
        session.close()
