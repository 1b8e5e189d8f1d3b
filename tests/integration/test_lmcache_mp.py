"""kvstore as the L2 of LMCache's multiprocess server: a real `lmcache server`
(CPU, LRU L1 of 20 MiB) loads kvstore_connectors.lmcache.l2 through its plugin L2
adapter; its client is the engine-driven shared-memory path a vLLM worker
takes (tests/lmcache/mp_driver.py), all in .venv-lmcache."""

from __future__ import annotations

import time

import pytest

from kvstore.client import Client
from tests.integration._lmcache import DriverProc, LMCacheMPServer

pytestmark = pytest.mark.timeout(600)

BLOCK_BYTES = 64 * 1024  # one LMCache chunk (256 tokens) of the client's layout
MODEL = f"kvstore-bench/compare-{BLOCK_BYTES}"  # the model kvstore_bench.compare_lmcache registers
STORE_RETRY_S = 30.0


def _store(client: DriverProc, name: str, chunks: int) -> None:
    """Store, waiting for L1 room: the server evicts in the background (once a
    second above its watermark) and refuses stores while L1 is full."""
    deadline = time.monotonic() + STORE_RETRY_S
    while True:
        try:
            client.call("store", name=name, chunks=chunks)
            return
        except AssertionError as exc:
            if "store failed" not in str(exc) or time.monotonic() > deadline:
                raise
        time.sleep(0.2)


def _wait_for(address: str, cond, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    with Client(address) as k:
        while not cond(k.stats()):
            assert time.monotonic() < deadline, k.stats()
            time.sleep(0.05)


def test_mp_server_serves_chunks_evicted_from_its_l1_out_of_kvstore(daemon_factory, tmp_path):
    from kvstore.events.wire import BlockStored, full_decoder
    from tests.integration._events import EventTap

    daemon = daemon_factory(
        dram_bytes=256 << 20,
        settings={
            "events.enabled": True,
            "events.publish_address": "tcp://127.0.0.1:0",
            "events.replay_address": "",
        },
    )
    tap = EventTap(daemon.address, daemon.info["events_publish_address"], b"kv@")
    servers: list[LMCacheMPServer] = []
    clients: list[DriverProc] = []
    try:
        servers.append(LMCacheMPServer(daemon.address, str(tmp_path), l1_size_gb=0.02))
        clients.append(DriverProc("tests.lmcache.mp_driver", servers[0].url, str(BLOCK_BYTES)))
        c = clients[0]
        _store(c, "first", 8)
        # the server's store controller writes L2 in the background
        _wait_for(daemon.address, lambda st: st.stored_blocks >= 8)
        # ... and they reach the daemon's KV events like any other block
        dec = full_decoder()
        hashes: set[int] = set()

        def stored_events() -> bool:
            hashes.clear()
            for topic, _, payload in tap.frames:
                if topic.endswith(f"@{MODEL}".encode()):
                    for e in dec.decode(payload).events:
                        if isinstance(e, BlockStored):
                            hashes.update(e.block_hashes)
            return len(hashes) >= 8

        tap.collect(stored_events)
        # 25 MiB more through a 20 MiB L1: "first" (least recently used) is evicted
        for j in range(40):
            _store(c, f"fill{j}", 10)
        _wait_for(daemon.address, lambda st: st.stored_blocks >= 408)
        assert "triggering eviction" in servers[0].tail(400)
        with Client(daemon.address) as k:
            before = k.stats()
        assert c.call("load", name="first", chunks=8) == {"exact": True}
        # the bytes came out of kvstore: 8 more blocks loaded from the region (the
        # adapter's lookups are answered from the presence table it maps, which the
        # daemon's lookup counters never see; its loads read the region directly and
        # tell the daemon in a message it does not wait for: docs/presence.md)
        _wait_for(daemon.address, lambda st: st.loaded_blocks - before.loaded_blocks >= 8)

        # A second server, its L1 empty, on the same daemon: served from kvstore alone.
        servers.append(LMCacheMPServer(daemon.address, str(tmp_path), l1_size_gb=0.02))
        clients.append(DriverProc("tests.lmcache.mp_driver", servers[1].url, str(BLOCK_BYTES)))
        assert clients[1].call("load", name="fill39", chunks=10) == {"exact": True}
    finally:
        tap.close()
        for cl in clients:
            cl.close()
        for s in servers:
            s.close()
