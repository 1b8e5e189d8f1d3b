"""The vLLM connector end to end: a real vLLM CPU build, a tiny random Llama, real daemons.

Each vLLM engine runs in its own child process (tests/integration/vllm_model.py),
so a "restart" is a new process and two engines can share one daemon at once.
Every output is compared with a run of the same prompts without the connector.
Run with the vLLM environment: ``.venv-vllm/bin/python -m pytest -m vllm``.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.v1 import store_pb2
from kvstore_bench.ports import dead_address
from tests.integration import vllm_model as vm

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.timeout(600),
]

BS = vm.BLOCK_SIZE
PREFIX = vm.prompt_ids(100, 5 * BS)  # 5 shared full blocks


def _prompts(
    seed: int, count: int, length: int, prefix: list[int] | None = None
) -> list[list[int]]:
    return [vm.prompt_ids(seed + i, length + 3 * i, prefix or []) for i in range(count)]


# Prompt sets, one per scenario; all are run once without the connector as the reference.
SHARED = _prompts(10, 3, 230, PREFIX)  # restart: a shared prefix + distinct tails
SALTED = _prompts(20, 1, 200)  # tenants
PAIR = _prompts(30, 2, 260)  # two engines on one daemon
BEFORE_KILL = _prompts(40, 2, 200)
DURING_KILL = _prompts(50, 6, 220)
AFTER_RESTART = _prompts(60, 2, 240)
PEER_PREFIX = vm.prompt_ids(700, 4 * BS)
PEER = _prompts(70, 3, 200, PEER_PREFIX)  # stored via node A, read on node B
MAX_TOKENS = 12
DURING_KILL_MAX_TOKENS = 48  # long enough that the kill lands mid-generation
ALL_SETS = {
    "shared": SHARED,
    "salted": SALTED,
    "pair": PAIR,
    "before_kill": BEFORE_KILL,
    "during_kill": DURING_KILL,
    "after_restart": AFTER_RESTART,
    "peer": PEER,
}


def _full_block_tokens(ids: list[int]) -> int:
    """Tokens an external hit can cover: whole blocks, leaving the last token to compute."""
    return (len(ids) - 1) // BS * BS


def _step(prompts: list[list[int]], salt: str | None = None, **kw: Any) -> dict[str, Any]:
    return {
        "prompts": [{"ids": p, "cache_salt": salt} for p in prompts],
        "max_tokens": kw.pop("max_tokens", MAX_TOKENS),
        **kw,
    }


def _spec(
    model_dir: Path, address: str | None, steps: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    spec: dict[str, Any] = {"model_dir": str(model_dir), "steps": steps}
    if address is not None:
        spec["kv_transfer_config"] = vm.kv_transfer_config(address, **extra)
    return spec


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm_e2e")


@pytest.fixture(scope="module")
def model_dir(workdir) -> Path:
    return vm.make_tiny_llama(workdir / "model")


@pytest.fixture(scope="module")
def reference(model_dir, workdir) -> dict[str, list[list[int]]]:
    """Greedy tokens of every prompt set from an engine without the connector."""
    steps = [
        _step(prompts, max_tokens=DURING_KILL_MAX_TOKENS if name == "during_kill" else MAX_TOKENS)
        for name, prompts in ALL_SETS.items()
    ]
    out = vm.run_once(workdir, "reference", _spec(model_dir, None, steps))
    return {name: step["tokens"] for name, step in zip(ALL_SETS, out["steps"], strict=True)}


@pytest.fixture(scope="module")
def restart_runs(model_dir, workdir, tmp_path_factory) -> dict[str, Any]:
    """Run A stores, exits; run B, a new engine on the same daemon, reads."""
    from kvstore.process import DaemonProcess

    daemon = DaemonProcess(tmp_path_factory.mktemp("d_restart"), tcp=False, dram_bytes=128 << 20)
    daemon.start()
    try:
        a = vm.run_once(
            workdir,
            "restart_a",
            _spec(model_dir, daemon.address, [_step(SHARED), _step(SALTED, salt="tenant-a")]),
        )
        stats_after_a = Client(daemon.address, map_region=False).stats()
        b = vm.run_once(
            workdir,
            "restart_b",
            _spec(
                model_dir,
                daemon.address,
                [_step(SHARED), _step(SALTED, salt="tenant-b"), _step(SALTED, salt="tenant-a")],
            ),
        )
    finally:
        daemon.stop()
    return {"a": a, "b": b, "stored_after_a": stats_after_a.stored_blocks}


def test_restart_gets_external_hits_and_same_tokens(restart_runs, reference):
    a, b = restart_runs["a"]["steps"][0], restart_runs["b"]["steps"][0]
    # A computed everything and stored every full block of every prompt.
    assert a["connector"]["scheduler_hit_blocks"] == 0
    distinct = {tuple(p[: i * BS]) for p in SHARED for i in range(1, len(p) // BS + 1)}
    assert restart_runs["stored_after_a"] >= len(distinct)
    assert a["tokens"] == reference["shared"]
    # B, a fresh engine, had every full block of every prompt cached, none computed.
    assert b["num_cached_tokens"] == [_full_block_tokens(p) for p in SHARED]
    assert b["connector"]["worker_loaded_blocks"] >= len(
        {tuple(p[: i * BS]) for p in SHARED for i in range(1, (len(p) - 1) // BS + 1)}
    )
    assert b["connector"]["worker_load_failed_blocks"] == 0
    assert b["tokens"] == reference["shared"]


def test_cache_salt_isolates_tenants(restart_runs, reference):
    other_tenant, same_tenant = restart_runs["b"]["steps"][1], restart_runs["b"]["steps"][2]
    assert other_tenant["num_cached_tokens"] == [0]
    assert other_tenant["connector"]["scheduler_hit_blocks"] == 0
    assert other_tenant["connector"]["worker_loaded_blocks"] == 0
    # The blocks are there: the tenant that stored them gets them.
    assert same_tenant["num_cached_tokens"] == [_full_block_tokens(SALTED[0])]
    assert same_tenant["connector"]["worker_loaded_blocks"] == _full_block_tokens(SALTED[0]) // BS
    assert other_tenant["tokens"] == same_tenant["tokens"] == reference["salted"]


def test_gpu_tier_restart_hits_and_same_tokens(model_dir, workdir, reference, daemon_factory):
    """kv_connector_extra_config tier="gpu": the engine stores into and loads from the
    daemon's GPU pool. In host mode here (gpu.device = "cpu", no CUDA): the same
    connector and daemon code as on a GPU, with a CPU cache and a shared-file pool."""
    daemon = daemon_factory(
        "d_gpu",
        tcp=False,
        dram_bytes=128 << 20,
        settings={"gpu.device": "cpu", "gpu.capacity_bytes": "64MiB", "gpu.chunk_bytes": "4MiB"},
    )
    a = vm.run_once(
        workdir, "gpu_a", _spec(model_dir, daemon.address, [_step(SHARED)], tier="gpu")
    )["steps"][0]
    with Client(daemon.address, map_region=False) as c:
        tiers = {store_pb2.Tier.Name(t.tier): t.blocks for t in c.stats().tiers}
    assert a["connector"]["worker_saved_blocks"] > 0
    assert tiers["TIER_GPU"] == a["connector"]["worker_saved_blocks"] and tiers["TIER_DRAM"] == 0
    b = vm.run_once(
        workdir, "gpu_b", _spec(model_dir, daemon.address, [_step(SHARED)], tier="gpu")
    )["steps"][0]
    assert b["num_cached_tokens"] == [_full_block_tokens(p) for p in SHARED]
    assert b["connector"]["worker_load_failed_blocks"] == 0
    assert a["tokens"] == b["tokens"] == reference["shared"]


def test_two_engines_share_one_daemon(model_dir, workdir, reference, daemon_factory):
    daemon = daemon_factory("d_pair", tcp=False, dram_bytes=128 << 20)
    stored, read = workdir / "pair_stored", workdir / "pair_read"
    first = vm.start_run(
        vm.write_spec(
            workdir / "pair1.spec.json",
            # The first engine stays up until the second has read: both live at once.
            _spec(
                model_dir,
                daemon.address,
                [
                    _step(PAIR, done_file=str(stored)),
                    _step([], wait_for=str(read), wait_timeout_s=400),
                ],
            ),
        ),
        workdir / "pair1.out.json",
        workdir / "pair1.log",
    )
    second = vm.start_run(
        vm.write_spec(
            workdir / "pair2.spec.json",
            _spec(
                model_dir,
                daemon.address,
                [_step(PAIR, wait_for=str(stored), wait_timeout_s=400, done_file=str(read))],
            ),
        ),
        workdir / "pair2.out.json",
        workdir / "pair2.log",
    )
    try:
        out2 = vm.finish_run(second, workdir / "pair2.out.json", workdir / "pair2.log")
    finally:
        read.write_text("done")  # never leave the first engine waiting
    out1 = vm.finish_run(first, workdir / "pair1.out.json", workdir / "pair1.log")
    s1, s2 = out1["steps"][0], out2["steps"][0]
    assert s1["connector"]["worker_saved_blocks"] == sum(len(p) // BS for p in PAIR), (
        s1["connector"],
        out1["kvstore_log"],
    )
    assert s2["num_cached_tokens"] == [_full_block_tokens(p) for p in PAIR]
    assert s2["connector"]["worker_loaded_blocks"] == sum(_full_block_tokens(p) // BS for p in PAIR)
    assert s1["tokens"] == s2["tokens"] == reference["pair"]


def test_daemon_killed_mid_run_generation_completes(model_dir, workdir, reference, daemon_factory):
    daemon = daemon_factory("d_kill", tcp=False, dram_bytes=128 << 20)
    killed_step_done, restarted = workdir / "kill_step_done", workdir / "kill_restarted"
    proc = vm.start_run(
        vm.write_spec(
            workdir / "kill.spec.json",
            _spec(
                model_dir,
                daemon.address,
                [
                    _step(BEFORE_KILL),
                    # The engine SIGKILLs the daemon 50 ms into this generation.
                    _step(
                        DURING_KILL,
                        max_tokens=DURING_KILL_MAX_TOKENS,
                        kill_pid=daemon.pid,
                        kill_after_s=0.05,
                        done_file=str(killed_step_done),
                    ),
                    # Past the connector's reconnect wait (retry_max_s) after the restart.
                    _step(AFTER_RESTART, wait_for=str(restarted), wait_timeout_s=300, delay_s=1.0),
                ],
                retry_initial_s=0.2,
                retry_max_s=0.5,
            ),
        ),
        workdir / "kill.out.json",
        workdir / "kill.log",
    )
    try:
        deadline = time.monotonic() + 400
        while not killed_step_done.exists():
            assert proc.poll() is None, vm._tail(workdir / "kill.log")
            assert time.monotonic() < deadline, "the engine never finished the killed step"
            time.sleep(0.05)
        assert daemon.proc is not None and daemon.proc.poll() is not None, "daemon was not killed"
        daemon.kill()  # reap it
        # Same socket and region file: what a supervisor restarting the daemon does.
        daemon.start()
    finally:
        restarted.write_text("done")
    out = vm.finish_run(proc, workdir / "kill.out.json", workdir / "kill.log")
    before, during, after = out["steps"]
    why = out["kvstore_log"]  # the connector's lines, shown when a count is off
    assert before["connector"]["worker_saved_blocks"] == sum(len(p) // BS for p in BEFORE_KILL), why
    assert before["tokens"] == reference["before_kill"]
    # Generation completed, with the outputs of an engine that never had a cache.
    assert during["tokens"] == reference["during_kill"]
    assert during["connector"]["worker_daemon_failures"] > 0, why
    assert during["connector"]["worker_saved_blocks"] < sum(
        (len(p) + DURING_KILL_MAX_TOKENS) // BS for p in DURING_KILL
    )
    # After the daemon came back the engine reconnected and stores again.
    assert after["tokens"] == reference["after_restart"]
    assert after["connector"]["worker_saved_blocks"] == sum(len(p) // BS for p in AFTER_RESTART), (
        why
    )
    assert after["connector"]["worker_daemon_reconnects"] >= 1, why
    log = (workdir / "kill.log").read_text(errors="replace")
    assert log.count("kvstore: daemon at") <= 2, log  # one warning per side, not one per call
    stats = Client(daemon.address, map_region=False).stats()
    assert stats.stored_blocks == after["connector"]["worker_saved_blocks"]


# ------------------------------------------------------------------ peers (issue 6, case 5)

HAVE_NIXL = any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu12"))
PEER_SECRET = "vllm-e2e-peer-secret"
NIXL_ENV = {"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}


def _usable_blocks(prompts: list[list[int]]) -> int:
    """Distinct blocks an external hit can cover over ``prompts`` (shared prefixes once)."""
    return len({tuple(p[: i * BS]) for p in prompts for i in range(1, (len(p) - 1) // BS + 1)})


@pytest.fixture(scope="module")
def peer_daemons(tmp_path_factory):
    """Node A and node B, peer-enabled over NIXL (forced: no silent gRPC fallback); B lists A."""
    from kvstore.process import DaemonProcess

    def make(name: str, **peers: str) -> DaemonProcess:
        return DaemonProcess(
            tmp_path_factory.mktemp(name),
            name=name,
            dram_bytes=128 << 20,
            settings={
                "peer.enabled": "true",
                "peer.secret": PEER_SECRET,
                "peer.transport": "nixl",
                **{f"peer.peers.{node}": address for node, address in peers.items()},
            },
            env=NIXL_ENV,
        )

    started = []
    try:
        a = make("node-a")
        a.start()
        started.append(a)
        b = make("node-b", **{"node-a": a.tcp_address})
        b.start()
        started.append(b)
        yield a, b
    finally:
        for d in started:
            d.stop()


@pytest.mark.nixl
@pytest.mark.skipif(not HAVE_NIXL, reason="NIXL (nixl-cu12) not installed")
def test_peer_pull_then_hit(model_dir, workdir, reference, peer_daemons):
    a, b = peer_daemons
    dead = dead_address()
    # Node A's engine: its hint names a peer nobody runs, so every lookup comes up
    # short and the pull fails; it computes everything, right, and stores it on A.
    on_a = vm.run_once(workdir, "peer_a", _spec(model_dir, a.address, [_step(PEER)], peer=dead))[
        "steps"
    ][0]
    assert on_a["tokens"] == reference["peer"]
    # (vLLM's own prefix cache may still share PEER_PREFIX between the prompts.)
    ca = on_a["connector"]
    assert ca["scheduler_hit_blocks"] == ca["scheduler_peer_hit_blocks"] == 0
    assert ca["scheduler_peer_fetches"] >= 1
    assert ca["scheduler_peer_fetch_failures"] == ca["scheduler_peer_fetches"]
    assert ca["scheduler_daemon_failures"] == 0  # a dead peer is not a dead daemon
    full = {tuple(p[: i * BS]) for p in PEER for i in range(1, len(p) // BS + 1)}
    assert ca["worker_saved_blocks"] == len(full)  # the shared prefix once
    log_a = (workdir / "peer_a.log").read_text(errors="replace")
    assert log_a.count(f"from peer {dead} failed") == 1, log_a  # one warning, not per request

    # Node B's engine on B's empty daemon, hinted at node A (by node id, from B's
    # [peer] peers): B's daemon pulls the prefix over NIXL, vLLM loads it from B.
    with Client(b.address, map_region=False) as c:
        assert c.stats().stored_blocks == 0
    on_b = vm.run_once(
        workdir, "peer_b", _spec(model_dir, b.address, [_step(PEER)], peer="node-a")
    )["steps"][0]
    cb = on_b["connector"]
    usable = _usable_blocks(PEER)
    assert on_b["num_cached_tokens"] == [_full_block_tokens(p) for p in PEER]
    assert cb["scheduler_peer_fetch_failures"] == 0
    assert cb["scheduler_peer_nixl_fetched_blocks"] == cb["scheduler_peer_fetched_blocks"] == usable
    assert cb["worker_loaded_blocks"] >= usable
    assert cb["worker_load_failed_blocks"] == 0
    assert on_b["tokens"] == reference["peer"]
    with Client(b.address, map_region=False) as c:
        # What B's daemon holds: the pulled blocks, plus the last full block of each
        # prompt that vLLM computed itself (it always computes the last token).
        assert c.stats().stored_blocks == _usable_blocks(PEER) + sum(
            len(p) // BS - (len(p) - 1) // BS for p in PEER
        )
    assert "FALLING BACK" not in b.log_path.read_text(errors="replace")


@pytest.mark.nixl
@pytest.mark.skipif(not HAVE_NIXL, reason="NIXL (nixl-cu12) not installed")
def test_peer_hint_from_sampling_params_reaches_the_scheduler(peer_daemons):
    """vLLM's own Request carries kv_transfer_params from SamplingParams.extra_args
    (what the OpenAI server does with a request's "kv_transfer_params"): a hint
    per request, here by address, makes B's daemon pull over NIXL."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from kvstore.hashing import BlockHasher, to_int_hashes
    from kvstore_connectors.vllm.config import ConnectorConfig
    from kvstore_connectors.vllm.namespace import EngineLayout
    from kvstore_connectors.vllm.scheduler import SchedulerSide
    from kvstore_connectors.vllm.session import DaemonSession

    a, b = peer_daemons
    layout = EngineLayout(
        model="hint-test",
        dtype="float32",
        block_size_tokens=BS,
        num_layers=1,
        num_kv_heads=1,
        head_dim=32,
        block_bytes=8192,
        page_layout="vllm-cpu-LBHNC",
    )
    ids = vm.prompt_ids(900, 3 * BS + 7)
    params = SamplingParams(
        max_tokens=1, extra_args={"kv_transfer_params": {"kvstore_peer": a.tcp_address}}
    )
    request = Request("hinted", ids, params, None)
    request.block_hashes = BlockHasher(BS).hash_tokens(ids)
    hashes = to_int_hashes(request.block_hashes)
    with Client(a.address) as c:
        ns = c.declare_namespace(layout.spec(None))
        data = np.random.default_rng(9).integers(0, 256, (3, layout.block_bytes), np.uint8)
        assert c.put(ns, hashes, data).stored == 3
    config = ConnectorConfig.from_extra({"address": b.address})
    session = DaemonSession(
        b.address, timeout_s=0.5, retry_initial_s=0.5, retry_max_s=1.0, map_region=False
    )
    sched = SchedulerSide(config, layout, session, hash_stride=1)
    try:
        assert request.kv_transfer_params == {"kvstore_peer": a.tcp_address}
        assert sched.hit_tokens(request, 0) == 3 * BS
        assert sched.counters.peer_nixl_fetched_blocks == 3
        with Client(b.address) as c:
            got = c.get(c.declare_namespace(layout.spec(None)), hashes)
            assert got.found == 3
            np.testing.assert_array_equal(got.data, data)
    finally:
        session.close()


def test_llmd_reads_one_chain_per_request_with_tokens_from_a_real_engine(
    model_dir, workdir, reference, daemon_factory
):
    """Issue 23, measured with this engine: a step's saves from three requests reached
    the daemon's stream as one BlockStored with every hash, `token_ids: []` and no
    parent. llm-d's scorer re-hashes token ids from the parent and names the engine by
    the topic: every event must carry its chain's tokens, after its parent."""
    from kvstore.events.wire import BlockStored, full_decoder
    from kvstore_bench.ports import free_port
    from tests.integration._events import EventTap

    pod = "10.0.0.5:8000"
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    daemon = daemon_factory(
        "d_llmd",
        tcp=False,
        dram_bytes=128 << 20,
        settings={
            "events.enabled": True,
            "events.publish_address": endpoint,
            "events.replay_address": "",
            "events.topic_ids": pod,
        },
    )
    tap = EventTap(daemon.address, endpoint, f"kv@{pod}@".encode())
    try:
        out = vm.run_once(workdir, "llmd", _spec(model_dir, daemon.address, [_step(SHARED)]))
        step = out["steps"][0]
        assert step["tokens"] == reference["shared"]
        tap.drain()
    finally:
        tap.close()
    dec = full_decoder()
    stored: list[BlockStored] = []
    for topic, seq, payload in tap.frames:
        assert len(seq) == 8 and topic.startswith(f"kv@{pod}@".encode())
        if not topic.endswith(b"@probe"):
            stored += [e for e in dec.decode(payload).events if isinstance(e, BlockStored)]
    seqs = [int.from_bytes(f[1], "big") for f in tap.frames]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    # every sequence the engine computed, as blocks of tokens
    seqs_blocks = []
    for prompt, gen in zip(SHARED, step["tokens"], strict=True):
        ids = prompt + gen
        seqs_blocks.append([tuple(ids[i : i + BS]) for i in range(0, len(ids) - BS + 1, BS)])
    tokens_of: dict[int, tuple[int, ...]] = {}
    for ev in stored:
        n = len(ev.block_hashes)
        assert len(ev.token_ids) == n * BS, "token ids always sent"
        blocks = [tuple(ev.token_ids[i * BS : (i + 1) * BS]) for i in range(n)]
        # the chain is n consecutive blocks of one sequence, from its parent's position
        where = [
            (s, k)
            for s, sb in enumerate(seqs_blocks)
            for k in range(len(sb) - n + 1)
            if sb[k : k + n] == blocks
        ]
        assert where, "an event's tokens are a run of one request's blocks"
        if ev.parent_block_hash is None:
            assert any(k == 0 for _, k in where)
        else:
            # parents first: the parent was published before, and precedes the run
            parent = tokens_of[int(ev.parent_block_hash)]
            assert any(k > 0 and seqs_blocks[s][k - 1] == parent for s, k in where)
        for h, b in zip(ev.block_hashes, blocks, strict=True):
            tokens_of[int(h)] = b
    assert step["connector"]["worker_saved_blocks"] == len(tokens_of)
    # the shared prefix once, every tail its own chain: at least one event per request
    assert len(stored) >= len(SHARED)
