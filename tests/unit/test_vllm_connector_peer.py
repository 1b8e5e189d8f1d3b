"""The connector's peer hint without vLLM: parsing, and the scheduler side pulling
through real daemons (peer transfer over the gRPC stream here; NIXL, with a real
vLLM, in tests/integration/test_vllm_e2e.py::test_peer_pull_then_hit)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import ConfigError
from kvstore.hashing import BlockHasher, to_int_hashes
from kvstore_bench.ports import dead_address
from kvstore_connectors.vllm.config import ConnectorConfig
from kvstore_connectors.vllm.namespace import EngineLayout
from kvstore_connectors.vllm.peer import PeerTarget, peer_hint, pull_ticket, wants_hand_over
from kvstore_connectors.vllm.scheduler import SchedulerSide
from kvstore_connectors.vllm.session import DaemonSession

BS = 16
SECRET = "peer-hint-secret"
LAYOUT = EngineLayout(
    model="tiny",
    dtype="float32",
    block_size_tokens=BS,
    num_layers=1,
    num_kv_heads=1,
    head_dim=32,
    block_bytes=4096,
    page_layout="vllm-cpu-LBHNC",
)


@dataclass
class Req:
    """The fields of vLLM's Request the scheduler side reads."""

    request_id: str
    all_token_ids: list[int]
    kv_transfer_params: Any = None
    cache_salt: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.block_hashes = BlockHasher(BS).hash_tokens(self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.all_token_ids)

    def int_hashes(self) -> list[int]:
        return to_int_hashes(self.block_hashes).tolist()


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, 30000, n).tolist()


def _blocks(hashes: list[int]) -> np.ndarray:
    return np.stack(
        [np.random.default_rng(h).integers(0, 256, LAYOUT.block_bytes, np.uint8) for h in hashes]
    )


def _put(address: str, hashes: list[int]) -> None:
    with Client(address) as c:
        ns = c.declare_namespace(LAYOUT.spec(None))
        assert c.put(ns, hashes, _blocks(hashes)).stored == len(hashes)


def _scheduler(address: str, clock: Clock | None = None, **extra: Any) -> SchedulerSide:
    config = ConnectorConfig.from_extra(
        {"address": address, "retry_initial_s": 1.0, "retry_max_s": 4.0, **extra}
    )
    session = DaemonSession(
        address, timeout_s=config.timeout_s, retry_initial_s=1.0, retry_max_s=4.0, map_region=False
    )
    return SchedulerSide(config, LAYOUT, session, hash_stride=1, clock=clock or Clock())


def _peer_settings(**peers: str) -> dict[str, str]:
    return {
        "peer.enabled": "true",
        "peer.secret": SECRET,
        "peer.transport": "grpc_stream",  # NIXL-free here; the vLLM e2e test uses NIXL
        **{f"peer.peers.{node}": address for node, address in peers.items()},
    }


# ------------------------------------------------------------------ parsing


def test_request_hint_wins_over_the_default_and_ports_mean_addresses():
    assert peer_hint({"kvstore_peer": "node-a"}, "node-z") == PeerTarget(node_id="node-a")
    assert peer_hint({"kvstore_peer": " 10.0.0.7:50051 "}, "") == PeerTarget(
        address="10.0.0.7:50051"
    )
    assert peer_hint(None, "node-z") == PeerTarget(node_id="node-z")
    assert peer_hint({"other": 1}, "127.0.0.1:9") == PeerTarget(address="127.0.0.1:9")
    assert peer_hint({"other": 1}, "") is None
    assert peer_hint(None, "") is None


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"kvstore_peer": 7}, "must be a non-empty string"),
        ({"kvstore_peer": "  "}, "must be a non-empty string"),
        (["node-a"], "kv_transfer_params is list, not a dict"),
    ],
)
def test_malformed_hints_fall_back_to_the_default_with_a_warning(params, message, caplog):
    with caplog.at_level(logging.WARNING, logger="kvstore_connectors.vllm.peer"):
        assert peer_hint(params, "") is None
        assert peer_hint(params, "node-z") == PeerTarget(node_id="node-z")
    assert message in caplog.text


