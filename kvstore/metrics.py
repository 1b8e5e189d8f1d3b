"""Prometheus metrics, applied by wrapping: tiers and policies never touch them.

Three sources: a server interceptor times every RPC (one observation per call,
never per block); a collector reads the manager's counters at scrape time, so
the data path pays nothing for metrics; and peer transfer is counted by
wrapping the puller and the owner's ``PeerService`` (one update per pull or
pin, never per block), into plain ``PeerCounters`` that both ``/metrics`` and
the Stats RPC read. Names follow ``kvstore_<subsystem>_<name>_<unit>``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.errors import InvalidRequest, KVStoreError, NotFound
from kvstore.manager import BlockManager
from kvstore.transfer.base import KIND_GRPC_STREAM, KIND_NIXL

if TYPE_CHECKING:
    from kvstore.transfer.puller import PullResult
    from kvstore.transfer.ticket import PullTicket

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
            "huge_page_bytes": GaugeMetricFamily(
                "kvstore_tier_huge_page_bytes",
                "Bytes of the tier's memory in pages of 2 MiB or more (docs/tiers.md).",
                labels=["tier"],
            ),
        }
        for t in s.tiers:
            for name, family in gauges.items():
                family.add_metric([t.tier.name.lower()], getattr(t, name))
        yield from gauges.values()
        # By tenant (docs/tenants.md): configured names only, every other tenant
        # summed under "_other", so the label set is bounded by the config and no
        # cache_salt is shown. Caps only where one is set.
        held = GaugeMetricFamily(
            "kvstore_tenant_bytes",
            'Bytes a tenant holds in a tier ("_other": the tenants not configured, summed).',
            labels=["tenant", "tier"],
        )
        quota = GaugeMetricFamily(
            "kvstore_tenant_quota_bytes",
            'A tenant\'s cap in a tier ("_other": the cap of each tenant not configured).',
            labels=["tenant", "tier"],
        )
        for row in s.tenants:
            for t in s.tiers:
                tier = t.tier.name.lower()
                held.add_metric([row.label, tier], row.used_bytes[t.tier])
                if row.quota_bytes[t.tier]:
                    quota.add_metric([row.label, tier], row.quota_bytes[t.tier])
        yield held
        yield quota
        yield GaugeMetricFamily("kvstore_lease_active", "Live leases.", value=s.active_leases)
        yield GaugeMetricFamily("kvstore_namespaces", "Declared namespaces.", value=s.namespaces)
        yield GaugeMetricFamily(
            "kvstore_replica_blocks",
            "Pulled copies resident in DRAM as low-priority replicas (first to go).",
            value=s.replica_blocks,
        )
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
            (
                "kvstore_load_blocks",
                "Blocks loaded: pinned for loading, or read directly by local clients.",
                c.loaded_blocks,
            ),
            (
                "kvstore_load_direct_blocks",
                "Of the loaded blocks: read by local clients from the region without a "
                "lease (found in the presence table).",
                c.direct_loaded_blocks,
            ),
            (
                "kvstore_eviction_blocks",
                "Blocks evicted (dropped from the node).",
                c.evicted_blocks,
            ),
            (
                "kvstore_eviction_redundant_blocks",
                "Of the evicted blocks: copies a lower-id node was believed to hold too.",
                c.evicted_redundant_blocks,
            ),
            (
                "kvstore_eviction_replica_blocks",
                "Of the evicted blocks: pulled copies evicted while low-priority replicas.",
                c.evicted_replica_blocks,
            ),
            (
                "kvstore_replica_admitted_blocks",
                "Pulled copies admitted to DRAM as low-priority replicas.",
                c.admitted_replicas,
            ),
            (
                "kvstore_replica_promoted_blocks",
                "Replicas promoted to normal blocks by local loads.",
                c.promoted_replicas,
            ),
            ("kvstore_lease_expired", "Leases reclaimed because they expired.", c.expired_leases),
            ("kvstore_tier_demoted_blocks", "Blocks moved to a lower tier.", c.demoted_blocks),
            ("kvstore_tier_promoted_blocks", "Blocks moved to a higher tier.", c.promoted_blocks),
        ):
            yield CounterMetricFamily(name, doc, value=value)


# A pull is one pin round trip plus one batched read: milliseconds to seconds.
PULL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Transport labels: the two kinds, and "unknown" for a peer naming neither
# (a peer's request is not trusted to pick label values: the set stays bounded).
PEER_TRANSPORTS = (KIND_NIXL, KIND_GRPC_STREAM, "unknown")


@dataclass(slots=True)
class PeerTransportCounters:
    """Peer-transfer counters of one transport, since the daemon started."""

    # This node as the puller.
    pulls: int = 0
    pull_failures: int = 0
    fetched_blocks: int = 0
    fetched_bytes: int = 0
    checksum_failed_blocks: int = 0
    pull_s: float = 0.0
    handed_over_pulls: int = 0
    # This node as the owner (labelled by the transport the puller reads with).
    serve_pins: int = 0
    serve_failures: int = 0
    served_blocks: int = 0
    served_bytes: int = 0


class PeerCounters:
    """The daemon's peer-transfer counters, by transport; read by /metrics and Stats."""

    def __init__(self) -> None:
        self.by_transport = {t: PeerTransportCounters() for t in PEER_TRANSPORTS}

    def of(self, transport: str) -> PeerTransportCounters:
        return self.by_transport.get(transport) or self.by_transport["unknown"]


