"""Scheduler side of the connector: external hits, and what to load and save each step.

    hit_tokens(request, num_computed_tokens)  one batched Lookup of the blocks
                                              past vLLM's local hit (then, when
                                              short and a peer is hinted, one
                                              FetchFromPeer of the rest)
    after_alloc(request, block_ids, n)        remember where the hit goes
    build_plan(new, cached, num_scheduled)    StepPlan for the workers
    hand_over(request)                        a finished prefill request asking
                                              for it: its blocks pinned for the
                                              decode node (kv_transfer_params)
    finished(request, block_ids)              forget the request; True: its last
                                              blocks are saved next step (vLLM
                                              keeps them until then)

Works on vLLM's ``Request`` (``request_id``, ``block_hashes``, ``num_tokens``,
``num_prompt_tokens``, ``all_token_ids``, ``cache_salt``, and
``kv_transfer_params`` when present) without importing vLLM. Loads are synchronous (done before the step's forward), so a request is
never held back waiting for the cache.

What is saved: each step, the full blocks a request completes in it
(``[computed_before // B, computed_after // B)``) that vLLM has hashed, plus
those of earlier steps that had no hash yet (async scheduling: the token that
fills a block is a placeholder when the step is planned), and on a request's first
step every full block it holds, including vLLM's local prefix-cache hits: the
daemon skips blocks it already has, and a daemon that restarted empty gets the
engine's hot prefixes back. A load that fails drops that request's saves for
the step (its later blocks were computed over bad KV); vLLM recomputes from the
failed block, and those recomputed blocks are saved on that later step.

A request that finishes in the step that completes a block whose hash did not
exist when that step was planned (speculative decoding: the drafts that fill it
are accepted in that step; async scheduling: the token that fills it is a
placeholder) has no later step to save it in. ``finished`` then plans that save
for the next step and says so: the connector asks vLLM to keep the request's
blocks (``request_finished`` -> delay_free_blocks) until the workers report the
save done (``get_finished``), whatever its outcome.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

from kvstore import errors
from kvstore.namespace import NamespaceSpec
from kvstore_connectors.vllm.config import ConnectorConfig
from kvstore_connectors.vllm.hashes import RequestHashes
from kvstore_connectors.vllm.metadata import IDLE_PLAN, LoadSpec, SaveSpec, StepPlan
from kvstore_connectors.vllm.namespace import EngineLayout
from kvstore_connectors.vllm.peer import (
    PeerTarget,
    peer_hint,
    pull_ticket,
    ticket_params,
    wants_hand_over,
)
from kvstore_connectors.vllm.session import DaemonSession

logger = logging.getLogger(__name__)

# Failing peers remembered for their retry wait (oldest forgotten first).
MAX_FAILING_PEERS = 256
# Skip the per-request walk on steps where no request can complete a block
# (``build_plan_columns``); tests turn it off to compare with the full walk.
SKIP_QUIET_STEPS = True
# Plans that walk every request after a step with loads, new or resumed
# requests: vLLM rewinds a request whose load failed (and those sharing its
# blocks) when it reads that step's output, one step later, two under async
# scheduling; the walk sees the rewind.
WALKS_AFTER_CHANGE = 3


class RequestView(Protocol):
    """The parts of vLLM's ``Request`` the scheduler side reads."""

    @property
    def request_id(self) -> str: ...
    @property
    def block_hashes(self) -> Sequence[bytes]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def all_token_ids(self) -> Sequence[int]: ...
    @property
    def cache_salt(self) -> str | None: ...


# NamedTuples, not frozen dataclasses: the connector builds one per running
# request every step (a frozen dataclass costs ~0.6 µs to build here, a tuple ~0.25).
class NewRequest(NamedTuple):
    """A request scheduled for the first time (or resumed after preemption)."""

    req_id: str
    block_ids: Sequence[int]  # all of its blocks
    num_computed_tokens: int  # local + external hits, before this step


class RunningRequest(NamedTuple):
    req_id: str
    new_block_ids: Sequence[int] | None  # blocks added this step (all blocks when resumed)
    resumed: bool
    num_computed_tokens: int


