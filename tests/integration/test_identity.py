"""Identities mapped to tenants (kvstore/identity.py), with real daemons, sockets and certificates.

One daemon with mutual TLS on its TCP listener and these principals:
alice (a token, tenant "a"), bob (a token, tenant "b"), ops (a token, every
tenant, admin), engine-b (a client certificate's CN, tenant "b"), and a uid
nobody here runs as. Alice stores blocks; every other path then tries to read
them: gRPC over the Unix socket, TCP with a token and with a certificate, the
lean channel with a token and by uid. Each refusal is PERMISSION_DENIED, reads
nothing, and is one ``kvstore.audit`` line. The indexer refuses RegisterNode
from a router's identity.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import grpc
import msgspec
import numpy as np
import pytest

from kvstore import audit
from kvstore.client import Client, pack_hashes
from kvstore.errors import ConfigError, LeaseNotFound, PermissionDenied
from kvstore.identity import TOKEN_METADATA_KEY, client_token, hash_token, read_token_file
from kvstore.indexer.config import IndexerConfig
from kvstore.indexer.service import Indexer
from kvstore.indexer.service import serve as serve_indexer
from kvstore.local_client import LocalChannel
from kvstore.local_server import local_socket_path
from kvstore.local_wire import Lookup, PrepareLoad
from kvstore.process import DaemonProcess
from kvstore.v1 import indexer_pb2, indexer_pb2_grpc, store_pb2, store_pb2_grpc
from tests.conftest import make_spec
from tests.integration.test_audit import scrape_denied
from tests.integration.test_tls import client_tls, make_pki, server_settings

ALICE, BOB, OPS = (secrets.token_hex(16) for _ in range(3))
UNUSED_UID = 54321  # mapped, but nobody here runs as it: this process's uid is not mapped
HASHES = [11, 12, 13]
T = 20.0  # call deadline: generous, the test machine is shared
BLOCK_BYTES = 4096


def principals(prefix: str = "auth.principals") -> dict[str, str]:
    return {
        f"{prefix}.alice.token_sha256": hash_token(ALICE),
        f"{prefix}.alice.tenants": "a",
        f"{prefix}.bob.token_sha256": hash_token(BOB),
        f"{prefix}.bob.tenants": "b",
        f"{prefix}.ops.token_sha256": hash_token(OPS),
        f"{prefix}.ops.tenants": "*",
        f"{prefix}.ops.roles": "admin",
        f"{prefix}.engine-b.cert_names": "engine-b",
        f"{prefix}.engine-b.tenants": "b",
        f"{prefix}.local.uids": str(UNUSED_UID),
        f"{prefix}.local.tenants": "a",
    }


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"), "engine-b", "engine-x")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, pki):
    d = DaemonProcess(
        tmp_path_factory.mktemp("identity"),
        name="ident",
        metrics=True,
        settings={"log.format": "json", **server_settings(pki), **principals()},
    )
    d.start()
    yield d
    d.stop()
    d.remove_region()


@pytest.fixture(scope="module")
def stored(daemon):
    """Alice's namespace (tenant "a") with three blocks in it."""
    with Client(daemon.address, timeout_s=T, token=ALICE) as alice:
        ns = alice.declare_namespace(make_spec(BLOCK_BYTES, tenant="a"))
        alice.put(ns, HASHES, np.full((3, BLOCK_BYTES), 5, np.uint8))
        assert alice.lookup(ns, HASHES).prefix_blocks == 3
    return ns


def audit_lines(d: DaemonProcess, reason: str) -> list[dict]:
    out = []
    for line in d.log_tail(500_000).splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("logger") == "kvstore.audit" and entry.get("reason") == reason:
            out.append(entry)
    return out


def still_there(d: DaemonProcess, ns) -> None:
    with Client(d.address, timeout_s=T, token=ALICE, map_region=False) as alice:
        got = alice.get(ns, HASHES)
        assert got.found == 3 and int(got.data.sum()) == 5 * 3 * BLOCK_BYTES


