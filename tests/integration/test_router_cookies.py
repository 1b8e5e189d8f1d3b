"""The router keeps no engine cookies: one client's Set-Cookie never rides on the
next client's request (a real router process, the minimal real HTTP engine,
addressed by host name, where a cookie jar would keep it)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.integration._engine_http import Engine
from tests.integration.test_router_ha import completion
from tests.integration.test_router_vllm import start_router, stop

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("aiohttp") is None, reason="aiohttp missing"),
    pytest.mark.timeout(120),
]


def test_an_engines_cookie_is_not_sent_on_later_requests(tmp_path):
    engine = Engine("node-a")
    engine.set_cookie = "session=user-1-secret; Path=/"
    port = engine.url.rsplit(":", 1)[1]
    proc, r = start_router(
        tmp_path,
        "router",
        {"backends.node-a": f"http://localhost:{port}", "strategy": "round-robin"},
    )
    try:
        for _ in range(3):
            status, _, body = r.post("/v1/completions", completion([1, 2, 3]))
            assert status == 200, body
        assert engine.served() == 3
        assert [h.get("cookie") for h in engine.headers] == [None, None, None]
    finally:
        stop(proc)
        engine.close()
