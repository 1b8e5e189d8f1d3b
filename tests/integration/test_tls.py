"""Mutual TLS on the daemon's TCP listener and on peer pulls (kvstore/tls.py).

Real daemons on 127.0.0.1:0 with certificates made by scripts/make_certs.sh
(openssl): a caller with a certificate of the cluster's CA makes data calls;
one of another CA, or without a certificate, fails the handshake; a daemon
without a certificate cannot pull from a TLS peer; bad files stop the start
with an error naming the path.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import ConfigError, PermissionDenied, Unavailable
from kvstore.hashing import BlockHasher
from kvstore.indexer.config import IndexerConfig
from kvstore.indexer.service import Indexer
from kvstore.indexer.service import serve as serve_indexer
from kvstore.indexer.subscriber import SourceSpec
from kvstore.process import DaemonProcess
from kvstore.router.backends import Fleet
from kvstore.tls import ClientCredentials, TlsFiles
from kvstore.v1 import indexer_pb2, indexer_pb2_grpc, store_pb2, store_pb2_grpc
from kvstore_bench.ports import free_port
from kvstore_router_client import RouterClient
from tests.conftest import make_spec

ROOT = Path(__file__).resolve().parents[2]
SECRET = "tls-test-secret"


def make_pki(where: Path, *clients: str) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (scripts/install.sh installs it)")
    subprocess.run(
        [
            str(ROOT / "scripts/make_certs.sh"),
            str(where),
            *[a for c in clients for a in ("--client", c)],
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return where


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"), "client")


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("other-pki"), "client")


def server_settings(pki: Path) -> dict[str, str]:
    return {
        "tls.cert_path": str(pki / "server.pem"),
        "tls.key_path": str(pki / "server.key"),
        "tls.ca_path": str(pki / "ca.pem"),
    }


def client_tls(pki: Path, name: str = "client", ca: Path | None = None) -> TlsFiles:
    return TlsFiles(str(pki / f"{name}.pem"), str(pki / f"{name}.key"), str(ca or pki / "ca.pem"))


def test_make_certs_files_are_private(pki):
    for path in pki.iterdir():
        assert path.stat().st_mode & 0o077 == 0, f"{path} is {oct(path.stat().st_mode)}"


def test_certificate_of_the_ca_makes_data_calls(daemon_factory, pki):
    d = daemon_factory(settings=server_settings(pki))
    with Client(d.address) as local:  # the Unix socket is unchanged
        ns = local.declare_namespace(make_spec(4096))
        local.put(ns, [1, 2], np.full((2, 4096), 7, np.uint8))
    with Client(d.tcp_address, map_region=False, tls=client_tls(pki)) as remote:
        got = remote.get(ns, [1, 2])  # GetInline: refused over plain TCP without a secret
        assert got.found == 2 and int(got.data.sum()) == 7 * 8192


def test_tls_with_secret_needs_both(daemon_factory, pki):
    d = daemon_factory(settings={**server_settings(pki), "peer.secret": SECRET})
    with pytest.raises(PermissionDenied, match="cluster secret"):
        Client(d.tcp_address, map_region=False, tls=client_tls(pki), secret="")
    with Client(d.tcp_address, map_region=False, tls=client_tls(pki), secret=SECRET) as c:
        assert c.stats().node_id == d.name


def test_wrong_ca_fails_the_handshake(daemon_factory, pki, other_pki):
    d = daemon_factory(settings=server_settings(pki))
    # A client certificate of another CA: the daemon refuses it.
    with pytest.raises(Unavailable):
        Client(d.tcp_address, map_region=False, tls=client_tls(other_pki, ca=pki / "ca.pem"))
    # Our certificate is fine, but we trust another CA: we refuse the daemon's.
    with pytest.raises(Unavailable):
        Client(d.tcp_address, map_region=False, tls=client_tls(pki, ca=other_pki / "ca.pem"))


def test_no_client_certificate_is_refused(daemon_factory, pki):
    d = daemon_factory(settings=server_settings(pki))
    ca = (pki / "ca.pem").read_bytes()
    with grpc.secure_channel(d.tcp_address, grpc.ssl_channel_credentials(ca)) as ch:
        with pytest.raises(grpc.RpcError) as err:
            store_pb2_grpc.StoreServiceStub(ch).Hello(store_pb2.HelloRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # Plaintext to a TLS port: no handshake at all.
    with grpc.insecure_channel(d.tcp_address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            store_pb2_grpc.StoreServiceStub(ch).Hello(store_pb2.HelloRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def peer_settings(pki: Path | None, name: str, transport: str = "grpc_stream") -> dict[str, str]:
    out = {"peer.enabled": "true", "peer.secret": SECRET, "peer.transport": transport}
    if pki is not None:
        out.update(
            {
                "tls.cert_path": str(pki / f"{name}.pem"),
                "tls.key_path": str(pki / f"{name}.key"),
                "tls.ca_path": str(pki / "ca.pem"),
            }
        )
    return out


def pull_through(b: DaemonProcess, a: DaemonProcess, spec, hashes: list[int]) -> int:  # type: ignore[no-untyped-def]
    """Ask b (over its Unix socket) to pull `hashes` from a; how many b then holds."""
    with Client(b.address) as cb:
        ns = cb.declare_namespace(spec)
        r = cb.fetch_from_peer(ns, hashes, peer_address=a.tcp_address, timeout_s=3.0)
        assert r.fetched_blocks == 0 or r.transport == b.info["peer_transport"]
        return cb.lookup(ns, hashes).prefix_blocks


# NIXL: the metadata exchange and the pins ride the TLS channel (the UCX data path does not).
NIXL_ENV = {"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}


@pytest.mark.parametrize("transport", ["grpc_stream", "nixl"])
def test_peer_pulls_need_a_certificate(daemon_factory, tmp_path, transport):
    pki = make_pki(tmp_path / "pki", "node-b")
    spec = make_spec(4096)

    def peer(name: str, pki: Path | None, cert: str) -> DaemonProcess:
        return daemon_factory(name, settings=peer_settings(pki, cert, transport), env=NIXL_ENV)

    a = peer("node-a", pki, "server")
    assert a.info["peer_transport"] == transport
    with Client(a.address) as ca:
        ns = ca.declare_namespace(spec)
        ca.put(ns, [11, 12], np.full((2, 4096), 3, np.uint8))
    b = peer("node-b", pki, "node-b")
    assert pull_through(b, a, spec, [11, 12]) == 2
    # The same secret, no certificate: the pull cannot even connect.
    c = peer("node-c", None, "node-c")
    with pytest.raises(Unavailable):
        pull_through(c, a, spec, [11, 12])
    with Client(c.address) as cc:
        assert cc.lookup(cc.declare_namespace(spec), [11, 12]).prefix_blocks == 0


@pytest.mark.parametrize("broken", ["missing_cert", "missing_ca", "mismatch", "not_pem"])
def test_bad_tls_files_stop_the_start_naming_the_path(tmp_path, pki, other_pki, broken):
    settings = server_settings(pki)
    if broken == "missing_cert":
        settings["tls.cert_path"] = bad = str(tmp_path / "nope.pem")
        expect = f"tls.cert_path: cannot read {bad}"
    elif broken == "missing_ca":
        settings["tls.ca_path"] = bad = str(tmp_path / "nope-ca.pem")
        expect = f"tls.ca_path: cannot read {bad}"
    elif broken == "mismatch":
        settings["tls.key_path"] = bad = str(other_pki / "server.key")
        expect = f"tls.key_path: {bad} is not the key of tls.cert_path"
    else:
        (tmp_path / "junk.pem").write_text("hello\n")
        settings["tls.ca_path"] = bad = str(tmp_path / "junk.pem")
        expect = f"tls.ca_path: {bad} is not PEM"
    d = DaemonProcess(tmp_path / "d", name="tlsbad", settings=settings, start_timeout_s=20)
    with pytest.raises(Unavailable) as err:
        d.start()
    assert expect in str(err.value), str(err.value)


def test_partial_tls_config_is_refused(tmp_path, pki):
    settings = server_settings(pki)
    del settings["tls.key_path"]
    d = DaemonProcess(tmp_path / "d", name="tlshalf", settings=settings, start_timeout_s=20)
    with pytest.raises(Unavailable, match="all three or none"):
        d.start()


def test_client_names_the_bad_path(tmp_path, pki, monkeypatch):
    monkeypatch.setenv("KVSTORE_TLS_CERT", str(pki / "client.pem"))
    monkeypatch.setenv("KVSTORE_TLS_KEY", str(tmp_path / "x.key"))
    monkeypatch.setenv("KVSTORE_TLS_CA", str(pki / "ca.pem"))
    with pytest.raises(
        ConfigError, match=re.escape(f"KVSTORE_TLS_KEY: cannot read {tmp_path}/x.key")
    ):
        Client("127.0.0.1:1")


def test_renewed_certificates_are_used_without_restart(daemon_factory, tmp_path):
    """Swap the daemon's files for a new CA's: new connections use them, no restart."""
    old = make_pki(tmp_path / "old", "client")
    new = make_pki(tmp_path / "new", "client")
    live = tmp_path / "live"
    live.mkdir()
    for name in ("server.pem", "server.key", "ca.pem"):
        shutil.copy(old / name, live / name)
    d = daemon_factory(settings=server_settings(live))
    with Client(d.tcp_address, map_region=False, tls=client_tls(old)) as c:
        assert c.stats().node_id == d.name
    for name in ("server.pem", "server.key", "ca.pem"):  # rename: each file changes at once
        shutil.copy(new / name, live / f".{name}.tmp")
        os.replace(live / f".{name}.tmp", live / name)
    with Client(d.tcp_address, map_region=False, tls=client_tls(new)) as c:
        assert c.stats().node_id == d.name
    with pytest.raises(Unavailable):
        Client(d.tcp_address, map_region=False, tls=client_tls(old))


# --- the indexer ---------------------------------------------------------------------


def indexer_tls(pki: Path, name: str = "server") -> dict[str, str]:
    return {
        "tls_cert_path": str(pki / f"{name}.pem"),
        "tls_key_path": str(pki / f"{name}.key"),
        "tls_ca_path": str(pki / "ca.pem"),
    }


def list_nodes(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    ch = (
        grpc.secure_channel(address, credentials)
        if credentials is not None
        else grpc.insecure_channel(address)
    )
    with ch:
        try:
            indexer_pb2_grpc.IndexerServiceStub(ch).ListNodes(
                indexer_pb2.ListNodesRequest(), timeout=5
            )
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


def test_indexer_grpc_needs_a_certificate_of_its_ca(pki, other_pki):
    ix = Indexer(IndexerConfig(address="127.0.0.1:0", **indexer_tls(pki)))  # type: ignore[arg-type]
    ix.start()
    server, port = serve_indexer(ix, "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    try:
        assert list_nodes(address, client_tls(pki).channel_credentials()) == grpc.StatusCode.OK
        ca = (pki / "ca.pem").read_bytes()
        no_cert = grpc.ssl_channel_credentials(ca)
        assert list_nodes(address, no_cert) == grpc.StatusCode.UNAVAILABLE
        foreign = client_tls(other_pki, ca=pki / "ca.pem").channel_credentials()
        assert list_nodes(address, foreign) == grpc.StatusCode.UNAVAILABLE
        assert list_nodes(address, None) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)
        ix.close()


def test_indexer_snapshots_a_tls_daemon_with_its_certificate(daemon_factory, pki):
    """No cluster secret anywhere: the indexer's certificate authenticates its Snapshot."""
    s = {
        **server_settings(pki),
        "events.enabled": True,
        "events.publish_address": "tcp://127.0.0.1:0",
        "events.replay_address": "tcp://127.0.0.1:0",
        "events.buffer_batches": 5,  # 20 one-block puts: only a snapshot has the head
        "events.max_events_per_batch": 1,  # (one batch each, however slow the sender)
    }
    d = daemon_factory("node-a", settings=s)
    hashes = BlockHasher(16).hash_tokens_int(np.arange(16 * 20) % 30_000)
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(4096))
        for i in range(len(hashes)):
            assert c.put(ns, hashes[i : i + 1], np.zeros((1, 4096), np.uint8)).stored == 1
    source = SourceSpec(
        node="node-a",
        endpoint=d.info["events_publish_address"],
        replay_endpoint=d.info["events_replay_address"],
        snapshot_address=d.tcp_address,
    )
    ix = Indexer(IndexerConfig(sources=[source], **indexer_tls(pki)))  # type: ignore[arg-type]
    ix.start()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and ix.subscriber.stats.snapshots < 1:
            time.sleep(0.05)
        assert ix.subscriber.stats.snapshots >= 1
        best = {n.node: n.prefix_blocks for n in ix.score("tiny", hashes)}
        assert best.get("node-a") == 20
    finally:
        ix.close()


