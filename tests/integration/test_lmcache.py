"""kvstore as LMCache's remote backend, with real LMCache 0.5.6 engines on CPU.

Each engine is tests/lmcache/driver.py in .venv-lmcache (LMCache's pins clash
with vLLM's), loading kvstore_connectors.lmcache.remote through LMCache's own plugin
mechanism; the daemon is a real one on a temp Unix socket, started here.
40 tokens = two full 16-token chunks and one partial chunk of 8.
"""

from __future__ import annotations

import time

import pytest

from kvstore.client import Client
from tests.integration._lmcache import LMCacheEngineProc

pytestmark = pytest.mark.timeout(600)
SECRET = "lmcache-test-secret"


@pytest.fixture
def engines():
    started: list[LMCacheEngineProc] = []

    def start(address: str, **kw: object) -> LMCacheEngineProc:
        e = LMCacheEngineProc(address, **kw)  # type: ignore[arg-type]
        started.append(e)
        return e

    yield start
    for e in started:
        e.close()


@pytest.mark.parametrize("path", ["region", "grpc"])
def test_store_then_retrieve_from_kvstore_bit_exact_local_copy_keeps_one_ref(
    daemon_factory, engines, path
):
    """region: a local daemon over its Unix socket, bytes through the shared region;
    grpc: as from another host (TCP with the cluster secret, bytes inline in gRPC)."""
    if path == "region":
        daemon = daemon_factory()
        eng = engines(daemon.address)
    else:
        daemon = daemon_factory(settings={"peer.secret": SECRET})
        eng = engines(daemon.tcp_address, map_region="false", env={"KVSTORE_SECRET": SECRET})
    stored = eng.call("store", seed=1, tokens=40)
    assert stored["chunks"] == 3
    assert stored["put_failed"] == 0
    # LMCache's local CPU copy keeps exactly its own reference after the
    # remote put (the remote path takes and drops its own): 0 would mean the
    # cached copy was freed while still cached, 2 a leak.
    assert stored["refcounts"] == [1, 1, 1]

    # Only kvstore can answer now.
    assert eng.call("clear_local")["left"] == 0
    assert eng.call("lookup", seed=1, tokens=40)["hit"] == 40
    got = eng.call("retrieve", seed=1, tokens=40)
    assert got == {"retrieved": 40, "exact": True}
    # a prompt never stored: no hit
    assert eng.call("lookup", seed=2, tokens=40)["hit"] == 0
    assert not [w for w in eng.warnings() if "kvstore" in w]


def test_tcp_without_the_secret_misses_with_a_warning_saying_why(daemon, engines):
    eng = engines(daemon.tcp_address, map_region="false")
    assert eng.call("store", seed=1, tokens=16)["put_failed"] == 0
    assert eng.call("clear_local")["left"] == 0
    assert eng.call("lookup", seed=1, tokens=16)["hit"] == 0
    assert any("refused" in w and "secret" in w for w in eng.warnings()), eng.tail()


def test_two_engines_share_chunks_through_one_daemon_tenants_do_not(daemon, engines):
    a = engines(daemon.address)
    b = engines(daemon.address)
    assert a.call("store", seed=3, tokens=72)["chunks"] == 5
    assert a.call("store", seed=4, tokens=32, salt="tenant-1")["chunks"] == 2

    # b never stored anything: every hit is a chunk a stored in the daemon
    assert b.call("lookup", seed=3, tokens=72)["hit"] == 72
    assert b.call("retrieve", seed=3, tokens=72) == {"retrieved": 72, "exact": True}
    # a longer prompt with the same start hits the shared prefix only
    assert b.call("lookup", seed=3, tokens=72)["hit"] == 72

    # cache_salt separates tenants: same tokens, another salt or none -> miss
    assert b.call("lookup", seed=4, tokens=32, salt="tenant-1")["hit"] == 32
    assert b.call("lookup", seed=4, tokens=32)["hit"] == 0
    assert b.call("lookup", seed=4, tokens=32, salt="tenant-2")["hit"] == 0
    assert b.call("lookup", seed=3, tokens=72, salt="tenant-1")["hit"] == 0
    assert b.call("retrieve", seed=4, tokens=32, salt="tenant-1") == {
        "retrieved": 32,
        "exact": True,
    }

    # another model's engine shares nothing either
    c = engines(daemon.address, model="other-model")
    assert c.call("lookup", seed=3, tokens=72)["hit"] == 0


def test_daemon_killed_mid_run_gives_misses_and_a_warning_never_an_exception(
    daemon_factory, engines
):
    daemon = daemon_factory()
    eng = engines(daemon.address, retry_initial_s=0.0)
    assert eng.call("store", seed=5, tokens=40)["refcounts"] == [1, 1, 1]
    daemon.kill()

    # stores go on (kept locally, with their one reference), loads miss
    stored = eng.call("store", seed=6, tokens=40)
    assert stored["chunks"] == 3 and stored["refcounts"] == [1, 1, 1]
    assert eng.call("clear_local")["left"] == 0
    assert eng.call("lookup", seed=5, tokens=40)["hit"] == 0
    assert eng.call("retrieve", seed=5, tokens=40)["retrieved"] == 0
    assert eng.call("lookup", seed=6, tokens=40)["hit"] == 0
    assert any("kvstore: daemon at" in w and "unusable" in w for w in eng.warnings()), eng.tail()
    assert eng.proc.poll() is None

    # A daemon back on the socket is used again, with no restart of the engine.
    # gRPC backs off reconnecting to an address that failed (about 1 s, growing),
    # so the first calls after the restart may still miss: bounded retries.
    daemon_factory(settings={"server.socket_path": daemon.socket_path}, name="kvstored2")
    deadline = time.monotonic() + 60
    while True:
        eng.call("store", seed=7, tokens=40)
        eng.call("clear_local")
        if eng.call("lookup", seed=7, tokens=40)["hit"] == 40:
            break
        assert time.monotonic() < deadline, eng.tail()
        time.sleep(0.2)
    assert eng.call("retrieve", seed=7, tokens=40) == {"retrieved": 40, "exact": True}
    assert any("reconnected" in w for w in eng.warnings()), eng.tail()


def test_chunks_stored_by_lmcache_appear_in_the_daemons_kv_events(daemon_factory, engines):
    from kvstore.events.wire import BlockStored, full_decoder
    from tests.integration._events import EventTap

    daemon = daemon_factory(
        settings={
            "events.enabled": True,
            "events.publish_address": "tcp://127.0.0.1:0",
            "events.replay_address": "",
        }
    )
    endpoint = daemon.info["events_publish_address"]
    tap = EventTap(daemon.address, endpoint, b"kv@")
    try:
        eng = engines(daemon.address)
        hashes = eng.call("store", seed=8, tokens=40)["hashes"]
        dec = full_decoder()
        seen: set[int] = set()

        def arrived() -> bool:
            for topic, _, payload in tap.frames:
                if topic.endswith(b"@tiny-lmcache"):
                    for e in dec.decode(payload).events:
                        if isinstance(e, BlockStored):
                            seen.update(int(h) & (2**64 - 1) for h in e.block_hashes)
            return seen >= set(hashes)

        tap.collect(arrived)
    finally:
        tap.close()
    # and the daemon holds them under LMCache's namespace like any other block
    with Client(daemon.address) as c:
        assert c.stats() is not None
