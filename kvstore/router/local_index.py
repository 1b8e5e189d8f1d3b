"""The index inside the router (``router.index = "local"``): Scores without a round trip.

Why: a re-sent 195k-token context is ~12,000 block hashes; asking the indexer
costs ~3.8 ms here, of which its index lookup is ~1 ms and the rest the gRPC
round trip (a 97 KB request through grpc's Python layers, both ends). The
router can hold the same index itself: it follows the same KV event streams
the indexer follows, with the indexer's own code, and answers the Score in
process.

What runs here is the product's indexer, not a copy of it: an ``Indexer``
(``kvstore.indexer.service``: a ``MemoryIndex``, the ``Subscriber`` that
follows the streams with their replays, snapshots, resyncs and gone-node
drops, and the Score's own semantics), without its gRPC server. The streams it
follows are the indexer's: every ``ListNodes`` read (each ``refresh_s``) makes
the followed set equal to the indexer's sources, configured and registered, so
a node registered at the indexer, or lapsing there, is followed or dropped
here too. ZMQ sockets are made by the subscriber alone (one place, for a
transport security layer to be added to).

When the local copy is not known to be in step, the decision asks the
indexer's Score as before (the fallback): before the first ListNodes answer,
while any followed stream is disconnected or a daemon stream has not matched
its first snapshot, while the ingestion thread is unhealthy, and for good once the tables outgrow ``max_bytes`` (dropped: a
bounded router never grows with the cluster past what it was given).

An indexer that stops answering does not take the copy out of step: it
follows the daemons, not the indexer (the last source list is kept; nothing
registers or lapses while the indexer is down), so decisions stay precise
through an indexer outage; ``list_age_s`` says how old the list is.

HA: two replicas following the same streams apply the same batches, so they
hold the same entries and make the same decisions as each other and as the
indexer (tests/integration/test_router_local_index.py, on real daemons).
Staleness: ``stale_s`` is how long the copy has been out of step (0 in step;
``kvstore_router_local_index_stale_seconds``); in step, the copy lags the
streams by their delivery time only (a ZMQ hop; the bench measures it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvstore.errors import KVStoreError
from kvstore.indexer.backend import NodeScore
from kvstore.indexer.config import IndexerConfig
from kvstore.indexer.memory import MemoryIndex
from kvstore.indexer.service import Indexer, spec_from_pb
from kvstore.indexer.subscriber import SourceSpec
from kvstore.tls import TlsFiles
from kvstore_router_client.policy import NodeHit, RankHit, ScoreResult
from kvstore_router_client.scorer import AsyncIndexClient

log = logging.getLogger("kvstore.router")

# Readiness is re-checked this often off the decision path (``keep_checked``: a
# task on the router's loop, run between requests). A check reads every source's
# status and the tables' size under the index's lock: 0.2 ms p50, 0.6 ms p90, 4.5 ms
# at worst in the decision bench's process (load 3), which a decision paid inline
# whenever the last check was older than this (at under 20 decisions a second:
# nearly every decision).
_CHECK_S = 0.05
# A decision checks inline only once the verdict is older than this (a loop too
# busy to run keep_checked), so the verdict a decision acts on is never older.
_MAX_AGE_S = 0.2


def score_result(scores: Sequence[NodeScore], request_blocks: int) -> ScoreResult:
    """The policy's view of the index's scores (what ``scorer.score_result`` builds
    from the indexer's answer, field for field)."""
    hits = []
    for s in scores:
        ranks = tuple(
            RankHit(r.rank, r.prefix_blocks, r.gpu_blocks, r.cpu_blocks, r.disk_blocks)
            for r in s.ranks
        )
        if ranks:
            hit = NodeHit(
                s.node, s.prefix_blocks, s.gpu_blocks, s.cpu_blocks, s.disk_blocks, s.rank, ranks
            )
        else:
            hit = NodeHit(s.node, s.prefix_blocks, s.gpu_blocks, s.cpu_blocks, s.disk_blocks)
        hits.append(hit)
    return ScoreResult(request_blocks=request_blocks, hits=hits)


class LocalIndex:
    """The indexer's index and event subscriber in the router's process."""

    def __init__(
        self,
        *,
        max_bytes: int,
        hash_algo: str = "sha256",
        hash_seed: str = "",
        cluster_secret: str = "",
        node_gone_s: float = 30.0,
        curve_key_file: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        tls = TlsFiles.from_env()  # the router's identity, for daemons' Snapshot calls
        cfg = IndexerConfig(
            hash_algo=hash_algo or "sha256",
            hash_seed=hash_seed,
            cluster_secret=cluster_secret,
            node_gone_s=node_gone_s,
            tls_cert_path=tls.cert_path,
            tls_key_path=tls.key_path,
            tls_ca_path=tls.ca_path,
            events_curve_key_file=curve_key_file,
        )
        self.memory = MemoryIndex()
        self.indexer = Indexer(cfg, index=self.memory)
        self.max_bytes = max_bytes
        self.listed_at: float | None = None
        """When the indexer's source list was last read (monotonic)."""
        self.dropped = ""
        """Why the copy was dropped for good ("" = it was not)."""
        self.bytes = 0
        self._clock = clock
        self._verdict: tuple[bool, str] = (False, "the indexer's sources are not read yet")
        self._checked_at = -1.0
        """When the verdict was made (-1: check at the next ``ready``)."""
        self._out_since: float | None = clock()
        self.fallbacks = 0

    def start(self) -> None:
        self.indexer.start()

    def close(self) -> None:
        self.indexer.close()

    # -- the followed streams ----------------------------------------------------------

    async def refresh(self, catalog: AsyncIndexClient, deadline_s: float) -> None:
        """Follow what the indexer follows now (a failed read keeps the last set)."""
        if self.dropped:
            return
        try:
            resp = await catalog.list_nodes(deadline_s)
        except KVStoreError as e:
            log.warning("local index: reading the indexer's sources failed (kept): %s", e)
            return
        wanted: dict[str, SourceSpec] = {}
        for info in resp.sources:
            spec = spec_from_pb(info.source)
            try:
                spec.check()
            except KVStoreError as e:
                log.warning("local index: the indexer lists a source it cannot follow: %s", e)
                continue
            wanted[spec.key] = spec
        self.follow(list(wanted.values()))
        self.listed_at = time.monotonic()

    def follow(self, specs: Sequence[SourceSpec]) -> None:
        """Make the followed streams ``specs``: new or changed ones added, gone ones
        removed with their entries (as the indexer drops a lapsed registration).
        A dropped copy follows nothing: ``refresh`` may have read the list before the
        drop, and following it again would refill tables that nothing measures."""
        if self.dropped:
            return
        sub = self.indexer.subscriber
        current = {s.key: s for s in sub.sources()}
        wanted = {s.key: s for s in specs}
        for key in sorted(current.keys() - wanted.keys()):
            log.info("local index: no longer following %s", key)
            sub.remove_source(key, drop_entries=True)
        for key, spec in sorted(wanted.items()):
            if current.get(key) != spec:
                log.info("local index: following %s", key)
                sub.add_source(spec)
        self._checked_at = -1.0  # a new set: check readiness again at once

    # -- state -------------------------------------------------------------------------

    def ready(self) -> tuple[bool, str]:
        """(whether a Score may be answered here, why not): the last check's verdict
        (``keep_checked`` re-checks every _CHECK_S), checked here only when that is
        older than _MAX_AGE_S or the followed set changed (``follow``)."""
        if self._checked_at >= 0 and self._clock() - self._checked_at < _MAX_AGE_S:
            return self._verdict
        return self.check()

    def check(self) -> tuple[bool, str]:
        """Check now whether the copy is in step (see the module doc); the verdict
        ``ready`` returns until the next check."""
        now = self._clock()
        self._checked_at = now
        verdict = self._check(now)
        if verdict[0] != self._verdict[0] or (not verdict[0] and verdict[1] != self._verdict[1]):
            if verdict[0]:
                log.info("local index in step: decisions are scored here")
            else:
                log.warning("local index out of step (%s): scoring at the indexer", verdict[1])
        if verdict[0]:
            self._out_since = None
        elif self._out_since is None:
            self._out_since = now
        self._verdict = verdict
        return verdict

    async def keep_checked(self, interval_s: float = _CHECK_S) -> None:
        """Re-check every ``interval_s`` until cancelled (the router runs it as a
        task: its checks fall between requests, not inside a decision)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.check()
            except Exception:  # a bug in a check must not end the re-checking
                log.exception("checking the local index failed")

    def _check(self, now: float) -> tuple[bool, str]:
        if self.dropped:
            return False, self.dropped
        with self.indexer.lock:
            self.bytes = self.memory.memory_bytes()
        if self.bytes > self.max_bytes:
            self.dropped = (
                f"the local index outgrew router.local_index_max_bytes "
                f"({self.bytes} > {self.max_bytes} bytes): dropped, scoring at the indexer"
            )
            log.error("%s", self.dropped)
            for spec in self.indexer.subscriber.sources():
                self.indexer.subscriber.remove_source(spec.key, drop_entries=False)
            with self.indexer.lock:
                self.memory.reset()
                self.bytes = 0
            return False, self.dropped
        if self.listed_at is None:
            return False, "the indexer's sources are not read yet"
        ok, why = self.indexer.health()
        if not ok:
            return False, why
        specs = {s.key: s for s in self.indexer.subscriber.sources()}
        seen = set()
        for st in self.indexer.subscriber.source_status():
            seen.add(st.key)
            if not st.connected:
                return False, f"the event stream of {st.key} is disconnected"
            followed = specs.get(st.key)
            if followed is not None and followed.snapshot_address and st.since_snapshot_s < 0:
                return False, f"{st.key} has not matched a snapshot yet"
        missing = specs.keys() - seen
        if missing:
            return False, f"{sorted(missing)[0]} is not followed yet"
        return True, ""

    @property
    def stale_s(self) -> float:
        """Seconds the copy has been out of step (0: in step)."""
        self.ready()
        return 0.0 if self._out_since is None else self._clock() - self._out_since

    def score(self, model: str, hashes: np.ndarray, candidates: Sequence[str]) -> ScoreResult:
        """The indexer's Score, answered from the local copy (check ``ready`` first)."""
        scores = self.indexer.score(model, hashes, list(candidates))
        return score_result(scores, int(hashes.size))

    def stats(self) -> dict[str, float]:
        subs = self.indexer.subscriber.source_status()
        listed = self.listed_at
        return {
            "list_age_s": -1.0 if listed is None else time.monotonic() - listed,
            "sources": float(len(subs)),
            "connected": float(sum(1 for s in subs if s.connected)),
            "bytes": float(self.bytes),
            "stale_s": self.stale_s,
        }
