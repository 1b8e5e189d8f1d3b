"""The daemon on uvloop (``server.event_loop``): the same calls, the same answers,
the same drain as on asyncio's loop. Real daemons; the loop is the only setting
that differs between the two runs of each test."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.config import load_config
from kvstore.event_loop import use_event_loop
from tests.conftest import make_spec

pytest.importorskip("uvloop")

BLOCK = 64 << 10


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_lean_channel_grpc_and_drain_on_either_loop(daemon_factory, loop: str) -> None:
    d = daemon_factory(loop[0], settings={"server.event_loop": loop})
    data = np.random.default_rng(7).integers(0, 256, (8, BLOCK), dtype=np.uint8)
    with Client(d.address) as c:
        assert c.using_local_channel, d.log_tail(50)
        ns = c.declare_namespace(make_spec(BLOCK))
        assert c.put(ns, list(range(1, 9)), data).stored == 8  # two-phase, lean channel
        got = c.get(ns, list(range(1, 10)))
        assert got.found == 8 and np.array_equal(got.data, data)
        assert c.lookup(ns, [1, 2, 99]).prefix_blocks == 2
    with Client(d.address, local_channel=False) as c:  # gRPC on the same loop
        ns = c.declare_namespace(make_spec(BLOCK))
        got = c.get(ns, [3, 4])
        assert got.found == 2 and np.array_equal(got.data, data[2:4])
        deadline = time.monotonic() + 10  # loads' releases are sent without waiting
        while c.stats().active_leases and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.stats().active_leases == 0
    assert f"event loop: {loop}" in d.log_tail(200)
    assert d.stop() == 0  # SIGTERM: drained, exit 0
    assert "Traceback" not in d.log_tail(400)


def test_event_loop_setting_is_checked() -> None:
    assert load_config(None, assignments=["server.event_loop=uvloop"]).server.event_loop == (
        "uvloop"
    )
    with pytest.raises(Exception, match="event_loop"):
        load_config(None, assignments=["server.event_loop=libuv"])
    assert use_event_loop("asyncio", "server.event_loop") == "asyncio"
