"""Peer hints cannot grow the daemon: channels to hinted addresses are bounded (issue 19, bug 7)."""

from __future__ import annotations

import gc

import grpc
import pytest

from kvstore.config import load_config
from kvstore.errors import InvalidRequest, KVStoreError
from kvstore.manager import BlockManager
from kvstore.tiers.dram import Region
from kvstore.transfer.grpc_stream import GrpcStreamTransport
from kvstore.transfer.puller import Puller
from kvstore_bench.ports import free_port
from tests.conftest import make_spec

# What the daemon may keep per hint source: the LRU bound (64) plus configured peers.
CHANNEL_BOUND = 64 + 2


@pytest.fixture
def puller(tmp_path):
    config = load_config(
        environ={},
        assignments=[
            "dram.capacity_bytes=1MiB",
            "dram.chunk_bytes=256KiB",
            f"dram.path={tmp_path}/r",
        ],
    )
    region = Region(config.dram.path, config.dram.capacity_bytes, prefault=False, huge_pages="off")
    manager = BlockManager(config, region)
    stream = GrpcStreamTransport(region.array, "s3cret")
    yield (
        manager,
        Puller(
            manager,
            region.array,
            node_id="here",
            secret="s3cret",
            nixl=None,
            stream=stream,
            transfer_timeout_s=1.0,
        ),
    )
    region.close(unlink=True)


def _live_channels() -> int:
    gc.collect()
    return sum(isinstance(o, grpc.aio.Channel) for o in gc.get_objects())


async def test_thousands_of_distinct_hints_keep_a_bounded_number_of_channels(puller):
    manager, p = puller
    ns = manager.declare_namespace(make_spec(4096))
    port = free_port()
    before = _live_channels()
    # 2,000 distinct dead addresses (all of 127/8 is loopback: refused at once).
    for i in range(2000):
        address = f"127.0.{i // 250}.{i % 250 + 1}:{port}"
        with pytest.raises(KVStoreError):
            await p.pull(ns.namespace_id, [1, 2], address, 1.0)
    assert _live_channels() - before <= CHANNEL_BOUND
    assert p.open_channels <= CHANNEL_BOUND
    await p.aclose()
    assert p.open_channels == 0


async def test_configured_peers_are_never_evicted_by_hints(tmp_path):
    from kvstore.transfer.base import MAX_HINT_CHANNELS, PeerChannels

    channels = PeerChannels(1 << 20, known=["10.0.0.1:50051"])
    peer = channels.get("10.0.0.1:50051")
    for i in range(3 * MAX_HINT_CHANNELS):
        channels.get(f"127.0.0.1:{1000 + i}")
        assert len(channels) <= MAX_HINT_CHANNELS + 1
    assert channels.get("10.0.0.1:50051") is peer  # same channel: never closed
    recent = channels.get(f"127.0.0.1:{1000 + 3 * MAX_HINT_CHANNELS - 1}")
    assert channels.get(f"127.0.0.1:{1000 + 3 * MAX_HINT_CHANNELS - 1}") is recent
    await channels.aclose()
    assert len(channels) == 0


@pytest.mark.parametrize(
    "hint",
    [
        "unix:/tmp/x.sock:1",
        "127.0.0.1:0",
        "127.0.0.1:70000",
        "host:",
        ":80",
        "a b:80",
        "dns:///x:1",
    ],
)
def test_malformed_hint_addresses_are_refused_before_dialing(hint):
    from kvstore.transfer.base import check_address

    with pytest.raises(InvalidRequest, match="not host:port"):
        check_address(hint)


@pytest.mark.parametrize("hint", ["127.0.0.1:50051", "node-b.example:1", "[::1]:5000"])
def test_plain_host_port_hints_are_accepted(hint):
    from kvstore.transfer.base import check_address

    assert check_address(hint) == hint
