"""Prometheus metrics, applied by wrapping: tiers and policies never touch them.

Two sources: a server interceptor times every RPC (one observation per call,
never per block), and a collector reads the manager's counters at scrape time,
so the data path pays nothing for metrics. Names follow
``kvstore_<subsystem>_<name>_<unit>``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.manager import BlockManager

RPC_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class RpcMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram(
            "kvstore_rpc_duration_seconds",
            "Server-side duration of a gRPC call.",
            ["method"],
            buckets=RPC_BUCKETS_S,
            registry=registry,
        )
        self.requests = Counter(
            "kvstore_rpc_requests_total",
            "gRPC calls by method and status code.",
            ["method", "code"],
            registry=registry,
        )


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Times unary calls and counts their status codes."""

    def __init__(self, metrics: RpcMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        behaviour = handler.unary_unary
        duration = self.metrics.duration.labels(method)
        requests = self.metrics.requests

        async def timed(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            try:
                return await behaviour(request, context)
            finally:
                duration.observe(time.perf_counter() - start)
                code = context.code()
                requests.labels(
                    method, code.name if isinstance(code, grpc.StatusCode) else "OK"
                ).inc()

        return grpc.unary_unary_rpc_method_handler(
            timed,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class ManagerCollector(Collector):
    """Reads the block manager's state at scrape time."""

    def __init__(self, manager: BlockManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[Any]:
        s = self.manager.stats()
        gauges = {
            "capacity_bytes": GaugeMetricFamily(
                "kvstore_tier_capacity_bytes", "Hard cap of the tier.", labels=["tier"]
            ),
            "used_bytes": GaugeMetricFamily(
                "kvstore_tier_used_bytes", "Bytes of the tier holding blocks.", labels=["tier"]
            ),
            "blocks": GaugeMetricFamily(
                "kvstore_tier_blocks", "Blocks held (committed and in flight).", labels=["tier"]
            ),
            "pinned_blocks": GaugeMetricFamily(
                "kvstore_tier_pinned_blocks", "Blocks pinned by a load lease.", labels=["tier"]
            ),
        }
        for t in s.tiers:
            for name, family in gauges.items():
                family.add_metric([t.tier.name.lower()], getattr(t, name))
        yield from gauges.values()
        yield GaugeMetricFamily("kvstore_lease_active", "Live leases.", value=s.active_leases)
        yield GaugeMetricFamily("kvstore_namespaces", "Declared namespaces.", value=s.namespaces)
        c = s.counters
        for name, doc, value in (
            (
                "kvstore_lookup_hit_blocks",
                "Blocks found by lookups (longest-prefix hits).",
                c.lookup_hit_blocks,
            ),
            (
                "kvstore_lookup_miss_blocks",
                "Blocks asked for by lookups but not found.",
                c.lookup_miss_blocks,
            ),
            ("kvstore_store_blocks", "Blocks committed.", c.stored_blocks),
            ("kvstore_load_blocks", "Blocks pinned for loading.", c.loaded_blocks),
            (
                "kvstore_eviction_blocks",
                "Blocks evicted (dropped from the node).",
                c.evicted_blocks,
            ),
            ("kvstore_lease_expired", "Leases reclaimed because they expired.", c.expired_leases),
            ("kvstore_tier_demoted_blocks", "Blocks moved to a lower tier.", c.demoted_blocks),
            ("kvstore_tier_promoted_blocks", "Blocks moved to a higher tier.", c.promoted_blocks),
        ):
            yield CounterMetricFamily(name, doc, value=value)


def serve_metrics(address: str, registry: CollectorRegistry) -> tuple[Any, int]:
    """Start /metrics on host:port (port 0 picks one); return (server, port)."""
    host, _, port = address.rpartition(":")
    server, _thread = start_http_server(int(port), addr=host or "127.0.0.1", registry=registry)
    return server, server.server_port
