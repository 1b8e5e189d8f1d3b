"""The connector's scheduler and worker sides against a real daemon, without vLLM.

Two "engines" are built from the connector's own parts with real CPU KV
caches (vLLM's CPU layout) and real daemons; requests carry real vLLM block
hashes (kvstore.hashing, verified against vLLM elsewhere). vLLM's part, what
it passes in and when, is played by the test.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvstore.client import Client  # noqa: E402
from kvstore.hashing import BlockHasher, to_int_hashes  # noqa: E402
from kvstore_connectors.vllm.config import ConnectorConfig  # noqa: E402
from kvstore_connectors.vllm.namespace import EngineLayout  # noqa: E402
from kvstore_connectors.vllm.scheduler import NewRequest, RunningRequest, SchedulerSide  # noqa: E402
from kvstore_connectors.vllm.session import DaemonSession  # noqa: E402
from kvstore_connectors.vllm.worker import WorkerSide  # noqa: E402

BS = 16
LAYERS, HEADS, HEAD_DIM = 2, 2, 32
NUM_BLOCKS = 40
BLOCK_BYTES = LAYERS * HEADS * BS * 2 * HEAD_DIM * 4


@dataclass
class Req:
    """The fields of vLLM's Request the scheduler side reads."""

    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    num_prompt_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int | None = None  # read when the request finishes

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.all_token_ids)
        self.rehash()

    def rehash(self) -> None:
        salt = self.cache_salt
        self.block_hashes = BlockHasher(BS).hash_tokens(self.all_token_ids, cache_salt=salt)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def int_hashes(self) -> list[int]:
        return to_int_hashes(self.block_hashes).tolist()


class Engine:
    """A scheduler side + a worker side over CPU caches, as one vLLM engine has them."""

    def __init__(self, address: str, seed: int, **config_kw) -> None:
        self.config = ConnectorConfig.from_extra(
            {"address": address, "retry_initial_s": 0.2, "retry_max_s": 0.4, **config_kw}
        )
        self.layout = EngineLayout(
            model="tiny",
            dtype="float32",
            block_size_tokens=BS,
            num_layers=LAYERS,
            num_kv_heads=HEADS,
            head_dim=HEAD_DIM,
            block_bytes=BLOCK_BYTES,
            page_layout="vllm-cpu-LBHNC",
        )
        session = dict(
            timeout_s=self.config.timeout_s,
            retry_initial_s=0.2,
            retry_max_s=0.4,
            token=self.config.token,  # as the connector passes it (client_token)
        )
        self.scheduler = SchedulerSide(
            self.config,
            self.layout,
            # as the connector's: no region, the presence table (lookups without a call)
            DaemonSession(address, map_region=False, map_presence=True, **session),
            hash_stride=1,
        )
        self.worker = WorkerSide(self.config, self.layout, DaemonSession(address, **session))
        g = torch.Generator().manual_seed(seed)
        self.caches = [
            (f"layers.{i}.attn", torch.randn(NUM_BLOCKS, HEADS, BS, 2 * HEAD_DIM, generator=g))
            for i in range(LAYERS)
        ]
        self.worker.register(self.caches, NUM_BLOCKS)

    def block_bytes(self, block_id: int) -> bytes:
        return b"".join(t[block_id].contiguous().numpy().tobytes() for _, t in self.caches)

    def step(self, new=(), running=(), scheduled=None):
        plan = self.scheduler.build_plan(list(new), list(running), scheduled or {})
        self.worker.start_step(plan)
        self.worker.finish_step()
        return plan

    def prefill(self, req: Req, block_ids: list[int], local_tokens: int = 0):
        """vLLM's first step for a request: lookup, allocate, schedule the whole prompt."""
        ext = self.scheduler.hit_tokens(req, local_tokens)
        self.scheduler.after_alloc(req, block_ids, ext)
        computed = local_tokens + ext
        plan = self.step(
            [NewRequest(req.request_id, block_ids, computed)],
            scheduled={req.request_id: req.num_tokens - computed},
        )
        return ext, plan


def _stored(address: str, engine: Engine, req: Req) -> list[bytes]:
    with Client(address) as c:
        ns = c.declare_namespace(engine.layout.spec(req.cache_salt))
        got = c.get(ns, req.int_hashes())
        return [bytes(row) for row in got.data]


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, 30000, n).tolist()


