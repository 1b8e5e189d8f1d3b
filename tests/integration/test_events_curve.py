"""ZMQ CURVE on the KV event streams (issue 13): real daemons, a real indexer, real sockets.

The streams carry every tenant's token ids: with ``events.curve_secret_key_file``
set, only subscribers whose public key is in ``events.curve_allowed_keys``
(and who know the daemon's public key) get anything, from the PUB or from the
replay ROUTER; every refusal is in the daemon's audit log.

"Receives nothing" is never "waited a while and saw nothing": each refused
socket's failed handshake is first seen in the daemon's audit counter, then the
indexer with the right keys is seen to ingest events published after it, and
only then are the refused sockets read.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import zmq

from kvstore.client import Client
from kvstore.errors import ConfigError
from kvstore.events.curve import CurveClient, KeyPair, load_keypair, secure_socket, write_keypair
from kvstore.events.publisher import ZmqEventPublisher
from kvstore.indexer.config import IndexerConfig
from kvstore.indexer.service import Indexer, serve
from kvstore.indexer.subscriber import SourceSpec
from kvstore.v1 import indexer_pb2, indexer_pb2_grpc
from tests.conftest import make_spec
from tests.integration.test_audit import audit_lines, denied_total
from tests.integration.test_indexer_daemons import events_settings, wait_for


class Keys:
    """Three key pairs made as `kvstore keys curve` makes them."""

    def __init__(self, directory: str) -> None:
        self.files: dict[str, tuple[str, str]] = {}
        self.pairs: dict[str, KeyPair] = {}
        for name in ("daemon", "indexer", "stranger"):
            public_path, secret_path, _ = write_keypair(directory, name)
            self.files[name] = (public_path, secret_path)
            self.pairs[name] = load_keypair(secret_path, name)

    def public(self, name: str) -> str:
        return self.pairs[name].public.decode()


@pytest.fixture
def keys(tmp_path) -> Keys:
    d = tmp_path / "keys"
    d.mkdir()
    return Keys(str(d))


def curve_daemon(daemon_factory, keys: Keys, name: str):
    settings = events_settings()
    settings["events.curve_secret_key_file"] = keys.files["daemon"][1]
    # one allowed subscriber, named by its public key file
    settings["events.curve_allowed_keys"] = keys.files["indexer"][0]
    d = daemon_factory(name, metrics=True, settings={"log.format": "json", **settings})
    return d, settings


def raw_socket(kind: int, endpoint: str, curve: CurveClient | None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    secure_socket(sock, curve)
    sock.connect(endpoint)
    return sock


def replay(sock: zmq.Socket, timeout_s: float) -> list[list[bytes]]:
    """Ask a replay ROUTER for everything from seq 0; the answer up to its END, or []."""
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        # a DEALER sends only once a handshake succeeded: a refused one never does
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
    except zmq.Again:
        return []
    out: list[list[bytes]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(50):
            frames = sock.recv_multipart()
            out.append(frames)
            if frames[1] == b"":  # (b"", b"", END_SEQ, b"")
                return out
    return out


def put_blocks(address: str, hashes: list[int], model: str = "tiny") -> None:
    with Client(address, map_region=False) as c:
        ns = c.declare_namespace(make_spec(4096, model=model))
        assert c.put(ns, hashes, np.zeros((len(hashes), 4096), np.uint8)).stored == len(hashes)


def test_curve_daemon_serves_only_the_allowed_indexer_and_audits_the_rest(daemon_factory, keys):
    d, s = curve_daemon(daemon_factory, keys, "curve-a")
    pub, rep = str(s["events.publish_address"]), str(s["events.replay_address"])
    daemon_key = keys.pairs["daemon"].public
    # Refused subscribers first: no key at all, a key the daemon does not list,
    # and the allowed key with a wrong idea of the daemon's public key.
    no_key = raw_socket(zmq.SUB, pub, None)
    stranger = raw_socket(zmq.SUB, pub, CurveClient(keys.pairs["stranger"], daemon_key))
    wrong_server = raw_socket(
        zmq.SUB, pub, CurveClient(keys.pairs["indexer"], keys.pairs["stranger"].public)
    )
    ix = Indexer(
        IndexerConfig(
            events_curve_key_file=keys.files["indexer"][1],
            sources=[
                SourceSpec(
                    node="curve-a",
                    endpoint=pub,
                    replay_endpoint=rep,
                    curve_server_key=keys.public("daemon"),
                )
            ],
        )
    )
    ix.start()
    try:
        wait_for(lambda: denied_total(d, "events_curve_denied") >= 1)

        def causes() -> set[str]:
            return {
                line["what"]
                for line in audit_lines(d)
                if line["reason"] == "events_handshake_failed"
            }

        # the one with the wrong server key (the daemon cannot decrypt its HELLO), and
        # the one without a key: libzmq reports that one as a mechanism mismatch, or,
        # when the plaintext peer saw the CURVE greeting and hung up first (about one
        # run in three here), without detail, and that peer may not retry
        wait_for(
            lambda: (
                any("cryptographic" in c for c in causes())
                and any("mechanism mismatch" in c or "without detail" in c for c in causes())
            )
        )
        (refusal,) = [line for line in audit_lines(d) if line["reason"] == "events_curve_denied"]
        assert keys.public("stranger") in refusal["who"]  # who: the refused key, and its address
        assert refusal["who"].startswith("127.0.0.1")

        hashes = [int(h) for h in np.arange(1, 9, dtype=np.uint64) * 7919]
        put_blocks(d.address, hashes)
        wait_for(lambda: ix.score("tiny", np.array(hashes, np.uint64)) != [])
        assert ix.score("tiny", np.array(hashes, np.uint64))[0].prefix_blocks == 8
        assert ix.subscriber.stats.handshake_failures == 0
        # the events the indexer got were published after every refused socket's
        # handshake had failed: none of them may hold a single frame
        for sock in (no_key, stranger, wrong_server):
            assert not sock.poll(200), "a refused subscriber received KV events"

        # The replay ROUTER: the same keys, the same refusals.
        good = raw_socket(zmq.DEALER, rep, CurveClient(keys.pairs["indexer"], daemon_key))
        answer = replay(good, timeout_s=10.0)
        assert answer and answer[-1][1] == b"", "the allowed key got no replay"
        assert len(answer) >= 2  # batches, then END
        denied_before = denied_total(d, "events_curve_denied")
        bad_replays = [
            raw_socket(zmq.DEALER, rep, None),
            raw_socket(zmq.DEALER, rep, CurveClient(keys.pairs["stranger"], daemon_key)),
        ]
        wait_for(lambda: denied_total(d, "events_curve_denied") > denied_before)
        for sock in bad_replays:
            # a DEALER queues the request until a handshake succeeds, which never happens
            assert replay(sock, timeout_s=0.5) == []
        for sock in (no_key, stranger, wrong_server, good, *bad_replays):
            sock.close(linger=0)
    finally:
        ix.close()
    # the publisher's own ZMQ context and ZAP thread end with it: a clean, prompt exit
    assert d.stop() == 0


def test_register_node_with_a_curve_key(daemon_factory, keys):
    d, s = curve_daemon(daemon_factory, keys, "curve-r")
    ix = Indexer(IndexerConfig(events_curve_key_file=keys.files["indexer"][1]))
    ix.start()
    server, port = serve(ix, "127.0.0.1:0")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = indexer_pb2_grpc.IndexerServiceStub(ch)
            source = indexer_pb2.EventSource(
                node="curve-r",
                endpoint=str(s["events.publish_address"]),
                replay_endpoint=str(s["events.replay_address"]),
            )
            with pytest.raises(grpc.RpcError) as bad:
                source.curve_server_key = "not a key"
                stub.RegisterNode(indexer_pb2.RegisterNodeRequest(source=source), timeout=10)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "Z85" in bad.value.details()
            source.curve_server_key = keys.public("daemon")
            stub.RegisterNode(indexer_pb2.RegisterNodeRequest(source=source), timeout=10)
            hashes = [int(h) for h in np.arange(1, 5, dtype=np.uint64) * 104729]
            put_blocks(d.address, hashes)
            wait_for(lambda: ix.score("tiny", np.array(hashes, np.uint64)) != [])
            (info,) = stub.ListNodes(indexer_pb2.ListNodesRequest(), timeout=10).sources
            assert info.source.curve_server_key == keys.public("daemon")
            assert info.connected and info.handshake_error == ""
    finally:
        server.stop(0)
        ix.close()


def test_register_node_with_a_curve_key_needs_the_indexers_own_key(keys):
    ix = Indexer(IndexerConfig())  # no events_curve_key_file
    ix.start()
    server, port = serve(ix, "127.0.0.1:0")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = indexer_pb2_grpc.IndexerServiceStub(ch)
            source = indexer_pb2.EventSource(
                node="n", endpoint="tcp://127.0.0.1:1", curve_server_key=keys.public("daemon")
            )
            with pytest.raises(grpc.RpcError) as info:
                stub.RegisterNode(indexer_pb2.RegisterNodeRequest(source=source), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "events_curve_key_file" in info.value.details()
    finally:
        server.stop(0)
        ix.close()
    with pytest.raises(ConfigError, match="events_curve_key_file"):
        IndexerConfig(
            sources=[
                SourceSpec(node="n", endpoint="tcp://h:1", curve_server_key=keys.public("daemon"))
            ]
        ).check()


class _NS:
    namespace_id = "ns"
    model = "m"
    tenant = ""
    block_size_tokens = 16


@pytest.mark.parametrize("curve_side", ["subscriber", "publisher"])
def test_a_curve_mismatch_is_reported_by_the_indexer(keys, curve_side):
    """A plaintext publisher and a CURVE source (or the reverse) never connect: the
    indexer says why (log, counter, ListNodes) instead of looking like an idle node."""
    if curve_side == "subscriber":
        pub = ZmqEventPublisher("mm", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
        server_key = keys.public("daemon")
    else:
        pub = ZmqEventPublisher(
            "mm",
            "tcp://127.0.0.1:0",
            "tcp://127.0.0.1:0",
            curve_keys=keys.pairs["daemon"],
            curve_allowed=[keys.pairs["indexer"].public],
        )
        server_key = ""
    ix = Indexer(
        IndexerConfig(
            events_curve_key_file=keys.files["indexer"][1],
            sources=[
                SourceSpec(
                    node="mm",
                    endpoint=pub.endpoint,
                    replay_endpoint=pub.replay_endpoint or "",
                    curve_server_key=server_key,
                )
            ],
        )
    )
    ix.start()
    server, port = serve(ix, "127.0.0.1:0")
    try:
        wait_for(lambda: ix.subscriber.stats.handshake_failures >= 1)
        (status,) = ix.subscriber.source_status()
        assert "mechanism mismatch" in status.handshake_error
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = indexer_pb2_grpc.IndexerServiceStub(ch)
            (info,) = stub.ListNodes(indexer_pb2.ListNodesRequest(), timeout=10).sources
        assert "mechanism mismatch" in info.handshake_error and not info.connected
        assert ix.subscriber.stats.batches == 0
    finally:
        server.stop(0)
        ix.close()
        pub.close()


def test_secret_key_files_must_be_private_and_ours(keys, tmp_path):
    _, secret = keys.files["daemon"]
    os.chmod(secret, 0o640)
    with pytest.raises(ConfigError, match=f"{secret} has mode 0640"):
        load_keypair(secret, "events.curve_secret_key_file")
    # the daemon refuses to start, naming the file
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "serve",
            "--set",
            "server.socket_path=",
            "--set",
            "server.tcp_address=127.0.0.1:0",
            "--set",
            "metrics.address=",
            "--set",
            f"dram.path={tmp_path}/r.dram",
            "--set",
            "dram.capacity_bytes=64MiB",
            "--set",
            "dram.prefault=false",
            "--set",
            "events.enabled=true",
            "--set",
            "events.publish_address=tcp://127.0.0.1:0",
            "--set",
            "events.replay_address=",
            "--set",
            f"events.curve_secret_key_file={secret}",
            "--set",
            f"events.curve_allowed_keys={keys.public('indexer')}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert f"{secret} has mode 0640" in proc.stderr, proc.stderr[-2000:]
    os.chmod(secret, 0o600)
    assert load_keypair(secret, "x") == keys.pairs["daemon"]
    # a public key file is not a secret key
    public_only = tmp_path / "public-only"
    public_only.write_bytes(Path(keys.files["daemon"][0]).read_bytes())
    public_only.chmod(0o600)
    with pytest.raises(ConfigError, match="no secret-key"):
        load_keypair(str(public_only), "x")
    # another user's file: refused, naming its owner
    if os.geteuid() == 0:
        os.chown(secret, 65534, 65534)
        with pytest.raises(ConfigError, match="owned by uid 65534"):
            load_keypair(secret, "indexer.events_curve_key_file")


def test_keys_command_makes_a_usable_private_pair(tmp_path):
    out = tmp_path / "k"
    done = subprocess.run(
        [sys.executable, "-m", "kvstore", "keys", "curve", "--out", str(out), "--name", "n1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert os.stat(out / "n1.key_secret").st_mode & 0o777 == 0o600
    pair = load_keypair(str(out / "n1.key_secret"), "x")
    assert f"public key {pair.public.decode()}" in done.stdout
    again = subprocess.run(
        [sys.executable, "-m", "kvstore", "keys", "curve", "--out", str(out), "--name", "n1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode != 0 and "exists already" in again.stderr


def test_curve_configured_but_unavailable_fails_at_start(keys, monkeypatch):
    monkeypatch.setattr(zmq, "has", lambda feature: feature != "curve")
    with pytest.raises(ConfigError, match=r"zmq.has\('curve'\) is False"):
        ZmqEventPublisher(
            "n",
            "tcp://127.0.0.1:0",
            None,
            curve_keys=keys.pairs["daemon"],
            curve_allowed=[keys.pairs["indexer"].public],
        )
    with pytest.raises(ConfigError, match="events_curve_key_file"):
        Indexer(IndexerConfig(events_curve_key_file=keys.files["indexer"][1]))


def test_two_curve_publishers_in_one_process_keep_their_own_allow_lists(keys):
    """ZAP handlers are per context: each CURVE publisher owns one, so one publisher's
    subscriber list does not admit (or refuse) the other's."""
    a = ZmqEventPublisher(
        "pa",
        "tcp://127.0.0.1:0",
        None,
        curve_keys=keys.pairs["daemon"],
        curve_allowed=[keys.pairs["indexer"].public],
    )
    b = ZmqEventPublisher(
        "pb",
        "tcp://127.0.0.1:0",
        None,
        curve_keys=keys.pairs["daemon"],
        curve_allowed=[keys.pairs["stranger"].public],
    )
    try:
        got: dict[str, bool] = {}
        threads = []
        for name, pub, who in (("a", a, "indexer"), ("b", b, "stranger")):
            sock = raw_socket(
                zmq.SUB, pub.endpoint, CurveClient(keys.pairs[who], keys.pairs["daemon"].public)
            )

            def follow(name=name, pub=pub, sock=sock) -> None:
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and not sock.poll(50):
                    pub.blocks_stored(_NS(), [1], "CPU", None, None)
                got[name] = bool(sock.poll(0))
                sock.close(linger=0)

            threads.append(threading.Thread(target=follow))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == {"a": True, "b": True}
        assert a.curve_denied == b.curve_denied == 0
    finally:
        a.close()
        b.close()