@pytest.mark.parametrize(
    "value", [7, "", "not base64!", "x" * (8 << 20) + "==", b"raw bytes", ["a"]]
)
def test_malformed_tickets_are_ignored_with_a_warning(value, caplog):
    with caplog.at_level(logging.WARNING, logger="kvstore_connectors.vllm.peer"):
        assert pull_ticket({"kvstore_ticket": value}) == b""
    assert "must be the base64 of a HandOver ticket" in caplog.text


def test_tickets_and_hand_over_requests_are_read_from_the_params():
    assert pull_ticket({"kvstore_ticket": "S1ZUMQ=="}) == b"KVT1"
    assert pull_ticket(None) == pull_ticket({"kvstore_peer": "node-a"}) == b""
    assert wants_hand_over({"kvstore_hand_over": True})
    # llm-d's sidecar asks a prefill engine this way (the rest as it sends them).
    llm_d = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert wants_hand_over(llm_d)
    for params in (
        None,
        {},
        {"kvstore_hand_over": 1},
        {"kvstore_hand_over": "yes"},
        ["x"],
        {**llm_d, "do_remote_decode": False},
        {"do_remote_decode": "true"},
        {"do_remote_prefill": True},  # a decode request of vLLM's NIXL protocol
    ):
        assert not wants_hand_over(params)


def test_peer_config_is_checked():
    config = ConnectorConfig.from_extra({"peer": "node-a", "peer_timeout_s": 0.5})
    assert (config.peer, config.peer_timeout_s) == ("node-a", 0.5)
    assert ConnectorConfig.from_extra(None).peer_timeout_s == 2.0
    for bad in (0, -1, 31):
        with pytest.raises(ConfigError, match=r"peer_timeout_s must be in \(0, 30\]"):
            ConnectorConfig.from_extra({"peer_timeout_s": bad})


# ------------------------------------------------------------------ with daemons


def test_hinted_request_pulls_the_missing_blocks_then_counts_them(daemon_factory):
    a = daemon_factory("node-a", settings=_peer_settings())
    b = daemon_factory("node-b", settings=_peer_settings(**{"node-a": a.tcp_address}))
    req = Req("r1", _tokens(1, 6 * BS + 5), {"kvstore_peer": "node-a"})  # 6 full blocks
    hashes = req.int_hashes()
    _put(a.address, hashes[:5])  # A has 5 of them
    _put(b.address, hashes[:1])  # B only the first
    sched = _scheduler(b.address)

    # vLLM's local cache covered block 0: B's daemon has block 0 (ignored), A blocks 1-4.
    assert sched.hit_tokens(req, BS) == 4 * BS
    c = sched.counters
    assert (c.lookups, c.peer_fetches, c.peer_fetch_failures) == (1, 1, 0)
    assert (c.peer_fetched_blocks, c.peer_hit_blocks, c.hit_blocks) == (4, 4, 4)
    assert c.peer_nixl_fetched_blocks == 0  # the gRPC stream moved them here
    with Client(b.address) as client:
        ns = client.declare_namespace(LAYOUT.spec(None))
        got = client.get(ns, hashes)
        assert got.found == 5
        np.testing.assert_array_equal(got.data, _blocks(hashes[:5]))

    # Asked again (vLLM may): 5 are local now; the 6th is asked for again, A lacks it too.
    assert sched.hit_tokens(req, 0) == 5 * BS
    assert (c.peer_fetches, c.peer_fetched_blocks, c.peer_hit_blocks) == (2, 4, 4)

    # No hint, no default: the local answer only, no pull.
    other = Req("r2", _tokens(2, 3 * BS + 1))
    _put(a.address, other.int_hashes())
    assert sched.hit_tokens(other, 0) == 0
    assert c.peer_fetches == 2
    # The connector-wide default applies to requests without a hint; an address works too.
    by_default = _scheduler(b.address, peer=a.tcp_address)
    assert by_default.hit_tokens(other, 0) == 3 * BS
    assert by_default.counters.peer_fetched_blocks == 3


