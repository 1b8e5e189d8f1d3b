"""The router's Prometheus metrics (``kvstore_router_*``), in one place.

Counters are bumped by the proxy at request boundaries (one observation per
request, never per chunk); per-backend gauges are read from the fleet at
scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.router.backends import Fleet

if TYPE_CHECKING:
    from kvstore.router.local_index import LocalIndex

DECISION_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1)
LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _FleetCollector(Collector):
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[GaugeMetricFamily]:
        healthy = GaugeMetricFamily(
            "kvstore_router_backend_healthy", "1 if the backend is a candidate.", labels=["backend"]
        )
        inflight = GaugeMetricFamily(
            "kvstore_router_backend_inflight_requests",
            "Requests the router sent to the backend that have not finished.",
            labels=["backend"],
        )
        queued = GaugeMetricFamily(
            "kvstore_router_backend_engine_requests",
            "The engine's own running + waiting requests (last scrape).",
            labels=["backend"],
        )
        others = GaugeMetricFamily(
            "kvstore_router_backend_other_requests",
            "The engine's requests that are not this router's (other replicas', direct "
            "clients'): they take this router's flow-control slots (last scrape).",
            labels=["backend"],
        )
        kv = GaugeMetricFamily(
            "kvstore_router_backend_kv_usage_ratio",
            "The engine's KV-cache usage, 0..1 (last scrape).",
            labels=["backend"],
        )
        daemon = GaugeMetricFamily(
            "kvstore_router_backend_daemon_serving",
            "1 if the node's daemon reports SERVING (or is not watched); 0 = drained.",
            labels=["backend"],
        )
        for b in self.fleet.backends.values():
            daemon.add_metric([b.node], 1.0 if b.daemon_serving else 0.0)
            healthy.add_metric([b.node], 1.0 if b.healthy else 0.0)
            inflight.add_metric([b.node], float(b.inflight))
            queued.add_metric([b.node], b.running + b.waiting)
            others.add_metric([b.node], b.others)
            kv.add_metric([b.node], b.kv_usage)
        yield from (healthy, inflight, queued, others, kv, daemon)


class _LocalIndexCollector(Collector):
    def __init__(self, local: Callable[[], LocalIndex | None]) -> None:
        self.local = local

    def collect(self) -> Iterator[GaugeMetricFamily]:
        local = self.local()
        if local is None:
            return
        st = local.stats()
        yield GaugeMetricFamily(
            "kvstore_router_local_index_stale_seconds",
            'index = "local": seconds the local index has been out of step with the event '
            "streams (decisions scored at the indexer meanwhile); 0 = in step.",
            value=st["stale_s"],
        )
        yield GaugeMetricFamily(
            "kvstore_router_local_index_sources",
            'index = "local": event streams followed.',
            value=st["sources"],
        )
        yield GaugeMetricFamily(
            "kvstore_router_local_index_connected_sources",
            'index = "local": followed event streams connected now.',
            value=st["connected"],
        )
        yield GaugeMetricFamily(
            "kvstore_router_local_index_list_age_seconds",
            'index = "local": seconds since the indexer\'s source list was last read '
            "(-1: never); the copy keeps scoring through an indexer outage.",
            value=st["list_age_s"],
        )
        yield GaugeMetricFamily(
            "kvstore_router_local_index_bytes",
            'index = "local": bytes of its tables (bounded by local_index_max_bytes).',
            value=st["bytes"],
        )


class RouterMetrics:
    def __init__(self, fleet: Fleet, local: Callable[[], LocalIndex | None] = lambda: None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvstore_router_requests_total",
            'Requests answered, by endpoint, backend ("" = none) and HTTP status.',
            ["endpoint", "backend", "code"],
            registry=r,
        )
        self.decisions = Counter(
            "kvstore_router_decisions_total",
            "Routing decisions by reason (prefix, load, affinity, fallback, no_hit, ...).",
            ["reason"],
            registry=r,
        )
        self.decision_s = Histogram(
            "kvstore_router_decision_seconds",
            "Token ids -> hashes -> indexer score -> choice.",
            buckets=DECISION_BUCKETS_S,
            registry=r,
        )
        self.score_s = Histogram(
            "kvstore_router_score_seconds",
            "The Score (the indexer's round trip, or the local index's lookup; failed ones too).",
            buckets=DECISION_BUCKETS_S,
            registry=r,
        )
        self.scores = Counter(
            "kvstore_router_scores_total",
            'Scores by where they were answered ("local": the router\'s own index; '
            '"indexer": its gRPC Score, the default or the local index\'s fallback).',
            ["source"],
            registry=r,
        )
        self.tokenize_s = Histogram(
            "kvstore_router_tokenize_seconds",
            "The engine's /tokenize round trip.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.first_byte_s = Histogram(
            "kvstore_router_upstream_first_byte_seconds",
            "From forwarding a request to the engine's first response bytes.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.upstream_errors = Counter(
            "kvstore_router_upstream_errors_total",
            "Engine failures by kind (connect, mid_stream, timeout).",
            ["backend", "kind"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "kvstore_router_client_disconnects_total",
            "Clients gone before the answer finished (the upstream request was cancelled).",
            registry=r,
        )
        self.hash_blocks = Counter(
            "kvstore_router_hash_blocks_total",
            "Request blocks by how their hash was found (reused from a recent chain, hashed).",
            ["how"],
            registry=r,
        )
        self.hash_hinted = Counter(
            "kvstore_router_hash_compares_skipped_total",
            "Requests whose re-sent ids were not compared with the stored hash chain "
            "(the prompt parser knew them equal: a KnownPrefix).",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvstore_router_prompt_tokens_parsed_total",
            "Token ids of large token-id prompts by how they were read from the body "
            "(reused: past a recent prompt's identical bytes; parsed).",
            ["how"],
            registry=r,
        )
        self.shed = Counter(
            "kvstore_router_shed_requests_total",
            "Requests refused with 429/503: the router at max_inflight, or shed by flow control.",
            registry=r,
        )
        self.queue_s = Histogram(
            "kvstore_router_queue_seconds",
            "Time a request waited for a slot (every engine saturated), by priority class.",
            ["priority"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.peer_hints = Counter(
            "kvstore_router_peer_hints_total",
            "Requests sent with a kvstore_peer hint (the engine's daemon pulls the prefix).",
            registry=r,
        )
        self.pd_fallbacks = Counter(
            "kvstore_router_pd_fallbacks_total",
            "Prefill/decode requests whose prefill failed or was late (decode computed it).",
            ["reason"],
            registry=r,
        )
        self.pd_tickets = Counter(
            "kvstore_router_pd_tickets_total",
            "Prefill/decode requests whose prefill handed its blocks' pin to decode.",
            registry=r,
        )
        r.register(_FleetCollector(fleet))
        r.register(_LocalIndexCollector(local))

    def render(self) -> bytes:
        return generate_latest(self.registry)
