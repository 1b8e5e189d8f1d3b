"""A minimal real HTTP engine for router tests that need no model: the endpoints
`kvstore router` calls on a vLLM server, served over TCP on port 0.

- ``GET /metrics``: vLLM's gauges the router reads (``vllm:num_requests_running``,
  ``_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:cache_config_info`` with the
  block size and hash algorithm), from :attr:`Engine.running` etc., so a test
  sets the load the router sees; one ``engine`` label per DP rank (``dp_ranks``),
  as vLLM labels each rank's engine core;
- ``GET /v1/models``: one model;
- ``POST /tokenize``: words ``w<N>`` -> token id N + 2 (the tiny vocabulary's);
- ``POST /v1/completions``: an answer naming the engine (``text = "<node>"``), so
  a test sees which engine the router really forwarded to; held while
  :attr:`Engine.gate` is clear (then counted in the running gauge). Each one's
  request headers are kept (:attr:`Engine.headers`).

It stands in for vLLM only where what is under test is the router's decision
(made by the real indexer) and its forwarding; tests of the engine path use
real vLLM servers (tests/integration/test_router_vllm.py).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Engine:
    def __init__(
        self, node: str, *, model: str = "tiny", block_size: int = 16, dp_ranks: int = 1
    ) -> None:
        self.node = node
        self.dp_ranks = dp_ranks
        self.headers: list[dict[str, str]] = []
        """Each completion's request headers (names lower-cased)."""
        self.model = model
        self.block_size = block_size
        self.running = 0.0
        self.waiting = 0.0
        self.kv_usage = 0.0
        self.completions: list[dict] = []
        self.gate = threading.Event()
        """Completions wait until it is set (clear it to hold them: real in-flight
        requests, counted in the running gauge)."""
        self.gate.set()
        self.set_cookie = ""
        """A ``Set-Cookie`` value completions answer with ("" = none)."""
        self.active = 0
        self._lock = threading.Lock()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                if engine.set_cookie and self.path == "/v1/completions":
                    self.send_header("Set-Cookie", engine.set_cookie)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self._send(200, engine.metrics().encode(), "text/plain")
                elif self.path == "/v1/models":
                    data = [{"id": engine.model, "root": engine.model, "max_model_len": 4096}]
                    self._send(200, json.dumps({"object": "list", "data": data}).encode())
                else:
                    self._send(404, b"{}")

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                if self.path == "/tokenize":
                    words = str(body.get("prompt", "")).split()
                    ids = [int(w[1:]) + 2 for w in words if w.startswith("w") and w[1:].isdigit()]
                    out = {"tokens": ids, "count": len(ids), "max_model_len": 4096}
                    self._send(200, json.dumps(out).encode())
                elif self.path == "/v1/completions":
                    with engine._lock:
                        engine.completions.append(body)
                        engine.headers.append({k.lower(): v for k, v in self.headers.items()})
                        engine.active += 1
                    try:
                        engine.gate.wait(120)
                    finally:
                        with engine._lock:
                            engine.active -= 1
                    out = {
                        "id": f"cmpl-{engine.node}",
                        "object": "text_completion",
                        "model": engine.model,
                        "choices": [{"index": 0, "text": engine.node, "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1},
                    }
                    self._send(200, json.dumps(out).encode())
                else:
                    self._send(404, b"{}")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def metrics(self) -> str:
        gauges = "".join(
            f'vllm:num_requests_running{{engine="{r}"}} {(self.running + self.active) if r == 0 else 0}\n'
            f'vllm:num_requests_waiting{{engine="{r}"}} {self.waiting if r == 0 else 0}\n'
            f'vllm:kv_cache_usage_perc{{engine="{r}"}} {self.kv_usage}\n'
            for r in range(self.dp_ranks)
        )
        return (
            gauges + f'vllm:cache_config_info{{block_size="{self.block_size}",'
            f'prefix_caching_hash_algo="sha256"}} 1.0\n'
        )

    def served(self) -> int:
        with self._lock:
            return len(self.completions)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
