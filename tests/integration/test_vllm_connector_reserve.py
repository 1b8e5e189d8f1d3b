"""The connector's worker storing into slots reserved ahead (store_reserve_blocks),
against a real daemon over the lean channel: decode store steps that wait for no
answer, exact bytes, and every lease back after failed steps, idle reserves and
a daemon killed mid-step."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")

from kvstore.client import Client
from kvstore_connectors.vllm import worker as worker_module
from tests.integration.test_vllm_connector_daemon import (
    BLOCK_BYTES,
    BS,
    Engine,
    Req,
    RunningRequest,
    _stored,
    _tokens,
)


def _wait_until(cond, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s}s"
        time.sleep(0.02)


def _decode(eng: Engine, req: Req, next_id: list[int]) -> None:
    """One decode step of ``req``: one token appended and computed (a new block id
    when the token opens a block)."""
    req.all_token_ids.append(7)
    req.rehash()
    p = req.num_tokens - 1
    new_ids = None
    if p % BS == 0:
        new_ids = [next_id[0]]
        next_id[0] += 1
    eng.step(running=[RunningRequest(req.request_id, new_ids, False, p)], scheduled={"r": 1})
    assert eng.worker.take_load_errors() == set()


def _active_leases(address: str) -> int:
    with Client(address) as c:
        return c.stats().active_leases


def test_decode_store_steps_wait_for_no_answer_and_store_exact_bytes(daemon):
    eng = Engine(daemon.address, seed=41)
    req = Req("r", _tokens(41, 2 * BS + 1))
    eng.prefill(req, [0, 1, 2])  # PrepareStore (waited for); its commit asks for a reserve
    worker = eng.worker.session.client()
    assert worker is not None and worker.local is not None and worker.reserves
    next_id = [3]
    store_steps = 0
    while req.num_tokens < 6 * BS + 1:  # four more blocks completed, one per store step
        frames, waits = worker.local.frames_sent, worker.local.waits
        saved = eng.worker.counters.saved_blocks
        _decode(eng, req, next_id)
        if eng.worker.counters.saved_blocks != saved:
            store_steps += 1
            # one send (the commit and the next reserve), not one wait
            assert (worker.local.frames_sent, worker.local.waits) == (frames + 1, waits)
        else:
            assert (worker.local.frames_sent, worker.local.waits) == (frames, waits)
    assert store_steps == 4
    assert eng.worker.counters.saved_blocks == 6
    assert eng.worker.counters.save_dropped_blocks == 0
    ids = [0, 1, 2, 3, 4, 5]
    assert _stored(daemon.address, eng, req) == [eng.block_bytes(i) for i in ids]
    eng.worker.close()  # the reserve held for the next step is given back
    _wait_until(lambda: _active_leases(daemon.address) == 0, what="the reserve's release")


def test_a_reserve_serves_several_store_steps_and_is_asked_for_ahead(daemon, monkeypatch):
    # The prefill (2 blocks, prepared) asks for a reserve of RESERVE_STEPS such
    # steps: 8 slots. Each decode store step (1 block) takes the next position
    # and keeps the rest (keep_rest); the next reserve is asked for only when
    # fewer slots than a recent step's are left. Bytes exact, no lease left.
    eng = Engine(daemon.address, seed=49)
    req = Req("r", _tokens(49, 2 * BS + 1))
    client = eng.worker.session.client()
    assert client is not None and client.reserve_keep
    commits: list[tuple[int, list[int] | None, bool, int]] = []
    real = client.commit_store_later

    def recorded(handle, *args, **kwargs):
        where = kwargs.get("positions")
        commits.append(
            (
                handle.lease_id,
                None if where is None else [int(p) for p in where],
                kwargs.get("keep_rest", False),
                kwargs.get("reserve_blocks", 0),
            )
        )
        return real(handle, *args, **kwargs)

    monkeypatch.setattr(client, "commit_store_later", recorded)
    eng.prefill(req, [0, 1, 2])
    assert commits[0][1:] == (None, False, 2 * worker_module.RESERVE_STEPS)
    next_id = [3]
    while req.num_tokens < 11 * BS + 1:  # nine more blocks, one per store step
        assert client.local is not None
        frames, waits = client.local.frames_sent, client.local.waits
        _decode(eng, req, next_id)
        assert client.local.waits == waits  # no store step waits for an answer
        assert client.local.frames_sent - frames in (0, 1)  # a store step: one send
    steps = commits[1:]
    assert len(steps) == 9
    first = steps[0][0]
    # positions 0..6 of the first reserve, each keeping the rest; with one slot
    # left (fewer than the prefill's 2) the 7th step asks for the next reserve
    assert [c[1] for c in steps[:7]] == [[p] for p in range(7)]
    assert all(c[0] == first and c[2] for c in steps[:7])
    assert [c[3] for c in steps[:7]] == [0] * 6 + [8]
    # the next steps take the new reserve from its position 0 (the old one's
    # last slot given back when its answer arrived)
    assert steps[7][0] != first and steps[7][1] == [0] and steps[8][1] == [1]
    assert eng.worker.counters.saved_blocks == 11
    assert eng.worker.counters.save_dropped_blocks == 0
    assert _stored(daemon.address, eng, req) == [eng.block_bytes(i) for i in range(11)]
    eng.worker.close()  # the reserve held is given back
    _wait_until(lambda: _active_leases(daemon.address) == 0, what="the reserve's release")


def test_a_kept_reserve_is_not_released_under_its_steps_saves(daemon, monkeypatch):
    # Two tenants complete a block in one step. Tenant a takes slots from its
    # kept reserve; then, while tenant b's slots are taken, a's reserve passes
    # the half of its life after which it is given back. It must not be
    # released under a's save (the release ends the whole lease, and the step
    # would then copy into freed slots): a's commit lands, bytes exact.
    eng = Engine(daemon.address, seed=52)
    reqs = [Req(f"r{t}", _tokens(52 + i, 2 * BS + 1), cache_salt=t) for i, t in enumerate("ab")]
    for i, req in enumerate(reqs):
        eng.prefill(req, [3 * i, 3 * i + 1, 3 * i + 2])  # each commit asks for a reserve
    for req in reqs:
        req.all_token_ids += [7] * (BS - 1)
        req.rehash()
    running = [RunningRequest(r.request_id, None, False, 3 * BS - 1) for r in reqs]
    plan = eng.scheduler.build_plan([], running, {r.request_id: 1 for r in reqs})
    assert [s.tenant for s in plan.saves] == ["a", "b"]
    eng.worker.session.client().flush()  # both reserves' answers read
    take = eng.worker._take_reserve

    def take_then_age(tenant, blocks):
        taken = take(tenant, blocks)
        if tenant == "a":
            assert taken is not None and taken[2]  # a's slots, its reserve kept
            for reserve in eng.worker._reserves.values():
                reserve.use_by_s = 0.0  # every reserve now past the half of its life
        return taken

    monkeypatch.setattr(eng.worker, "_take_reserve", take_then_age)
    eng.worker.start_step(plan)
    eng.worker.finish_step()
    eng.worker.session.client().flush()
    assert eng.worker.counters.save_dropped_blocks == 0
    assert eng.worker.counters.saved_blocks == 6
    for i, req in enumerate(reqs):
        assert _stored(daemon.address, eng, req) == [
            eng.block_bytes(b) for b in (3 * i, 3 * i + 1, 3 * i + 2)
        ]
    eng.worker.close()
    _wait_until(lambda: _active_leases(daemon.address) == 0, what="every lease back")


def test_reserves_off_prepare_every_store_step(daemon):
    eng = Engine(daemon.address, seed=42, store_reserve_blocks=0)
    req = Req("r", _tokens(42, 2 * BS + 1))
    eng.prefill(req, [0, 1, 2])
    worker = eng.worker.session.client()
    assert worker is not None and worker.local is not None
    waits = worker.local.waits
    next_id = [3]
    while req.num_tokens < 3 * BS + 1:
        _decode(eng, req, next_id)
    assert worker.local.waits == waits + 1  # the PrepareStore
    assert _stored(daemon.address, eng, req) == [eng.block_bytes(i) for i in (0, 1, 2)]
    assert _active_leases(daemon.address) == 0


def test_a_block_the_daemon_has_is_skipped_not_dropped(daemon):
    """A reserve cannot know what the daemon holds: a block another engine stored
    meanwhile is not committed again, and counted as skipped."""
    a, b = Engine(daemon.address, seed=43), Engine(daemon.address, seed=44)
    tokens = _tokens(43, 2 * BS + 1)
    ra = Req("r", list(tokens))
    a.prefill(ra, [0, 1, 2])  # a holds a reserve now
    # b completes the same third block first (same tokens, its own bytes)
    rb = Req("r", list(tokens))
    b.prefill(rb, [10, 11, 12], local_tokens=0)
    for eng, req, first in ((b, rb, 13), (a, ra, 3)):
        next_id = [first]
        while req.num_tokens < 3 * BS + 1:
            req.all_token_ids.append(9)
            req.rehash()
            p = req.num_tokens - 1
            new_ids = None
            if p % BS == 0:
                new_ids = [next_id[0]]
                next_id[0] += 1
            eng.step(running=[RunningRequest("r", new_ids, False, p)], scheduled={"r": 1})
    a.worker.session.client().flush()  # the commit's answer read
    assert a.worker.counters.save_skipped_blocks == 1
    assert a.worker.counters.save_dropped_blocks == 0
    a.worker.close()
    b.worker.close()
    _wait_until(lambda: _active_leases(daemon.address) == 0, what="every lease back")


def test_a_block_in_the_presence_table_is_skipped_at_once_without_a_send(daemon):
    """What the daemon's presence table holds is not written into a reserve: counted
    skipped in the step itself (a restore step's counters are exact, as with a
    PrepareStore), no copy, no commit sent."""
    a, b = Engine(daemon.address, seed=46), Engine(daemon.address, seed=47)
    tokens = _tokens(46, 2 * BS + 1)
    ra, rb = Req("r", list(tokens)), Req("r", list(tokens))
    a.prefill(ra, [0, 1, 2])  # a holds a reserve now
    b.prefill(rb, [10, 11, 12], local_tokens=0)
    next_id = [13]
    while rb.num_tokens < 3 * BS + 1:  # b completes the third block (same tokens)
        _decode(b, rb, next_id)
    b.worker.session.client().flush()  # b's commit answered: the block is in the table
    worker = a.worker.session.client()
    assert worker is not None and worker.local is not None and worker.reserves
    frames = worker.local.frames_sent
    saved, skipped = a.worker.counters.saved_blocks, a.worker.counters.save_skipped_blocks
    next_id = [3]
    while ra.num_tokens < 3 * BS + 1:  # a completes the same block
        _decode(a, ra, next_id)
    # counted in the step itself, before any answer is read; nothing copied or sent
    assert a.worker.counters.saved_blocks == saved
    assert a.worker.counters.save_skipped_blocks == skipped + 1
    assert worker.local.frames_sent == frames
    worker.flush()
    assert a.worker.counters.saved_blocks == saved  # and no late correction
    assert a.worker.counters.save_skipped_blocks == skipped + 1
    assert a.worker.counters.save_dropped_blocks == 0
    a.worker.close()
    b.worker.close()
    _wait_until(lambda: _active_leases(daemon.address) == 0, what="every lease back")


def test_clean_small_batches_sample_the_presence_check_and_a_duplicate_resumes_it(
    daemon, monkeypatch
):
    """After PRESENCE_CLEAN_BATCHES small save batches in a row with nothing found at
    the daemon, their presence check is sampled: a block the daemon has is then
    copied and sent, and the commit's answer counts it skipped (stored once, the
    first copy's bytes); from there every batch is checked again."""
    monkeypatch.setattr(worker_module, "PRESENCE_CLEAN_BATCHES", 2)
    monkeypatch.setattr(worker_module, "PRESENCE_SAMPLE_EVERY", 1000)  # no sampled check
    a, b = Engine(daemon.address, seed=48), Engine(daemon.address, seed=49)
    tokens = _tokens(48, 2 * BS + 1)
    ra, rb = Req("r", list(tokens)), Req("r", list(tokens))
    a.prefill(ra, [0, 1, 2])  # two blocks (a PrepareStore); a holds a reserve now
    next_a, next_b = [3], [13]
    while ra.num_tokens < 4 * BS + 1:  # blocks 2 and 3: two clean checked batches
        _decode(a, ra, next_a)
    a.worker.session.client().flush()
    b.prefill(rb, [10, 11, 12], local_tokens=0)
    while rb.num_tokens < 5 * BS + 1:  # b stores block 4 first (same tokens)
        _decode(b, rb, next_b)
    b.worker.session.client().flush()
    worker = a.worker.session.client()
    saved, skipped = a.worker.counters.saved_blocks, a.worker.counters.save_skipped_blocks
    frames = worker.local.frames_sent
    while ra.num_tokens < 5 * BS + 1:  # a completes block 4: not checked, copied, sent
        _decode(a, ra, next_a)
    assert worker.local.frames_sent == frames + 1
    assert a.worker.counters.saved_blocks == saved + 1
    worker.flush()  # the commit's answer: the daemon had it, nothing committed
    assert a.worker.counters.saved_blocks == saved
    assert a.worker.counters.save_skipped_blocks == skipped + 1
    with Client(daemon.address) as c:
        ns = c.declare_namespace(a.layout.spec(None))
        got = c.get(ns, ra.int_hashes()[4:5])
        assert got.found == 1 and bytes(got.data[0]) == b.block_bytes(14)  # b's copy
    # checked again: b stores block 5 first, a's batch of it finds it and sends nothing
    while rb.num_tokens < 6 * BS + 1:
        _decode(b, rb, next_b)
    b.worker.session.client().flush()
    frames = worker.local.frames_sent
    while ra.num_tokens < 6 * BS + 1:
        _decode(a, ra, next_a)
    assert worker.local.frames_sent == frames
    assert a.worker.counters.saved_blocks == saved
    assert a.worker.counters.save_skipped_blocks == skipped + 2
    assert a.worker.counters.save_dropped_blocks == 0
    a.worker.close()
    b.worker.close()
    _wait_until(lambda: _active_leases(daemon.address) == 0, what="every lease back")


