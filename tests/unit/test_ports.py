"""Ports for the processes benches and tests start (kvstore_bench.ports)."""

from __future__ import annotations

import socket

import pytest

from kvstore_bench import ports


def test_ports_come_from_below_the_ephemeral_range_and_differ():
    low, high = ports.band()
    got = ports.free_ports(50)
    assert len(set(got)) == 50
    assert all(low <= p < high for p in got)
    # the range outgoing connections draw their local port from starts at `high`
    with socket.create_server(("127.0.0.1", 0)) as srv, socket.socket() as c:
        c.connect(srv.getsockname())
        assert c.getsockname()[1] >= high


def test_a_process_never_hands_out_the_same_port_twice():
    # The soak's indexer once drew the port just given to a daemon (closed after the
    # check, so bound-then-released looked free): a process must not repeat one.
    seen: set[int] = set()
    for _ in range(200):
        p = ports.free_port()
        assert p not in seen
        seen.add(p)


def test_a_port_in_use_is_never_handed_out():
    low, _ = ports.band()
    held = []
    try:
        for port in range(low, low + 200):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.append(s)
        busy = {s.getsockname()[1] for s in held}
        got = set(ports.free_ports(300))
        assert not got & busy
    finally:
        for s in held:
            s.close()


def test_a_negative_count_is_refused():
    with pytest.raises(ValueError, match="n must be >= 0"):
        ports.free_ports(-1)
    assert ports.free_ports(0) == []


def test_a_dead_address_refuses_connections():
    host, port = ports.dead_address().rsplit(":", 1)
    with pytest.raises(ConnectionRefusedError), socket.socket() as s:
        s.connect((host, int(port)))
