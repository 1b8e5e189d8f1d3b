"""The scheduler side's step plans against a simulated vLLM scheduler.

``SchedulerSide.build_plan_columns`` skips the walk over running requests on
steps where none can complete a block (``SKIP_QUIET_STEPS``). Here two
scheduler sides see the same simulated engine, step by step: one skips, the
other always walks; every plan must be the same. The simulation does what
vLLM's scheduler does to the numbers the connector reads: chunked prefill,
decode with speculative drafts (some rejected: ``num_computed_tokens`` falls
back), blocks allocated as tokens need them, preemption (blocks dropped,
resumed later from token 0), requests that finish, and rewinds after an
admission (what vLLM does after a failed load, one or two steps later).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvstore_connectors.vllm import scheduler as scheduler_module
from kvstore_connectors.vllm.config import ConnectorConfig
from kvstore_connectors.vllm.namespace import EngineLayout
from kvstore_connectors.vllm.scheduler import NewRequest, SchedulerSide
from kvstore_connectors.vllm.session import DaemonSession

BS = 4
LAYOUT = EngineLayout(
    model="m",
    dtype="float32",
    block_size_tokens=BS,
    num_layers=1,
    num_kv_heads=1,
    head_dim=8,
    block_bytes=BS * 2 * 8 * 4,
    page_layout="vllm-cpu-LBHNC",
)


@dataclass
class SimRequest:
    """The fields of vLLM's Request the scheduler side reads, and the simulation's own."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    computed_before_step: int = 0  # num_computed_tokens when the last step was planned
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def rehash(self) -> None:
        """vLLM's hashes: one per block filled with real tokens, each over the prefix."""
        full = self.num_tokens // BS
        while len(self.block_hashes) < full:
            prefix = np.asarray(self.all_token_ids[: (len(self.block_hashes) + 1) * BS], np.int64)
            self.block_hashes.append(hashlib.blake2b(prefix.tobytes(), digest_size=32).digest())


def _side() -> SchedulerSide:
    # load off: hit_tokens asks no daemon (this test is about plans, not lookups)
    config = ConnectorConfig.from_extra({"address": "unix:/nonexistent.sock", "load": False})
    session = DaemonSession(
        config.resolved_address(), timeout_s=0.1, retry_initial_s=1.0, retry_max_s=2.0
    )
    return SchedulerSide(config, LAYOUT, session, hash_stride=1)


def _summary(plan) -> tuple:
    return (
        [
            (
                s.req_id,
                s.block_ids.tolist(),
                s.block_hashes.tolist(),
                s.parent_block_hash,
                s.token_ids.tolist(),
            )
            for s in plan.saves
        ],
        [(s.req_id, s.block_ids.tolist()) for s in plan.loads],
        list(plan.deferred),
    )


