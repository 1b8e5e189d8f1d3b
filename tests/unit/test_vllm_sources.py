"""vLLM's /kv_event_sources listing -> one indexer source per DP rank (no engine needed;
tests/integration/test_vllm_dp.py reads a real server's)."""

from __future__ import annotations

import pytest

from kvstore.errors import ConfigError
from kvstore.indexer.vllm_sources import engine_sources


def test_engine_sources_from_a_listing() -> None:
    """What /kv_event_sources lists becomes connectable per-rank sources."""
    listed = {
        "1": {"endpoint": "tcp://*:5558", "replay_endpoint": "tcp://*:5568", "topic": ""},
        "0": {"endpoint": "tcp://*:5557", "replay_endpoint": None, "topic": ""},
    }
    got = engine_sources(listed, node="n", model="m", host="10.0.0.5", engine_url="http://e:8000")
    assert [(s.data_parallel_rank, s.endpoint, s.replay_endpoint) for s in got] == [
        (0, "tcp://10.0.0.5:5557", ""),
        (1, "tcp://10.0.0.5:5558", "tcp://10.0.0.5:5568"),
    ]
    assert all(s.kind == "engine" and s.engine_url == "http://e:8000" for s in got)
    # one engine: its cache is the node's, as without DP
    (one,) = engine_sources({"0": {"endpoint": "tcp://h:1"}}, node="n", model="m")
    assert one.data_parallel_rank == -1
    with pytest.raises(ConfigError, match="wildcard"):
        engine_sources(listed, node="n", model="m")
    with pytest.raises(ConfigError, match="no port"):
        engine_sources({"0": {"endpoint": "tcp://h:0"}}, node="n", model="m")
    with pytest.raises(ConfigError, match="rank -> config"):
        engine_sources({"x": {}}, node="n", model="m")
    assert (
        engine_sources({"0": {"endpoint": "tcp://h:1", "publisher": "null"}}, node="n", model="m")
        == []
    )


def test_a_rank_source_on_the_command_line() -> None:
    from kvstore.indexer.config import parse_source

    spec = parse_source("node=n,endpoint=tcp://h:5558,kind=engine,model=m,data_parallel_rank=1")
    assert (spec.data_parallel_rank, spec.kind) == (1, "engine")
    with pytest.raises(ConfigError, match="data_parallel_rank"):
        parse_source("node=n,endpoint=tcp://h:5558,kind=engine,model=m,data_parallel_rank=x")
    with pytest.raises(ConfigError, match="only an engine source"):
        parse_source("node=n,endpoint=tcp://h:5558,data_parallel_rank=0")


def test_fetching_the_listing_over_http_and_its_errors() -> None:
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kvstore.errors import Unavailable
    from kvstore.indexer.vllm_sources import fetch_kv_event_sources

    answers = {"/kv_event_sources": (200, json.dumps({"0": {"endpoint": "tcp://h:1"}}).encode())}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            status, body = answers.get(self.path, (404, b"{}"))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert fetch_kv_event_sources(url) == {"0": {"endpoint": "tcp://h:1"}}
        answers["/kv_event_sources"] = (200, b"not json")
        with pytest.raises(Unavailable, match="not JSON"):
            fetch_kv_event_sources(url)
        answers["/kv_event_sources"] = (200, b"[1, 2]")
        with pytest.raises(Unavailable, match="not an object"):
            fetch_kv_event_sources(url)
        answers["/kv_event_sources"] = (500, b"boom")
        with pytest.raises(Unavailable, match="answered 500"):
            fetch_kv_event_sources(url)
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(Unavailable, match="kv_event_sources"):
        fetch_kv_event_sources(url, timeout_s=2)  # nothing listens there now
    with pytest.raises(ConfigError, match="http://host:port or unix:PATH"):
        fetch_kv_event_sources("ftp://x")