def test_an_unfinished_step_gives_its_reserved_slots_back(daemon):
    eng = Engine(daemon.address, seed=45)
    req = Req("r", _tokens(45, 2 * BS + 1))
    eng.prefill(req, [0, 1, 2])
    req.all_token_ids += [7] * (BS - 1)
    req.rehash()
    plan = eng.scheduler.build_plan([], [RunningRequest("r", None, False, 3 * BS - 1)], {"r": 1})
    assert plan.saves
    eng.worker.start_step(plan)  # slots taken from the reserve, no call
    # the forward fails: no finish_step; the next step aborts the unfinished one
    eng.worker.start_step(
        eng.scheduler.build_plan([], [RunningRequest("r", [3], False, 3 * BS)], {"r": 1})
    )
    eng.worker.finish_step()
    assert eng.worker.counters.save_dropped_blocks == 1
    _wait_until(lambda: _active_leases(daemon.address) == 0, what="the reserve's release")
    with Client(daemon.address) as c:
        dram = c.stats().tiers[0]
        assert dram.blocks == 2 and dram.used_bytes == 2 * BLOCK_BYTES  # no slot held
        ns = c.declare_namespace(eng.layout.spec(None))
        assert c.lookup(ns, req.int_hashes()).prefix_blocks == 2


def test_closing_mid_step_gives_a_kept_reserves_slots_back_at_once(daemon):
    eng = Engine(daemon.address, seed=53)
    req = Req("r", _tokens(53, 2 * BS + 1))
    eng.prefill(req, [0, 1, 2])
    eng.worker.session.client().flush()  # the reserve (8 slots) held
    req.all_token_ids += [7] * (BS - 1)
    req.rehash()
    plan = eng.scheduler.build_plan([], [RunningRequest("r", None, False, 3 * BS - 1)], {"r": 1})
    eng.worker.start_step(plan)  # one slot taken, the reserve kept for later steps
    assert _active_leases(daemon.address) == 1
    eng.worker.close()  # the engine stops before the step finishes
    _wait_until(lambda: _active_leases(daemon.address) == 0, what="the reserve's release")
    assert eng.worker.counters.save_dropped_blocks == 1
    with Client(daemon.address) as c:
        dram = c.stats().tiers[0]
        assert dram.blocks == 2 and dram.used_bytes == 2 * BLOCK_BYTES  # no slot held


