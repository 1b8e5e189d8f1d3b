"""The lean local channel (kvstore.local_server / local_client) against real daemons.

Raw frames are written to the daemon's ``<socket>.lean`` to check what a bad
client gets; kvstore.client is checked for using it, falling back to gRPC, and
for its commits sent without waiting; the connector's parts for making no call
on a step with nothing to do and for degrading to recompute when the daemon
dies mid-step; a killed client for leaking nothing once its leases expire.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import textwrap
import time
import urllib.request

import msgspec
import numpy as np
import pytest

from kvstore import errors
from kvstore.client import Client
from kvstore.local_server import local_socket_path
from kvstore.local_wire import HEADER
from tests.conftest import make_spec

BLOCK = 4096


def _wait_until(cond, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s}s"
        time.sleep(0.02)


class Raw:
    """A hand-driven lean-channel connection: frames in, replies out (as lists)."""

    def __init__(self, daemon) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(local_socket_path(daemon.socket_path))

    def send_body(self, body: bytes) -> None:
        self.sock.sendall(HEADER.pack(len(body)) + body)

    def send(self, *messages) -> None:
        self.send_body(msgspec.msgpack.encode(list(messages)))

    def read(self):
        """The next reply frame, decoded untyped; None when the daemon closed the connection."""
        header = self._exactly(HEADER.size)
        if header is None:
            return None
        (size,) = HEADER.unpack(header)
        body = self._exactly(size)
        assert body is not None
        return msgspec.msgpack.decode(body)

    def _exactly(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    def hello(self) -> None:
        self.send(["hello", 1, "raw-test", 1])
        (reply,) = self.read()
        assert reply[0] == "hello" and reply[1] == 1, reply

    def close(self) -> None:
        self.sock.close()


def _declared(daemon) -> str:
    with Client(daemon.address) as c:
        return c.declare_namespace(make_spec(BLOCK)).namespace_id


def test_client_uses_the_lean_channel_and_falls_back_to_grpc(daemon_factory):
    lean = daemon_factory("lean")
    with Client(lean.address) as c:
        assert c.using_local_channel
        ns = c.declare_namespace(make_spec(BLOCK))
        data = np.arange(4 * BLOCK, dtype=np.uint8).reshape(4, BLOCK)
        assert c.put(ns, [1, 2, 3, 4], data).stored == 4
        got = c.get(ns, [1, 2, 3, 4, 5])
        assert got.found == 4 and np.array_equal(got.data, data)
        assert c.lookup(ns, [1, 2, 9]).prefix_blocks == 2
        assert c.delete(ns, [2, 99]) == (1, 0)
        assert c.lookup(ns, [1, 2]).prefix_blocks == 1
    with Client(lean.address, local_channel=False) as c:  # the flag turns it off
        assert not c.using_local_channel
        assert c.lookup(c.declare_namespace(make_spec(BLOCK)), [1, 2]).prefix_blocks == 1
    off = daemon_factory("off", settings={"server.local_channel": False})
    assert not os.path.exists(local_socket_path(off.socket_path))
    with Client(off.address) as c:  # nothing to connect to: gRPC, silently
        assert not c.using_local_channel
        ns = c.declare_namespace(make_spec(BLOCK))
        assert c.put(ns, [7], np.zeros((1, BLOCK), np.uint8)).stored == 1


def test_socket_is_private_to_the_daemons_user(daemon):
    st = os.stat(local_socket_path(daemon.socket_path))
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid()


def test_bad_frames_get_precise_errors_and_the_connection_goes_on(daemon):
    ns_id = _declared(daemon)
    raw = Raw(daemon)
    raw.send(["lookup", 1, ns_id, b""])  # before hello
    assert raw.read() == [["error", 1, "state_conflict", "send hello first"]]
    raw.hello()

    raw.send_body(b"\xc1")  # not msgpack
    ((tag, seq, reason, message),) = raw.read()
    assert (tag, seq, reason) == ("error", 0, "invalid_request")
    assert message.startswith("malformed frame")

    raw.send(["frobnicate", 2, "x"])
    ((tag, seq, reason, message),) = raw.read()
    assert (seq, reason) == (0, "invalid_request")
    assert "unknown op 'frobnicate'" in message and "prepare_store" in message

    raw.send(["lookup", 3, 12345, b""])  # namespace id of the wrong type
    ((tag, seq, reason, message),) = raw.read()
    assert reason == "invalid_request" and "Expected `str`, got `int`" in message

    raw.send(["prepare_store", 4, ns_id, b"\x00" * 8, -1.0, 0])  # negative lease
    ((_, _, reason, message),) = raw.read()
    assert reason == "invalid_request" and ">= 0.0" in message

    # Field values the schema cannot judge get the gRPC service's own errors.
    raw.send(["lookup", 5, ns_id, b"\x00" * 7])
    assert raw.read() == [
        [
            "error",
            5,
            "invalid_request",
            "block_hashes must be packed uint64 (a multiple of 8 bytes), got 7 bytes",
        ]
    ]
    raw.send(["lookup", 6, "0" * 32, b""], ["commit_store", 7, 99, b"", None, b"", []])
    unknown_ns, unknown_lease = raw.read()
    assert unknown_ns[:3] == ["error", 6, "namespace_not_found"]
    assert unknown_lease[:3] == ["error", 7, "lease_not_found"]
    raw.send(["prepare_store", 8, ns_id, b"\x00" * 8, 0.0, 77])
    assert raw.read() == [["error", 8, "invalid_request", "unknown tier 77"]]

    # Still the same connection, still serving: one frame, two answers in order.
    raw.send(["lookup", 9, ns_id, b"\x01" * 8], ["release", 0, [123]], ["lookup", 10, ns_id, b""])
    first, second = raw.read()
    assert first[:3] == ["looked", 9, 0] and second[:3] == ["looked", 10, 0]
    raw.close()


def test_request_bounds_are_the_grpc_services(daemon_factory):
    d = daemon_factory(settings={"limits.max_blocks_per_request": 16})
    ns_id = _declared(d)
    raw = Raw(d)
    raw.hello()
    raw.send(["lookup", 1, ns_id, b"\x00" * 8 * 17])
    assert raw.read() == [
        [
            "error",
            1,
            "invalid_request",
            "17 blocks in one request exceeds limits.max_blocks_per_request=16",
        ]
    ]
    raw.send(["release", 2, list(range(1, 18))])
    ((_, _, reason, message),) = raw.read()
    assert reason == "invalid_request" and "17 lease ids" in message
    raw.close()
    with Client(d.address) as c:  # the client raises the exact class
        ns = c.declare_namespace(make_spec(BLOCK))
        assert c.using_local_channel
        with pytest.raises(errors.InvalidRequest, match="max_blocks_per_request=16"):
            c.lookup(ns, list(range(17)))
        with pytest.raises(errors.LeaseNotFound):
            c.release(424242)
        assert c.using_local_channel  # an error answer is not a broken link


def test_oversize_frame_is_refused_unread_and_the_daemon_serves_on(daemon):
    ns_id = _declared(daemon)
    raw = Raw(daemon)
    raw.hello()
    raw.sock.sendall(HEADER.pack(2**32 - 1))  # claims 4 GiB, sends none of it
    ((tag, seq, reason, message),) = raw.read()
    assert (tag, seq, reason) == ("error", 0, "invalid_request")
    assert "exceeds server.max_message_bytes" in message
    assert raw.read() is None  # closed: the rest of the stream cannot be trusted
    raw.close()
    again = Raw(daemon)
    again.hello()
    again.send(["lookup", 2, ns_id, b""])
    assert again.read()[0][:2] == ["looked", 2]
    again.close()


def test_connections_are_bounded_and_the_client_falls_back(daemon_factory):
    d = daemon_factory(settings={"server.local_max_connections": 2})
    held = [Raw(d), Raw(d)]
    for r in held:
        r.hello()
    extra = Raw(d)
    ((tag, _, reason, message),) = extra.read()
    assert (tag, reason) == ("error", "capacity_exhausted") and "local_max_connections" in message
    assert extra.read() is None
    extra.close()
    with Client(d.address) as c:
        assert not c.using_local_channel  # refused: gRPC carries the calls
        ns = c.declare_namespace(make_spec(BLOCK))
        assert c.put(ns, [1], np.ones((1, BLOCK), np.uint8)).stored == 1
    held.pop().close()
    _wait_until(lambda: _local_ok(d), what="a lean connection after one closed")
    for r in held:
        r.close()


def _local_ok(d) -> bool:
    with Client(d.address) as c:
        return c.using_local_channel


def test_a_commit_sent_without_waiting_lands_before_the_client_exits(daemon, tmp_path):
    """commit_store_later returns before the answer; close() reads it: after close
    the commit has landed (and its callback ran) even if the process dies at once."""
    script = textwrap.dedent(
        f"""
        import os, numpy as np
        from kvstore.client import Client
        from tests.conftest import make_spec
        c = Client({daemon.address!r})
        assert c.using_local_channel
        ns = c.declare_namespace(make_spec({BLOCK}))
        h = c.prepare_store(ns, [11, 12, 13])
        for i, off in enumerate(h.offsets.tolist()):
            c.view(off, {BLOCK})[:] = 40 + i
        got = []
        c.commit_store_later(h, on_done=got.append)
        assert got == [], "answered before close: not a commit without waiting"
        c.close()
        print("committed", got, flush=True)
        os._exit(0)  # no interpreter shutdown: nothing else may flush on the way out
        """
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    assert "committed [3]" in out.stdout
    with Client(daemon.address) as c:
        got = c.get(c.declare_namespace(make_spec(BLOCK)), [11, 12, 13])
        assert got.found == 3
        assert [int(row[0]) for row in got.data] == [40, 41, 42]
        assert c.stats().active_leases == 0


def test_a_client_killed_mid_step_leaks_no_slot_or_lease(daemon_factory):
    d = daemon_factory(
        settings={
            "leases.default_ttl_s": 0.5,
            "leases.max_ttl_s": 1.0,
            "leases.quarantine_s": 0.0,
            "leases.reap_interval_s": 0.02,
        }
    )
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(BLOCK))
        c.put(ns, [1, 2], np.ones((2, BLOCK), np.uint8))
        before = c.stats()
    script = textwrap.dedent(
        f"""
        import os, signal
        from kvstore.client import Client
        from tests.conftest import make_spec
        c = Client({d.address!r})
        assert c.using_local_channel
        ns = c.declare_namespace(make_spec({BLOCK}))
        store = c.prepare_store(ns, [21, 22, 23])    # slots reserved, never committed
        load = c.prepare_load(ns, [1, 2])            # blocks pinned, never released
        assert store.lease_id and load.found == 2
        print("prepared", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == -9 and "prepared" in out.stdout, out.stderr
    with Client(d.address) as c:
        _wait_until(lambda: c.stats().active_leases == 0, what="the killed client's leases expire")
        s = c.stats()
        assert s.expired_leases == 2
        assert s.tiers[0].pinned_blocks == 0
        assert s.tiers[0].used_bytes == before.tiers[0].used_bytes  # the 3 slots came back
        ns = c.declare_namespace(make_spec(BLOCK))
        assert c.lookup(ns, [21]).prefix_blocks == 0
        assert c.put(ns, [21, 22, 23], np.zeros((3, BLOCK), np.uint8)).stored == 3


def _rpc_total(daemon) -> float:
    body = urllib.request.urlopen(f"http://{daemon.metrics_address}/metrics", timeout=5).read()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in body.decode().splitlines()
        if line.startswith("kvstore_rpc_requests_total{")
    )