def test_store_then_another_engine_loads_exact_bytes(daemon):
    a, b = Engine(daemon.address, seed=1), Engine(daemon.address, seed=2)
    req = Req("r1", _tokens(1, 5 * BS + 3))  # 5 full blocks + a partial one
    ids_a = [7, 3, 9, 1, 12, 20]
    ext, plan = a.prefill(req, ids_a)
    assert ext == 0 and not plan.loads
    assert [s.block_ids.tolist() for s in plan.saves] == [ids_a[:5]]
    assert plan.saves[0].parent_block_hash is None
    assert plan.saves[0].token_ids.tolist() == req.all_token_ids[: 5 * BS]
    assert a.worker.counters.saved_blocks == 5
    assert _stored(daemon.address, a, req) == [a.block_bytes(i) for i in ids_a[:5]]

    # Engine B: every full block is an external hit, loaded into B's own block ids.
    req_b = Req("r1", list(req.all_token_ids))
    ids_b = [30, 31, 2, 5, 8, 11]
    ext, plan = b.prefill(req_b, ids_b)
    assert ext == 5 * BS
    assert [spec.block_ids.tolist() for spec in plan.loads] == [ids_b[:5]]
    assert b.worker.take_load_errors() == set()
    assert [b.block_bytes(i) for i in ids_b[:5]] == [a.block_bytes(i) for i in ids_a[:5]]
    assert b.worker.counters.loaded_blocks == 5
    assert b.worker.counters.direct_loaded_blocks == 5  # no lease: the presence table
    client = b.scheduler.session.client()
    assert client is not None and client.probed_lookups >= 1 and not client.mapped
    # Its first step offered the blocks again; the daemon had them all.
    assert b.worker.counters.saved_blocks == 0 and b.worker.counters.save_skipped_blocks == 5


def test_hits_start_after_the_local_hit_and_leave_the_last_token(daemon):
    a, b = Engine(daemon.address, seed=1), Engine(daemon.address, seed=2)
    req = Req("r", _tokens(2, 4 * BS))  # exactly 4 blocks
    a.prefill(req, [0, 1, 2, 3])
    # vLLM must compute the last prompt token: only 3 blocks can come from the cache.
    assert b.scheduler.hit_tokens(req, 0) == 3 * BS
    # vLLM already has 2 blocks locally: one more comes from the daemon.
    assert b.scheduler.hit_tokens(req, 2 * BS) == BS
    b.scheduler.after_alloc(req, [4, 5, 6, 7], BS)
    plan = b.scheduler.build_plan([NewRequest("r", [4, 5, 6, 7], 3 * BS)], [], {"r": BS})
    assert [(s.block_ids.tolist(), s.block_hashes.tolist()) for s in plan.loads] == [
        ([6], req.int_hashes()[2:3])
    ]
    assert Engine(daemon.address, seed=3, min_hit_blocks=4).scheduler.hit_tokens(req, 0) == 0
    assert Engine(daemon.address, seed=3, load=False).scheduler.hit_tokens(req, 0) == 0


def test_decode_saves_the_completed_block_with_its_parent(daemon):
    eng = Engine(daemon.address, seed=4)
    req = Req("d", _tokens(3, 2 * BS + 10))
    eng.prefill(req, [0, 1, 2])
    # Decode: tokens are appended one per step; the step computing token 47
    # (the last of block 2) completes block 2.
    req.all_token_ids += _tokens(4, 6)
    req.rehash()
    plan = eng.step(running=[RunningRequest("d", None, False, 3 * BS - 1)], scheduled={"d": 1})
    (save,) = plan.saves
    assert save.block_ids.tolist() == [2]
    assert save.parent_block_hash == req.int_hashes()[1]
    assert save.token_ids.tolist() == req.all_token_ids[2 * BS : 3 * BS]
    assert _stored(daemon.address, eng, req) == [eng.block_bytes(i) for i in (0, 1, 2)]
    # A step that completes no block plans nothing.
    assert not eng.step(running=[RunningRequest("d", [5], False, 3 * BS)], scheduled={"d": 1})
    no_decode = Engine(daemon.address, seed=4, save_decode=False)
    no_decode.prefill(Req("p", list(req.all_token_ids[: 2 * BS + 10])), [0, 1, 2])
    plan = no_decode.scheduler.build_plan(
        [], [RunningRequest("p", None, False, 3 * BS - 1)], {"p": 1}
    )
    assert not plan.saves


def test_async_scheduling_saves_a_block_once_its_placeholder_token_is_known(daemon):
    """Async scheduling plans the step that computes a block's last position while
    that token is still a placeholder: the block has no hash yet. It is saved on
    the next step, which starts past it (the old code never saved it)."""
    eng = Engine(daemon.address, seed=6)
    prompt, generated = _tokens(6, 2 * BS + 10), _tokens(7, 6)
    req = Req("a", list(prompt))
    eng.prefill(req, [0, 1, 2])
    # Step computing position 47 (block 2's last): token 47 is a placeholder, so
    # the request holds 47 tokens and 2 block hashes.
    req.all_token_ids = [*prompt, *generated[:5]]
    req.rehash()
    assert len(req.block_hashes) == 2
    plan = eng.step(running=[RunningRequest("a", None, False, 3 * BS - 1)], scheduled={"a": 1})
    assert not plan.saves
    # Next step: token 47 is known (block 2 hashed); vLLM has computed 48 tokens.
    req.all_token_ids = [*prompt, *generated]
    req.rehash()
    plan = eng.step(running=[RunningRequest("a", None, False, 3 * BS)], scheduled={"a": 1})
    (save,) = plan.saves
    assert save.block_ids.tolist() == [2]
    assert save.parent_block_hash == req.int_hashes()[1]
    assert _stored(daemon.address, eng, req) == [eng.block_bytes(i) for i in (0, 1, 2)]
    # Saved once: the step after plans nothing.
    assert not eng.step(running=[RunningRequest("a", None, False, 3 * BS + 1)], scheduled={"a": 1})