@dataclass(slots=True)
class _Tracked:
    request: RequestView
    hashes: RequestHashes
    block_ids: list[int] = field(default_factory=list)
    lookup_start: int = 0  # first block asked for in the last lookup
    pending_load: tuple[int, int] | None = None  # (first block, count) to load next step
    # Blocks [0, save_cursor) have been planned for saving. Under async scheduling
    # a block's KV can be computed before its hash exists (the token that fills it
    # is still a placeholder), so the cursor, not num_computed_tokens, says where
    # the next save starts: such a block is saved on a later step, once hashed.
    save_cursor: int = 0


@dataclass(slots=True)
class SchedulerCounters:
    lookups: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    planned_load_blocks: int = 0
    planned_save_blocks: int = 0
    peer_fetches: int = 0  # FetchFromPeer calls made for hinted requests
    peer_fetch_failures: int = 0  # of those, calls that failed (no extra hit)
    peer_fetched_blocks: int = 0  # blocks the daemon moved from a peer for them
    peer_nixl_fetched_blocks: int = 0  # of those, blocks moved by NIXL (not the gRPC fallback)
    peer_fetches_skipped: int = 0  # hinted peer failed recently: not asked again yet
    peer_hit_blocks: int = 0  # hit blocks beyond the local daemon's answer
    peer_ticket_fetches: int = 0  # of the fetches, those with a handed-over pin (a ticket)
    hand_overs: int = 0  # finished prefill requests whose blocks were pinned for a peer
    hand_over_blocks: int = 0  # blocks those pins hold
    deferred_saves: int = 0  # finished requests whose last blocks were saved a step later


