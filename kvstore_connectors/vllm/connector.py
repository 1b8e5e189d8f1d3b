"""``KVStoreConnector``: vLLM's KV connector API (v1) over the kvstore daemon.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore_connectors.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"address": "unix:/tmp/kvstore.sock"}}'

This module is the only one that imports vLLM; it adapts vLLM's objects to
``scheduler.SchedulerSide`` and ``worker.WorkerSide``. The API it implements
is ``KVConnectorBase_V1``, which vLLM marks experimental: at start the base
class is checked against what the connector relies on (``compat``), a mismatch
fails naming what is missing, and a version not in ``compat.TESTED_VLLM_VERSIONS``
(0.32.0 end to end, 0.33.0 against its source) gets one warning.
"""

from __future__ import annotations

import functools
import logging
import operator
import os
import time
from collections.abc import Callable
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstore.errors import ConfigError
from kvstore.identity import client_token
from kvstore.presence import compile_probes
from kvstore_connectors.vllm import compat
from kvstore_connectors.vllm.config import ConnectorConfig
from kvstore_connectors.vllm.hashes import block_hash_stride, hash_seed_fingerprint
from kvstore_connectors.vllm.metadata import IDLE_PLAN, StepPlan
from kvstore_connectors.vllm.namespace import EngineLayout, dtype_name
from kvstore_connectors.vllm.scheduler import (
    NewRequest,
    SchedulerCounters,
    SchedulerSide,
)
from kvstore_connectors.vllm.session import DaemonSession
from kvstore_connectors.vllm.stats import Deltas, KVStoreConnectorStats, KVStorePromMetrics
from kvstore_connectors.vllm.worker import WorkerCounters, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

TESTED_VLLM_VERSIONS = tuple(compat.TESTED_VLLM_VERSIONS)

try:  # vLLM >= 0.3x labels external hits by tier in its metrics
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _HIT_SOURCE: Any = CacheHitSource.HOST
except ImportError:  # pragma: no cover - older vLLM
    _HIT_SOURCE = None


_perf_ns = time.perf_counter_ns

# Each side's counters read in one C call (``get_kv_connector_stats`` runs every step).
_SCHEDULER_FIELDS = tuple(f.name for f in fields(SchedulerCounters))
_WORKER_FIELDS = tuple(f.name for f in fields(WorkerCounters))
_READ_SCHEDULER = operator.attrgetter(*_SCHEDULER_FIELDS)
_READ_WORKER = operator.attrgetter(*_WORKER_FIELDS)