def test_another_tenant_reads_nothing_over_grpc_on_the_unix_socket(daemon, stored):
    with Client(
        daemon.address, timeout_s=T, token=BOB, local_channel=False, map_region=False
    ) as bob:
        assert not bob.using_local_channel
        with pytest.raises(PermissionDenied, match="bob may not use namespace"):
            bob.lookup(stored, HASHES)
        with pytest.raises(PermissionDenied):
            bob.get(stored, HASHES)  # GetInline
        with pytest.raises(PermissionDenied):
            bob.prepare_load(stored, HASHES)
        with pytest.raises(PermissionDenied):
            bob.put(stored, [99], np.zeros((1, BLOCK_BYTES), np.uint8))  # PutInline
        with pytest.raises(PermissionDenied):
            bob.delete(stored, HASHES)
        with pytest.raises(PermissionDenied, match="may not use tenant 'a'"):
            bob.declare_namespace(make_spec(BLOCK_BYTES, tenant="a"))
        # its own tenant is fine
        own = bob.declare_namespace(make_spec(BLOCK_BYTES, tenant="b"))
        assert bob.lookup(own, HASHES).prefix_blocks == 0
    # no token: gRPC on the socket carries no peer credentials, so nothing
    with (
        Client(
            daemon.address, timeout_s=T, token="", local_channel=False, map_region=False
        ) as anon,
        pytest.raises(PermissionDenied, match="needs an identity"),
    ):
        anon.lookup(stored, HASHES)
    # a token no principal has is refused outright
    with (
        pytest.raises(PermissionDenied, match="no principal"),
        Client(daemon.address, timeout_s=T, token="not-a-token", local_channel=False) as c,
    ):
        c.lookup(stored, HASHES)
    still_there(daemon, stored)
    # the first refusal is logged (one line per caller and reason per 10 s), each counted
    denied = audit_lines(daemon, audit.TENANT_DENIED)
    assert any(e["who"] == "bob (unix)" and e["what"].startswith("Lookup") for e in denied)
    assert scrape_denied(daemon.metrics_address, audit.TENANT_DENIED) >= 6
    assert any(e["who"] == "unix" for e in audit_lines(daemon, audit.NO_IDENTITY))


def test_another_tenant_reads_nothing_over_tcp_by_token_or_certificate(daemon, stored, pki):
    # a verified certificate no principal has, with bob's token: bob
    tls_x = client_tls(pki, "engine-x")
    with Client(daemon.tcp_address, timeout_s=T, token=BOB, map_region=False, tls=tls_x) as bob:
        with pytest.raises(PermissionDenied, match="bob may not use"):
            bob.get(stored, HASHES)
        with pytest.raises(PermissionDenied):
            bob.lookup(stored, HASHES)
    # the certificate mapped to tenant b, no token
    with (
        Client(
            daemon.tcp_address, token="", map_region=False, tls=client_tls(pki, "engine-b")
        ) as b,
        pytest.raises(PermissionDenied, match="engine-b may not use"),
    ):
        b.get(stored, HASHES)
    # an unmapped certificate alone is no identity (before: any certificate of the CA)
    with (
        Client(daemon.tcp_address, timeout_s=T, token="", map_region=False, tls=tls_x) as x,
        pytest.raises(PermissionDenied, match="need an identity"),
    ):
        x.get(stored, HASHES)
    # alice's token over TCP reads her blocks
    with Client(daemon.tcp_address, timeout_s=T, token=ALICE, map_region=False, tls=tls_x) as alice:
        assert alice.get(stored, HASHES).found == 3
    denied = audit_lines(daemon, audit.TENANT_DENIED)
    assert any(e["who"].startswith("engine-b (ipv4:127.0.0.1)") for e in denied)
    assert any(e["who"].startswith("bob (ipv4:127.0.0.1)") for e in denied)


def test_another_tenant_reads_nothing_over_the_lean_channel(daemon, stored):
    path = local_socket_path(daemon.socket_path)
    ch = LocalChannel.open(path, "bob-1", 5.0, token=BOB)
    try:
        for make in (
            lambda seq: Lookup(seq, stored.namespace_id, pack_hashes(HASHES)),
            lambda seq: PrepareLoad(seq, stored.namespace_id, pack_hashes(HASHES)),
        ):
            with pytest.raises(PermissionDenied, match="bob may not use"):
                ch.call(make)
    finally:
        ch.close()
    # the Client's hot path uses the lean channel with its token
    with Client(daemon.address, timeout_s=T, token=BOB) as bob:
        assert bob.using_local_channel
        with pytest.raises(PermissionDenied):
            bob.lookup(stored, HASHES)
    with Client(daemon.address, timeout_s=T, token=ALICE) as alice:
        assert alice.using_local_channel
        assert alice.lookup(stored, HASHES).prefix_blocks == 3
    assert any(e["who"].startswith("bob (uid ") for e in audit_lines(daemon, audit.TENANT_DENIED))


