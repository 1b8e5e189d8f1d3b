"""A raw ZMQ SUB on a daemon's KV-event PUB, as llm-d's precise-prefix scorer has one."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import zmq

from kvstore.client import Client
from tests.conftest import make_spec


class EventTap:
    """Subscribes to ``prefix`` and waits until the subscription is live.

    PUB/SUB joins late and silently drops what is sent before: the tap stores
    probe blocks (model "probe") until one of their events arrives, instead of
    sleeping and hoping.
    """

    def __init__(self, address: str, endpoint: str, prefix: bytes, block_bytes: int = 4096) -> None:
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, prefix)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.frames: list[list[bytes]] = []
        with Client(address, map_region=False) as c:
            ns = c.declare_namespace(make_spec(block_bytes, model="probe"))
            deadline = time.monotonic() + 15
            for i in range(100_000):
                assert time.monotonic() < deadline, "no event reached the subscriber"
                c.put(ns, [9_000_000 + i], np.zeros((1, block_bytes), np.uint8))
                if self.sub.poll(50):
                    break

    def collect(self, until: Callable[[], bool], timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not until():
            assert time.monotonic() < deadline, "the expected events did not arrive"
            if self.sub.poll(50):
                self.frames.append(self.sub.recv_multipart())

    def drain(self, quiet_s: float = 0.5) -> None:
        """Everything that arrives until nothing has for ``quiet_s``."""
        while self.sub.poll(int(quiet_s * 1000)):
            self.frames.append(self.sub.recv_multipart())

    def close(self) -> None:
        self.sub.close(linger=0)