class Engine:
    """A vLLM-like scheduler loop over two scheduler sides (skipping / walking)."""

    def __init__(self, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rng = np.random.default_rng(seed)
        self.sides = [_side(), _side()]  # [skips quiet steps, always walks]
        self.monkeypatch = monkeypatch
        self.running: list[SimRequest] = []
        self.preempted: list[SimRequest] = []
        self.next_block = 0
        self.made = 0
        self.steps = 0
        self.rewind: list[tuple[int, SimRequest]] = []  # (step, request) to rewind then

    def _both(self, name: str, *args):
        answers = []
        for skip, side in zip((True, False), self.sides, strict=True):
            self.monkeypatch.setattr(scheduler_module, "SKIP_QUIET_STEPS", skip)
            answers.append(getattr(side, name)(*args))
        return answers

    def _alloc(self, req: SimRequest, tokens: int) -> list[int]:
        """Blocks for ``tokens`` tokens of ``req``: the new block ids."""
        need = -(-tokens // BS) - len(req.block_ids)
        new = list(range(self.next_block, self.next_block + max(need, 0)))
        self.next_block += len(new)
        req.block_ids += new
        return new

    def step(self) -> tuple[bool, bool]:
        """One step; (plans equal, the skipping side walked)."""
        rng = self.rng
        new: list[NewRequest] = []
        scheduled: dict[str, int] = {}
        admitted: list[SimRequest] = []
        if len(self.running) < 6 and rng.random() < 0.15:
            self.made += 1
            prompt = int(rng.integers(1, 7 * BS))
            req = SimRequest(
                f"r{self.made}",
                rng.integers(1, 1000, prompt).tolist(),
                prompt,
                max_tokens=int(rng.integers(1, 6 * BS)),
                cache_salt=None if rng.random() < 0.7 else "t",
            )
            req.rehash()
            admitted.append(req)
        resumed: list[SimRequest] = []
        if self.preempted and rng.random() < 0.2:
            resumed.append(self.preempted.pop(0))
        for req in admitted + resumed:
            self._both("hit_tokens", req, 0)
        # the running requests, in vLLM's order (resumed ones last)
        req_ids, new_block_ids, computed = [], [], []
        for req in self.running:
            pending = req.num_tokens - req.num_computed_tokens
            if pending > 1:  # prefill (or recompute), in chunks (often one token)
                n = int(rng.integers(1, pending + 1)) if rng.random() < 0.5 else 1
            else:
                n = 1 + (int(rng.integers(0, 4)) if rng.random() < 0.3 else 0)  # drafts
            scheduled[req.request_id] = n
            ids = self._alloc(req, req.num_computed_tokens + n)
            req_ids.append(req.request_id)
            new_block_ids.append((ids,) if ids else None)
            computed.append(req.num_computed_tokens)
        for req in resumed:
            n = int(rng.integers(1, req.num_tokens + 1))
            scheduled[req.request_id] = n
            self._alloc(req, n)
            self._both("after_alloc", req, list(req.block_ids), 0)
            req_ids.append(req.request_id)
            new_block_ids.append((list(req.block_ids),))
            computed.append(0)
        for req in admitted:
            n = int(rng.integers(1, req.num_prompt_tokens + 1))
            scheduled[req.request_id] = n
            self._alloc(req, n)
            self._both("after_alloc", req, list(req.block_ids), 0)
            new.append(NewRequest(req.request_id, list(req.block_ids), 0))
            # as after a failed load: vLLM rewinds it one or two steps later
            if rng.random() < 0.3:
                self.rewind.append((self.steps + int(rng.integers(1, 3)), req))
        walks = self.sides[0].activity
        plans = self._both(
            "build_plan_columns",
            new,
            req_ids,
            new_block_ids,
            {r.request_id for r in resumed},
            computed,
            scheduled,
        )
        walked = self.sides[0].activity != walks
        same = _summary(plans[0]) == _summary(plans[1])
        # the forward: tokens computed, sampled, drafts accepted or rejected
        self.running += resumed + admitted
        for req in self.running:
            n = scheduled[req.request_id]
            req.computed_before_step = req.num_computed_tokens
            pending = req.num_tokens - req.num_computed_tokens
            if pending > 1 or n < pending:  # a prefill chunk; the last one samples a token
                req.num_computed_tokens += n
                sampled = 1 if req.num_computed_tokens == req.num_tokens else 0
            else:  # decode: the pending token and n - 1 drafts, some of them accepted
                accepted = int(rng.integers(0, n))
                req.num_computed_tokens += 1 + accepted
                sampled = accepted + 1  # those drafts and the bonus token
            req.all_token_ids += rng.integers(1, 1000, sampled).tolist()
            req.rehash()
        self.steps += 1
        for due, req in list(self.rewind):
            if due == self.steps and req in self.running:
                # vLLM's two rewinds: to the failed block, or to what was computed
                # before the step (its failed block was another request's to redo)
                if rng.random() < 0.5 and req.num_computed_tokens >= BS:
                    block = int(rng.integers(0, req.num_computed_tokens // BS))
                    req.num_computed_tokens = block * BS
                else:
                    req.num_computed_tokens = req.computed_before_step
                self.rewind.remove((due, req))
        for req in list(self.running):
            if req.num_tokens - req.num_prompt_tokens >= req.max_tokens:
                self.running.remove(req)
                kept = self._both("finished", req, list(req.block_ids))
                same = same and kept[0] == kept[1]
            elif rng.random() < 0.01:  # preempted: blocks dropped, recomputed from 0
                self.running.remove(req)
                req.num_computed_tokens, req.block_ids = 0, []
                self.preempted.append(req)
        return same, walked


@pytest.mark.parametrize("seed", range(8))
def test_skipping_quiet_steps_plans_what_walking_every_request_plans(seed, monkeypatch):
    engine = Engine(seed, monkeypatch)
    walked = 0
    for step in range(600):
        same, did_walk = engine.step()
        assert same, f"step {step}: the plans differ"
        walked += did_walk
    # the skip is real (blocks of 4 tokens and frequent admissions: most steps walk here)
    assert walked < 0.95 * 600, walked
    assert engine.made > 20


def test_a_decode_step_that_completes_no_block_walks_no_request(monkeypatch):
    """Decode of two requests, one token a step: a walk where a block completes
    (and at each change), none in between."""
    side = _side()
    reqs = [SimRequest(f"d{i}", list(range(1 + i, 1 + i + 2 * BS)), 2 * BS, 100) for i in range(2)]
    for i, req in enumerate(reqs):
        req.rehash()
        side.hit_tokens(req, 0)
        side.after_alloc(req, [3 * i, 3 * i + 1], 0)
    side.build_plan_columns(
        [NewRequest(r.request_id, [3 * i, 3 * i + 1], 0) for i, r in enumerate(reqs)],
        [],
        [],
        set(),
        [],
        {r.request_id: 2 * BS for r in reqs},
    )
    ids = [r.request_id for r in reqs]
    walks, saved = [], []
    for t in range(2 * BS, 5 * BS):  # tokens computed before the step
        for req in reqs:
            req.all_token_ids.append(7)
            req.rehash()
        # the token computed at t starts a block: vLLM hands each request a new one
        blocks = [([100 + 2 * t + i],) for i in range(2)] if t % BS == 0 else [None, None]
        before = side.activity
        plan = side.build_plan_columns([], list(ids), blocks, set(), [t, t], {i: 1 for i in ids})
        walks.append(side.activity != before)
        saved.append(sum(len(s.block_ids) for s in plan.saves))
    # after a change, WALKS_AFTER_CHANGE walks; then one where blocks complete (the
    # step that computes a block's last token: both requests, 2 blocks) and one
    # where vLLM hands out blocks; none between
    n = scheduler_module.WALKS_AFTER_CHANGE
    due = [(t + 1) % BS == 0 for t in range(2 * BS, 5 * BS)]
    given = [t % BS == 0 for t in range(2 * BS, 5 * BS)]
    assert saved == [2 if d else 0 for d in due]
    assert walks == [i < n or d or g for i, (d, g) in enumerate(zip(due, given, strict=True))]
    assert walks.count(False) == 3 * BS - n - 2 * 3 + 1  # (the first given step is a change walk)