def test_indexer_bad_tls_file_names_the_path(tmp_path, pki):
    cfg = IndexerConfig(**{**indexer_tls(pki), "tls_key_path": str(tmp_path / "gone.key")})  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match=re.escape(f"indexer.tls_key_path: cannot read {tmp_path}/gone.key")
    ):
        Indexer(cfg)
    with pytest.raises(ConfigError, match=re.escape("indexer.tls_ca_path is needed")):
        IndexerConfig(tls_cert_path="a", tls_key_path="b").check()


# --- the router's channels (KVSTORE_TLS_*) -------------------------------------------


def test_router_client_scores_from_a_tls_indexer(pki, monkeypatch):
    ix = Indexer(IndexerConfig(address="127.0.0.1:0", **indexer_tls(pki)))  # type: ignore[arg-type]
    ix.start()
    server, port = serve_indexer(ix, "127.0.0.1:0")
    try:
        hashes = np.arange(1, 5, dtype=np.uint64)
        # No identity: the handshake fails and the client reports the indexer unavailable.
        with pytest.raises(Unavailable):
            RouterClient(f"127.0.0.1:{port}", deadline_s=5).scores("tiny", hashes)
        for var, name in (("CERT", "client.pem"), ("KEY", "client.key"), ("CA", "ca.pem")):
            monkeypatch.setenv(f"KVSTORE_TLS_{var}", str(pki / name))
        got = RouterClient(f"127.0.0.1:{port}", deadline_s=5).scores("tiny", hashes)
        assert (got.request_blocks, got.hits) == (4, [])
    finally:
        server.stop(0)
        ix.close()