def test_a_request_that_finishes_in_the_step_completing_its_block_saves_it_next_step(daemon):
    """Speculative decoding (the drafts filling a block are accepted in the step that
    computes them) and async scheduling (the filling token is a placeholder) plan a
    block's last step before the block has a hash. A request that finishes in that
    step has no later step: its save is planned for the next one, and vLLM keeps
    the blocks (request_finished -> True) until the worker reports it done. Found
    with EAGLE/MTP drafters that agree with their target on the CPU engine: the
    old code never stored the last block of such a request."""
    eng = Engine(daemon.address, seed=8)
    prompt, accepted = _tokens(8, 2 * BS + 10), _tokens(9, 6)
    req = Req("f", list(prompt))
    eng.prefill(req, [0, 1, 2])
    # a target token + 5 drafts scheduled: block 2's last position is computed,
    # its hash does not exist yet
    plan = eng.step(running=[RunningRequest("f", None, False, 2 * BS + 10)], scheduled={"f": 6})
    assert not plan.saves
    # all accepted; the request has its max_tokens and finishes in that step
    req.all_token_ids = [*prompt, *accepted]
    req.rehash()
    req.num_computed_tokens = 3 * BS
    assert eng.scheduler.finished(req, [0, 1, 2]) is True
    assert eng.worker.take_finished_saving() == set()
    plan = eng.step()  # the next step, nothing else scheduled
    assert plan.deferred == ["f"]
    assert [s.block_ids.tolist() for s in plan.saves] == [[2]]
    assert plan.saves[0].parent_block_hash == req.int_hashes()[1]
    assert eng.worker.take_finished_saving() == {"f"}  # vLLM may free its blocks now
    assert _stored(daemon.address, eng, req) == [eng.block_bytes(i) for i in (0, 1, 2)]
    assert not eng.step()
    # every block saved already: freed at once, nothing deferred
    done = Req("g", _tokens(10, 2 * BS), num_computed_tokens=2 * BS)
    eng.prefill(done, [5, 6])
    assert eng.scheduler.finished(done, [5, 6]) is False
    assert not eng.step()
    # a deferred save that cannot be made (daemon gone) is still reported done
    late = Req("h", _tokens(11, BS + 4))
    eng.prefill(late, [7, 8])
    late.all_token_ids += _tokens(12, BS - 4)
    late.rehash()
    late.num_computed_tokens = 2 * BS
    assert eng.scheduler.finished(late, [7, 8]) is True
    daemon.stop()
    eng.step()
    assert eng.worker.take_finished_saving() == {"h"}


def test_resumed_request_takes_its_new_blocks(daemon):
    eng = Engine(daemon.address, seed=5)
    req = Req("p", _tokens(5, 3 * BS))
    eng.scheduler.hit_tokens(req, 0)
    eng.scheduler.after_alloc(req, [0, 1, 2], 0)
    eng.scheduler.build_plan([NewRequest("p", [0, 1, 2], 0)], [], {"p": BS})  # chunked prefill
    # Preempted, then resumed into other blocks: saves use the new ids, from block 0.
    plan = eng.scheduler.build_plan([], [RunningRequest("p", [9, 10, 11], True, 0)], {"p": 3 * BS})
    assert [s.block_ids.tolist() for s in plan.saves] == [[9, 10, 11]]


def _hit_on_the_other_engine(address: str, seed: int) -> tuple[Engine, Engine, Req, list[int], int]:
    """Engine A stores a 6-block prompt; engine B looks it up (6 blocks hit) and
    allocates blocks 20..26 for it: (a, b, the request, B's block ids, hit tokens)."""
    a, b = Engine(address, seed=seed), Engine(address, seed=seed + 1)
    req = Req("r", _tokens(seed, 6 * BS + 1))
    a.prefill(req, list(range(7)))
    ids = [20, 21, 22, 23, 24, 25, 26]
    ext = b.scheduler.hit_tokens(req, 0)
    assert ext == 6 * BS
    b.scheduler.after_alloc(req, ids, ext)
    return a, b, req, ids, ext


def test_blocks_gone_before_the_load_are_reported_and_not_saved(daemon):
    a, b, req, ids, ext = _hit_on_the_other_engine(daemon.address, 6)
    # Evicted between vLLM's lookup and the load: blocks 3.. are gone.
    with Client(daemon.address) as c:
        ns = c.declare_namespace(a.layout.spec(None))
        assert c.delete(ns, req.int_hashes()[3:]) == (3, 0)
    before = {i: b.block_bytes(i) for i in ids}
    plan = b.scheduler.build_plan([NewRequest("r", ids, ext)], [], {"r": 1})
    b.worker.start_step(plan)
    b.worker.finish_step()
    assert b.worker.take_load_errors() == {23, 24, 25}
    assert b.worker.take_load_errors() == set()  # reported once
    assert [b.block_bytes(i) for i in ids[:3]] == [a.block_bytes(i) for i in range(3)]
    assert [b.block_bytes(i) for i in ids[3:]] == [before[i] for i in ids[3:]]
    # This step's blocks were computed over missing KV: none of them was stored.
    assert b.worker.counters.saved_blocks == 0
    assert _stored(daemon.address, a, req) == [a.block_bytes(i) for i in range(3)]


