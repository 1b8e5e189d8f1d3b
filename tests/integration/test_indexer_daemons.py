"""End to end: real `kvstore serve` daemons publish events, the indexer scores them."""

from __future__ import annotations

import os
import subprocess
import time

import msgspec
import numpy as np
import pytest

from kvstore.client import Client
from kvstore.hashing import BlockHasher
from kvstore.indexer.backend import NodeScore
from kvstore.indexer.config import IndexerConfig
from kvstore.indexer.service import Indexer, serve
from kvstore.indexer.subscriber import SourceSpec
from kvstore_bench.ports import free_port
from kvstore_router_client import RouterClient
from tests.conftest import make_spec
from tests.integration._events import EventTap
from tests.vllm_python import vllm_python


def wait_for(cond, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"condition not reached within {timeout_s:.1f}s")


def events_settings() -> dict[str, object]:
    return {
        "events.enabled": True,
        "events.publish_address": f"tcp://127.0.0.1:{free_port()}",
        "events.replay_address": f"tcp://127.0.0.1:{free_port()}",
    }


def test_indexer_beside_two_daemons(daemon_factory):
    sa, sb = events_settings(), events_settings()
    a = daemon_factory("node-a", settings=sa)
    b = daemon_factory("node-b", settings=sb)
    ix = Indexer(
        IndexerConfig(
            sources=[
                SourceSpec(
                    node=name,
                    endpoint=str(s["events.publish_address"]),
                    replay_endpoint=str(s["events.replay_address"]),
                )
                for name, s in (("node-a", sa), ("node-b", sb))
            ]
        )
    )
    ix.start()
    server, port = serve(ix, "127.0.0.1:0")
    try:
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, 32_000, 16 * 24)
        hashes = BlockHasher(16).hash_tokens_int(tokens)
        spec = make_spec(4096, model="tiny")
        blocks = np.zeros((24, 4096), dtype=np.uint8)
        with Client(a.address) as ca, Client(b.address) as cb:
            na = ca.declare_namespace(spec)
            nb = cb.declare_namespace(spec)
            assert ca.put(na, hashes[:20], blocks[:20]).stored == 20
            assert cb.put(nb, hashes[:8], blocks[:8]).stored == 8
            wait_for(lambda: len(ix.score("tiny", hashes)) == 2)
            assert ix.score("tiny", hashes) == [
                NodeScore("node-a", 20, 0, 20, 0),
                NodeScore("node-b", 8, 0, 8, 0),
            ]
            with RouterClient(f"127.0.0.1:{port}", deadline_s=2.0) as rc:
                d = rc.pick("tiny", tokens, ["node-a", "node-b"], default="node-b")
                assert (d.node, d.reason) == ("node-a", "prefix")
            # the daemon drops blocks -> BlockRemoved -> the score follows
            ca.delete(na, hashes[10:20])
            wait_for(lambda: ix.score("tiny", hashes)[0] == NodeScore("node-a", 10, 0, 10, 0))
            ca.clear(na)
            wait_for(lambda: [s.node for s in ix.score("tiny", hashes)] == ["node-b"])
        assert ix.subscriber.stats.malformed == 0
    finally:
        server.stop(0)
        ix.close()


_DECODE_WITH_VLLM = r"""
import sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
frames = msgspec.msgpack.decode(open(sys.argv[1], "rb").read())
dec = msgspec.msgpack.Decoder(KVEventBatch)
seen = {}
for topic, seq, payload in frames:
    for ev in dec.decode(payload).events:
        seen.setdefault(type(ev).__name__, []).append(ev)
stored = [h for ev in seen["BlockStored"] for h in ev.block_hashes]
assert all(ev.medium == "CPU" and ev.block_size == 16 for ev in seen["BlockStored"])
removed = [h for ev in seen["BlockRemoved"] for h in ev.block_hashes]
print(sorted(stored) == sorted(map(int, sys.argv[2].split(","))),
      sorted(removed) == sorted(map(int, sys.argv[3].split(","))))
"""


@pytest.mark.vllm
def test_vllm_classes_decode_what_a_daemon_publishes(daemon_factory, tmp_path):
    py = vllm_python()
    if py is None:
        pytest.skip("vLLM (CPU build) is not installed")
    settings = events_settings()
    d = daemon_factory("node-v", settings=settings)
    # joined once a probe block's event (model "probe") arrived; those are read
    tap = EventTap(d.address, str(settings["events.publish_address"]), b"kv@node-v@")
    tap.drain(quiet_s=0.3)
    sub = tap.sub
    try:
        hashes = list(range(1000, 1012))
        with Client(d.address) as c:
            ns = c.declare_namespace(make_spec(4096, model="tiny"))
            c.put(ns, hashes, np.zeros((12, 4096), dtype=np.uint8))
            c.delete(ns, hashes[8:])
            c.clear(ns)
        frames = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if sub.poll(300):
                if (frame := sub.recv_multipart())[0] != b"kv@node-v@probe":
                    frames.append(frame)
            elif frames:
                break
    finally:
        sub.close()
    assert frames and all(f[0] == b"kv@node-v@tiny" for f in frames)
    dump = tmp_path / "frames.msgpack"
    dump.write_bytes(msgspec.msgpack.encode(frames))
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    proc = subprocess.run(
        [
            py,
            "-c",
            _DECODE_WITH_VLLM,
            str(dump),
            ",".join(map(str, hashes)),
            # delete() removed the last 4, clear() the other 8: exact BlockRemoved
            # events (a clear is not AllBlocksCleared, which would hit other tenants)
            ",".join(map(str, hashes)),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "True"]
