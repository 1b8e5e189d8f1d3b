"""The audit log of denied requests, with real daemons (issue 13).

Each refusal at a trust boundary is one ``kvstore.audit`` line (who, what,
reason; the record's ts is the when) and one count in
``kvstore_denied_requests_total{reason}``; a flood is one line per (who,
reason) per 10 s, with the count of those not logged.
"""

from __future__ import annotations

import json
import logging
import math
import time
import urllib.request

import grpc
import msgspec
import pytest

from kvstore.client import pack_hashes
from kvstore.events.publisher import ZmqEventPublisher
from kvstore.indexer.config import IndexerConfig
from kvstore.indexer.metrics import serve_metrics
from kvstore.indexer.service import Indexer, serve
from kvstore.indexer.subscriber import SourceSpec
from kvstore.process import DaemonProcess
from kvstore.v1 import indexer_pb2, indexer_pb2_grpc, peer_pb2, peer_pb2_grpc, store_pb2_grpc
from kvstore.v1 import store_pb2 as pb
from tests.conftest import make_spec
from tests.integration import test_trust
from tests.unprivileged import OTHER_UID

SECRET = "audit-secret"
AUDIT_INTERVAL_S = 10.0  # kvstore.audit.AuditLog's default


def start(daemon_factory, **settings: object) -> DaemonProcess:
    return daemon_factory(metrics=True, settings={"log.format": "json", **settings})


def audit_lines(d: DaemonProcess) -> list[dict]:
    out = []
    for line in d.log_tail(500_000).splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("logger") == "kvstore.audit":
            out.append(entry)
    return out


def denied_total(d: DaemonProcess, reason: str) -> float:
    return scrape_denied(d.metrics_address, reason)


def scrape_denied(address: str, reason: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        text = r.read().decode()
    prefix = f'kvstore_denied_requests_total{{reason="{reason}"}} '
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    raise AssertionError(f"no {prefix!r} in /metrics")


def refused(fn, *args, **kw) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, timeout=10, **kw)
    return info.value.code()


