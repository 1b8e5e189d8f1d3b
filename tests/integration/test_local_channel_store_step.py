"""The connector worker's store step over the lean channel, against real daemons:
a step that never finishes (its forward failed) gives its slots back at the
next step, not when its lease runs out; blocks a step has just loaded are not
asked for again (a restore step makes no PrepareStore for them).
"""

from __future__ import annotations

import pytest

from kvstore import local_wire
from kvstore.client import Client

BLOCK = 4096


# ---------------------------------------------------------------- the connector's worker


@pytest.fixture
def engine_parts():
    pytest.importorskip("torch")
    from tests.integration import test_vllm_connector_daemon as parts

    return parts


def test_a_step_that_never_finished_gives_its_slots_back_at_the_next(daemon, engine_parts):
    p = engine_parts
    eng = p.Engine(daemon.address, seed=22)
    req = p.Req("r", p._tokens(22, 3 * p.BS + 1))
    eng.scheduler.hit_tokens(req, 0)
    eng.scheduler.after_alloc(req, [1, 2, 3, 4], 0)
    plan = eng.scheduler.build_plan([p.NewRequest("r", [1, 2, 3, 4], 0)], [], {"r": req.num_tokens})
    eng.worker.start_step(plan)  # the forward then fails: no finish_step
    with Client(daemon.address) as c:
        assert c.stats().active_leases == 1
    eng.worker.start_step(type(plan)())  # the next step
    client = eng.worker.session.client()
    ns = eng.worker.session.namespace(eng.layout.spec(None))
    assert client is not None and ns is not None
    client.lookup(ns, [1])  # answered after the release before it (one connection, in order)
    with Client(daemon.address) as c:
        s = c.stats()
        assert s.active_leases == 0 and s.expired_leases == 0  # released, not expired
        assert s.tiers[0].used_bytes == 0
    assert eng.worker.counters.saved_blocks == 0
    assert eng.worker.counters.save_dropped_blocks == 3


def test_blocks_just_loaded_are_not_asked_for_again(daemon, engine_parts):
    p = engine_parts
    a, b = p.Engine(daemon.address, seed=23), p.Engine(daemon.address, seed=24)
    req = p.Req("r", p._tokens(23, 3 * p.BS + 1))
    a.prefill(req, [0, 1, 2, 3])
    assert b.scheduler.hit_tokens(req, 0) == 3 * p.BS
    b.scheduler.after_alloc(req, [5, 6, 7, 8], 3 * p.BS)
    plan = b.scheduler.build_plan([p.NewRequest("r", [5, 6, 7, 8], 3 * p.BS)], [], {"r": 1})
    assert sum(len(s.block_ids) for s in plan.saves) == 3  # the first step saves all it holds
    client = b.worker.session.client()
    assert client is not None and b.worker.session.namespace(b.layout.spec(None)) is not None
    sent = client.local.frames_sent
    b.worker.start_step(plan)
    b.worker.finish_step()
    # A direct load (docs/presence.md): one unanswered loaded_direct (queued: sent
    # by the notices' thread or by this flush), no PrepareLoad, no Release; no
    # PrepareStore for the 3 blocks it just loaded.
    client.flush()
    assert client.local.frames_sent == sent + 1
    assert b.worker.counters.loaded_blocks == b.worker.counters.direct_loaded_blocks == 3
    assert b.worker.counters.save_skipped_blocks == 3
    assert b.worker.take_load_errors() == set()


def test_lean_calls_are_counted_per_method_and_status(daemon_factory):
    """The lean server keeps its labelled metric children: every call still counts,
    under its own method and status code."""
    import urllib.request

    import numpy as np

    from kvstore import errors
    from tests.conftest import make_spec

    d = daemon_factory(metrics=True)

    def series(name: str) -> dict[str, float]:
        body = urllib.request.urlopen(f"http://{d.metrics_address}/metrics", timeout=5).read()
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in body.decode().splitlines()
            if line.startswith(name + "{")
        }

    # map_region=False: lookups are lean calls, not probes of the presence table
    with Client(d.address, map_region=False) as c:
        assert c.using_local_channel
        ns = c.declare_namespace(make_spec(4096))
        for _ in range(3):
            c.lookup(ns, np.arange(4, dtype=np.uint64))
        c.clear(ns)  # dropped: the next lookup is NOT_FOUND (then declared again)
        with pytest.raises(errors.NamespaceNotFound):
            c.local.call(lambda seq: local_wire.Lookup(seq, ns.namespace_id, b""))
    got = series("kvstore_rpc_requests_total")
    assert got['kvstore_rpc_requests_total{code="OK",method="Lookup"}'] == 3
    assert got['kvstore_rpc_requests_total{code="NOT_FOUND",method="Lookup"}'] == 1
    assert (
        series("kvstore_rpc_duration_seconds_count")[
            'kvstore_rpc_duration_seconds_count{method="Lookup"}'
        ]
        == 4
    )