def test_a_uid_not_mapped_gets_nothing_on_the_lean_channel(daemon, stored):
    # this process's uid is in no principal (only UNUSED_UID is), and it sends no token
    path = local_socket_path(daemon.socket_path)
    with pytest.raises(PermissionDenied, match="is no principal's and it sent no token"):
        LocalChannel.open(path, "anon-1", 5.0)
    # the Client falls back to gRPC, where it has no identity either
    with Client(daemon.address, timeout_s=T, token="") as anon:
        assert not anon.using_local_channel
        with pytest.raises(PermissionDenied):
            anon.lookup(stored, HASHES)
    assert any(e["what"] == "lean channel hello" for e in audit_lines(daemon, audit.NO_IDENTITY))


def test_an_admin_only_call_from_a_tenant_is_denied(daemon, stored):
    with (
        Client(daemon.address, timeout_s=T, token=ALICE, map_region=False) as alice,
        pytest.raises(PermissionDenied, match="Clear needs the role admin"),
    ):
        alice.clear(stored)  # her own namespace: Clear is the admin's
    with grpc.insecure_channel(f"unix:{daemon.socket_path}") as ch:
        stream = store_pb2_grpc.StoreServiceStub(ch).Snapshot(
            store_pb2.SnapshotRequest(), metadata=((TOKEN_METADATA_KEY, ALICE),), timeout=10
        )
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    still_there(daemon, stored)
    denied = audit_lines(daemon, audit.ROLE_DENIED)
    assert [(e["who"], e["what"]) for e in denied] == [("alice (unix)", "Clear")]
    assert scrape_denied(daemon.metrics_address, audit.ROLE_DENIED) == 2  # Snapshot too


def test_leases_stay_their_principals(daemon, stored):
    with Client(daemon.address, timeout_s=T, token=ALICE, local_channel=False) as alice:
        handle = alice.prepare_load(stored, HASHES)
        with Client(daemon.address, timeout_s=T, token=OPS, local_channel=False) as ops:
            # another principal (even an admin) is answered as for an id never issued
            with pytest.raises(LeaseNotFound):
                ops.release(handle.lease_id)
            assert ops.stats().active_leases >= 1
        alice.release(handle)


def test_the_default_without_principals_is_unchanged(daemon_factory):
    d = daemon_factory()
    with Client(d.address, timeout_s=T, token="") as c:  # one trust domain locally, as before
        ns = c.declare_namespace(make_spec(BLOCK_BYTES, tenant="anyone"))
        c.put(ns, [1], np.ones((1, BLOCK_BYTES), np.uint8))
        assert c.lookup(ns, [1]).prefix_blocks == 1
        c.clear(ns)
    with (
        Client(d.tcp_address, timeout_s=T, token=ALICE, map_region=False) as remote,
        pytest.raises(PermissionDenied, match="cluster secret"),  # TCP: still no data
    ):
        remote.lookup(ns, [1])


def indexer_with(principals: dict[str, dict]) -> Indexer:
    return Indexer(
        msgspec.convert({"address": "127.0.0.1:0", "principals": principals}, IndexerConfig)
    )