def _timed(method: Callable[..., Any]) -> Callable[..., Any]:
    """Add the call's wall time to the connector's total (``counters()``: *_time_ns).

    Every hook vLLM calls on this connector is timed, so ``*_time_ns`` is the
    connector's whole cost. The hooks vLLM calls on every step (and per layer)
    time themselves inline: this wrapper's extra frame costs ~0.4 µs warm and a
    few µs right after a forward, each step.
    """

    @functools.wraps(method)
    def wrapper(self: KVStoreConnector, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._time_ns += time.perf_counter_ns() - t0

    return wrapper


class KVStoreConnectorMetadata(KVConnectorMetadata):
    """The scheduler's ``StepPlan`` for one step, as vLLM's metadata type."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def _check_version() -> None:
    """Fail when vLLM's connector interface is not the one implemented here; warn
    (once) when it matches but the version is not a tested one."""
    import vllm

    compat.check_vllm(
        compat.describe_class(KVConnectorBase_V1),
        str(getattr(vllm, "__version__", "unknown")),
        implemented=set(vars(KVStoreConnector)),
    )


def _log_through_vllm() -> None:
    """Send the connector's and kvstore's log records to vLLM's handler, at vLLM's level.

    vLLM configures only its own "vllm" logger (propagation off); records of other
    loggers reach Python's last-resort handler, which prints WARNING and above, so
    the connector's INFO lines were lost. A logger someone configured is left alone,
    and so is everything when vLLM's logging is off (VLLM_CONFIGURE_LOGGING=0).
    """
    source = logging.getLogger("vllm")
    if not source.handlers:
        return
    for name in ("kvstore_connectors.vllm", "kvstore"):
        target = logging.getLogger(name)
        if target.handlers:
            continue
        for handler in source.handlers:
            target.addHandler(handler)
        target.setLevel(source.level)
        target.propagate = False


def _hash_seed(vllm_config: VllmConfig) -> str:
    """This engine's hash-seed fingerprint (kvstore_connectors.vllm.hashes), warned about when
    it cannot match any other engine's."""
    from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED

    algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    fingerprint = hash_seed_fingerprint(
        algo, os.environ.get("PYTHONHASHSEED"), DEFAULT_NONE_HASH_SEED
    )
    if fingerprint.endswith(":random"):
        logger.warning(
            "KVStoreConnector: prefix_caching_hash_algo=%s without PYTHONHASHSEED seeds block "
            "hashes randomly per process: blocks this engine stores are NEVER reused by another "
            "engine or after a restart; set PYTHONHASHSEED to one value on every engine",
            algo,
        )
    return fingerprint


def engine_layout(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: ConnectorConfig
) -> EngineLayout:
    """The namespace-defining layout of this engine (TP/PP rank 0; workers set their own)."""
    from vllm.platforms import current_platform

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"KVStoreConnector supports models with one KV cache group (full attention); this one has {len(groups)}"
        )
    spec = groups[0].kv_cache_spec
    for attr in ("num_kv_heads", "head_size", "dtype"):
        if not hasattr(spec, attr):
            raise ConfigError(
                f"KVStoreConnector needs an attention KV cache; got {type(spec).__name__}"
            )
    num_layers = len(groups[0].layer_names)
    parallel = vllm_config.parallel_config
    page_layout = (
        f"vllm-{current_platform.device_type}-{kv_cache_config.kv_cache_layout or 'default'}"
    )
    return EngineLayout(
        model=config.model_name or str(vllm_config.model_config.model),
        dtype=dtype_name(spec.dtype),
        block_size_tokens=spec.block_size,
        num_layers=num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        block_bytes=spec.page_size_bytes * num_layers,
        page_layout=page_layout,
        tp_world_size=parallel.tensor_parallel_size,
        pp_world_size=parallel.pipeline_parallel_size,
        hash_seed=_hash_seed(vllm_config),
        # vLLM 0.33 keeps the legacy block hashes whenever a KV connector is
        # configured (lookahead hashing is for EAGLE/MTP without one), so this
        # engine's scheme is legacy: L = 0. Recorded all the same, so a scheme
        # change shows in the namespace (and never mixes blocks).
        hash_lookahead_tokens=0,
    )