def test_router_watches_a_tls_daemon_with_its_certificate(daemon_factory, pki, monkeypatch):
    d = daemon_factory(settings=server_settings(pki))

    async def daemon_serving() -> bool:
        fleet = Fleet(
            {"node-a": "http://127.0.0.1:9"},  # no engine: only the daemon's health matters
            connect_timeout_s=5,
            scrape_interval_s=60,
            capacity=1,
            daemons={"node-a": d.tcp_address},
        )
        await fleet.start()
        try:
            return fleet.backends["node-a"].daemon_serving
        finally:
            await fleet.close()

    assert asyncio.run(daemon_serving()) is False  # plaintext to a TLS daemon
    for var, name in (("CERT", "client.pem"), ("KEY", "client.key"), ("CA", "ca.pem")):
        monkeypatch.setenv(f"KVSTORE_TLS_{var}", str(pki / name))
    assert asyncio.run(daemon_serving()) is True


# --- client certificates renewed ------------------------------------------------------


def test_client_certificates_renewed_are_used_for_new_connections(daemon_factory, tmp_path):
    """The whole PKI is replaced (a new CA) while a Client runs: after the daemon comes
    back with the new CA only, the same Client, not restarted, connects again with the
    renewed files. Before, its channel kept the certificate it was made with."""
    old = make_pki(tmp_path / "old", "client")
    new = make_pki(tmp_path / "new", "client")
    live = tmp_path / "live"
    live.mkdir()
    files = ("server.pem", "server.key", "ca.pem", "client.pem", "client.key")
    for name in files:
        shutil.copy(old / name, live / name)
    settings = {**server_settings(live), "server.tcp_address": f"127.0.0.1:{free_port()}"}
    a = daemon_factory("tls-old", settings=settings)
    address = a.tcp_address
    with Client(address, map_region=False, tls=client_tls(live), timeout_s=2.0) as c:
        assert c.stats().node_id == "tls-old"
        for name in files:  # rename: each file changes at once
            shutil.copy(new / name, live / f".{name}.tmp")
            os.replace(live / f".{name}.tmp", live / name)
        a.stop()  # its connections go; the next daemon trusts the new CA only
        daemon_factory("tls-new", settings=settings)
        deadline = time.monotonic() + 20.0
        while True:
            try:
                assert c.stats().node_id == "tls-new"
                break
            except Unavailable:
                # the files are looked at once a second (kvstore.tls.RELOAD_CHECK_S)
                assert time.monotonic() < deadline, "the renewed client certificate was not used"
                time.sleep(0.1)
    # an old-CA client is refused by the new daemon: it was the renewal that got through
    with pytest.raises(Unavailable):
        Client(address, map_region=False, tls=client_tls(old), timeout_s=2.0)


