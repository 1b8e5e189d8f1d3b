"""Worker side of the connector: copy the step's blocks in and out of the daemon.

    register(kv_caches, num_blocks)   learn vLLM's cache layout (again after
                                      unregister(): sleep mode)
    start_step(plan)                  before the forward: pin and load hits
                                      (one PrepareLoad per request), reserve
                                      slots for saves (one PrepareStore per request)
    wait_layer(name) / save_layer(name)   around each attention layer (GPU overlap)
    finish_step()                     after the forward: copy saves out, commit
    take_load_errors()                vLLM block ids that must be recomputed

Leases are fenced by this process's clock (``handle.deadline_s``, see
kvstore.client): a load copied out after its lease ran out is reported as
failed (its slots may hold another block by then), and a step whose forward
outlived its store leases writes nothing into their slots and commits nothing;
the daemon is fine, so the link and the cache stay up.

Every block of a step moves in one batched copy per layer (``copier``). The
daemon's failures never reach vLLM: a request whose blocks could not be loaded
(daemon gone, evicted since the lookup, checksum mismatch, a restarted daemon
whose region is another file) gets those blocks reported as load errors and
vLLM recomputes exactly them; saves that cannot be made are dropped.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from kvstore.client import STORE_ALLOCATED, Client, LoadHandle, StoreHandle
from kvstore.errors import ConfigError, KVStoreError
from kvstore_connectors.vllm.config import RESERVE_STEPS, ConnectorConfig
from kvstore_connectors.vllm.copier import BlockCopier, Copier, PagedKV
from kvstore_connectors.vllm.metadata import IDLE_PLAN, LoadSpec, SaveSpec, StepPlan
from kvstore_connectors.vllm.namespace import EngineLayout
from kvstore_connectors.vllm.session import DaemonSession

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerCounters:
    loaded_blocks: int = 0
    load_failed_blocks: int = 0
    saved_blocks: int = 0
    save_skipped_blocks: int = 0  # already stored, stored by another client, or no room
    save_dropped_blocks: int = 0  # planned but not stored (daemon down, failed load)
    checksum_failures: int = 0
    # Of loaded_blocks: read with no lease (presence table), and of those, blocks
    # found gone from their slots after the copy (failed loads, recomputed).
    direct_loaded_blocks: int = 0
    direct_lost_blocks: int = 0


@dataclass(slots=True)
class _SaveBatch:
    """One namespace's blocks to store this step, from one or more requests."""

    tenant: str
    block_hashes: np.ndarray  # uint64, distinct
    block_ids: np.ndarray  # int64
    token_ids: np.ndarray  # int32, block_size per block
    # per block: the hash of the block before it in its request (parents[i] is
    # meaningless where has_parent[i] is False: a request's first block)
    parents: np.ndarray  # uint64
    has_parent: np.ndarray  # bool
    handle: StoreHandle | None = None
    allocated: np.ndarray | None = None  # indices of the blocks to write
    generation: int = -1  # the daemon connection the slots belong to
    reserved: bool = False  # the slots came from a reserve: the commit names positions
    # A reserve's slots: the lease position of the handle's first slot, and whether
    # the commit keeps the reserve's slots past this batch's (keep_rest).
    position_base: int = 0
    keep_rest: bool = False

    @classmethod
    def of(cls, tenant: str, specs: list[SaveSpec], block_size: int) -> _SaveBatch:
        if len(specs) == 1:
            s = specs[0]
            has_parent = np.ones(len(s.block_hashes), dtype=bool)
            has_parent[0] = s.parent_block_hash is not None
            return cls(tenant, s.block_hashes, s.block_ids, s.token_ids, _parents_of(s), has_parent)
        # Several requests (a decode step: one block each, as many specs as
        # requests): the columns in Python ints, then one array each. Numpy per
        # spec cost ~25 calls for 8 specs, 10-20 µs each right after a forward.
        hashes: list[int] = []
        ids: list[int] = []
        parents: list[int] = []
        has_parent: list[bool] = []
        kept: list[int] = []  # each kept block's place among all the specs' blocks
        seen: set[int] = set()
        at = 0
        for s in specs:
            parent = s.parent_block_hash
            for h, b in zip(s.block_hashes.tolist(), s.block_ids.tolist(), strict=True):
                # Two requests can complete the same block in one step: store it
                # once, at the first (its parent stays the one of its own request).
                if h not in seen:
                    seen.add(h)
                    kept.append(at)
                    hashes.append(h)
                    ids.append(b)
                    parents.append(0 if parent is None else parent)
                    has_parent.append(parent is not None)
                parent = h
                at += 1
        tokens = np.concatenate([s.token_ids for s in specs])
        if len(kept) < at:
            tokens = tokens.reshape(-1, block_size)[kept].reshape(-1)
        return cls(
            tenant,
            np.array(hashes, dtype=np.uint64),
            np.array(ids, dtype=np.int64),
            tokens,
            np.array(parents, dtype=np.uint64),
            np.array(has_parent, dtype=bool),
        )

    def only(self, keep: np.ndarray, block_size: int) -> _SaveBatch:
        """The batch of the blocks where ``keep`` (a bool mask) is True."""
        return _SaveBatch(
            self.tenant,
            self.block_hashes[keep],
            self.block_ids[keep],
            self.token_ids.reshape(-1, block_size)[keep].reshape(-1),
            self.parents[keep],
            self.has_parent[keep],
        )