def test_a_decode_step_with_nothing_to_load_or_save_sends_nothing(daemon_factory):
    pytest.importorskip("torch")
    from tests.integration.test_vllm_connector_daemon import (
        BS,
        Engine,
        Req,
        RunningRequest,
        _tokens,
    )

    d = daemon_factory(metrics=True)
    eng = Engine(d.address, seed=3)
    req = Req("r", _tokens(3, 2 * BS + 1))  # 2 full blocks + 1 token
    eng.prefill(req, [1, 2, 3])
    assert eng.worker.counters.saved_blocks == 2
    worker, scheduler = eng.worker.session.client(), eng.scheduler.session.client()
    assert worker.using_local_channel and scheduler.using_local_channel
    # The prefill's commit (and the reserve it asks for) went without waiting: the
    # daemon counts them when it serves them, so read their answers first.
    worker.flush()
    sent = (worker.local.frames_sent, scheduler.local.frames_sent)
    calls = _rpc_total(d)
    for _ in range(BS - 2):  # decode tokens that complete no block
        req.all_token_ids.append(5)
        req.rehash()
        eng.step(running=[RunningRequest("r", None, False, req.num_tokens - 1)], scheduled={"r": 1})
        assert eng.worker.take_load_errors() == set()
    assert (worker.local.frames_sent, scheduler.local.frames_sent) == sent
    assert _rpc_total(d) == calls  # nor a gRPC call (the daemon counts both channels)
    # The step that completes the third block sends one frame: its slot came from
    # the reserve asked for with the prefill's commit (no prepare, no wait), and
    # its commit carries the next reserve's request.
    waits = worker.local.waits
    req.all_token_ids.append(5)
    req.rehash()
    eng.step(running=[RunningRequest("r", None, False, req.num_tokens - 1)], scheduled={"r": 1})
    assert worker.local.frames_sent == sent[0] + 1
    assert worker.local.waits == waits
    assert eng.worker.counters.saved_blocks == 3