# (field, metric name, help) of the counters, in exposition order.
_PEER_COUNTERS = (
    ("pulls", "kvstore_peer_pulls", "Pulls from a peer this node ran (FetchFromPeer, hints)."),
    ("pull_failures", "kvstore_peer_pull_failures", "Pulls that failed (peer down, timeout)."),
    ("fetched_blocks", "kvstore_peer_fetched_blocks", "Blocks pulled from peers and verified."),
    ("fetched_bytes", "kvstore_peer_fetched_bytes", "Bytes of the blocks pulled from peers."),
    (
        "checksum_failed_blocks",
        "kvstore_peer_checksum_failed_blocks",
        "Pulled blocks whose xxh3 did not match the owner's: dropped.",
    ),
    (
        "handed_over_pulls",
        "kvstore_peer_handed_over_pulls",
        "Pulls that read a pin the owner handed over (a ticket): no pin round trip.",
    ),
    ("serve_pins", "kvstore_peer_serve_pins", "Pins made here for peers (PinForPull; HandOver)."),
    ("serve_failures", "kvstore_peer_serve_failures", "Pin requests from peers refused."),
    ("served_blocks", "kvstore_peer_served_blocks", "Blocks pinned here for peers to read."),
    ("served_bytes", "kvstore_peer_served_bytes", "Bytes of the blocks pinned for peers."),
)
assert {f for f, _, _ in _PEER_COUNTERS} | {"pull_s"} == {
    f.name for f in fields(PeerTransportCounters)
}


class PeerCollector(Collector):
    """Exposes ``PeerCounters`` at scrape time."""

    def __init__(self, counters: PeerCounters) -> None:
        self.counters = counters

    def collect(self) -> Iterator[Any]:
        for field_name, name, doc in _PEER_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["transport"])
            for transport, c in self.counters.by_transport.items():
                family.add_metric([transport], getattr(c, field_name))
            yield family


class _Pulls(Protocol):
    async def pull(
        self,
        ns_id: str,
        hashes: Sequence[int],
        address: str,
        timeout_s: float = 0.0,
        ticket: PullTicket | None = None,
    ) -> PullResult: ...

    def transport_to(self, address: str) -> str: ...

    async def aclose(self) -> None: ...


class InstrumentedPuller:
    """A puller that counts each pull (once, from its result) in ``PeerCounters``."""

    def __init__(self, inner: _Pulls, metrics: PeerMetrics) -> None:
        self.inner = inner
        self.metrics = metrics

    async def pull(
        self,
        ns_id: str,
        hashes: Sequence[int],
        address: str,
        timeout_s: float = 0.0,
        ticket: PullTicket | None = None,
    ) -> PullResult:
        started = time.perf_counter()
        try:
            result = await self.inner.pull(ns_id, hashes, address, timeout_s, ticket)
        except KVStoreError as exc:
            if not isinstance(exc, InvalidRequest | NotFound):  # the caller's mistake, not a pull
                transport = self.inner.transport_to(address)
                c = self.metrics.counters.of(transport)
                c.pulls += 1
                c.pull_failures += 1
                self.metrics.observe_pull(transport, time.perf_counter() - started)
            raise
        c = self.metrics.counters.of(result.transport)
        c.pulls += 1
        c.handed_over_pulls += result.handed_over
        c.fetched_blocks += result.fetched_blocks
        c.fetched_bytes += result.fetched_bytes
        c.checksum_failed_blocks += result.corrupt_blocks
        self.metrics.observe_pull(result.transport, time.perf_counter() - started)
        return result

    def transport_to(self, address: str) -> str:
        return self.inner.transport_to(address)

    async def aclose(self) -> None:
        await self.inner.aclose()