def _parents_of(spec: SaveSpec) -> np.ndarray:
    parents = np.empty(len(spec.block_hashes), dtype=np.uint64)
    parents[0] = 0 if spec.parent_block_hash is None else spec.parent_block_hash
    parents[1:] = spec.block_hashes[:-1]
    return parents


# Blocks of a step ordered into chains in Python ints up to this many (numpy above).
PYTHON_CHAIN_BLOCKS = 64


def chain_order(
    hashes: np.ndarray, parents: np.ndarray, has_parent: np.ndarray
) -> tuple[np.ndarray, list[tuple[int, int | None]]]:
    """Split blocks into chains (each block's parent is the one before it) and
    order the chains parent first: ``(permutation of the blocks, [(blocks,
    parent hash or None)])``.

    A step's blocks come from several requests (and the copies two requests
    share are kept once, at the first), so one request's blocks may follow
    another's child of them; consumers that place a block by its parent
    (llm-d) need every parent before its children.
    """
    n = len(hashes)
    if n == 0:
        return np.zeros(0, dtype=np.int64), []
    hs = hashes.tolist()
    # Where chains start: a block whose parent is not the block before it.
    if n <= PYTHON_CHAIN_BLOCKS:
        # (a decode step's few blocks: numpy calls cost 10-20 µs each after a forward)
        ps, hp = parents.tolist(), has_parent.tolist()
        starts = [0] + [i for i in range(1, n) if not (hp[i] and ps[i] == hs[i - 1])]
        head_parent, head_has = [ps[i] for i in starts], [hp[i] for i in starts]
    else:
        cut = np.flatnonzero(~(has_parent[1:] & (parents[1:] == hashes[:-1]))) + 1
        starts = [0, *cut.tolist()]
        head_parent, head_has = parents[starts].tolist(), has_parent[starts].tolist()
    ends = [*starts[1:], n]
    present = set(hs)
    if not any(h and p in present for p, h in zip(head_parent, head_has, strict=True)):
        # No chain continues another of this batch (a decode step: each request's
        # new blocks follow blocks stored before): the order stands as it is.
        return np.arange(n, dtype=np.int64), [
            (e - s, p if h else None)
            for s, e, p, h in zip(starts, ends, head_parent, head_has, strict=True)
        ]
    block_at = {h: i for i, h in enumerate(hs)}
    segment = [k for k, (s, e) in enumerate(zip(starts, ends, strict=True)) for _ in range(e - s)]
    order: list[int] = []
    done = [False] * len(starts)
    for k in range(len(starts)):
        # emit the oldest ancestor segment not yet emitted, until k itself is
        while not done[k]:
            j, seen = k, {k}
            while True:
                up = block_at.get(head_parent[j]) if head_has[j] else None
                if up is None or done[segment[up]] or segment[up] in seen:
                    break  # (a cycle can only come from colliding hashes)
                j = segment[up]
                seen.add(j)
            done[j] = True
            order.append(j)
    perm = np.concatenate([np.arange(starts[j], ends[j]) for j in order])
    chains = [(ends[j] - starts[j], head_parent[j] if head_has[j] else None) for j in order]
    return perm, chains


@dataclass(slots=True)
class _Step:
    leases: list[LoadHandle] = field(default_factory=list)
    saves: list[_SaveBatch] = field(default_factory=list)
    # (tenant, hashes) of the blocks this step loaded: the daemon has them
    loaded: list[tuple[str, np.ndarray]] = field(default_factory=list)


@dataclass(slots=True)
class _Reserve:
    """Slots reserved ahead for one namespace (kvstore.client.Client.reserve_store)."""

    handle: StoreHandle
    generation: int  # the daemon connection it was asked on
    use_by_s: float  # by time.monotonic: past it, a step's forward might outlive the lease
    # The daemon keeps a reserve's other slots past a commit (keep_rest): store
    # steps take its slots in order from ``cursor``; else one step takes it whole.
    keep: bool = False
    cursor: int = 0
    # Its slots (handle.allocated counts them anew on each read: once here).
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = len(self.handle.allocated)

    @property
    def open(self) -> int:
        """Slots not taken by a store step yet."""
        return self.size - self.cursor