def test_client_credentials_follow_the_files_and_keep_the_old_on_a_bad_renewal(tmp_path):
    old = make_pki(tmp_path / "old", "client")
    new = make_pki(tmp_path / "new", "client")
    live = tmp_path / "live"
    live.mkdir()
    for name in ("client.pem", "client.key", "ca.pem"):
        shutil.copy(old / name, live / name)
    now = [0.0]
    creds = ClientCredentials(client_tls(live), check_interval_s=1.0, clock=lambda: now[0])
    first, gen = creds.current()
    assert gen == 0
    # half a rotation (the certificate, not yet its key): not loadable, the old stay
    shutil.copy(new / "client.pem", live / "client.pem")
    now[0] = 1.0
    assert creds.current() == (first, 0)
    shutil.copy(new / "client.key", live / "client.key")
    shutil.copy(new / "ca.pem", live / "ca.pem")
    now[0] = 1.5  # within the check interval: not looked at yet
    assert creds.current()[1] == 0
    now[0] = 2.0
    renewed, gen = creds.current()
    assert gen == 1 and renewed is not first


def test_indexer_snapshots_with_renewed_certificates(daemon_factory, tmp_path):
    """The PKI is replaced while the indexer runs; the daemon comes back (same
    addresses) with the new CA only: the indexer's next Snapshot connects with its
    renewed files, without a restart. Before, its snapshot channel kept the old ones."""
    old = make_pki(tmp_path / "old")
    new = make_pki(tmp_path / "new")
    live = tmp_path / "live"
    live.mkdir()
    files = ("server.pem", "server.key", "ca.pem")
    for name in files:
        shutil.copy(old / name, live / name)
    s = {
        **server_settings(live),
        "server.tcp_address": f"127.0.0.1:{free_port()}",
        "events.enabled": True,
        "events.publish_address": f"tcp://127.0.0.1:{free_port()}",
        "events.replay_address": f"tcp://127.0.0.1:{free_port()}",
    }
    a = daemon_factory("snap-old", settings=s)
    source = SourceSpec(
        node="node-a",
        endpoint=str(s["events.publish_address"]),
        replay_endpoint=str(s["events.replay_address"]),
        snapshot_address=a.tcp_address,
    )
    ix = Indexer(IndexerConfig(sources=[source], **indexer_tls(live)))  # type: ignore[arg-type]
    ix.start()
    try:
        deadline = time.monotonic() + 20
        while ix.subscriber.stats.snapshots < 1:
            assert time.monotonic() < deadline, "no first snapshot"
            time.sleep(0.05)
        for name in files:  # rename: each file changes at once
            shutil.copy(new / name, live / f".{name}.tmp")
            os.replace(live / f".{name}.tmp", live / name)
        a.stop()
        b = daemon_factory("snap-new", settings=s)  # the new CA only, same addresses
        hashes = BlockHasher(16).hash_tokens_int(np.arange(16 * 4) % 30_000)
        with Client(b.address) as c:
            ns = c.declare_namespace(make_spec(4096))
            assert c.put(ns, hashes, np.zeros((4, 4096), np.uint8)).stored == 4
        # the reconnection makes a snapshot due; it must get through with the new files
        deadline = time.monotonic() + 30
        while ix.subscriber.stats.snapshots < 2:
            assert time.monotonic() < deadline, (
                f"no snapshot with the renewed certificate "
                f"({ix.subscriber.stats.snapshot_failures} failed)"
            )
            time.sleep(0.05)
    finally:
        ix.close()