def test_daemon_killed_mid_step_degrades_to_recompute(daemon_factory):
    pytest.importorskip("torch")
    from tests.integration.test_vllm_connector_daemon import (
        BS,
        Engine,
        NewRequest,
        Req,
        _tokens,
    )

    d = daemon_factory("dies", tcp=False)
    a, b = Engine(d.address, seed=1), Engine(d.address, seed=2)
    req = Req("r", _tokens(1, 3 * BS + 1))
    a.prefill(req, [0, 1, 2, 3])
    assert b.scheduler.hit_tokens(req, 0) == 3 * BS
    b.scheduler.after_alloc(req, [5, 6, 7, 8], 3 * BS)
    plan = b.scheduler.build_plan([NewRequest("r", [5, 6, 7, 8], 3 * BS)], [], {"r": 1})
    new = Req("n", _tokens(9, 2 * BS + 1))
    assert b.scheduler.hit_tokens(new, 0) == 0
    b.scheduler.after_alloc(new, [10, 11, 12], 0)
    plan.saves.extend(
        b.scheduler.build_plan([NewRequest("n", [10, 11, 12], 0)], [], {"n": new.num_tokens}).saves
    )
    b.worker.start_step(plan)  # loads done and released, store slots reserved
    assert b.worker.take_load_errors() == set()
    d.kill()  # between the prepare and the commit
    b.worker.finish_step()  # no exception: the saves are dropped
    assert b.worker.counters.saved_blocks == 0
    assert b.worker.counters.save_dropped_blocks == 2
    # Down: no hit (vLLM computes), nothing raised, no call attempted for a while.
    assert b.scheduler.hit_tokens(Req("again", list(req.all_token_ids)), 0) == 0
    assert not b.worker.session.connected