# Store steps remembered for sizing the next reserve (the most blocks among them).
RECENT_STORE_STEPS = 32
# A reserve holds at most this share of the region (1/64): an idle engine's
# reserve never crowds out the blocks others store.
RESERVE_REGION_SHARE = 64
# The presence check of a small save batch into a reserve (a decode step's new
# blocks) costs ~100 us right after a forward and almost never finds one: the
# daemon's commit skips blocks it has anyway, so a missed check costs a copy of
# a few blocks, not a wrong byte. After this many small batches in a row with no
# block found there (by a check or by a commit's answer), only one in
# PRESENCE_SAMPLE_EVERY is checked, until a duplicate is seen again.
PRESENCE_CLEAN_BATCHES = 16
PRESENCE_SAMPLE_EVERY = 8
PRESENCE_SMALL_BATCH = 16  # blocks; a larger batch (a prefill's) is always checked


class WorkerSide:
    def __init__(
        self, config: ConnectorConfig, layout: EngineLayout, session: DaemonSession
    ) -> None:
        self.config = config
        self.layout = layout
        self.session = session
        self.counters = WorkerCounters()
        self.kv: PagedKV | None = None
        self.copier: Copier | None = None
        self._region_t: torch.Tensor | None = None
        self._region_generation = -1
        self._region_src: object = None  # the mapping _region_t was built on
        self._load_errors: set[int] = set()
        self._warned: set[str] = set()
        self._step = _Step()
        # Finished requests whose deferred save is in this step (plan.deferred),
        # then, once it is done or dropped, whose blocks vLLM may free.
        self._deferred: list[str] = []
        self._finished_saving: set[str] = set()
        # The copier was handed loads in this step (its per-layer waits and
        # wait_loads matter); cleared when the step finishes.
        self._loads_issued = False
        # Store slots reserved ahead, per tenant (docs/vllm.md, "Store steps"), the
        # tenants whose next reserve was asked for and not read yet, and the
        # sizes of recent store steps (how many to ask for).
        self._reserves: dict[str, _Reserve] = {}
        # The earliest use_by_s among them: an idle step reads one float, not each reserve.
        self._reserves_use_by_s = math.inf
        self._reserve_asked: set[str] = set()
        self._store_sizes: collections.deque[int] = collections.deque(maxlen=RECENT_STORE_STEPS)
        # Small save batches into reserves since the daemon last had one of their
        # blocks (see PRESENCE_CLEAN_BATCHES).
        self._clean_batches = 0
        # Bumped by every step that did more than the idle fast paths, i.e. may
        # have moved a counter (the connector's stats hook reads the counters
        # only when this moved: it runs on every step).
        self.activity = 0

    # ------------------------------------------------------------ setup

    def register(self, layers: Sequence[tuple[str, torch.Tensor]], num_blocks: int) -> None:
        kv = PagedKV.from_layers(layers, num_blocks)
        if kv.block_bytes != self.layout.block_bytes:
            raise ConfigError(
                f"vLLM's KV cache holds {kv.block_bytes} bytes per block across {len(kv.layers)} layers, "
                f"but its config says {self.layout.block_bytes}; the kvstore connector does not "
                "support this layout (padded or hybrid pages)"
            )
        self.kv = kv
        on_cuda = kv.device is not None and kv.device.type == "cuda"
        if on_cuda and self.config.tier == "dram":
            from kvstore_connectors.vllm.cuda import CudaBlockCopier

            self.copier = CudaBlockCopier(kv)
        else:
            # A CPU cache, or the GPU tier: both sides on one device, so the
            # same batched index_select/index_copy_ runs there (device to device).
            self.copier = BlockCopier(kv)

    def unregister(self) -> None:
        """Forget vLLM's KV cache (sleep mode unmaps it): no pointer into it is kept."""
        self.kv = None
        self.copier = None

    @property
    def registered(self) -> bool:
        return self.copier is not None

    @property
    def layer_wise(self) -> bool:
        """Whether the copier does anything in wait_layer / save_layer."""
        return self.copier is not None and self.copier.layer_wise

    # ------------------------------------------------------------ per step

    def start_step(self, plan: StepPlan) -> None:
        """Loads (complete or queued) and save reservations, before the forward."""
        if (
            (plan is IDLE_PLAN or not plan)  # (the identity first: no __bool__ call)
            and not self._deferred
            and not self._step.saves
            and not self._step.leases
        ):
            # Most decode steps: nothing to load, save or hand back, and no
            # unfinished step to clean up after. No call, no allocation (a
            # reserve near its lease's end is given back: one message, no wait).
            if self._reserves:
                now_s = time.monotonic()
                if now_s > self._reserves_use_by_s:
                    self._drop_reserves(now_s)
            return
        self.activity += 1
        unfinished, self._step = self._step, _Step()
        if unfinished.saves:
            # The previous step never finished (its forward failed): its slots go
            # back now, not when their leases run out.
            if self.copier is not None:
                self.copier.cancel_save()
            self._abort(unfinished.saves)
        self._finished_saving.update(self._deferred)  # a step that never finished
        self._deferred = list(plan.deferred)
        if self.copier is None and plan.loads:
            # No KV cache to load into (unregistered for sleep mode): vLLM must
            # compute those blocks, not read whatever its cache holds.
            failed = {int(b) for spec in plan.loads for b in spec.block_ids.tolist()}
            self.counters.load_failed_blocks += len(failed)
            self._load_errors |= failed
        if self.copier is None or not plan:
            return
        failed_reqs, failed_ids = self._load(plan)
        self._reserve_saves(plan, failed_reqs, failed_ids)

    def has_layer_work(self, plan: StepPlan) -> bool:
        """Whether ``wait_layer`` / ``save_layer`` can do anything in the step of ``plan``:
        a copier that works layer by layer, and something to load or save."""
        return self.layer_wise and bool(plan.loads or plan.saves)

    def wait_layer(self, name: str) -> None:
        if self._loads_issued and self.copier is not None:
            self.copier.wait_layer(name)

    def save_layer(self, name: str) -> None:
        if self.copier is not None and self._step.saves:
            self.copier.save_layer(name)

    def finish_step(self) -> None:
        """Copy the step's saves into the region and commit them; release load leases.
        Finished requests whose save this was are reported done whatever happened
        (``take_finished_saving``): vLLM holds their blocks until then."""
        if not (self._deferred or self._loads_issued or self._step.saves or self._step.loaded):
            return  # a step with nothing to do: nothing to wait for, copy or commit
        self.activity += 1
        deferred, self._deferred = self._deferred, []
        try:
            self._finish_step()
        finally:
            self._finished_saving.update(deferred)

    def take_finished_saving(self) -> set[str]:
        """Finished requests whose last save is done (or dropped): vLLM frees their blocks."""
        done, self._finished_saving = self._finished_saving, set()
        return done

    def _finish_step(self) -> None:
        step, self._step = self._step, _Step()
        if self.copier is not None and self._loads_issued:
            self.copier.wait_loads()
        self._loads_issued = False
        if not step.saves:
            return
        # The forward may have outlived the store leases: then their slots may
        # belong to other blocks already, and not one byte may go there.
        deadline_s = min(b.handle.deadline_s for b in step.saves if b.handle is not None)
        in_time = True
        try:
            assert self.copier is not None
            in_time = self.copier.finish_save(deadline_s)
            current = self.session.region_is_current() and all(
                b.generation == self.session.generation for b in step.saves
            )
        except Exception as exc:  # a failed copy must not fail the step: drop the saves
            logger.warning("kvstore: copying blocks out failed (%s); not stored", exc)
            current = False
        if current and not (in_time and time.monotonic() <= deadline_s):
            self._warn_once(
                "store-lease-expired",
                "kvstore: a step outlived its store leases (raise lease_ttl_s); "
                "its blocks are not stored",
            )
            self._abort(step.saves)
            return
        if not current:
            # The daemon restarted onto another region file mid-step: the bytes
            # went to the old one, so committing would publish garbage.
            self._warn_once(
                "stale-region",
                "kvstore: the link to the daemon was reset during a step; "
                "that step's blocks are not stored",
            )
            self._abort(step.saves)
            self._remap()
            return
        for batch in step.saves:
            self._commit(batch)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------ loads

    def _load(self, plan: StepPlan) -> tuple[set[str], set[int]]:
        failed_reqs: set[str] = set()
        failed_ids: set[int] = set()
        offsets: list[np.ndarray] = []
        block_ids: list[np.ndarray] = []
        prepared = []
        for spec in plan.loads:
            found, handle = self._prepare_load(spec.tenant, spec.block_hashes)
            prepared.append((spec, found, handle, self.session.generation))
        direct: list[tuple[LoadSpec, int, LoadHandle]] = []
        for spec, found, handle, generation in prepared:
            if generation != self.session.generation:
                found = 0  # offsets of a daemon connection that has since been replaced
            elif handle is not None and handle.lease_id:
                self._step.leases.append(handle)
            if found:
                assert handle is not None
                offsets.append(handle.offsets[:found])
                block_ids.append(spec.block_ids[:found])
                self._step.loaded.append((spec.tenant, spec.block_hashes[:found]))
                if handle.located is not None:
                    direct.append((spec, found, handle))
            if found < len(spec.block_ids):
                failed_reqs.add(spec.req_id)
                failed_ids.update(spec.block_ids[found:].tolist())
        if block_ids:
            ids = np.concatenate(block_ids)
            region = self._region()
            ok = region is not None and self.session.region_is_current()
            if region is not None and not ok:
                self._remap()
            if ok:
                try:
                    assert self.copier is not None and region is not None
                    self._loads_issued = True  # (also when it raises: it may have queued some)
                    self.copier.load(region, np.concatenate(offsets), ids)
                except Exception as exc:  # never fail the step: recompute instead
                    logger.warning("kvstore: loading blocks failed (%s); vLLM recomputes them", exc)
                    ok = False
            if ok and _any_expired(self._step.leases):
                # Read (some of) it after a lease ran out: those slots may have
                # held another block by then. Recompute rather than trust it.
                self._warn_once(
                    "load-lease-expired",
                    "kvstore: a load outlived its lease (lease_ttl_s); vLLM recomputes it",
                )
                ok = False
            lost: set[int] = set()
            if ok and direct:
                # Read with no lease: only blocks that stayed in their slots through
                # the copy (out of the region: done when load() returned) count.
                lost_reqs, lost = self._lost_direct(direct)
                if lost:
                    failed_reqs |= lost_reqs
                    failed_ids |= lost
                    ids = ids[~np.isin(ids, np.fromiter(lost, np.int64, len(lost)))]
                    self._step.loaded.clear()  # (only used to skip re-stores)
            if self._step.leases:
                # Copied out of the region (to the cache, or to pinned staging on
                # a GPU): the pins are no longer needed; don't wait for the answers.
                leases, self._step.leases = self._step.leases, []
                self.session.call("release", lambda c: _release_all(c, leases), retry=False)
            if ok:
                self.counters.loaded_blocks += len(ids)
                self.counters.direct_loaded_blocks += sum(f for _, f, _ in direct) - len(lost)
            else:
                failed_ids.update(ids.tolist())
                failed_reqs.update(spec.req_id for spec in plan.loads)
                self._step.loaded.clear()  # not known to be there (a replaced region)
        self.counters.load_failed_blocks += len(failed_ids)
        self._load_errors |= failed_ids
        return failed_reqs, failed_ids

    def _lost_direct(
        self, direct: list[tuple[LoadSpec, int, LoadHandle]]
    ) -> tuple[set[str], set[int]]:
        """The requests and vLLM block ids of direct loads whose blocks left their
        slots during the copy (counted, warned about once): vLLM recomputes them."""
        reqs: set[str] = set()
        lost: set[int] = set()
        for spec, found, handle in direct:
            # (the client tells the daemon what was loaded; a link gone since: none)
            ok = self.session.call(
                "check a direct load", lambda c, h=handle: c.intact(h), retry=False
            )
            ok = min(ok or 0, found)
            if ok < found:
                reqs.add(spec.req_id)
                lost.update(spec.block_ids[ok:found].tolist())
        if lost:
            self.counters.direct_lost_blocks += len(lost)
            self._warn_once(
                "direct-load-lost",
                "kvstore: blocks left the daemon's DRAM while read directly; vLLM "
                "recomputes them (counted in direct_lost_blocks)",
            )
        return reqs, lost

    def _prepare_load(self, tenant: str, hashes: np.ndarray) -> tuple[int, LoadHandle | None]:
        ttl = self.config.lease_ttl_s
        pin = not self.config.direct_loads
        handle = self.session.call_in(
            "prepare load",
            self.layout.spec(tenant),
            lambda c, ns: c.prepare_load(
                ns, hashes, lease_ttl_s=ttl, tier=self.config.tier, pin=pin
            ),
        )
        if handle is None:
            return 0, None
        found = min(handle.found, len(hashes))
        if self.config.verify_checksums and found:
            found = self._verified_prefix(handle, found)
        return found, handle

    def _verified_prefix(self, handle: LoadHandle, found: int) -> int:
        """Blocks of the prefix whose bytes match the daemon's checksum (where it has one)."""
        sums = handle.checksums[:found]
        to_check = np.flatnonzero(sums)
        if not len(to_check):
            return found
        region = self._region()
        if region is None:
            return 0
        block_bytes = handle.namespace.block_bytes
        for i in to_check.tolist():
            off = int(handle.offsets[i])
            block = region[off : off + block_bytes]
            if block.is_cuda:
                block = block.cpu()  # rare: only blocks that crossed disk or network
            if xxhash.xxh3_64_intdigest(block.numpy().data) != int(sums[i]):
                self.counters.checksum_failures += 1
                logger.warning(
                    "kvstore: block %d of a load failed its checksum; recomputing from it", i
                )
                return i
        return found

    # ------------------------------------------------------------ saves

    def _reserve_saves(self, plan: StepPlan, failed_reqs: set[str], failed_ids: set[int]) -> None:
        """One PrepareStore per namespace for all of the step's new blocks."""
        failed = (
            np.fromiter(failed_ids, dtype=np.int64, count=len(failed_ids)) if failed_ids else None
        )
        by_tenant: dict[str, list[SaveSpec]] = {}
        for spec in plan.saves:
            if spec.req_id in failed_reqs or (
                failed is not None and np.isin(spec.block_ids, failed).any()
            ):
                # Blocks computed this step over KV that failed to load are wrong.
                self.counters.save_dropped_blocks += len(spec.block_ids)
                continue
            by_tenant.setdefault(spec.tenant, []).append(spec)
        bs = self.layout.block_size_tokens
        for tenant, specs in by_tenant.items():
            batch = _SaveBatch.of(tenant, specs, bs)
            loaded = [h for t, h in self._step.loaded if t == tenant]
            if loaded:
                # Loaded from the daemon in this very step: it has them (it would
                # answer PRESENT), so they are not asked for; a restore step whose
                # saves are all such blocks makes no PrepareStore at all.
                there = np.isin(batch.block_hashes, np.concatenate(loaded))
                if there.any():
                    self.counters.save_skipped_blocks += int(there.sum())
                    batch = batch.only(~there, bs)
                    if not len(batch.block_hashes):
                        continue
            if (tenant in self._reserves or tenant in self._reserve_asked) and self._check_presence(
                len(batch.block_hashes)
            ):
                # A reserve cannot know what the daemon holds (a PrepareStore would
                # answer PRESENT): its presence table says, without a call.
                there = self._present(tenant, batch.block_hashes)
                if there is not None and there.any():
                    self._clean_batches = 0
                    self.counters.save_skipped_blocks += int(there.sum())
                    batch = batch.only(~there, bs)
                    if not len(batch.block_hashes):
                        continue
            self._store_sizes.append(len(batch.block_hashes))
            taken = self._take_reserve(tenant, len(batch.block_hashes))
            handle = None
            if taken is not None:
                handle, batch.position_base, batch.keep_rest = taken
            batch.reserved = handle is not None
            if handle is None:
                handle = self._prepare_store(tenant, batch.block_hashes)
            if handle is None:
                self.counters.save_dropped_blocks += len(batch.block_ids)
                continue
            # (a reserve's slots are all allocated: no pass over their statuses)
            batch.handle = handle
            batch.allocated = (
                np.arange(len(batch.block_hashes)) if batch.reserved else handle.allocated
            )
            batch.generation = self.session.generation
            self.counters.save_skipped_blocks += len(batch.block_ids) - len(batch.allocated)
            if len(batch.allocated):
                self._step.saves.append(batch)
        stale = [b for b in self._step.saves if b.generation != self.session.generation]
        if stale:
            self._abort(stale)
            self._step.saves = [
                b for b in self._step.saves if b.generation == self.session.generation
            ]
        if not self._step.saves:
            return
        region = self._region()
        if region is None:
            self._warn_once(
                "no-region",
                "kvstore: the daemon's blocks are not mapped in this process "
                f"(tier {self.config.tier}); blocks are not stored",
            )
            self._abort(self._step.saves)
            self._step.saves = []
            return
        assert self.copier is not None
        saves = self._step.saves
        offsets = [b.handle.offsets[b.allocated] for b in saves]  # type: ignore[union-attr,index]
        block_ids = [b.block_ids[b.allocated] for b in saves]  # type: ignore[index]
        self.copier.begin_save(
            region,
            # (one tenant, the usual step: its arrays as they are, no concatenate)
            offsets[0] if len(saves) == 1 else np.concatenate(offsets),
            block_ids[0] if len(saves) == 1 else np.concatenate(block_ids),
        )

    def _check_presence(self, blocks: int) -> bool:
        """Whether a save batch of ``blocks`` into a reserve is checked against the
        presence table (PRESENCE_CLEAN_BATCHES)."""
        if blocks > PRESENCE_SMALL_BATCH:
            return True
        self._clean_batches += 1
        return (
            self._clean_batches <= PRESENCE_CLEAN_BATCHES
            or self._clean_batches % PRESENCE_SAMPLE_EVERY == 0
        )

    def _present(self, tenant: str, hashes: np.ndarray) -> np.ndarray | None:
        """Which of ``hashes`` the daemon's presence table holds (no call); None: unknown."""
        return self.session.call_in(
            "probe presence", self.layout.spec(tenant), lambda c, ns: c.present(ns, hashes)
        )

    def _prepare_store(self, tenant: str, hashes: np.ndarray) -> StoreHandle | None:
        ttl = self.config.lease_ttl_s
        return self.session.call_in(
            "prepare store",
            self.layout.spec(tenant),
            lambda c, ns: c.prepare_store(ns, hashes, lease_ttl_s=ttl, tier=self.config.tier),
        )

    # ------------------------------------------------------------ reserves

    def _take_reserve(self, tenant: str, blocks: int) -> tuple[StoreHandle, int, bool] | None:
        """The slots of ``tenant``'s reserve for a step's ``blocks`` new blocks, when a
        live one fits (same daemon connection, region current, lease far from its
        end): (a handle of just those slots, the lease position of its first,
        whether the reserve keeps slots past them: the commit's keep_rest). None:
        the step asks the daemon (PrepareStore), which also skips the blocks it
        has, which a reserve cannot know of."""
        if not self.config.store_reserve_blocks:
            return None
        if tenant in self._reserve_asked:
            # asked for with the last commit: its answer has arrived by now (read, no wait)
            # (idempotent: a link found broken here reconnects at once, as a prepare would)
            self.session.call("collect reserve", lambda c: c.flush())
            self._reserve_asked.discard(tenant)  # a lost answer must not block the next ask
        self._drop_reserves(time.monotonic())
        reserve = self._reserves.get(tenant)
        if reserve is None or blocks > reserve.open:
            return None
        # (Whether the region is still the daemon's is checked once, after the
        # copy and before the commit (_finish_step): a region replaced under a
        # live connection drops the step's saves there, whenever it happened.)
        base = reserve.cursor
        reserve.cursor += blocks
        # Kept for later steps while slots are left (the commit says keep_rest);
        # else this step's commit ends the lease.
        kept = reserve.keep and reserve.open > 0
        if not kept:
            del self._reserves[tenant]
            self._reserves_changed()
        r = reserve.handle
        handle = StoreHandle(
            r.lease_id,
            r.namespace,
            np.zeros(blocks, dtype=np.uint64),
            np.full(blocks, STORE_ALLOCATED, dtype=np.uint8),
            r.offsets[base : base + blocks],
            r.tier,
            r.deadline_s,
            reserve=True,
        )
        return handle, base, kept

    def _drop_reserves(self, now_s: float) -> None:
        """Give back reserves near their lease's end, forget those of another connection."""
        stale = [
            t
            for t, r in self._reserves.items()
            if r.generation != self.session.generation or now_s > r.use_by_s
        ]
        if not stale:
            return
        # A kept reserve this step's saves took slots from is not released under
        # them (the release ends the whole lease): their commit ends or keeps it,
        # and the next step's call drops it.
        busy = {b.handle.lease_id for b in self._step.saves if b.keep_rest and b.handle}
        handles = []
        for tenant in stale:
            if self._reserves[tenant].handle.lease_id in busy:
                continue
            reserve = self._reserves.pop(tenant)
            if reserve.generation == self.session.generation:
                handles.append(reserve.handle)
        self._reserves_changed()
        if handles:
            self.activity += 1  # (a failed call counts a failure)
            # retried on a fresh link: a release the new daemon does not know is ignored
            self.session.call("release", lambda c: _release_all(c, handles))

    def _reserves_changed(self) -> None:
        self._reserves_use_by_s = min(
            (r.use_by_s for r in self._reserves.values()), default=math.inf
        )

    def _reserve_size(self, client: Client, block_bytes: int) -> int:
        """Slots to ask for: the most blocks among recent store steps that a reserve
        can hold (at most store_reserve_blocks and a small share of the region);
        the bound itself when none can (a request's first step, far bigger than
        the decode steps after it). Every slot asked costs the daemon work on a
        machine whose cores the engine needs: no more than recent steps used."""
        limit = self._reserve_limit(client, block_bytes)
        fits = [n for n in self._store_sizes if n <= limit]
        if fits:
            return max(fits)
        return limit if self._store_sizes else 0

    def _reserve_limit(self, client: Client, block_bytes: int) -> int:
        """The most slots one reserve may hold: store_reserve_blocks, and a small
        share of the region (RESERVE_REGION_SHARE)."""
        share = client.info.region_bytes // RESERVE_REGION_SHARE // max(block_bytes, 1)
        return min(self.config.store_reserve_blocks, share)

    def _on_reserved(self, tenant: str, generation: int, keep: bool) -> Any:
        def done(result: StoreHandle | KVStoreError) -> None:
            self._reserve_asked.discard(tenant)
            if isinstance(result, KVStoreError):
                logger.debug("kvstore: no store reserve (%s)", result)
                return
            now_s = time.monotonic()
            # usable while more than half of its life is left: a forward is far shorter
            use_by_s = now_s + (result.deadline_s - now_s) / 2
            old = self._reserves.get(tenant)
            self._reserves[tenant] = _Reserve(result, generation, use_by_s, keep)
            self._reserves_changed()
            if old is not None and old.generation == generation:
                # Read inside a call, right before a store step's commit goes out:
                # the release rides in its frame (queued, not sent on its own).
                handles = [old.handle]
                self.session.call(
                    "release", lambda c: _release_all(c, handles, now=False), retry=False
                )

        return done

    def _commit(self, batch: _SaveBatch) -> None:
        handle, idx = batch.handle, batch.allocated
        assert handle is not None and idx is not None
        # Every commit carries its blocks' tokens and parents, split into chains
        # ordered parent first, so the daemon's BlockStored events are what
        # vLLM's own are: one per sequence, tokens included (llm-d re-hashes them).
        perm, chains = chain_order(
            batch.block_hashes[idx], batch.parents[idx], batch.has_parent[idx]
        )
        sel = idx[perm]
        hashes = batch.block_hashes[sel]
        bs = self.layout.block_size_tokens
        tokens = batch.token_ids.reshape(-1, bs)[sel].reshape(-1)
        parent = chains[0][1] if len(chains) == 1 else None
        # one chain: the plain fields, which daemons without chain support read too
        multi = chains if len(chains) > 1 else None
        # Sent without waiting for the answer (over the lean channel; gRPC waits):
        # counted as saved now, corrected when the answer says otherwise. It is
        # read by this client's next call, or at close (so it lands before exit).
        expected = len(idx)
        counters = self.counters
        reserved = batch.reserved
        positions = batch.position_base + sel if reserved else None
        tenant, generation = batch.tenant, batch.generation

        def done(result: int | Exception) -> None:
            committed = 0 if isinstance(result, Exception) else int(result)
            if committed != expected:
                counters.saved_blocks -= expected - committed
                if reserved and not isinstance(result, Exception):
                    # a reserve cannot know what the daemon has: those were there already
                    counters.save_skipped_blocks += expected - committed
                    self._clean_batches = 0  # check the next batches again
                else:
                    counters.save_dropped_blocks += expected - committed
                logger.debug(
                    "kvstore: commit stored %d of %d blocks (%s)", committed, expected, result
                )

        def send(c: Client) -> bool:
            # The tenant's next reserve rides in the commit's frame (one send),
            # when what it holds (its slots not taken yet) will not fit a step
            # like the recent ones (the answer replaces it, _on_reserved releases
            # the old one). Where the daemon keeps a reserve past a commit, one
            # is asked for RESERVE_STEPS such steps.
            ask = 0
            keep = False
            if (
                tenant not in self._reserve_asked
                and self.config.store_reserve_blocks
                and c.reserves
            ):
                keep = c.reserve_keep
                block_bytes = handle.namespace.block_bytes
                step = self._reserve_size(c, block_bytes)
                ask = (
                    min(step * RESERVE_STEPS, self._reserve_limit(c, block_bytes)) if keep else step
                )
                held = self._reserves.get(tenant)
                if held is not None and held.open >= step:
                    ask = 0
            c.commit_store_later(
                handle,
                hashes,
                parent_block_hash=parent,
                token_ids=tokens,
                chains=multi,
                on_done=done,
                positions=positions,
                keep_rest=batch.keep_rest,
                reserve_blocks=ask,
                reserve_ttl_s=self.config.lease_ttl_s,
                on_reserved=self._on_reserved(tenant, generation, keep) if ask else None,
            )
            if ask:
                self._reserve_asked.add(tenant)
            return True

        if self.session.call("commit store", send, retry=False) is None:
            self.counters.save_dropped_blocks += expected  # not sent, or refused at once
        else:
            self.counters.saved_blocks += expected

    def _abort(self, saves: list[_SaveBatch]) -> None:
        for batch in saves:
            self.counters.save_dropped_blocks += (
                len(batch.allocated) if batch.allocated is not None else 0
            )
            held = self._reserves.get(batch.tenant)
            if (
                batch.keep_rest
                and held is not None
                and batch.handle is not None
                and held.handle.lease_id == batch.handle.lease_id
            ):
                # The release below ends the whole lease: its other slots go with it.
                del self._reserves[batch.tenant]
                self._reserves_changed()
        handles = [batch.handle for batch in saves if batch.handle is not None]
        self.session.call("release", lambda c: _release_all(c, handles), retry=False)

    # ------------------------------------------------------------ region

    def _region(self) -> torch.Tensor | None:
        """Where this connector's offsets point: the DRAM region, or the GPU pool."""
        import torch

        region = self.session.region if self.config.tier == "dram" else self.session.gpu_pool()
        if region is None:
            self._region_t = None
            return None
        # Rebuilt when the mapping object changed too, not only the connection: the
        # Client maps anew when it follows a restarted daemon inside one call (the
        # session's generation then stays), and the old tensor would still point
        # at the old mapping (another layout: another tenant's bytes).
        if (
            self._region_t is None
            or self._region_generation != self.session.generation
            or region is not self._region_src
        ):
            self._region_t = (
                region if isinstance(region, torch.Tensor) else torch.from_numpy(region)
            )
            self._region_generation = self.session.generation
            self._region_src = region
        return self._region_t

    def _remap(self) -> None:
        """Our mapping is not the daemon's region any more: reconnect on the next call."""
        if self.session.connected and not self.session.region_is_current():
            logger.warning("kvstore: the daemon's region file changed; mapping it again")
            self.session.disconnect()

    def _warn_once(self, key: str, message: str) -> None:
        """A silent loss of saves must leave one line in the engine's log."""
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)

    def close(self) -> None:
        self._region_t = self._region_src = None
        if self._step.saves:
            # A step that never finished (the engine stops mid-step): its slots, and
            # a kept reserve's others, go back now, not when their leases run out.
            saves, self._step.saves = self._step.saves, []
            self._abort(saves)
        if self._reserve_asked:  # read the answers first: those reserves are held too
            self.session.call("collect reserve", lambda c: c.flush(), retry=False)
        self._drop_reserves(float("inf"))  # given back now, not at their leases' end
        self.session.close()


def _any_expired(handles: Sequence[LoadHandle | StoreHandle]) -> bool:
    """By the client's clock (time.monotonic, kvstore.client's default)."""
    now = time.monotonic()
    return any(now > h.deadline_s for h in handles)


def _release_all(
    client: Client, handles: Sequence[LoadHandle | StoreHandle], *, now: bool = True
) -> int:
    """End leases without waiting for the answers (a lost one just expires): one
    message, sent at once or (``now=False``) with the client's next frame."""
    client.release_all(handles, wait=False, now=now)
    return len(handles)