def test_blocks_that_leave_their_slots_during_a_direct_load_are_reported(daemon):
    """Direct loads (no lease): blocks deleted while the worker copies them (timed by
    running the delete inside the copier's load, after its copy) are reported as
    load errors and their request's saves dropped; the blocks before stay loaded."""
    a, b, req, ids, ext = _hit_on_the_other_engine(daemon.address, 16)
    copier = b.worker.copier
    assert copier is not None
    real_load = copier.load

    def load_then_delete(region, offsets, block_ids):  # type: ignore[no-untyped-def]
        real_load(region, offsets, block_ids)
        with Client(daemon.address) as c:  # evicted right after the bytes were copied
            ns = c.declare_namespace(a.layout.spec(None))
            assert c.delete(ns, req.int_hashes()[3:]) == (3, 0)

    copier.load = load_then_delete  # type: ignore[method-assign]
    plan = b.scheduler.build_plan([NewRequest("r", ids, ext)], [], {"r": 1})
    b.worker.start_step(plan)
    b.worker.finish_step()
    assert b.worker.take_load_errors() == {23, 24, 25}
    assert [b.block_bytes(i) for i in ids[:3]] == [a.block_bytes(i) for i in range(3)]
    c = b.worker.counters
    assert (c.loaded_blocks, c.direct_loaded_blocks, c.direct_lost_blocks) == (3, 3, 3)
    assert c.saved_blocks == 0  # computed over KV that failed to load: not stored
    # with direct_loads off the same step pins (a lease), and nothing is lost
    pinned = Engine(daemon.address, seed=18, direct_loads=False)
    req2 = Req("r2", _tokens(18, 2 * BS + 1))
    a.prefill(req2, [30, 31, 32])
    pinned.prefill(req2, [0, 1, 2])
    assert pinned.worker.counters.loaded_blocks == 2
    assert pinned.worker.counters.direct_loaded_blocks == 0


def test_tenants_do_not_see_each_others_blocks(daemon):
    a, b = Engine(daemon.address, seed=8), Engine(daemon.address, seed=9)
    req = Req("t", _tokens(7, 3 * BS + 1), cache_salt="tenant-a")
    a.prefill(req, [0, 1, 2, 3])
    # The same hashes under another tenant: a different namespace, no hit.
    other = Req("t", list(req.all_token_ids), cache_salt="tenant-b")
    other.block_hashes = list(req.block_hashes)
    assert b.scheduler.hit_tokens(other, 0) == 0
    assert b.scheduler.hit_tokens(req, 0) == 3 * BS


def test_daemon_death_costs_one_warning_and_recovers(daemon_factory, caplog):
    daemon = daemon_factory("dying", tcp=False)
    a, b = Engine(daemon.address, seed=10), Engine(daemon.address, seed=11)
    req = Req("r", _tokens(8, 4 * BS + 1))
    a.prefill(req, [0, 1, 2, 3, 4])
    assert b.scheduler.hit_tokens(req, 0) == 4 * BS
    b.scheduler.after_alloc(req, [5, 6, 7, 8, 9], 4 * BS)
    daemon.kill()
    caplog.set_level(logging.WARNING, logger="kvstore_connectors.vllm")
    t0 = time.monotonic()
    plan = b.scheduler.build_plan([NewRequest("r", [5, 6, 7, 8, 9], 4 * BS)], [], {"r": 1})
    b.worker.start_step(plan)
    b.worker.finish_step()
    assert b.worker.take_load_errors() == {5, 6, 7, 8}  # vLLM recomputes exactly these
    for i in range(20):  # many requests while it is down: no hits, no exceptions
        assert b.scheduler.hit_tokens(Req(f"x{i}", list(req.all_token_ids)), 0) == 0
    assert time.monotonic() - t0 < 5.0
    warnings = [r for r in caplog.records if "unusable" in r.getMessage()]
    assert len(warnings) == 2, [r.getMessage() for r in caplog.records]  # one per session
    daemon.start()  # same socket and region file; it starts empty (no disk tier)
    again = Req("again", _tokens(18, 2 * BS + 1))
    deadline = time.monotonic() + 10
    while b.scheduler.hit_tokens(Req("again", list(again.all_token_ids)), 0) == 0:
        # Engine A keeps serving requests; its sessions come back on their own.
        a.prefill(Req("again", list(again.all_token_ids)), [10, 11, 12])
        assert time.monotonic() < deadline, "never reconnected"
        time.sleep(0.1)
    assert b.scheduler.session.reconnects == 1
    assert a.worker.session.reconnects == 1
    assert _stored(daemon.address, a, again) == [a.block_bytes(i) for i in (10, 11)]
    assert any("reconnected" in r.getMessage() for r in caplog.records)