class InstrumentedPeerService:
    """The owner's PeerService with its pins counted; the other calls pass through."""

    def __init__(self, inner: Any, metrics: PeerMetrics) -> None:
        self.inner = inner
        self.metrics = metrics

    async def GetAgentMetadata(self, request: Any, context: Any) -> Any:
        return await self.inner.GetAgentMetadata(request, context)

    async def PinForPull(self, request: Any, context: Any) -> Any:
        return await self._counted(request, self.inner.PinForPull(request, context))

    async def pin(self, request: Any) -> Any:
        """The same pin asked over the pin channel (kvstore.transfer.pin_channel)."""
        return await self._counted(request, self.inner.pin(request))

    async def release(self, request: Any) -> Any:
        return await self.inner.release(request)

    async def hand_over(
        self, ns_id: str, hashes: list[int], ttl_s: float = 0.0
    ) -> tuple[Any, bytes]:
        """A pin for a peer not known yet (HandOver): counted as a pin served, under
        the transport peers read this node with."""
        call = self.inner.hand_over(ns_id, hashes, ttl_s)
        result: tuple[Any, bytes] = await self._count(self.inner.transport, call, lambda r: r[0])
        return result

    async def _counted(self, request: Any, call: Any) -> Any:
        return await self._count(request.transport, call, lambda r: r)

    async def _count(self, transport: str, call: Any, pin_of: Callable[[Any], Any]) -> Any:
        """``call``'s result, its pin (``pin_of`` it, a PinForPullResponse) counted."""
        started = time.perf_counter()
        c = self.metrics.counters.of(transport)
        try:
            result = await call
        except BaseException:  # aborts (refusals) raise out of the handler
            c.serve_failures += 1
            raise
        pin = pin_of(result)
        c.serve_pins += 1
        c.served_blocks += pin.found_blocks
        c.served_bytes += pin.found_blocks * pin.block_bytes
        label = transport if transport in PEER_TRANSPORTS else "unknown"
        self.metrics.pin_duration.labels(label).observe(time.perf_counter() - started)
        return result

    async def ReleasePull(self, request: Any, context: Any) -> Any:
        return await self.inner.ReleasePull(request, context)

    async def StreamBlocks(self, request: Any, context: Any) -> AsyncIterator[Any]:
        # An async generator itself: gRPC serves a plain function returning one as unary.
        async for chunk in self.inner.StreamBlocks(request, context):
            yield chunk


class PeerMetrics:
    """Peer-transfer metrics of one daemon: counters (also read by Stats) and
    latency histograms; ``wrap_*`` apply them to the puller and the PeerService."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counters = PeerCounters()
        registry.register(PeerCollector(self.counters))
        self.pull_duration = Histogram(
            "kvstore_peer_pull_duration_seconds",
            "Duration of one pull from a peer (metadata, pin, read, verify, commit).",
            ["transport"],
            buckets=PULL_BUCKETS_S,
            registry=registry,
        )
        self.pin_duration = Histogram(
            "kvstore_peer_serve_pin_duration_seconds",
            "Duration of a peer's PinForPull here (pin, promotion, checksums).",
            ["transport"],
            buckets=PULL_BUCKETS_S,
            registry=registry,
        )
        # Zero series from the start: a dashboard shows "no pulls", not "no data".
        for transport in (KIND_NIXL, KIND_GRPC_STREAM):
            self.pull_duration.labels(transport)
            self.pin_duration.labels(transport)

    def observe_pull(self, transport: str, seconds: float) -> None:
        self.counters.of(transport).pull_s += seconds
        label = transport if transport in PEER_TRANSPORTS else "unknown"
        self.pull_duration.labels(label).observe(seconds)

    def wrap_puller(self, puller: _Pulls) -> InstrumentedPuller:
        return InstrumentedPuller(puller, self)

    def wrap_service(self, service: Any) -> InstrumentedPeerService:
        return InstrumentedPeerService(service, self)


def serve_metrics(address: str, registry: CollectorRegistry) -> tuple[Any, int]:
    """Start /metrics on host:port (port 0 picks one); return (server, port)."""
    host, _, port = address.rpartition(":")
    server, _thread = start_http_server(int(port), addr=host or "127.0.0.1", registry=registry)
    return server, server.server_port