def test_an_idle_reserve_near_its_end_is_given_back(daemon_factory):
    d = daemon_factory(settings={"leases.reap_interval_s": 0.02, "leases.quarantine_s": 0.0})
    # 3 s: the release must land before the lease ends, 1.4 s after the step (a
    # 0.8 s lease left 0.3 s, short for a loaded machine)
    eng = Engine(d.address, seed=46, lease_ttl_s=3.0)
    req = Req("r", _tokens(46, 2 * BS + 1))
    eng.prefill(req, [0, 1, 2])
    eng.worker.session.client().flush()  # the reserve's answer read
    assert _active_leases(d.address) == 1
    time.sleep(1.6)  # past half of its life: not trusted for a forward any more
    eng.step()  # an idle step: no call but the release (one message)
    with Client(d.address) as c:
        _wait_until(lambda: c.stats().active_leases == 0, what="the release")
        assert c.stats().expired_leases == 0  # released, not left to expire
    # the next store step prepares (and asks for a new reserve)
    next_id = [3]
    while req.num_tokens < 3 * BS + 1:
        _decode(eng, req, next_id)
    assert _stored(d.address, eng, req) == [eng.block_bytes(i) for i in (0, 1, 2)]


def test_daemon_killed_mid_step_with_reserved_slots_degrades_to_recompute(daemon_factory):
    d = daemon_factory("dies", tcp=False)
    eng = Engine(d.address, seed=47)
    req = Req("r", _tokens(47, 2 * BS + 1))
    eng.prefill(req, [0, 1, 2])
    req.all_token_ids += [7] * (BS - 1)
    req.rehash()
    plan = eng.scheduler.build_plan([], [RunningRequest("r", None, False, 3 * BS - 1)], {"r": 1})
    eng.worker.start_step(plan)  # slots from the reserve
    d.kill()
    eng.worker.finish_step()  # no exception: the save is dropped
    assert eng.worker.counters.saved_blocks == 2
    assert eng.worker.counters.save_dropped_blocks == 1
    d.start()  # same socket and region file, empty
    again = Req("again", _tokens(48, 2 * BS + 1))
    deadline = time.monotonic() + 10
    while True:  # the session comes back on its own; no reserve of the dead daemon is used
        eng.prefill(Req("again", list(again.all_token_ids)), [10, 11, 12])
        if _stored(d.address, eng, again) == [eng.block_bytes(i) for i in (10, 11)]:
            break
        assert time.monotonic() < deadline, "never stored again"
        time.sleep(0.1)
    eng.worker.close()
    _wait_until(lambda: _active_leases(d.address) == 0, what="no lease left")