def test_the_indexer_refuses_register_node_from_a_router():
    router, node = secrets.token_hex(16), secrets.token_hex(16)
    ix = indexer_with(
        {
            "router-1": {"token_sha256": hash_token(router), "roles": ["router"]},
            "node-1": {"token_sha256": hash_token(node), "roles": ["node"]},
            "alice": {"token_sha256": hash_token(ALICE), "tenants": ["a"]},
        }
    )
    server, port = serve_indexer(ix, "127.0.0.1:0")
    before = audit.AUDIT.counts()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = indexer_pb2_grpc.IndexerServiceStub(ch)
            reg = indexer_pb2.RegisterNodeRequest(
                source=indexer_pb2.EventSource(node="n1", endpoint="tcp://127.0.0.1:1"), ttl_s=30
            )
            for md in (((TOKEN_METADATA_KEY, router),), ((TOKEN_METADATA_KEY, ALICE),), ()):
                with pytest.raises(grpc.RpcError) as err:
                    stub.RegisterNode(reg, metadata=md, timeout=10)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.RpcError) as err:
                stub.UnregisterNode(
                    indexer_pb2.UnregisterNodeRequest(node="n1"),
                    metadata=((TOKEN_METADATA_KEY, router),),
                    timeout=10,
                )
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert (
                stub.ListNodes(
                    indexer_pb2.ListNodesRequest(),
                    metadata=((TOKEN_METADATA_KEY, router),),
                    timeout=10,
                ).sources
                == []
            )  # nothing was registered
            score = indexer_pb2.ScoreRequest(model="m", block_hashes=pack_hashes([1]))
            stub.Score(score, metadata=((TOKEN_METADATA_KEY, router),), timeout=10)  # a router
            with pytest.raises(grpc.RpcError) as err:
                stub.Score(score, timeout=10)  # no identity
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            # the node's identity registers
            stub.RegisterNode(reg, metadata=((TOKEN_METADATA_KEY, node),), timeout=10)
    finally:
        server.stop(None)
        ix.close()
    after = audit.AUDIT.counts()
    assert after[audit.ROLE_DENIED] - before[audit.ROLE_DENIED] == 3  # router x2, alice
    assert after[audit.NO_IDENTITY] - before[audit.NO_IDENTITY] == 2


def test_router_client_presents_its_token():
    from kvstore_router_client import RouterClient

    router = secrets.token_hex(16)
    ix = indexer_with({"router-1": {"token_sha256": hash_token(router), "roles": ["router"]}})
    server, port = serve_indexer(ix, "127.0.0.1:0")
    hashes = np.array([1], np.uint64)
    try:
        with pytest.raises(PermissionDenied):
            RouterClient(f"127.0.0.1:{port}", token="", deadline_s=5).scores("m", hashes)
        got = RouterClient(f"127.0.0.1:{port}", token=router, deadline_s=5).scores("m", hashes)
        assert got.request_blocks == 1 and got.hits == []
    finally:
        server.stop(None)
        ix.close()


def test_token_files_must_be_private(tmp_path):
    f = tmp_path / "token"
    f.write_text(ALICE + "\n")
    f.chmod(0o644)
    with pytest.raises(ConfigError, match="make it 0600"):
        read_token_file(str(f))
    f.chmod(0o600)
    assert read_token_file(str(f)) == ALICE


def test_the_vllm_connector_session_presents_its_token(daemon, stored, tmp_path):
    from kvstore_connectors.vllm.config import ConnectorConfig
    from kvstore_connectors.vllm.session import DaemonSession

    f = tmp_path / "alice.token"
    f.write_text(ALICE + "\n")
    f.chmod(0o600)
    config = ConnectorConfig.from_extra({"address": daemon.address, "token_file": str(f)})
    token = client_token(config.token or None, config.token_file)
    for who, expect in ((token, 3), ("", None)):
        session = DaemonSession(
            daemon.address, timeout_s=T, retry_initial_s=0.5, retry_max_s=1.0, token=who
        )
        try:
            if expect is None:
                # no token (none in the environment either): lean channel refused, gRPC denied
                assert session.call("lookup", lambda c: c.lookup(stored, HASHES)) is None
                assert session.connected and session.failures == 1  # refused, not down
            else:
                got = session.call("lookup", lambda c: c.lookup(stored, HASHES))
                assert got is not None and got.prefix_blocks == expect
                assert session.client().using_local_channel
        finally:
            session.close()


def test_tenants_that_share_the_region_are_named_at_start(daemon):
    """Principals make tenants trust domains; tenants without a region of their own
    (dram.tenant_regions) still share the one mapped region: one warning at start,
    naming the principals, never a cache_salt."""
    lines = [line for line in daemon.log_tail(500_000).splitlines() if "share the one DRAM" in line]
    assert len(lines) == 1, lines
    for name in ("alice", "bob", "engine-b", "local"):
        assert name in lines[0]
    assert "ops" not in lines[0].split("tenants of", 1)[1].split("share", 1)[0]  # "*" only