class KVStoreConnector(KVConnectorBase_V1):
    """Loads prefix hits from, and stores computed blocks into, the node's kvstore daemon."""

    _cache_hit_source = _HIT_SOURCE

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        _log_through_vllm()
        _check_version()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        missing = compat.missing_init_attributes(self)
        if missing:
            raise ConfigError(
                "KVStoreConnector does not match this vLLM's KVConnectorBase_V1: its __init__ "
                f"no longer sets {', '.join(missing)}"
            )
        extra = self._kv_transfer_config.kv_connector_extra_config
        config = ConnectorConfig.from_extra(extra)
        # kv_role: a producer only stores, a consumer only loads, kv_both does both.
        transfer = self._kv_transfer_config
        self.config = msgspec.structs.replace(
            config,
            load=config.load and transfer.is_kv_consumer,
            save=config.save and transfer.is_kv_producer,
        )
        # Never fail a request over the cache: failed loads are recomputed.
        # (The scheduler reads this after building its connector.)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.info("KVStoreConnector: kv_load_failure_policy set to 'recompute'")
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        layout = engine_layout(vllm_config, kv_cache_config, self.config)
        self._layer_order = list(kv_cache_config.kv_cache_groups[0].layer_names)
        self._num_blocks = kv_cache_config.num_blocks
        address = self.config.resolved_address()
        # The client connects at the first request; the compiled presence probes
        # (lookups, direct loads) start compiling now, while the engine starts.
        compile_probes()
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._kv_caches: list[tuple[str, torch.Tensor]] = []
        self._time_ns = 0  # wall time spent inside the connector's hooks
        self._steps = 0
        self._deltas = Deltas()  # what get_kv_connector_stats reported so far
        # The counters (less the per-step ones) and hook time at the last report:
        # a step that moved neither skips building the counters (see Deltas).
        self._reported: tuple[Any, ...] | None = None
        # Hook time at the last report plus what Deltas holds back: below it, a
        # step that moved nothing else reports nothing (Deltas.holds, precomputed).
        self._report_by_ns = self._deltas.hold_ns
        # The side's ``activity`` when the counters were last read: while it has
        # not moved, no counter has (the idle paths move none), nothing is read.
        self._read_activity = -1
        # has_connector_metadata: the copier works layer by layer, and whether the
        # step of the last metadata asked about has anything to do per layer
        self._layer_wise = False
        self._layer_meta: KVConnectorMetadata | None = None
        self._layer_work = False
        # What build_connector_meta hands vLLM on every idle step (IDLE_PLAN's).
        self._idle_meta = KVStoreConnectorMetadata(IDLE_PLAN)
        if role == KVConnectorRole.SCHEDULER:
            hash_block_size = kv_cache_config.hash_block_size or layout.block_size_tokens
            self._scheduler = SchedulerSide(
                self.config,
                layout,
                # no block bytes here, but the presence table: lookups without a call
                self._session(address, map_region=False, map_presence=True),
                hash_stride=block_hash_stride(layout.block_size_tokens, hash_block_size),
            )
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            layout = layout.for_rank(
                tp_rank=get_tensor_model_parallel_rank(), pp_rank=get_pp_group().rank_in_group
            )
            self._worker = WorkerSide(self.config, layout, self._session(address, map_region=True))
        logger.info(
            "KVStoreConnector (%s): daemon %s, namespace layout %s", role.name, address, layout
        )

    def _session(
        self, address: str, *, map_region: bool, map_presence: bool | None = None
    ) -> DaemonSession:
        return DaemonSession(
            address,
            map_presence=map_presence,
            timeout_s=self.config.timeout_s,
            retry_initial_s=self.config.retry_initial_s,
            retry_max_s=self.config.retry_max_s,
            map_region=map_region,
            local_channel=self.config.local_channel,
            # read now: a bad token file stops the engine at start, naming it
            token=client_token(self.config.token or None, self.config.token_file),
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        order = [name for name in self._layer_order if name in kv_caches]
        order += [name for name in kv_caches if name not in order]
        # Kept for restore_kv_caches: vLLM's own tensors (their storage is what
        # sleep mode unmaps and maps again), not pointers into them.
        self._kv_caches = [(name, kv_caches[name]) for name in order]
        self._worker.register(self._kv_caches, self._num_blocks)
        self._layer_wise = self._worker.layer_wise

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33+: the connector follows sleep mode's KV cache remap (below)."""
        return True

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33+, before sleep: drop every view of and pointer into vLLM's KV
        cache (copier, staging, block layout); until restore, planned loads are
        reported failed (recomputed) and saves dropped. Idempotent."""
        if self._worker is not None:
            self._worker.unregister()
            self._layer_wise = False

    def restore_kv_caches(self) -> None:
        """vLLM 0.33+, after wake-up: map the KV cache again from vLLM's tensors.
        Idempotent."""
        if self._worker is not None and self._kv_caches:
            self._worker.register(self._kv_caches, self._num_blocks)
            self._layer_wise = self._worker.layer_wise

    @property
    def kv_caches_registered(self) -> bool:
        return self._worker is not None and self._worker.registered

    def has_connector_metadata(self) -> bool:
        """The base's answer, and False where this step's per-layer hooks would do
        nothing: the CPU copier's never do, the CUDA copier's only on a step with
        loads or saves. vLLM (0.32, 0.33) asks this only around each attention
        layer, to decide whether to call wait_for_layer_load / save_kv_layer: two
        calls per layer per step saved. On the CPU the answer costs what the
        base's does; on CUDA the plan is looked at once per step."""
        if not self._layer_wise or not super().has_connector_metadata():
            return False
        meta = self._get_connector_metadata()
        if meta is not self._layer_meta:
            assert self._worker is not None
            self._layer_meta = meta
            self._layer_work = isinstance(
                meta, KVStoreConnectorMetadata
            ) and self._worker.has_layer_work(meta.plan)
        return self._layer_work

    # The hooks below run on every step (or per layer): timed inline, as _timed does.
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        t0 = _perf_ns()
        try:
            assert self._worker is not None
            meta = self._get_connector_metadata()
            assert isinstance(meta, KVStoreConnectorMetadata)
            self._worker.start_step(meta.plan)
        finally:
            self._time_ns += _perf_ns() - t0

    def wait_for_layer_load(self, layer_name: str) -> None:
        t0 = _perf_ns()
        assert self._worker is not None
        self._worker.wait_layer(layer_name)
        self._time_ns += _perf_ns() - t0

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        t0 = _perf_ns()
        assert self._worker is not None
        self._worker.save_layer(layer_name)
        self._time_ns += _perf_ns() - t0

    def wait_for_save(self) -> None:
        t0 = _perf_ns()
        try:
            assert self._worker is not None
            self._steps += 1
            self._worker.finish_step()
        finally:
            self._time_ns += _perf_ns() - t0

    def get_block_ids_with_load_errors(self) -> set[int]:
        t0 = _perf_ns()
        errors = self._worker.take_load_errors() if self._worker is not None else set()
        self._time_ns += _perf_ns() - t0
        return errors

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.session.close()

    # ------------------------------------------------------------ scheduler side

    @_timed
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.hit_tokens(request, num_computed_tokens), False

    @_timed
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        t0 = _perf_ns()
        try:
            assert self._scheduler is not None
            news = scheduler_output.scheduled_new_reqs
            new = (
                [
                    NewRequest(
                        r.req_id, r.block_ids[0] if r.block_ids else [], r.num_computed_tokens
                    )
                    for r in news
                ]
                if news
                else ()  # most steps: no comprehension (a call) for nothing
            )
            cached = scheduler_output.scheduled_cached_reqs
            plan = self._scheduler.build_plan_columns(
                new,
                cached.req_ids,
                cached.new_block_ids,
                cached.resumed_req_ids,
                cached.num_computed_tokens,
                scheduler_output.num_scheduled_tokens,
            )
            if plan is IDLE_PLAN:
                return self._idle_meta
            return KVStoreConnectorMetadata(plan)
        finally:
            self._time_ns += _perf_ns() - t0

    @_timed
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Saves complete within the step that planned them, so vLLM may free the
        # blocks at once, unless the request finished with blocks not hashed when
        # its last step was planned: then they are saved next step and vLLM keeps
        # them until the workers say so (get_finished).
        # A prefill request of the P/D split (kvstore_hand_over) answers a ticket:
        # its blocks pinned for the decode node, read there with no pin round trip.
        assert self._scheduler is not None
        params = self._scheduler.hand_over(request)
        return self._scheduler.finished(request, block_ids), params

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose blocks vLLM kept for a deferred save that is now done."""
        t0 = _perf_ns()
        done = self._worker.take_finished_saving() if self._worker is not None else None
        self._time_ns += _perf_ns() - t0
        return (done or None), None

    # ------------------------------------------------------------ observability

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What this side's counters gained since vLLM last asked (once per step);
        None on a step that moved only the hook time and the step count (``Deltas``
        holds those back)."""
        t0 = _perf_ns()
        try:
            side = self._scheduler if self._scheduler is not None else self._worker
            assert side is not None
            held = self._time_ns < self._report_by_ns
            if held and side.activity == self._read_activity:
                return None  # nothing ran since the counters were read that could move one
            self._read_activity = side.activity
            now = self._counter_values()
            if held and now == self._reported:
                return None  # what Deltas.take would answer, without building the counters
            stats = self._deltas.take(self.counters())
            if stats is not None:
                self._reported = now
                self._report_by_ns = self._time_ns + self._deltas.hold_ns
            return stats
        finally:
            self._time_ns += _perf_ns() - t0

    def _counter_values(self) -> tuple[Any, ...]:
        """This side's counters but the per-step ones (time, steps), as one tuple."""
        if self._scheduler is not None:
            side: SchedulerSide | WorkerSide = self._scheduler
            values = _READ_SCHEDULER(self._scheduler.counters)
        else:
            assert self._worker is not None
            side, values = self._worker, _READ_WORKER(self._worker.counters)
        return (values, side.session.failures, side.session.reconnects)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def counters(self) -> dict[str, int]:
        """Cumulative counters of this side (and of its daemon link)."""
        side = self._scheduler if self._scheduler is not None else self._worker
        assert side is not None
        prefix = "scheduler" if self._scheduler is not None else "worker"
        names = _SCHEDULER_FIELDS if self._scheduler is not None else _WORKER_FIELDS
        out = {f"{prefix}_{k}": getattr(side.counters, k) for k in names}
        out[f"{prefix}_daemon_failures"] = side.session.failures
        out[f"{prefix}_daemon_reconnects"] = side.session.reconnects
        out[f"{prefix}_time_ns"] = self._time_ns
        if self._worker is not None:
            out["worker_steps"] = self._steps
        return out
