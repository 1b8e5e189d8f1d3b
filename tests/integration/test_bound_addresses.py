"""Every address a daemon binds is reported as bound (port 0 resolved): in its ready
line, in Hello and in `kvstore status --json`, so events can bind port 0 too."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import numpy as np

from kvstore.client import Client
from kvstore.hashing import BlockHasher
from kvstore.indexer.backend import NodeScore
from kvstore.indexer.config import IndexerConfig
from kvstore.indexer.service import Indexer
from kvstore.indexer.subscriber import SourceSpec
from kvstore.tiers.dram import page_bytes_of
from tests.conftest import make_spec

ADDRESS_KEYS = (
    "socket_path",
    "tcp_address",
    "metrics_address",
    "events_publish_address",
    "events_replay_address",
)


def wait_for(cond, timeout_s: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s:.1f}s")
        time.sleep(0.05)


def test_events_on_port_0_are_reported_and_an_indexer_follows_them(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory(
        "node-a",
        tcp=True,
        metrics=True,
        settings={
            "events.enabled": True,
            "events.publish_address": "tcp://127.0.0.1:0",
            "events.replay_address": "tcp://127.0.0.1:0",
        },
    )
    ready = {k: d.info[k] for k in ADDRESS_KEYS}
    for key in ("events_publish_address", "events_replay_address"):
        assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", ready[key]), ready
        assert not ready[key].endswith(":0"), ready
    assert ready["events_publish_address"] != ready["events_replay_address"]
    assert re.fullmatch(r"127\.0\.0\.1:[1-9]\d*", ready["tcp_address"]), ready
    assert re.fullmatch(r"127\.0\.0\.1:[1-9]\d*", ready["metrics_address"]), ready
    assert ready["socket_path"] == d.socket_path
    # The page size the region's memory comes in, as its mount says (docs/tiers.md)
    assert d.info["region_page_bytes"] == page_bytes_of(d.info["region_path"])

    with Client(d.address, map_region=False) as c:
        assert {k: getattr(c.info, k) for k in ADDRESS_KEYS} == ready
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "status", "--json", "--address", d.address],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert json.loads(out)["addresses"] == ready

    # Blocks stored before the indexer exists reach it by replay, later ones live.
    tokens = np.random.default_rng(1).integers(0, 32_000, 16 * 12)
    hashes = BlockHasher(16).hash_tokens_int(tokens)
    blocks = np.zeros((12, 4096), dtype=np.uint8)
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(4096, model="tiny"))
        assert c.put(ns, hashes[:8], blocks[:8]).stored == 8
        ix = Indexer(
            IndexerConfig(
                sources=[
                    SourceSpec(
                        node="node-a",
                        endpoint=ready["events_publish_address"],
                        replay_endpoint=ready["events_replay_address"],
                    )
                ]
            )
        )
        ix.start()
        try:
            wait_for(lambda: ix.score("tiny", hashes) == [NodeScore("node-a", 8, 0, 8, 0)])
            assert c.put(ns, hashes[8:], blocks[8:]).stored == 4
            wait_for(lambda: ix.score("tiny", hashes) == [NodeScore("node-a", 12, 0, 12, 0)])
        finally:
            ix.close()


def test_unbound_addresses_are_null_in_the_ready_line(daemon) -> None:  # type: ignore[no-untyped-def]
    assert daemon.info["events_publish_address"] is None
    assert daemon.info["events_replay_address"] is None
    assert daemon.info["metrics_address"] is None
    with Client(daemon.address, map_region=False) as c:
        assert c.info.events_publish_address == "" and c.info.metrics_address == ""
