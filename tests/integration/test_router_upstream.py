"""The router's forwarding hop (kvstore.router.upstream, the lean HTTP/1.1 client):
against a real HTTP/1.1 engine over TCP whose completions misbehave as a test
says (``ScriptedEngine``), through the real router process, and the client on
its own where what is checked is inside it (the pool, bounds).

Each test says what bad input it gives and what the user must get.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvstore.errors import BackendError
from kvstore.router.upstream import MAX_HEAD_BYTES, MAX_HEADERS, Upstream
from tests.integration.test_router_vllm import _dechunk, start_router, stop

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("aiohttp") is None, reason="aiohttp missing"),
    pytest.mark.timeout(120),
]

MODELS = json.dumps({"data": [{"id": "tiny", "root": "tiny", "max_model_len": 4096}]}).encode()
METRICS = (
    b'vllm:num_requests_running{engine="0"} 0\nvllm:num_requests_waiting{engine="0"} 0\n'
    b'vllm:kv_cache_usage_perc{engine="0"} 0\n'
    b'vllm:cache_config_info{block_size="16",prefix_caching_hash_algo="sha256"} 1.0\n'
)
ANSWER = json.dumps({"choices": [{"index": 0, "text": "ok"}]}).encode()


def event(i: int) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": str(i)}]}).encode() + b"\n\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def answer(body: bytes, extra: bytes = b"") -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    return head + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


class ScriptedEngine:
    """A raw HTTP/1.1 server on 127.0.0.1:0, a thread per connection, keeping
    connections alive; /metrics and /v1/models answer as vLLM's do, and each
    ``POST /v1/completions`` answers as :attr:`behaviour` says (see ``_complete``)."""

    def __init__(self) -> None:
        self.behaviour = "ok"
        self.attempts: list[tuple[int, int]] = []
        """Each completion received: (connection number, its nth completion there)."""
        self.gate = threading.Event()
        self.peer_closed = threading.Event()
        """Set when a stalled stream's connection was closed by the router."""
        self.closed_conns: list[int] = []
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._conns = 0
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                s, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns += 1
                cid = self._conns
            threading.Thread(target=self._serve, args=(s, cid), daemon=True).start()

    def _serve(self, s: socket.socket, cid: int) -> None:
        f = s.makefile("rb")
        nth = 0
        try:
            while True:
                line = f.readline(65536)
                if not line:
                    return
                _, path, _ = line.split(b" ", 2)
                headers: dict[str, str] = {}
                while (h := f.readline(65536)) not in (b"\r\n", b""):
                    k, _, v = h.decode().partition(":")
                    headers[k.strip().lower()] = v.strip()
                f.read(int(headers.get("content-length", "0")))
                if path == b"/metrics":
                    s.sendall(answer(METRICS))
                elif path == b"/v1/models":
                    s.sendall(answer(MODELS))
                else:
                    nth += 1
                    with self._lock:
                        self.attempts.append((cid, nth))
                    if not self._complete(s, nth):
                        return
        except OSError:
            return
        finally:
            with self._lock:
                self.closed_conns.append(cid)
            s.close()

    def _complete(self, s: socket.socket, nth: int) -> bool:
        """Answer one completion; False: the connection is to be closed."""
        b = self.behaviour
        if b == "ok":
            s.sendall(answer(ANSWER))
        elif b == "ok-close":
            s.sendall(answer(ANSWER, b"Connection: close\r\n"))
            return False
        elif b == "close-reused":  # the keep-alive race, made certain
            if nth > 1:
                return False
            s.sendall(answer(ANSWER))
        elif b == "close-always":
            return False
        elif b == "sse-gated":  # one event, then the rest once the test opens the gate
            s.sendall(SSE_HEAD + chunk(event(0)))
            self.gate.wait(30)
            s.sendall(chunk(event(1)) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        elif b == "stall":  # one event, then silence until the router hangs up
            s.sendall(SSE_HEAD + chunk(event(0)))
            s.settimeout(30)
            with contextlib.suppress(OSError):
                if s.recv(1) == b"":
                    self.peer_closed.set()
            return False
        elif b == "silent":
            s.settimeout(30)
            with contextlib.suppress(OSError):
                s.recv(1)
            return False
        elif b == "garbage":
            s.sendall(b"SMTP ready\r\n\r\n")
        elif b == "huge-head":
            s.sendall(b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * (MAX_HEAD_BYTES + 10) + b"\r\n\r\n")
        elif b == "many-headers":
            s.sendall(
                b"HTTP/1.1 200 OK\r\n"
                + b"".join(b"X-H%d: v\r\n" % i for i in range(MAX_HEADERS + 5))
                + b"Content-Length: 0\r\n\r\n"
            )
        elif b == "bad-chunk":
            s.sendall(SSE_HEAD + chunk(event(0)) + b"zz\r\nnot hex\r\n")
        elif b == "cut-body":  # says 1000 bytes, sends 10 and hangs up
            s.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n0123456789")
            return False
        elif b == "cut-stream":
            s.sendall(SSE_HEAD + chunk(event(0)))
            return False
        elif b == "interim":  # two interim answers, then the final one
            s.sendall(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n")
            s.sendall(answer(ANSWER, b"X-Final: 1\r\n"))
        elif b == "twice":  # a second answer nobody asked for, in the same segment
            s.sendall(answer(ANSWER) + answer(b'{"second": true}'))
        elif b == "interim-flood":
            s.sendall(b"HTTP/1.1 100 Continue\r\n\r\n" * 50)
        else:
            raise AssertionError(b)
        return True

    def close(self) -> None:
        self._stop = True
        self._sock.close()


@pytest.fixture
def engine() -> Iterator[ScriptedEngine]:
    e = ScriptedEngine()
    yield e
    e.gate.set()
    e.close()


def body(stream: bool = False) -> dict:
    return {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "stream": stream}


def router_for(tmp_path, engine: ScriptedEngine, **settings: str):  # type: ignore[no-untyped-def]
    return start_router(
        tmp_path,
        "router",
        {"backends.node-a": engine.url, "strategy": "round-robin", **settings},
    )


def test_a_stale_kept_alive_connection_is_retried_once_on_a_fresh_one(tmp_path, engine):
    """Bad input: the engine closes a kept-alive connection as the next request
    arrives on it, answering nothing (the keep-alive race). Users get 200 (the
    request is sent again, once, on a fresh connection). When the fresh one is
    closed unanswered too: 502 naming the engine, after exactly one retry.
    (aiohttp's client gave this user a 502: it retries only idempotent methods.)"""
    engine.behaviour = "close-reused"
    proc, r = router_for(tmp_path, engine)
    try:
        for _ in range(3):
            status, _, out = r.post("/v1/completions", body())
            assert status == 200, out
        # first on connection 1, second there (closed unanswered) then on 2, ...
        conns = [c for c, _ in engine.attempts]
        assert len(engine.attempts) == 5 and len(set(conns)) == 3, engine.attempts
        assert [n for _, n in engine.attempts] == [1, 2, 1, 2, 1]

        engine.behaviour = "close-always"
        before = len(engine.attempts)
        status, _, err = r.post("/v1/completions", body())
        assert status == 502, err
        assert "node-a" in err["error"]["message"]
        assert "closed the connection before answering" in err["error"]["message"]
        assert len(engine.attempts) == before + 2  # the reused one, then one fresh
    finally:
        stop(proc)


def test_connections_are_kept_alive_and_a_connection_close_answer_is_not_reused(tmp_path, engine):
    """Five completions in a row ride one connection; an answer with
    ``Connection: close`` makes the next request open a new one (never a write
    to a connection the engine said it closes)."""
    proc, r = router_for(tmp_path, engine)
    try:
        for _ in range(5):
            assert r.post("/v1/completions", body())[0] == 200
        assert len({c for c, _ in engine.attempts}) == 1, engine.attempts
        engine.behaviour = "ok-close"
        del engine.attempts[:]
        for _ in range(3):
            assert r.post("/v1/completions", body())[0] == 200
        # the first still rides the kept-alive one (its 6th); each after, a new one
        assert [n for _, n in engine.attempts] == [6, 1, 1]
        assert len({c for c, _ in engine.attempts}) == 3
    finally:
        stop(proc)


def read_until(s: socket.socket, marker: bytes) -> bytes:
    """What the router sent on ``s`` up to and including ``marker`` (its socket
    timeout bounds a hang; a close before it fails)."""
    got = b""
    while marker not in got:
        part = s.recv(65536)
        assert part, got
        got += part
    return got


def test_streamed_events_pass_through_before_the_answer_ends(tmp_path, engine):
    """The engine sends one event and holds the rest: the client must already
    have that event (no buffering of the answer), then the whole stream."""
    engine.behaviour = "sse-gated"
    proc, r = router_for(tmp_path, engine)
    try:
        s = r.connect(timeout_s=30)
        r.send(s, "POST", "/v1/completions", json.dumps(body(stream=True)).encode())
        got = read_until(s, b'"text": "0"')
        assert not engine.gate.is_set()
        engine.gate.set()
        while part := s.recv(65536):
            got += part
        s.close()
        head, _, rest = got.partition(b"\r\n\r\n")
        assert b"content-type: text/event-stream" in head.lower()
        assert b"x-kvstore-backend: node-a" in head.lower()
        assert _dechunk(rest) == event(0) + event(1) + b"data: [DONE]\n\n"
    finally:
        stop(proc)


@pytest.mark.parametrize(
    ("behaviour", "stream", "why"),
    [
        ("garbage", False, "malformed HTTP response"),
        ("huge-head", False, "response head is over"),
        ("many-headers", False, "response headers"),
        ("cut-body", False, "closed the connection mid-response"),
        ("interim-flood", False, "interim answers"),
        ("bad-chunk", True, "malformed HTTP response"),
        ("cut-stream", True, "closed the connection mid-response"),
    ],
)
def test_a_malformed_answer_is_a_502_with_a_clear_message_never_a_hang(
    tmp_path, engine, behaviour, stream, why
):
    """Bad input: a response that is not HTTP, a head past MAX_HEAD_BYTES or
    MAX_HEADERS, a body cut short, an interim 1xx, a bad chunk size, a stream
    cut mid-way. Users get a 502 naming the engine and what was wrong, or (the
    stream already started) an SSE error event then [DONE]; the router serves on."""
    engine.behaviour = behaviour
    proc, r = router_for(tmp_path, engine)
    try:
        status, headers, data = r.request("POST", "/v1/completions", body(stream=stream))
        if not stream:
            assert status == 502, data
            msg = json.loads(data)["error"]["message"]
        else:
            assert status == 200 and headers["content-type"].startswith("text/event-stream")
            assert data.startswith(event(0)), data
            tail = data[len(event(0)) :].decode()
            assert tail.startswith("data: ") and tail.rstrip().endswith("[DONE]"), tail
            msg = json.loads(tail[6:].split("\n\n")[0])["error"]["message"]
        assert "node-a" in msg and why in msg, msg
        engine.behaviour = "ok"
        assert r.post("/v1/completions", body())[0] == 200
    finally:
        stop(proc)


def test_interim_answers_are_skipped_for_the_final_one(tmp_path, engine):
    """100 Continue and 103 Early Hints before the answer: the user gets the
    final answer (as through aiohttp's client), not a 1xx."""
    engine.behaviour = "interim"
    proc, r = router_for(tmp_path, engine)
    try:
        status, _, out = r.request("POST", "/v1/completions", body())
        assert status == 200 and out == ANSWER
        assert r.request("POST", "/v1/completions", body())[2] == ANSWER  # kept alive, in step
        assert len({c for c, _ in engine.attempts}) == 1
    finally:
        stop(proc)


def test_bytes_past_an_answer_leave_it_whole_and_the_connection_unused(tmp_path, engine):
    """Bad input: the engine writes a second answer after the first, unasked.
    The user gets the first answer, untouched (the second is not appended to
    it), and the connection is not reused (it is out of step)."""
    engine.behaviour = "twice"
    proc, r = router_for(tmp_path, engine)
    try:
        for _ in range(2):
            status, _, out = r.request("POST", "/v1/completions", body())
            assert status == 200 and out == ANSWER, out
        assert [n for _, n in engine.attempts] == [1, 1]
    finally:
        stop(proc)


def test_a_silent_engine_is_a_504_and_silence_mid_stream_an_error_event(tmp_path, engine):
    """Bad input: an engine that reads the request and never answers (504 after
    upstream_timeout_s), and one that goes silent after its first event (the
    stream ends with an error event naming the wait, then [DONE])."""
    proc, r = router_for(tmp_path, engine, upstream_timeout_s="0.5")
    try:
        engine.behaviour = "silent"
        t0 = time.monotonic()
        status, _, err = r.post("/v1/completions", body())
        assert status == 504 and "no bytes" in err["error"]["message"], err
        assert time.monotonic() - t0 < 10
        engine.behaviour = "stall"
        status, _, data = r.request("POST", "/v1/completions", body(stream=True))
        assert status == 200 and data.startswith(event(0))
        assert b'"error"' in data and b"no bytes" in data and data.rstrip().endswith(b"[DONE]")
    finally:
        stop(proc)


def test_a_client_gone_mid_stream_closes_the_engines_connection(tmp_path, engine):
    """The client hangs up after the first event: the router closes its
    connection to the engine (vLLM then aborts the request), counted."""
    engine.behaviour = "stall"
    proc, r = router_for(tmp_path, engine)
    try:
        s = r.connect(timeout_s=30)
        r.send(s, "POST", "/v1/completions", json.dumps(body(stream=True)).encode())
        read_until(s, b"data: ")
        s.close()
        assert engine.peer_closed.wait(20), "the engine's connection stayed open"
    finally:
        stop(proc)


def test_idle_connections_close_after_their_timeout_and_reads_are_bounded(engine):
    """The client on its own: an idle connection is closed by us after
    idle_timeout_s (the engine sees it go), at most max_idle are kept, and a
    read past its max_bytes is a BackendError (the connection is not reused)."""

    async def main() -> None:
        up = Upstream(engine.url, connect_timeout_s=2, max_idle=1, idle_timeout_s=0.2)
        try:
            rs = [
                await up.request("POST", "/v1/completions", b"{}", {}, read_timeout_s=5)
                for _ in range(2)
            ]
            for resp in rs:
                assert await resp.read(1 << 20) == ANSWER
                resp.release()
            assert up.opened == 2 and up.idle() == 1  # the second was over max_idle
            deadline = time.monotonic() + 10
            while (up.idle() or len(engine.closed_conns) < 2) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert up.idle() == 0 and len(engine.closed_conns) == 2
            resp = await up.request("POST", "/v1/completions", b"{}", {}, read_timeout_s=5)
            with pytest.raises(BackendError, match="over 10 bytes"):
                await resp.read(10)
            resp.release()
            assert up.idle() == 0 and up.opened == 3
        finally:
            await up.close()

    asyncio.run(main())


def test_an_https_engine_is_verified_against_the_systems_trust(tmp_path, monkeypatch):
    """An https:// engine: answered when its certificate chains to a trusted CA
    (here the test CA, made trusted by SSL_CERT_FILE, as an operator would add
    theirs to the system's store); refused, as a connect failure naming the
    engine, when it does not (the next engine would be tried)."""
    import ssl

    from aiohttp import web

    from kvstore.errors import Unavailable
    from tests.integration.test_tls import make_pki

    pki = make_pki(tmp_path / "pki")

    async def main() -> None:
        async def completions(request: web.Request) -> web.Response:
            return web.Response(body=ANSWER, content_type="application/json")

        app = web.Application()
        app.add_routes([web.post("/v1/completions", completions)])
        runner = web.AppRunner(app)
        await runner.setup()
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(pki / "server.pem", pki / "server.key")
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
        await site.start()
        port = runner.addresses[0][1]
        try:
            up = Upstream(f"https://localhost:{port}", connect_timeout_s=5)
            with pytest.raises(Unavailable, match=f"localhost:{port}.*CERTIFICATE_VERIFY_FAILED"):
                await up.request("POST", "/v1/completions", b"{}", {}, read_timeout_s=5)
            monkeypatch.setenv("SSL_CERT_FILE", str(pki / "ca.pem"))
            up = Upstream(f"https://localhost:{port}", connect_timeout_s=5)
            for _ in range(2):
                resp = await up.request("POST", "/v1/completions", b"{}", {}, read_timeout_s=5)
                assert resp.status == 200 and await resp.read(1 << 20) == ANSWER
                resp.release()
            assert up.opened == 1  # kept alive over TLS too
            await up.close()
        finally:
            await runner.cleanup()

    asyncio.run(main())


@pytest.mark.parametrize("url", ["http://", "ftp://h", "http://h:abc", "http://h:99999"])
def test_an_engine_url_it_cannot_use_is_refused_naming_it(url):
    """Bad input: a backend URL without a host, of another scheme, or with a
    port that is not one: InvalidRequest naming the URL (the router refuses it
    at start, or ignores such an entry of the indexer's list)."""
    from kvstore.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="engine URL"):
        Upstream(url, connect_timeout_s=1)


def test_concurrent_streams_each_get_their_own_answer_and_reuse_the_pool():
    """32 streams at once on one engine (aiohttp's server, chunked SSE, each
    answer naming its request, written in pieces with the loop turning between):
    each gets exactly its own events in order; a second wave rides the 32
    connections the first left idle (none opened)."""
    from aiohttp import web

    async def main() -> None:
        async def sse(request: web.Request) -> web.StreamResponse:
            rid = int(await request.read())
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(5):
                await resp.write(b"data: %d.%d\n\n" % (rid, i))
                await asyncio.sleep(0)
            await resp.write_eof()
            return resp

        app = web.Application()
        app.add_routes([web.post("/v1/completions", sse)])
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        up = Upstream(f"http://127.0.0.1:{runner.addresses[0][1]}", connect_timeout_s=5)

        async def one(rid: int) -> bytes:
            resp = await up.request("POST", "/v1/completions", b"%d" % rid, {}, read_timeout_s=30)
            parts = []
            while part := await resp.next_chunk():
                parts.append(part)
            resp.release()
            return b"".join(parts)

        try:
            for wave in range(2):
                got = await asyncio.gather(*(one(rid) for rid in range(32)))
                for rid, data in enumerate(got):
                    assert data == b"".join(b"data: %d.%d\n\n" % (rid, i) for i in range(5))
                assert up.opened == 32, (wave, up.opened)
            assert up.idle() == 32
        finally:
            await up.close()
            await runner.cleanup()

    asyncio.run(main())


def test_a_connect_timeout_is_a_connect_failure_so_the_next_engine_is_tried():
    """An engine that does not answer the TCP handshake within connect_timeout_s
    (here: a listener whose accept queue is full, so the kernel drops our SYNs) is
    Unavailable, as a refused connection is: nothing was sent, the router marks it
    down and tries the next engine (router.connect_timeout_s says so). It was a
    DeadlineExceeded (504 to the user, no other engine tried) before."""
    import socket

    from kvstore.errors import DeadlineExceeded, Unavailable

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filling = []
    try:
        while True:  # fill the accept queue until a handshake goes unanswered
            s = socket.socket()
            s.settimeout(0.3)
            filling.append(s)
            try:
                s.connect(("127.0.0.1", port))
            except TimeoutError:
                break
            assert len(filling) < 64, "the accept queue never filled"

        async def main() -> None:
            up = Upstream(f"http://127.0.0.1:{port}", connect_timeout_s=0.3)
            t0 = time.monotonic()
            with pytest.raises(Unavailable, match=r"no answer within 0\.3 s") as got:
                await up.request("POST", "/v1/completions", b"{}", {}, read_timeout_s=5)
            assert not isinstance(got.value, DeadlineExceeded)
            assert time.monotonic() - t0 < 5
            await up.close()

        asyncio.run(main())
    finally:
        for s in filling:
            s.close()
        listener.close()
