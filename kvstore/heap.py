"""The cyclic garbage collector in long-running servers (the daemon, the router).

A full (generation 2) collection walks every object the collector tracks and
stops the whole process while it does: every request in flight waits. Two
things keep that walk short: what start-up leaves alive is frozen out of its
reach (``settle_heap``), and the daemon's per-block records are never tracked
at all (``kvstore.namespace.Block``). ``CollectorPauses`` times every
collection, for ``/metrics`` (``kvstore_gc_pause_seconds``).
"""

from __future__ import annotations

import bisect
import gc
import itertools
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

# Upper bounds of the pause histogram's buckets: from a young collection
# (tens of microseconds) to the full ones a large heap costs (hundreds of ms).
PAUSE_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_BUCKET_LABELS = (*(str(bound_s) for bound_s in PAUSE_BUCKETS_S), "+Inf")
GENERATIONS = 3


def settle_heap() -> None:
    """Put everything alive after start-up out of the cyclic collector's reach.

    Why: a started router holds ~135k tracked objects (aiohttp, grpc, numba's
    compiler for the index walk): measured 85-92 ms per full collection in the
    decision bench's process, a pause any request in flight then waits through
    (the decision's p99); a started daemon ~48-57k (grpc, NIXL, its tiers, what
    a warm restart loaded). Frozen objects (``gc.freeze``) are never scanned
    again; what requests allocate later is collected as before. Start-up garbage
    is collected first, so freezing keeps nothing that is already unreachable."""
    gc.collect()
    gc.freeze()


class CollectorPauses:
    """The wall time of every collection, by generation (``gc.callbacks``).

    Collections run one at a time under the interpreter lock, in whichever
    thread allocated last, so one start time serves them all; /metrics reads
    the counts from its own thread (plain ints and floats: a read may miss the
    collection being recorded, never tears one). Not a prometheus ``Histogram``:
    its ``observe`` takes a lock, and a collection can start in a thread that
    holds that very lock (a scrape allocating), which would then wait on itself."""

    def __init__(self) -> None:
        # Per generation: how many pauses fell in each bucket (the last: past them all).
        self.buckets = [[0] * (len(PAUSE_BUCKETS_S) + 1) for _ in range(GENERATIONS)]
        self.total_s = [0.0] * GENERATIONS
        self.longest_s = [0.0] * GENERATIONS
        self._started_s = 0.0
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._on_collection)
            self._installed = True

    def export(self, registry: CollectorRegistry) -> None:
        """Start timing collections and expose them in ``registry`` (the daemon's
        and the router's /metrics): before ``settle_heap``, so its full
        collection counts."""
        self.install()
        registry.register(PauseCollector(self))

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._on_collection)
            self._installed = False

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started_s = time.perf_counter()
            return
        pause_s = time.perf_counter() - self._started_s
        generation = info["generation"]
        self.buckets[generation][bisect.bisect_left(PAUSE_BUCKETS_S, pause_s)] += 1
        self.total_s[generation] += pause_s
        if pause_s > self.longest_s[generation]:
            self.longest_s[generation] = pause_s

    def count(self, generation: int) -> int:
        return sum(self.buckets[generation])


class PauseCollector(Collector):
    """``CollectorPauses`` and the frozen start-up heap, at scrape time."""

    def __init__(self, pauses: CollectorPauses) -> None:
        self.pauses = pauses

    def collect(self) -> Iterator[Any]:
        pauses = self.pauses
        histogram = HistogramMetricFamily(
            "kvstore_gc_pause_seconds",
            "Wall time of each cyclic garbage collection, which stops the whole process, "
            "by generation (2: a full collection).",
            labels=["generation"],
        )
        for generation in range(GENERATIONS):
            cumulative = itertools.accumulate(pauses.buckets[generation])
            buckets = list(zip(_BUCKET_LABELS, cumulative, strict=True))
            histogram.add_metric([str(generation)], buckets, pauses.total_s[generation])
        yield histogram
        longest = GaugeMetricFamily(
            "kvstore_gc_longest_pause_seconds",
            "The longest collection since start, by generation.",
            labels=["generation"],
        )
        for generation in range(GENERATIONS):
            longest.add_metric([str(generation)], pauses.longest_s[generation])
        yield longest
        yield GaugeMetricFamily(
            "kvstore_gc_frozen_objects",
            "Objects frozen out of the collector's reach after start-up (settle_heap).",
            value=gc.get_freeze_count(),
        )
