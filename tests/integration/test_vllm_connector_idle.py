"""A decode step with nothing to load or save costs the connector next to nothing.

vLLM calls the connector's hooks on every step; most decode steps complete no
block. Such a step must make no daemon call (test_local_channel) and do no
per-request hash work: the scheduler side must not read a request's block
hashes (only their count) until a block is complete.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from tests.integration.test_vllm_connector_daemon import (
    BS,
    Engine,
    Req,
    RunningRequest,
    _tokens,
)


class _CountingHashes(list[bytes]):
    """vLLM's per-request hash list, counting the reads of its entries."""

    reads = 0

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        type(self).reads += 1
        return super().__getitem__(index)


def test_an_idle_decode_step_reads_no_block_hash(daemon):
    eng = Engine(daemon.address, seed=3)
    req = Req("r", _tokens(3, 2 * BS + 1))  # 2 full blocks + 1 token
    eng.prefill(req, [1, 2, 3])
    assert eng.worker.counters.saved_blocks == 2

    def decode() -> None:
        req.all_token_ids.append(5)
        req.rehash()
        req.block_hashes = _CountingHashes(req.block_hashes)
        plan = eng.step(
            running=[RunningRequest("r", None, False, req.num_tokens - 1)], scheduled={"r": 1}
        )
        assert eng.worker.take_load_errors() == set()
        return plan

    _CountingHashes.reads = 0
    for _ in range(BS - 2):  # decode tokens that complete no block
        assert not decode()
    assert _CountingHashes.reads == 0
    # The step that completes the third block converts its hash and saves it.
    assert decode().saves
    assert _CountingHashes.reads > 0
    assert eng.worker.counters.saved_blocks == 3


def test_idle_decode_steps_move_no_activity_and_the_completing_step_does(daemon):
    """The connector's stats hook reads the counters only when a side's ``activity``
    moved (it runs on every step). Idle decode steps must not move it; the scheduler
    walks its requests only for the steps after a change, and for the step that
    completes a block; that step moves both sides (and their counters)."""
    from kvstore_connectors.vllm.scheduler import WALKS_AFTER_CHANGE

    eng = Engine(daemon.address, seed=5)
    req = Req("r", _tokens(5, 2 * BS + 1))
    eng.prefill(req, [1, 2, 3])
    moved = []
    for _ in range(BS - 1):  # BS - 2 idle decode steps, then the one completing block 3
        req.all_token_ids.append(5)
        req.rehash()
        before = (eng.scheduler.activity, eng.worker.activity)
        eng.step(running=[RunningRequest("r", None, False, req.num_tokens - 1)], scheduled={"r": 1})
        after = (eng.scheduler.activity, eng.worker.activity)
        moved.append((after[0] != before[0], after[1] != before[1]))
    idle = moved[:-1]
    assert [s for s, _ in idle] == [i < WALKS_AFTER_CHANGE for i in range(BS - 2)]
    assert not any(w for _, w in idle)
    assert moved[-1] == (True, True)
    assert eng.worker.counters.saved_blocks == 3


def test_per_layer_hooks_are_asked_for_only_where_a_copier_works_layer_by_layer(daemon):
    """vLLM calls wait_for_layer_load / save_kv_layer around each layer only when
    has_connector_metadata() says so (KVStoreConnector answers has_layer_work):
    never for the CPU copier (its per-layer calls do nothing), and for a copier
    that works layer by layer (CUDA's) only on a step that loads or saves."""
    from kvstore_connectors.vllm.metadata import StepPlan

    eng = Engine(daemon.address, seed=6)
    req = Req("r", _tokens(6, 2 * BS + 1))
    _, plan = eng.prefill(req, [1, 2, 3])
    assert plan.saves and not eng.worker.layer_wise
    assert not eng.worker.has_layer_work(plan) and not eng.worker.has_layer_work(StepPlan())

    class LayerWise:  # the part of CudaBlockCopier this asks about
        layer_wise = True

    eng.worker.copier = LayerWise()  # type: ignore[assignment]
    assert eng.worker.layer_wise
    assert eng.worker.has_layer_work(plan)
    assert not eng.worker.has_layer_work(StepPlan())
    eng.worker.unregister()
    assert not eng.worker.layer_wise and not eng.worker.has_layer_work(plan)


def test_quiet_steps_share_one_plan_that_nothing_builds_on(daemon):
    """The scheduler's quiet steps hand the workers IDLE_PLAN, one object (nothing
    built per step; the connector wraps it once), which the worker knows by
    identity. Nothing writes to it: after steps that save and load it is empty."""
    from kvstore_connectors.vllm.metadata import IDLE_PLAN
    from kvstore_connectors.vllm.scheduler import WALKS_AFTER_CHANGE

    a, b = Engine(daemon.address, seed=7), Engine(daemon.address, seed=8)
    req = Req("r", _tokens(7, 2 * BS + 1))
    a.prefill(req, [1, 2, 3])
    plans = []
    for _ in range(BS - 1):  # BS - 2 decode steps that complete nothing, then one that does
        req.all_token_ids.append(5)
        req.rehash()
        plans.append(
            a.step(
                running=[RunningRequest("r", None, False, req.num_tokens - 1)], scheduled={"r": 1}
            )
        )
    walks, quiet, completing = (
        plans[:WALKS_AFTER_CHANGE],
        plans[WALKS_AFTER_CHANGE:-1],
        plans[-1],
    )
    assert quiet and all(p is IDLE_PLAN for p in quiet)
    assert all(p is not IDLE_PLAN and not p for p in walks)  # walked: built, empty
    assert completing.saves and completing is not IDLE_PLAN
    # Another engine restores the stored prefix (a plan with loads), then idles.
    again = Req("again", _tokens(7, 2 * BS + 1))
    ext, plan = b.prefill(again, [4, 5, 6])
    assert ext == 2 * BS and plan.loads and b.worker.counters.loaded_blocks == 2
    for _ in range(WALKS_AFTER_CHANGE + 1):
        again.all_token_ids.append(5)
        again.rehash()
        last = b.step(
            running=[RunningRequest("again", None, False, again.num_tokens - 1)],
            scheduled={"again": 1},
        )
    assert last is IDLE_PLAN
    assert not IDLE_PLAN and (IDLE_PLAN.loads, IDLE_PLAN.saves, IDLE_PLAN.deferred) == ([], [], [])
    assert a.worker.counters.saved_blocks == 3 and b.worker.counters.load_failed_blocks == 0