def test_a_tcp_call_without_the_secret_is_audited_and_a_flood_is_rate_limited(daemon_factory):
    d = start(daemon_factory)  # no secret: TCP serves Hello and Stats only
    assert audit_lines(d) == [] and denied_total(d, "tcp_no_secret") == 0
    req = pb.LookupRequest(namespace_id="ns", block_hashes=pack_hashes([1]))
    with grpc.insecure_channel(d.tcp_address) as ch:
        stub = store_pb2_grpc.StoreServiceStub(ch)
        assert refused(stub.Lookup, req) == grpc.StatusCode.PERMISSION_DENIED
        lines = audit_lines(d)
        assert len(lines) == 1, lines
        (line,) = lines
        assert line["audit"] == "denied" and line["reason"] == "tcp_no_secret"
        assert line["who"].startswith("ipv4:127.0.0.1:")
        assert line["what"] == "/kvstore.v1.StoreService/Lookup"
        assert line["level"] == "warning" and line["ts"].endswith("Z")
        assert line["suppressed"] == 0
        assert denied_total(d, "tcp_no_secret") == 1

        flood = 200
        start_s = time.monotonic()
        for _ in range(flood // 20):  # new connections (ports): the key is the host
            with grpc.insecure_channel(d.tcp_address) as again:
                flooder = store_pb2_grpc.StoreServiceStub(again)
                for _ in range(20):
                    code = refused(flooder.GetInline, pb.GetInlineRequest())
                    assert code == grpc.StatusCode.PERMISSION_DENIED
        elapsed_s = time.monotonic() - start_s
    assert denied_total(d, "tcp_no_secret") == 1 + flood  # every one counted
    lines = audit_lines(d)
    # one line per 10 s: how many the flood's duration allows, whatever the load
    assert len(lines) <= 1 + math.ceil(elapsed_s / AUDIT_INTERVAL_S), (elapsed_s, lines)
    assert sum(1 + line["suppressed"] for line in lines) <= 1 + flood


def test_a_wrong_secret_is_audited_for_the_store_and_the_peer_service(daemon_factory):
    d = start(
        daemon_factory,
        **{"peer.enabled": "true", "peer.secret": SECRET, "peer.transport": "grpc_stream"},
    )
    bad = (("x-kvstore-cluster-secret", "guess"),)
    with grpc.insecure_channel(d.tcp_address) as ch:
        store = store_pb2_grpc.StoreServiceStub(ch)
        peer = peer_pb2_grpc.PeerServiceStub(ch)
        assert refused(store.Clear, pb.ClearRequest(), metadata=bad) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        assert refused(peer.PinForPull, peer_pb2.PinForPullRequest(), metadata=bad) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
    by_reason = {line["reason"]: line for line in audit_lines(d)}
    assert by_reason["tcp_wrong_secret"]["what"] == "/kvstore.v1.StoreService/Clear"
    assert by_reason["peer_wrong_secret"]["what"] == "/kvstore.v1.PeerService/PinForPull"
    assert denied_total(d, "tcp_wrong_secret") == 1
    assert denied_total(d, "peer_wrong_secret") == 1
    assert "guess" not in d.log_tail(500_000)  # a presented secret is never logged


def test_using_another_callers_lease_is_audited(daemon_factory):
    d = start(daemon_factory, **{"peer.secret": SECRET})
    with grpc.insecure_channel(d.address) as local:
        stub = store_pb2_grpc.StoreServiceStub(local)
        ns = stub.DeclareNamespace(
            pb.DeclareNamespaceRequest(
                spec=pb.NamespaceSpec(**msgspec.structs.asdict(make_spec(4096)))
            )
        )
        lease = stub.PrepareStore(
            pb.PrepareStoreRequest(namespace_id=ns.namespace_id, block_hashes=pack_hashes([7]))
        ).lease_id
    ok = (("x-kvstore-cluster-secret", SECRET),)
    with grpc.insecure_channel(d.tcp_address) as ch:
        tcp = store_pb2_grpc.StoreServiceStub(ch)
        # the secret is right, the lease is the Unix socket's: as if never issued
        assert refused(tcp.CommitStore, pb.CommitStoreRequest(lease_id=lease), metadata=ok) == (
            grpc.StatusCode.NOT_FOUND
        )
        assert refused(tcp.Release, pb.ReleaseRequest(lease_ids=[lease]), metadata=ok) == (
            grpc.StatusCode.NOT_FOUND
        )
    lines = [line for line in audit_lines(d) if line["reason"] == "lease_not_owner"]
    assert len(lines) == 1, lines  # the second: same caller, same reason, within 10 s
    assert lines[0]["who"] == "ipv4:127.0.0.1" and lines[0]["what"] == f"lease {lease}"
    assert denied_total(d, "lease_not_owner") == 2
    with grpc.insecure_channel(d.address) as local:  # the owner still has it
        stub = store_pb2_grpc.StoreServiceStub(local)
        assert stub.Release(pb.ReleaseRequest(lease_ids=[lease])).released == 1


def test_a_file_another_user_owns_is_audited(node_for_audit):
    d = node_for_audit
    lines = [line for line in audit_lines(d) if line["reason"] == "foreign_file"]
    assert lines and lines[0]["who"].startswith(f"uid {OTHER_UID}")
    assert lines[0]["what"].endswith(".manifest")
    assert denied_total(d, "foreign_file") >= 1


@pytest.fixture
def node_for_audit(tmp_path):
    """A daemon started beside a manifest another user planted (test_trust's case)."""
    made: list[DaemonProcess] = []

    def make(name: str = "d", **settings: object) -> DaemonProcess:
        d = DaemonProcess(
            tmp_path / name,
            name=name,
            metrics=True,
            settings={"log.format": "json", **settings},
        )
        made.append(d)
        return d

    test_trust.test_a_manifest_planted_by_another_user_is_never_adopted(make)
    yield made[0]
    for d in made:
        d.stop()
        d.remove_region()


def test_the_indexer_audits_refused_registrations(caplog):
    caplog.set_level(logging.WARNING, "kvstore.audit")
    pub = ZmqEventPublisher("node-c", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    ix = Indexer(
        IndexerConfig(
            address="127.0.0.1:0",
            sources=[SourceSpec(node="node-c", endpoint=pub.endpoint)],
            cluster_secret=SECRET,
        )
    )
    ix.start()
    server, port = serve(ix, "127.0.0.1:0")
    metrics_server, metrics_port = serve_metrics(ix, "127.0.0.1:0")
    scrape = f"127.0.0.1:{metrics_port}"
    try:
        before = {
            r: scrape_denied(scrape, r) for r in ("indexer_wrong_secret", "indexer_node_refused")
        }
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = indexer_pb2_grpc.IndexerServiceStub(ch)
            src = indexer_pb2.EventSource(node="node-c", endpoint="tcp://127.0.0.1:1")
            req = indexer_pb2.RegisterNodeRequest(source=src)
            assert refused(stub.RegisterNode, req) == grpc.StatusCode.PERMISSION_DENIED
            ok = (("x-kvstore-cluster-secret", SECRET),)
            assert refused(stub.RegisterNode, req, metadata=ok) == (
                grpc.StatusCode.PERMISSION_DENIED  # a configured source cannot be replaced
            )
        got = {r.fields["reason"]: r.fields for r in caplog.records if r.name == "kvstore.audit"}  # type: ignore[attr-defined]
        assert got["indexer_wrong_secret"]["what"] == "RegisterNode 'node-c'"
        assert got["indexer_node_refused"]["who"].startswith("ipv4:127.0.0.1:")
        for reason, n in before.items():
            assert scrape_denied(scrape, reason) == n + 1
    finally:
        metrics_server.shutdown()
        server.stop(0)
        ix.close()
        pub.close()