def test_restarted_daemon_with_another_region_file_gets_exact_bytes(daemon_factory, tmp_path):
    first = daemon_factory("first", tcp=False)
    eng = Engine(first.address, seed=12)
    warm = Req("w", _tokens(9, BS + 1))
    eng.prefill(warm, [0, 1])  # connected, region mapped
    first.kill()
    # A new daemon on the same socket with another region file, and the namespace
    # already declared (by some other client): calls succeed, offsets are in the new file.
    second = daemon_factory(
        "second",
        tcp=False,
        settings={
            "server.socket_path": first.socket_path,
            "dram.path": str(tmp_path / "other.dram"),
        },
    )
    with Client(second.address) as c:
        c.declare_namespace(eng.layout.spec(None))
    req = Req("r", _tokens(10, 2 * BS + 1))
    eng.prefill(req, [3, 4, 5])
    # The connection drop was noticed: the worker mapped the new region before
    # writing, so what the new daemon holds is exactly the engine's blocks.
    assert eng.worker.session.reconnects == 1
    assert _stored(second.address, eng, req) == [eng.block_bytes(i) for i in (3, 4)]


def test_one_step_saves_many_requests_once_each(daemon):
    eng = Engine(daemon.address, seed=13)
    shared = _tokens(11, 2 * BS)
    r1 = Req("r1", shared + _tokens(12, BS + 5))
    r2 = Req("r2", shared + _tokens(13, 2 * BS + 1))
    for req in (r1, r2):
        assert eng.scheduler.hit_tokens(req, 0) == 0
    eng.scheduler.after_alloc(r1, [0, 1, 2, 3], 0)
    # Without vLLM's prefix cache both requests compute the shared blocks in this step.
    eng.scheduler.after_alloc(r2, [4, 5, 6, 7, 8], 0)
    eng.step(
        [NewRequest("r1", [0, 1, 2, 3], 0), NewRequest("r2", [4, 5, 6, 7, 8], 0)],
        scheduled={"r1": r1.num_tokens, "r2": r2.num_tokens},
    )
    # 2 shared + 1 + 2 distinct blocks, each stored once, from the block that computed it first.
    assert eng.worker.counters.saved_blocks == 5
    assert eng.worker.counters.save_skipped_blocks == 0
    assert _stored(daemon.address, eng, r1) == [eng.block_bytes(i) for i in (0, 1, 2)]
    assert _stored(daemon.address, eng, r2) == [eng.block_bytes(i) for i in (0, 1, 6, 7)]


def _wait_until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_a_forward_that_outlives_its_store_leases_changes_no_other_block(daemon_factory):
    """Issue 19 bug 4 (connector): the worker copied into its store slots after their
    lease expired, over another client's committed block (all 0x07); its commit then
    failed with NOT_FOUND and the session took that for a broken link (cache off)."""
    slots = 4
    daemon = daemon_factory(
        dram_bytes=slots * BLOCK_BYTES,
        chunk_bytes=slots * BLOCK_BYTES,
        settings={"leases.reap_interval_s": 0.02},
    )
    engine = Engine(daemon.address, seed=21, lease_ttl_s=0.2)
    req = Req("r", _tokens(21, 2 * BS + 1))
    ext = engine.scheduler.hit_tokens(req, 0)
    engine.scheduler.after_alloc(req, [3, 4, 5], ext)
    plan = engine.scheduler.build_plan(
        [NewRequest("r", [3, 4, 5], ext)], [], {"r": req.num_tokens - ext}
    )
    engine.worker.start_step(plan)  # 2 store slots reserved for the forward
    sevens = np.full((slots, BLOCK_BYTES), 0x07, np.uint8)
    with Client(daemon.address) as other:
        spec = engine.layout.spec(None)
        ns = other.declare_namespace(msgspec.structs.replace(spec, model="x"))
        # The "forward" stalls past the leases; another client fills the tier meanwhile.
        _wait_until(lambda: other.stats().expired_leases >= 1)
        stored = other.put(ns, list(range(1000, 1000 + slots)), sevens).stored
        engine.worker.finish_step()
        got = other.get(ns, list(range(1000, 1000 + slots)))
        assert got.found == stored > 0
        np.testing.assert_array_equal(got.data, sevens[:stored])  # not one byte changed
    assert engine.worker.counters.saved_blocks == 0
    assert engine.worker.counters.save_dropped_blocks == 2
    # The daemon was fine: the link and the cache stay up.
    assert engine.worker.session.connected and engine.worker.session.failures == 0
    # The other client's get released its pins without waiting for the answer: with
    # them still held the tier is all pinned and the late reservation is refused.
    _wait_until(lambda: engine.worker.session.client().stats().active_leases == 0)
    late = engine.worker.session.call_in(
        "prepare store", spec, lambda c, n: c.prepare_store(n, [77], lease_ttl_s=0.2)
    )
    assert late is not None and late.lease_id
    _wait_until(lambda: engine.worker.session.client().stats().expired_leases >= 2)
    committed = engine.worker.session.call(
        "commit store", lambda c: c.commit_store(late), retry=False
    )
    assert committed is None  # refused: the lease expired...
    assert engine.worker.session.connected  # ...which is not a broken link


# ------------------------------------------------------------ llm-d as a consumer

POD_ID = "10.0.0.5:8000"  # the engine's serving address:port, llm-d's pod id