def test_a_lease_taken_on_one_channel_ends_on_the_other(daemon):
    """Same owner ("unix") on both local front-ends: a client that falls back to
    gRPC mid-life can still commit or release what it prepared over the lean one."""
    with Client(daemon.address) as lean, Client(daemon.address, local_channel=False) as rpc:
        assert lean.using_local_channel and not rpc.using_local_channel
        ns = lean.declare_namespace(make_spec(BLOCK))
        store = lean.prepare_store(ns, [31, 32])
        lean.view(int(store.offsets[0]), BLOCK)[:] = 1
        lean.view(int(store.offsets[1]), BLOCK)[:] = 2
        assert rpc.commit_store(store) == 2  # prepared on lean, committed on gRPC
        load = rpc.prepare_load(rpc.declare_namespace(make_spec(BLOCK)), [31, 32])
        assert load.found == 2
        lean.release(load)  # pinned on gRPC, released on lean
        assert rpc.stats().active_leases == 0
        with pytest.raises(errors.LeaseNotFound):
            lean.release(load)  # gone for both


def test_a_waited_answer_is_polled_for_before_the_client_sleeps(daemon, monkeypatch):
    """A call polls for its answer (KVSTORE_SPIN_US) before it sleeps in recv: an
    answer the daemon sends within the poll is read without sleeping; answers read
    together are taken from the buffer, not polled for again; an answer bigger than
    one read is put together; with 0 nothing is polled for."""
    from kvstore.client import pack_hashes
    from kvstore.local_wire import Lookup

    # Any answer here comes within 10 s, however loaded the machine; a poll that
    # finds nothing spins all of it, which the timing below would show.
    with Client(daemon.address, spin_s=10.0) as c:
        ch = c.local
        assert ch is not None and ch.spin_s == 10.0
        ns = c.declare_namespace(make_spec(BLOCK))
        before = ch.polled_reads
        c.commit_store(c.prepare_store(ns, [1, 2, 3]))
        assert ch.polled_reads == before + 2  # two waited answers, both seen by the poll
        # Three answers sent for and left to arrive, then read: they came in one
        # read, and the two behind the first are not polled for (a poll for an
        # answer already read would spin its whole 10 s on an empty socket).
        got: list[object] = []
        packed = pack_hashes([1, 2, 3])
        for _ in range(3):
            ch.call_later(lambda seq: Lookup(seq, ns.namespace_id, packed), got.append)
        time.sleep(0.3)
        t0 = time.monotonic()
        ch.collect()
        assert time.monotonic() - t0 < 5.0
        assert [type(r).__name__ for r in got] == ["Looked"] * 3
        # 8,000 slots: an answer of ~72 KB, more than one read of the socket takes
        hashes = np.arange(100, 8100, dtype=np.uint64)
        handle = c.prepare_store(ns, hashes)
        assert len(handle.offsets) == 8000 and len(handle.allocated) == 8000
        assert c.commit_store(handle) == 8000
        assert c.lookup(ns, hashes).prefix_blocks == 8000
    monkeypatch.setenv("KVSTORE_SPIN_US", "0")
    with Client(daemon.address) as c:
        ch = c.local
        assert ch is not None and ch.spin_s == 0
        ns = c.declare_namespace(make_spec(BLOCK))
        c.commit_store(c.prepare_store(ns, [9]))
        assert ch.polled_reads == 0
        assert c.lookup(ns, [9]).prefix_blocks == 1


@pytest.mark.parametrize("value", ["abc", "-1", "100001", "nan"])
def test_a_bad_spin_setting_fails_the_client_naming_it(daemon, monkeypatch, value):
    monkeypatch.setenv("KVSTORE_SPIN_US", value)
    with pytest.raises(errors.ConfigError, match="KVSTORE_SPIN_US"):
        Client(daemon.address)
