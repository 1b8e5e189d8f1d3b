"""The connector's counters through vLLM's connector-stats hooks (imports vLLM).

vLLM asks both connector roles for ``get_kv_connector_stats()`` after every
step, sums the workers' with the scheduler's (``aggregate``), and feeds the
sum to its periodic log line ("KV Transfer metrics: ...", ``reduce``) and to
its Prometheus registry (``build_prom_metrics`` -> ``observe``), in the API
server process. So a step's stats are what changed in that step: each role
keeps cumulative counters (``KVStoreConnector.counters()``) and ``Deltas``
turns them into increases, once per step (never per block).

On ``/metrics`` each counter ``<role>_<name>`` is ``vllm:kvstore_<role>_<name>_total``
(``*_time_ns`` as ``vllm:kvstore_<role>_time_seconds_total``), labelled like
vLLM's own metrics (model name, engine).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvstore_connectors.vllm.scheduler import SchedulerCounters
from kvstore_connectors.vllm.worker import WorkerCounters

# Counters each role adds to its dataclass's (see KVStoreConnector.counters()).
_LINK = ("daemon_failures", "daemon_reconnects", "time_ns")
COUNTER_NAMES: tuple[str, ...] = (
    *(f"scheduler_{f.name}" for f in fields(SchedulerCounters)),
    *(f"scheduler_{n}" for n in _LINK),
    *(f"worker_{f.name}" for f in fields(WorkerCounters)),
    *(f"worker_{n}" for n in _LINK),
    "worker_steps",
)

_DOCS = {
    "scheduler_lookups": "Lookups the scheduler made (presence table or daemon call).",
    "scheduler_lookup_blocks": "Blocks asked for by those lookups.",
    "scheduler_hit_blocks": "Blocks the daemon had (external prefix hits).",
    "scheduler_peer_fetches": "FetchFromPeer calls made for hinted requests.",
    "scheduler_peer_fetch_failures": "FetchFromPeer calls that failed.",
    "scheduler_peer_fetched_blocks": "Blocks the daemon pulled from a peer for this engine.",
    "scheduler_peer_nixl_fetched_blocks": "Of those, blocks moved by NIXL.",
    "scheduler_peer_hit_blocks": "Hit blocks beyond the local daemon's answer (from peers).",
    "scheduler_peer_ticket_fetches": "Of the FetchFromPeer calls, those with a handed-over pin.",
    "scheduler_hand_overs": "Finished prefill requests whose blocks were pinned for a peer.",
    "scheduler_hand_over_blocks": "Blocks those pins hold.",
    "worker_loaded_blocks": "Blocks loaded from the daemon into the KV cache.",
    "worker_load_failed_blocks": "Blocks whose load failed (recomputed).",
    "worker_saved_blocks": "Blocks stored to the daemon.",
    "worker_save_skipped_blocks": "Blocks not stored: already there, in flight or no room.",
    "worker_save_dropped_blocks": "Blocks planned for storing but dropped (daemon down, bad load).",
    "worker_checksum_failures": "Loaded blocks whose xxh3 did not match the daemon's.",
    "worker_direct_loaded_blocks": "Of the loaded blocks: read with no lease (presence table).",
    "worker_direct_lost_blocks": "Direct loads found gone from their slots after the copy "
    "(recomputed).",
    "scheduler_daemon_failures": "Scheduler daemon calls that failed (timeout, down, refused).",
    "worker_daemon_failures": "Worker daemon calls that failed (timeout, down, refused).",
}


def _prom_name(key: str) -> str:
    if key.endswith("_time_ns"):
        return f"vllm:kvstore_{key.removesuffix('_ns')}_seconds"
    return f"vllm:kvstore_{key}"


# Hook time (``*_time_ns``) and ``worker_steps`` grow on every step, also on
# one with nothing to do; reporting them alone would hand vLLM a stats object
# to aggregate, log and export every step. They are held back until another
# counter moves or this much hook time has piled up (so /metrics lags by at
# most this much connector time, about 2000 idle steps here).
HOLD_PROGRESS_NS = 10_000_000


def is_progress_counter(key: str) -> bool:
    """Counters that move on every step (held back by ``Deltas``)."""
    return key.endswith("_time_ns") or key == "worker_steps"


class Deltas:
    """Increases of cumulative counters since the previous ``take`` that reported.

    Increases of progress counters only (``is_progress_counter``) are not
    reported until another counter moves or their time reaches ``hold_ns``;
    they are not lost: the next report carries them.
    """

    def __init__(self, hold_ns: int = HOLD_PROGRESS_NS) -> None:
        self._last: dict[str, int] = {}
        self.hold_ns = hold_ns

    def holds(self, time_ns: int) -> bool:
        """Whether progress of ``time_ns`` hook time alone is still held back."""
        return time_ns < self.hold_ns

    def take(self, counters: dict[str, int]) -> KVStoreConnectorStats | None:
        changed = {k: v - self._last.get(k, 0) for k, v in counters.items()}
        changed = {k: v for k, v in changed.items() if v}
        if not changed:
            return None
        if all(is_progress_counter(k) for k in changed) and self.holds(
            sum(v for k, v in changed.items() if k.endswith("_time_ns"))
        ):
            return None  # kept in self._last's gap: the next report carries them
        self._last = dict(counters)
        return KVStoreConnectorStats(data=changed)


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """``data``: counter name -> its increase over the interval (ints; serialisable)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k, v in sorted(self.data.items()):
            if k.endswith("_time_ns"):
                out[k.removesuffix("_ns") + "_ms"] = round(v / 1e6, 1)
            else:
                out[k] = v
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVStorePromMetrics(KVConnectorPromMetrics):
    """One vLLM counter per connector counter, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for key in COUNTER_NAMES:
            counter = self._counter_cls(
                name=_prom_name(key),
                documentation=_DOCS.get(key, f"kvstore connector counter {key}."),
                labelnames=labelnames,
            )
            self.counters[key] = create_metric_per_engine(counter, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine = self.counters.get(key)
            if per_engine is None or value <= 0:
                continue  # another connector's key (MultiConnector), or nothing new
            per_engine[engine_idx].inc(value / 1e9 if key.endswith("_time_ns") else value)