def test_llmd_consumer_gets_one_chain_per_request_with_tokens_parent_first(daemon_factory):
    """Issue 23: three requests saved in one step reached the stream as one
    BlockStored with every hash, token_ids [] and no parent, under the daemon's
    node id: llm-d's scorer, which names the engine by the topic and re-hashes
    token ids from the parent, could place none of them."""
    from kvstore.events.wire import AllBlocksCleared, BlockStored, full_decoder
    from kvstore_bench.ports import free_port
    from tests.integration._events import EventTap

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    daemon = daemon_factory(
        settings={
            "events.enabled": True,
            "events.publish_address": endpoint,
            "events.replay_address": "",
            "events.topic_ids": POD_ID,
        }
    )
    tap = EventTap(daemon.address, endpoint, f"kv@{POD_ID}@".encode(), BLOCK_BYTES)
    try:
        eng = Engine(daemon.address, seed=31)
        shared = _tokens(31, 2 * BS)
        r1 = Req("r1", shared + _tokens(32, BS + 5))  # 3 blocks
        r2 = Req("r2", shared + _tokens(33, 2 * BS + 1))  # the same 2, then 2 of its own
        r3 = Req("r3", _tokens(34, 2 * BS + 7))  # 2 blocks, unrelated
        reqs = (r1, r2, r3)
        ids = {"r1": [0, 1, 2, 3], "r2": [4, 5, 6, 7, 8], "r3": [9, 10, 11]}
        for req in reqs:
            assert eng.scheduler.hit_tokens(req, 0) == 0
            eng.scheduler.after_alloc(req, ids[req.request_id], 0)
        eng.step(
            [NewRequest(r.request_id, ids[r.request_id], 0) for r in reqs],
            scheduled={r.request_id: r.num_tokens for r in reqs},
        )
        assert eng.worker.counters.saved_blocks == 7

        # what each block is: its tokens and the block before it
        tokens_of: dict[int, list[int]] = {}
        parent_of: dict[int, int | None] = {}
        for req in reqs:
            hs = req.int_hashes()
            for i, h in enumerate(hs):
                tokens_of[h] = req.all_token_ids[i * BS : (i + 1) * BS]
                parent_of[h] = hs[i - 1] if i else None
        expected = set(tokens_of)
        dec = full_decoder()
        stored: list[BlockStored] = []

        def step_events_in() -> bool:
            stored.clear()
            for topic, _, payload in tap.frames:
                if topic.endswith(b"@tiny"):
                    stored.extend(
                        e for e in dec.decode(payload).events if isinstance(e, BlockStored)
                    )
            return {h for e in stored for h in e.block_hashes} >= expected

        tap.collect(step_events_in)
    finally:
        tap.close()

    # three frames, the topic names the engine, seq counts batches one by one
    assert all(len(f) == 3 for f in tap.frames)
    seqs = [int.from_bytes(f[1], "big") for f in tap.frames]
    assert all(len(f[1]) == 8 for f in tap.frames)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    for topic, _, payload in tap.frames:
        events = dec.decode(payload).events
        if all(isinstance(e, AllBlocksCleared) for e in events):
            assert topic == f"kv@{POD_ID}@".encode()  # a clear of every model
        else:
            assert topic in (f"kv@{POD_ID}@tiny".encode(), f"kv@{POD_ID}@probe".encode())

    # one BlockStored per request's chain (r2's shared blocks stored once, by r1)
    chains = [[int(h) for h in e.block_hashes] for e in stored]
    assert sorted(map(len, chains)) == [2, 2, 3]
    assert sorted(h for c in chains for h in c) == sorted(expected)  # each block once
    seen: set[int] = set()
    for ev, chain in zip(stored, chains, strict=True):
        # token ids always there, exactly the blocks' tokens, in order
        assert ev.token_ids == [t for h in chain for t in tokens_of[h]]
        assert ev.block_size == BS and ev.medium == "CPU"
        # a chain: each block continues the one before it, from its parent
        assert ev.parent_block_hash == parent_of[chain[0]]
        assert all(parent_of[b] == a for a, b in itertools.pairwise(chain))
        # parents before children, across the requests of the step
        assert ev.parent_block_hash is None or ev.parent_block_hash in seen
        seen.update(chain)
    r2_own = r2.int_hashes()[2:]
    assert [c for c in chains if c[0] == r2_own[0]] == [r2_own]
    assert stored[[c[0] for c in chains].index(r2_own[0])].parent_block_hash == r1.int_hashes()[1]


# ------------------------------------------------------------ tenant regions

MiB = 1 << 20
SALT_A = "alpha-salt-6c1f0e"  # capped: its own region file
SALT_B = "beta-salt-92d4aa"  # capped: its own region file
TENANT_REGIONS = {
    "dram.tenant_regions": True,
    "quotas.tenants.alpha.tenant": SALT_A,
    "quotas.tenants.alpha.dram_bytes": "1MiB",
    "quotas.tenants.beta.tenant": SALT_B,
    "quotas.tenants.beta.dram_bytes": "1MiB",
}
# docs/tenants.md: the shared file's range first, then the tenants' by name.
RANGES = {"": (0, 2 * MiB), SALT_A: (2 * MiB, 3 * MiB), SALT_B: (3 * MiB, 4 * MiB)}


def _tenant_daemon(daemon_factory, **settings):
    return daemon_factory(
        dram_bytes=4 * MiB, chunk_bytes=MiB, settings={**TENANT_REGIONS, **settings}
    )


