"""With a cluster secret, TCP callers must present it; the Unix socket and probes stay open."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import Client
from kvstore.errors import PermissionDenied
from tests.conftest import make_spec

SECRET = "s3cret-for-tests"


@pytest.fixture
def guarded(daemon_factory):
    return daemon_factory(settings={"peer.secret": SECRET})


def test_tcp_without_secret_is_permission_denied(guarded):
    with pytest.raises(PermissionDenied, match="cluster secret"):
        Client(guarded.tcp_address)  # Hello already needs it
    with pytest.raises(PermissionDenied):
        Client(guarded.tcp_address, secret="wrong")


def test_tcp_with_secret_and_unix_without_it_are_served(guarded):
    with Client(guarded.address) as local:  # trusted by the socket's file mode
        ns = local.declare_namespace(make_spec(4096))
        local.put(ns, [1, 2], np.full((2, 4096), 7, np.uint8))
    with Client(guarded.tcp_address, secret=SECRET, map_region=False) as remote:
        got = remote.get(ns, [1, 2])
        assert got.found == 2 and int(got.data.sum()) == 7 * 8192


def test_health_stays_open_for_probes(guarded):
    with grpc.insecure_channel(guarded.tcp_address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=3
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_no_secret_configured_still_answers_stats_over_tcp(daemon):
    # Data calls are refused then (tests/integration/test_trust.py); tools keep Stats.
    with Client(daemon.tcp_address, map_region=False) as c:
        assert c.stats().node_id == daemon.name