def test_peer_pulls_use_renewed_certificates(daemon_factory, tmp_path):
    """The puller's files are renewed (a new CA) while it runs; its peer comes back on
    the same address with the new CA only: the next pull connects with the renewed
    certificate. Before, the peer channel kept the one loaded at start."""
    old = make_pki(tmp_path / "old", "node-b")
    new = make_pki(tmp_path / "new", "node-b")
    live = tmp_path / "live"
    live.mkdir()
    files = ("node-b.pem", "node-b.key", "ca.pem")
    for name in files:
        shutil.copy(old / name, live / name)
    spec = make_spec(4096)
    port = free_port()

    def peer_a(name: str, pki: Path) -> DaemonProcess:
        settings = {**peer_settings(pki, "server"), "server.tcp_address": f"127.0.0.1:{port}"}
        a = daemon_factory(name, settings=settings)
        with Client(a.address) as ca:
            ns = ca.declare_namespace(spec)
            ca.put(ns, [11, 12], np.full((2, 4096), 3, np.uint8))
        return a

    a = peer_a("node-a", old)
    b = daemon_factory("node-b", settings=peer_settings(live, "node-b"))
    assert pull_through(b, a, spec, [11, 12]) == 2
    for name in files:  # rename: each file changes at once
        shutil.copy(new / name, live / f".{name}.tmp")
        os.replace(live / f".{name}.tmp", live / name)
    a.stop()
    a2 = peer_a("node-a2", new)  # same address, the new CA only
    with Client(b.address) as cb:
        cb.delete(cb.declare_namespace(spec), [11, 12])
    deadline = time.monotonic() + 20
    while True:
        try:
            assert pull_through(b, a2, spec, [11, 12]) == 2
            break
        except Unavailable:
            # b looks at its files at most once a second (kvstore.tls.RELOAD_CHECK_S)
            assert time.monotonic() < deadline, "the renewed certificate was not used"
            time.sleep(0.1)