def _file_of(daemon, salt: str) -> bytes:
    base = str(daemon.settings["dram.path"])
    path = {"": base, SALT_A: base + ".tenant-alpha", SALT_B: base + ".tenant-beta"}[salt]
    with open(path, "rb") as f:
        return f.read()


def _offsets(address: str, engine: Engine, req: Req, token: str = "") -> list[int]:
    """Where the daemon holds the request's blocks (a load lease, released at once)."""
    with Client(address, token=token or None) as c:
        ns = c.declare_namespace(engine.layout.spec(req.cache_salt))
        handle = c.prepare_load(ns, req.int_hashes())
        try:
            assert handle.found == len(req.int_hashes())
            return [int(off) for off in handle.offsets]
        finally:
            c.release(handle.lease_id)


def test_tenant_regions_store_and_load_through_the_tenants_own_file(daemon_factory):
    """dram.tenant_regions on: a request with a capped tenant's cache_salt is stored
    by one engine and loaded by another through the connector's two-phase path; its
    blocks sit in the tenant's range (its own file), nowhere else, and each worker's
    mapping of that range is the tenant's file (mapped over the Client's reservation)."""
    daemon = _tenant_daemon(daemon_factory)
    a, b = Engine(daemon.address, seed=41), Engine(daemon.address, seed=42)
    req = Req("ta", _tokens(41, 5 * BS + 3), cache_salt=SALT_A)
    ids_a = [7, 3, 9, 1, 12, 20]
    ext, _ = a.prefill(req, ids_a)
    assert ext == 0 and a.worker.counters.saved_blocks == 5
    want = [a.block_bytes(i) for i in ids_a[:5]]
    assert _stored(daemon.address, a, req) == want
    lo, hi = RANGES[SALT_A]
    offsets = _offsets(daemon.address, a, req)
    assert all(lo <= off and off + BLOCK_BYTES <= hi for off in offsets), offsets
    # The bytes went through the tenant's own file, and only there.
    for salt in RANGES:
        content = _file_of(daemon, salt)
        assert all((block in content) == (salt == SALT_A) for block in want), salt

    req_b = Req("ta", list(req.all_token_ids), cache_salt=SALT_A)
    ids_b = [30, 31, 2, 5, 8, 11]
    ext, plan = b.prefill(req_b, ids_b)
    assert ext == 5 * BS and [s.block_ids.tolist() for s in plan.loads] == [ids_b[:5]]
    assert b.worker.take_load_errors() == set()
    assert [b.block_bytes(i) for i in ids_b[:5]] == want
    assert b.worker.counters.loaded_blocks == 5 and b.worker.counters.load_failed_blocks == 0
    for eng in (a, b):
        region = eng.worker.session.region
        assert region is not None and eng.worker.session.region_is_current()
        assert [bytes(region[off : off + BLOCK_BYTES]) for off in offsets] == want
        # beta's range was never asked for: this process's own empty memory
        assert not region[RANGES[SALT_B][0] : RANGES[SALT_B][1]].any()


def test_tenant_regions_a_tenant_the_token_may_not_use_is_recomputed(daemon_factory, caplog):
    """With auth.principals, an engine whose token is bob's (tenant beta) serving a
    request with alpha's cache_salt: no hit, its blocks computed by vLLM, nothing
    stored under alpha, one warning per session, no exception; none of alpha's
    bytes in its mapping; and its own tenant's requests still use the cache."""
    from kvstore.identity import hash_token

    alice, bob = "alice-token-2f7d0b9c41", "bob-token-8a3e51c6d0"
    daemon = _tenant_daemon(
        daemon_factory,
        **{
            "auth.principals.alice.token_sha256": hash_token(alice),
            "auth.principals.alice.tenants": SALT_A,
            "auth.principals.bob.token_sha256": hash_token(bob),
            "auth.principals.bob.tenants": SALT_B,
        },
    )
    a = Engine(daemon.address, seed=43, token=alice)
    b = Engine(daemon.address, seed=44, token=bob)
    req = Req("ta", _tokens(43, 4 * BS + 1), cache_salt=SALT_A)
    a.prefill(req, [0, 1, 2, 3, 4])
    assert a.worker.counters.saved_blocks == 4
    alpha_blocks = [a.block_bytes(i) for i in range(4)]
    stored = _offsets(daemon.address, a, req, token=alice)

    caplog.set_level(logging.WARNING, logger="kvstore_connectors.vllm")
    ids = [20, 21, 22, 23, 24]
    before = [b.block_bytes(i) for i in ids]
    for i in range(3):  # several requests: still no exception and no more warnings
        denied = Req(f"d{i}", list(req.all_token_ids), cache_salt=SALT_A)
        ext, plan = b.prefill(denied, ids)
        assert ext == 0 and not plan.loads  # vLLM computes every block
        assert b.worker.take_load_errors() == set()
    assert [b.block_bytes(i) for i in ids] == before  # nothing was copied in
    assert b.worker.counters.loaded_blocks == 0 and b.worker.counters.saved_blocks == 0
    assert b.worker.counters.save_dropped_blocks == 3 * 4
    denials = [r for r in caplog.records if "denied" in r.getMessage()]
    assert len(denials) == 2, [r.getMessage() for r in caplog.records]  # one per session
    assert all(r.levelno == logging.WARNING for r in denials)
    # The daemon holds alpha's blocks as alice stored them, where she stored them.
    assert _stored_as(daemon.address, a, req, alice) == alpha_blocks
    assert _offsets(daemon.address, a, req, token=alice) == stored
    # Bob's worker maps none of alpha's bytes: that range is its own empty memory.
    region = b.worker.session.region
    assert region is not None
    lo, hi = RANGES[SALT_A]
    assert not region[lo:hi].any()
    # Denied is not down: bob's own tenant round-trips through its own file.
    own = Req("tb", _tokens(44, 3 * BS + 1), cache_salt=SALT_B)
    b.prefill(own, [5, 6, 7, 8])
    assert b.worker.counters.saved_blocks == 3
    assert _stored_as(daemon.address, b, own, bob) == [b.block_bytes(i) for i in (5, 6, 7)]
    lo_b, hi_b = RANGES[SALT_B]
    assert all(lo_b <= off < hi_b for off in _offsets(daemon.address, b, own, token=bob))
    assert not region[lo:hi].any()
    assert b.worker.session.connected and b.scheduler.session.connected


