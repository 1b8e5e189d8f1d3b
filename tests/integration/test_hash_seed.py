"""Engines with different hash seeds on one daemon: told at declare time, loudly."""

from __future__ import annotations

import logging

import pytest

from kvstore.client import Client
from kvstore_connectors.vllm.namespace import EngineLayout
from kvstore_connectors.vllm.session import DaemonSession

LAYOUT = dict(
    model="tiny",
    dtype="float32",
    block_size_tokens=32,
    num_layers=2,
    num_kv_heads=2,
    head_dim=32,
    block_bytes=32768,
    page_layout="vllm-cpu-LBHNC",
)


def test_a_second_seed_on_one_daemon_is_reported_and_warned(daemon, caplog) -> None:  # type: ignore[no-untyped-def]
    a = EngineLayout(**LAYOUT, hash_seed="sha256:aaaaaaaaaaaa").spec(None)  # type: ignore[arg-type]
    b = EngineLayout(**LAYOUT, hash_seed="sha256:bbbbbbbbbbbb").spec(None)  # type: ignore[arg-type]
    other_model = EngineLayout(**{**LAYOUT, "model": "other"}, hash_seed="sha256:cccccccccccc")  # type: ignore[arg-type]
    caplog.set_level(logging.WARNING, logger="kvstore.client")
    with Client(daemon.address, map_region=False) as c:
        assert c.declare_namespace(a).sibling_layouts == ()
        assert c.declare_namespace(other_model.spec(None)).sibling_layouts == ()  # other model
        assert not [r for r in caplog.records if "HASH SEED" in r.message]
    # The second engine connects the way the connector does (DaemonSession).
    session = DaemonSession(
        daemon.address, timeout_s=2.0, retry_initial_s=0.5, retry_max_s=1.0, map_region=False
    )
    try:
        ns = session.namespace(b)
        assert ns is not None and ns.sibling_layouts == (a.layout,)
    finally:
        session.close()
    warned = [r for r in caplog.records if "HASH SEED MISMATCH" in r.message]
    assert len(warned) == 1 and r"sha256:aaaaaaaaaaaa" in warned[0].message, caplog.text
    assert "sha256:bbbbbbbbbbbb" in warned[0].message
    # The daemon logs it once, when the second seed's namespace appears.
    with Client(daemon.address, map_region=False) as c:
        assert c.declare_namespace(a).sibling_layouts == (b.layout,)
    log = daemon.log_path.read_text()
    assert log.count("differs from 1 other namespace(s) only in its layout") == 1, log


@pytest.mark.parametrize("seed", ["", "sha256:aaaaaaaaaaaa"])
def test_no_warning_when_seeds_agree(daemon, caplog, seed: str) -> None:  # type: ignore[no-untyped-def]
    spec = EngineLayout(**LAYOUT, hash_seed=seed).spec(None)  # type: ignore[arg-type]
    caplog.set_level(logging.WARNING, logger="kvstore.client")
    with Client(daemon.address, map_region=False) as c1, Client(daemon.address) as c2:
        assert c1.declare_namespace(spec).sibling_layouts == ()
        assert c2.declare_namespace(spec).sibling_layouts == ()
    assert "HASH SEED" not in caplog.text