def test_a_finished_prefill_hands_its_blocks_over_and_decode_reads_them(daemon_factory):
    """The P/D split through two schedulers: the prefill side's finished request
    answers a ticket; the decode side's request carries it (no kvstore_peer: the
    ticket names node-a) and its daemon reads the handed-over pin."""
    a = daemon_factory("node-a", settings=_peer_settings())
    b = daemon_factory("node-b", settings=_peer_settings(**{"node-a": a.tcp_address}))
    tokens = _tokens(5, 5 * BS + 3)  # 5 full blocks
    prefill = Req("p1", tokens, {"kvstore_hand_over": True})
    hashes = prefill.int_hashes()
    _put(a.address, hashes)  # what the prefill engine's workers stored
    sched_a = _scheduler(a.address)
    assert sched_a.hit_tokens(prefill, 0) == 5 * BS
    prefill.num_computed_tokens = len(tokens)  # type: ignore[attr-defined]
    params = sched_a.hand_over(prefill)
    assert params is not None and set(params) == {"kvstore_ticket"}
    assert (sched_a.counters.hand_overs, sched_a.counters.hand_over_blocks) == (1, 5)
    assert sched_a.finished(prefill) is False
    # A request that does not ask, or has no blocks: nothing handed over.
    plain = Req("p2", tokens)
    sched_a.hit_tokens(plain, 0)
    plain.num_computed_tokens = len(tokens)  # type: ignore[attr-defined]
    assert sched_a.hand_over(plain) is None
    assert sched_a.counters.hand_overs == 1

    sched_b = _scheduler(b.address)
    decode = Req("d1", tokens, params)
    assert sched_b.hit_tokens(decode, BS) == 4 * BS  # vLLM's own cache had block 0
    c = sched_b.counters
    assert (c.peer_fetches, c.peer_ticket_fetches, c.peer_fetch_failures) == (1, 1, 0)
    assert (c.peer_fetched_blocks, c.peer_hit_blocks) == (4, 4)
    with Client(b.address) as client:
        ns = client.declare_namespace(LAYOUT.spec(None))
        got = client.get(ns, hashes[1:5])
        np.testing.assert_array_equal(got.data, _blocks(hashes[1:5]))
        peer = {p.transport: p for p in client.stats().peer}
        assert peer["grpc_stream"].handed_over_pulls == 1
    with Client(a.address) as client:
        peer = {p.transport: p for p in client.stats().peer}
        assert peer["grpc_stream"].serve_pins == 1  # the hand-over: no pin asked by node-b


def test_unreachable_or_unknown_peer_means_no_extra_hit_and_keeps_the_daemon(
    daemon_factory, caplog
):
    b = daemon_factory("node-b", settings=_peer_settings())
    clock = Clock()
    sched = _scheduler(b.address, clock)
    dead = dead_address()
    req = Req("r1", _tokens(3, 4 * BS + 2), {"kvstore_peer": dead})
    _put(b.address, req.int_hashes()[:1])
    with caplog.at_level(logging.WARNING, logger="kvstore_connectors.vllm.scheduler"):
        assert sched.hit_tokens(req, 0) == BS  # the local block, nothing more
        # Within the retry wait the dead peer is not asked again.
        assert sched.hit_tokens(Req("r2", req.all_token_ids, {"kvstore_peer": dead}), 0) == BS
        clock.now_s += 1.5
        assert sched.hit_tokens(Req("r3", req.all_token_ids, {"kvstore_peer": dead}), 0) == BS
        unknown = Req("r4", req.all_token_ids, {"kvstore_peer": "node-nowhere"})
        assert sched.hit_tokens(unknown, 0) == BS
    c = sched.counters
    assert (c.peer_fetches, c.peer_fetch_failures, c.peer_fetches_skipped) == (3, 3, 1)
    assert c.peer_hit_blocks == 0
    # One warning per failing peer, not per request; the local daemon was never given up.
    assert caplog.text.count(f"from peer {dead} failed") == 1
    assert caplog.text.count("from peer node-nowhere failed") == 1
    assert "unknown peer" in caplog.text
    assert sched.session.failures == 0 and sched.session.connected
    assert sched.hit_tokens(Req("r5", req.all_token_ids), 0) == BS