def _stored_as(address: str, engine: Engine, req: Req, token: str) -> list[bytes]:
    with Client(address, token=token) as c:
        ns = c.declare_namespace(engine.layout.spec(req.cache_salt))
        got = c.get(ns, req.int_hashes())
        return [bytes(row) for row in got.data]


def test_tenant_regions_a_warm_restart_that_moves_the_tenants_range(daemon_factory):
    """The daemon comes back (warm: every file kept) with another layout: beta gone,
    "aardvark" before alpha, so alpha's range moves from 2-3 MiB to 3-4 MiB, where
    the old layout had beta's file. The connector must notice and map the new
    layout before it copies: through its old mapping alpha's new slots would be
    beta's file."""
    daemon = _tenant_daemon(daemon_factory)
    eng = Engine(daemon.address, seed=45)
    first = Req("w", _tokens(45, 2 * BS + 1), cache_salt=SALT_A)
    eng.prefill(first, [0, 1, 2])  # connected, alpha's file mapped at 2-3 MiB
    beta = Req("b", _tokens(46, 2 * BS + 1), cache_salt=SALT_B)
    eng.prefill(beta, [3, 4, 5])
    beta_blocks = [eng.block_bytes(i) for i in (3, 4)]
    assert daemon.stop(keep_region=True) == 0
    for key in ("quotas.tenants.beta.tenant", "quotas.tenants.beta.dram_bytes"):
        del daemon.settings[key]
    daemon.settings["quotas.tenants.aardvark.tenant"] = "aardvark-salt-07"
    daemon.settings["quotas.tenants.aardvark.dram_bytes"] = "1MiB"
    base = str(daemon.settings["dram.path"])
    with open(base + ".tenant-beta", "rb") as f:
        beta_file = f.read()
    assert all(block in beta_file for block in beta_blocks)
    daemon.start()
    req = Req("r", _tokens(47, 3 * BS + 1), cache_salt=SALT_A)
    eng.prefill(req, [6, 7, 8, 9])
    want = [eng.block_bytes(i) for i in (6, 7, 8)]
    assert eng.worker.counters.saved_blocks == 2 + 2 + 3
    assert _stored(daemon.address, eng, req) == want
    offsets = _offsets(daemon.address, eng, req)
    assert all(3 * MiB <= off < 4 * MiB for off in offsets), offsets
    with open(base + ".tenant-alpha", "rb") as f:
        alpha_file = f.read()
    assert all(block in alpha_file for block in want)
    with open(base + ".tenant-beta", "rb") as f:
        assert f.read() == beta_file  # the old layout's beta file: not one byte written
    region = eng.worker.session.region
    assert region is not None
    assert [bytes(region[off : off + BLOCK_BYTES]) for off in offsets] == want


def test_the_workers_region_tensor_follows_a_new_mapping_in_the_same_connection(
    daemon_factory,
):
    """The Client maps the region anew when it follows a restarted daemon inside one
    call (with tenant regions it always re-maps), and the session's generation stays
    the same then: the worker's tensor must follow the new mapping object, or its
    copies go through the old mapping (after a layout change, another tenant's
    bytes)."""
    daemon = _tenant_daemon(daemon_factory)
    eng = Engine(daemon.address, seed=47)
    req = Req("tf", _tokens(47, 2 * BS), cache_salt=SALT_A)
    eng.prefill(req, [1, 2, 3])
    session = eng.worker.session
    client = session.client()
    assert client is not None and client.region is not None
    generation = session.generation
    first = eng.worker._region()
    assert first is not None and first.data_ptr() == client.region.ctypes.data
    # What following a restart in one call leaves behind: another mapping object on
    # the same connection (here a copy of the old one, at another address).
    client.region = client.region.copy()
    assert session.generation == generation
    again = eng.worker._region()
    assert again is not None and again.data_ptr() == client.region.ctypes.data
    assert again.data_ptr() != first.data_ptr()