class SchedulerSide:
    def __init__(
        self,
        config: ConnectorConfig,
        layout: EngineLayout,
        session: DaemonSession,
        *,
        hash_stride: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.layout = layout
        self.session = session
        self.block_size = layout.block_size_tokens
        self.hash_stride = hash_stride
        self.counters = SchedulerCounters()
        self._requests: dict[str, _Tracked] = {}
        self._clock = clock
        # Peers whose last pull failed -> (no pulls before, next wait): a dead peer
        # costs one peer_timeout_s per retry wait, not one per request.
        self._failing_peers: dict[PeerTarget, tuple[float, float]] = {}
        # Saves of finished requests, for the next step's plan (emptied by each
        # build_plan: bounded by the requests that finish in one step).
        self._deferred: list[SaveSpec] = []
        # Bumped by every call that may move a counter (the connector's stats
        # hook reads the counters only when this moved: it runs on every step).
        self.activity = 0
        # Quiet steps (build_plan_columns): the requests of the last walk, in
        # vLLM's order, and how many more tokens each of them can be scheduled
        # before one could complete a block; plans left that walk regardless.
        self._quiet_req_ids: list[str] | None = None
        self._quiet_tokens = 0
        self._walks_due = 0

    # ------------------------------------------------------------ hits

    def hit_tokens(self, request: RequestView, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` (block aligned) the daemon can supply.

        Side-effect free for vLLM (it may ask again): only the daemon's answer is kept.
        """
        self.activity += 1
        tracked = self._track(request)
        if not self.config.load:
            return 0
        bs = self.block_size
        hashes = tracked.hashes.update(request.block_hashes)
        # vLLM must compute at least the last token itself (it needs its logits).
        usable = min(len(hashes), (request.num_tokens - 1) // bs)
        start = num_computed_tokens // bs
        tracked.lookup_start = start
        if start >= usable:
            return 0
        wanted = hashes[start:usable]
        spec = self.layout.spec(request.cache_salt)
        result = self.session.call_in("lookup", spec, lambda c, ns: c.lookup(ns, wanted))
        self.counters.lookups += 1
        self.counters.lookup_blocks += len(wanted)
        hit = result.prefix_blocks if result is not None else 0
        if result is not None and hit < len(wanted):
            params = getattr(request, "kv_transfer_params", None)
            target = peer_hint(params, self.config.peer)
            ticket = pull_ticket(params)
            if ticket and target is None:
                target = PeerTarget()  # the ticket names its node
            if target is not None:
                gained = self._pull_from_peer(spec, wanted[hit:], target, ticket)
                self.counters.peer_hit_blocks += gained
                hit += gained
        if hit < self.config.min_hit_blocks:
            return 0
        self.counters.hit_blocks += hit
        return hit * bs

    def after_alloc(
        self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        self.activity += 1
        self._walks_due = WALKS_AFTER_CHANGE
        tracked = self._track(request)
        tracked.block_ids = list(block_ids)
        if num_external_tokens > 0:
            # Hits are whole blocks (hit_tokens); vLLM only ever passes one back or 0.
            tracked.pending_load = (tracked.lookup_start, num_external_tokens // self.block_size)
        else:
            tracked.pending_load = None

    # ------------------------------------------------------------ per step

    def build_plan(
        self,
        new: Sequence[NewRequest],
        running: Iterable[RunningRequest],
        num_scheduled_tokens: Mapping[str, int],
    ) -> StepPlan:
        running = list(running)
        return self.build_plan_columns(
            new,
            [r.req_id for r in running],
            [None if r.new_block_ids is None else (r.new_block_ids,) for r in running],
            {r.req_id for r in running if r.resumed},
            [r.num_computed_tokens for r in running],
            num_scheduled_tokens,
        )

    def build_plan_columns(
        self,
        new: Sequence[NewRequest],
        req_ids: Sequence[str],
        new_block_ids: Sequence[Sequence[Sequence[int]] | None],
        resumed_ids: Collection[str],
        num_computed_tokens: Sequence[int],
        num_scheduled_tokens: Mapping[str, int],
    ) -> StepPlan:
        """The step's plan; running requests as vLLM's ``scheduled_cached_reqs`` holds
        them (columns; ``new_block_ids`` per KV-cache group, the first one used), so
        a decode step builds nothing per request where no block completes.

        Most decode steps do not walk the requests at all: when the same requests
        as in the last walk are scheduled, none new, resumed or given a block, and
        none is scheduled as many tokens as the fewest any of them still needs to
        complete a block, nothing can be due. The bound only shrinks between walks
        (by the most tokens scheduled to one request: a request never gets further
        than it was scheduled), and every step with loads, new or resumed requests
        is followed by walks (``WALKS_AFTER_CHANGE``: rewinds after a failed load).
        """
        if (
            self._walks_due == 0
            and not new
            and not self._deferred
            and not resumed_ids
            and SKIP_QUIET_STEPS
            and req_ids == self._quiet_req_ids
            and not any(new_block_ids)
        ):
            # (max with default= parses keywords: ~2x the cost)
            most = max(num_scheduled_tokens.values()) if num_scheduled_tokens else 0
            if most < self._quiet_tokens:
                self._quiet_tokens -= most
                return IDLE_PLAN
        # The walk: every request, in vLLM's order.
        self.activity += 1
        if self._walks_due:
            self._walks_due -= 1
        if new or resumed_ids:
            self._walks_due = WALKS_AFTER_CHANGE
        plan = StepPlan()
        if self._deferred:
            plan.saves.extend(self._deferred)
            plan.deferred = [s.req_id for s in self._deferred]
            self._deferred = []
        requests = self._requests
        for req in new:
            tracked = requests.get(req.req_id)
            if tracked is None:
                continue  # never seen by hit_tokens/after_alloc: nothing to do
            tracked.block_ids = list(req.block_ids)
            self._plan_load(tracked, plan)
            after = req.num_computed_tokens + num_scheduled_tokens.get(req.req_id, 0)
            tracked.save_cursor = 0
            self._plan_save(tracked, 0, after, plan)
        bs = self.block_size
        quiet = 1 << 62  # the fewest tokens any request below may be scheduled without a walk
        for req_id, groups, computed in zip(
            req_ids, new_block_ids, num_computed_tokens, strict=True
        ):
            tracked = requests.get(req_id)
            if tracked is None:
                continue
            resumed = req_id in resumed_ids
            if resumed:
                tracked.block_ids = list(groups[0]) if groups else []
            elif groups:
                tracked.block_ids.extend(groups[0])
            if tracked.pending_load is not None:
                self._plan_load(tracked, plan)
            after = computed + num_scheduled_tokens.get(req_id, 0)
            if resumed:
                first = 0
            else:
                cursor = tracked.save_cursor
                if after < (cursor + 1) * bs and computed >= cursor * bs:
                    quiet = min(quiet, (cursor + 1) * bs - after)
                    continue  # no block completes and none is to be redone: most steps
                # Never past vLLM's computed blocks: after a failed load vLLM rewinds
                # num_computed_tokens and recomputes (and this saves) from there.
                first = min(cursor, computed // bs)
            tracked.save_cursor = first
            self._plan_save(tracked, first, after, plan)
            # <= 0 when the cursor stays behind (a block not hashed yet): walk next step
            quiet = min(quiet, (tracked.save_cursor + 1) * bs - after)
        if plan.loads:
            self._walks_due = WALKS_AFTER_CHANGE
        self._quiet_req_ids = list(req_ids)
        self._quiet_tokens = quiet
        return plan

    def hand_over(self, request: RequestView) -> dict[str, str] | None:
        """For a finished request that asks for it (``kvstore_hand_over``): pin its
        computed full blocks in the daemon for the node that will decode it, and
        the ``kv_transfer_params`` carrying the ticket; None otherwise, or when
        nothing could be pinned (the decode node then pins as usual). Before
        ``finished``: it reads the request's hashes."""
        if not wants_hand_over(getattr(request, "kv_transfer_params", None)):
            return None
        self.activity += 1
        tracked = self._requests.get(request.request_id)
        computed = getattr(request, "num_computed_tokens", None)
        if tracked is None or not isinstance(computed, int):
            return None
        hashes = tracked.hashes.update(request.block_hashes)[: computed // self.block_size]
        if not len(hashes):
            return None
        spec = self.layout.spec(request.cache_salt)
        handed = self.session.call_in("hand over", spec, lambda c, ns: c.hand_over(ns, hashes))
        if handed is None or not handed.ticket:
            return None
        self.counters.hand_overs += 1
        self.counters.hand_over_blocks += handed.found_blocks
        return ticket_params(handed.ticket)

    def finished(self, request: RequestView, block_ids: Sequence[int] | None = None) -> bool:
        """Forget ``request``; True when full blocks of it that vLLM computed are not
        saved yet: their save is in the next step's plan, and vLLM must keep the
        blocks (``block_ids``, vLLM's at finish) until the workers report it done."""
        self.activity += 1
        tracked = self._requests.pop(request.request_id, None)
        computed = getattr(request, "num_computed_tokens", None)
        if tracked is None or not self.config.save or not isinstance(computed, int):
            return False
        if block_ids is not None:
            tracked.block_ids = list(block_ids)
        plan = StepPlan()
        # never past vLLM's computed blocks (as build_plan: after a failed load it
        # rewinds num_computed_tokens)
        first = min(tracked.save_cursor, computed // self.block_size)
        self._plan_save(tracked, first, computed, plan)
        if not plan.saves:
            return False
        self._deferred.extend(plan.saves)
        self.counters.deferred_saves += 1
        return True

    @property
    def num_tracked(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------ helpers

    def _pull_from_peer(
        self, spec: NamespaceSpec, missing: np.ndarray, target: PeerTarget, ticket: bytes = b""
    ) -> int:
        """Have the local daemon pull ``missing`` from ``target`` (with the pin it
        handed over, ``ticket``, if any); how many of them, from the first, it now
        holds (0 on any failure: the request goes on)."""
        failing = self._failing_peers.get(target)
        if failing is not None and self._clock() < failing[0]:
            self.counters.peer_fetches_skipped += 1
            return 0
        ns = self.session.namespace(spec)
        client = self.session.client()
        if ns is None or client is None:
            return 0
        self.counters.peer_fetches += 1
        self.counters.peer_ticket_fetches += bool(ticket)
        try:
            reply = client.fetch_from_peer(
                ns,
                missing,
                peer_node_id=target.node_id,
                peer_address=target.address,
                timeout_s=self.config.peer_timeout_s,
                ticket=ticket,
            )
        except errors.KVStoreError as exc:
            # Not routed through session.call: an unreachable peer (UNAVAILABLE)
            # must not mark the local daemon down.
            self.counters.peer_fetch_failures += 1
            self._note_peer_failure(target, failing)
            if failing is None:
                logger.warning(
                    "kvstore: pulling %d blocks from peer %s failed (%s); "
                    "those requests compute them",
                    len(missing),
                    target,
                    exc,
                )
            return 0
        if self._failing_peers.pop(target, None) is not None:
            logger.warning("kvstore: pulls from peer %s work again", target)
        self.counters.peer_fetched_blocks += reply.fetched_blocks
        if reply.transport == "nixl":
            self.counters.peer_nixl_fetched_blocks += reply.fetched_blocks
        return min(int(reply.prefix_blocks), len(missing))

    def _track(self, request: RequestView) -> _Tracked:
        tracked = self._requests.get(request.request_id)
        if tracked is None or tracked.request is not request:
            tracked = _Tracked(request=request, hashes=RequestHashes(self.hash_stride))
            self._requests[request.request_id] = tracked
        return tracked

    def _note_peer_failure(self, target: PeerTarget, failing: tuple[float, float] | None) -> None:
        wait_s = self.config.retry_initial_s if failing is None else failing[1]
        self._failing_peers.pop(target, None)
        if len(self._failing_peers) >= MAX_FAILING_PEERS:
            # Hints come with requests: never let arbitrary ones grow this without bound.
            del self._failing_peers[next(iter(self._failing_peers))]
        self._failing_peers[target] = (
            self._clock() + wait_s,
            min(wait_s * 2, self.config.retry_max_s),
        )

    def _plan_load(self, tracked: _Tracked, plan: StepPlan) -> None:
        if tracked.pending_load is None:
            return
        start, count = tracked.pending_load
        tracked.pending_load = None
        hashes = tracked.hashes.update(tracked.request.block_hashes)
        block_ids = tracked.block_ids[start : start + count]
        if len(block_ids) != count or len(hashes) < start + count:
            # vLLM allocated fewer blocks than it accepted as a hit: a bug, but
            # never worth failing the request over; it just computes them.
            logger.warning(
                "kvstore: load plan for %s does not fit its blocks; skipped",
                tracked.request.request_id,
            )
            return
        plan.loads.append(
            LoadSpec(
                req_id=tracked.request.request_id,
                tenant=tracked.request.cache_salt or "",
                block_ids=np.asarray(block_ids, dtype=np.int64),
                block_hashes=hashes[start : start + count].copy(),
            )
        )
        self.counters.planned_load_blocks += count

    def _plan_save(
        self, tracked: _Tracked, first: int, computed_after: int, plan: StepPlan
    ) -> None:
        if not self.config.save:
            return
        request = tracked.request
        bs = self.block_size
        # How many KV-block hashes the request has (what hashes.update returns the
        # length of), without converting them: most steps complete no block.
        known = len(request.block_hashes) // self.hash_stride
        last = min(computed_after // bs, known, len(tracked.block_ids))
        if not self.config.save_decode:
            last = min(last, request.num_prompt_tokens // bs)
        if last <= first:
            return
        hashes = tracked.hashes.update(request.block_hashes)
        tracked.save_cursor = last
        tokens = np.asarray(request.all_token_ids[first * bs : last * bs], dtype=np.int32)
        plan.saves.append(
            SaveSpec(
                req_id=request.request_id,
                tenant=request.cache_salt or "",
                block_ids=np.asarray(tracked.block_ids[first:last], dtype=np.int64),
                block_hashes=hashes[first:last].copy(),
                parent_block_hash=int(hashes[first - 1]) if first > 0 else None,
                token_ids=tokens,
            )
        )
        self.counters.planned_save_blocks += last - first
