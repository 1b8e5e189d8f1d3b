"""The indexer's Prometheus metrics, read from the indexer at scrape time.

Staleness per source is what an operator watches: how long since the
source's last applied event (``kvstore_indexer_source_last_event_age_seconds``)
and since the index last matched a snapshot of it
(``kvstore_indexer_source_since_snapshot_seconds``); -1 = never. A growing
age on a busy node, or ``kvstore_indexer_up`` at 0, means scores are stale.
Ingestion never touches metrics: the collector reads the subscriber's
counters and source status when scraped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.audit import AuditCollector

if TYPE_CHECKING:
    from kvstore.indexer.service import Indexer

_LABELS = ["source", "node", "kind"]


class IndexerCollector(Collector):
    def __init__(self, indexer: Indexer) -> None:
        self.indexer = indexer

    def collect(self) -> Iterator[Any]:
        ix = self.indexer
        yield GaugeMetricFamily(
            "kvstore_indexer_up",
            "1 while ingestion runs and the backend answers (health SERVING).",
            value=1.0 if ix.healthy else 0.0,
        )
        sub = ix.subscriber
        yield GaugeMetricFamily(
            "kvstore_indexer_backend_up",
            "0 while the index backend (Redis) is unreachable.",
            value=0.0 if sub.backend_down_since is not None else 1.0,
        )
        age = GaugeMetricFamily(
            "kvstore_indexer_source_last_event_age_seconds",
            "Seconds since the source's last applied event batch (-1: none yet).",
            labels=_LABELS,
        )
        since = GaugeMetricFamily(
            "kvstore_indexer_source_since_snapshot_seconds",
            "Seconds since the index last matched a snapshot of the source (-1: never).",
            labels=_LABELS,
        )
        connected = GaugeMetricFamily(
            "kvstore_indexer_source_connected",
            "1 while the source's event stream is connected.",
            labels=_LABELS,
        )
        errors = CounterMetricFamily(
            "kvstore_indexer_source_errors", "Ingestion errors on the source.", labels=_LABELS
        )
        snaps = CounterMetricFamily(
            "kvstore_indexer_source_snapshots", "Snapshots of the source applied.", labels=_LABELS
        )
        for st in sub.source_status():
            labels = [st.key, st.node, st.kind]
            age.add_metric(labels, st.last_event_age_s)
            since.add_metric(labels, st.since_snapshot_s)
            connected.add_metric(labels, 1.0 if st.connected else 0.0)
            errors.add_metric(labels, st.errors)
            snaps.add_metric(labels, st.snapshots)
        yield from (age, since, connected, errors, snaps)
        for name, value in msgspec.structs.asdict(sub.stats).items():
            yield CounterMetricFamily(
                f"kvstore_indexer_{name}", f"Subscriber counter {name}.", value=value
            )


def serve_metrics(indexer: Indexer, address: str) -> tuple[Any, int]:
    """Start /metrics on host:port (port 0 picks one); return (server, port)."""
    registry = CollectorRegistry()
    registry.register(IndexerCollector(indexer))
    registry.register(AuditCollector())  # kvstore_denied_requests_total, as the daemon's
    host, _, port = address.rpartition(":")
    server, _thread = start_http_server(int(port), addr=host or "127.0.0.1", registry=registry)
    return server, server.server_port
