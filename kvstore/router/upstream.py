"""A lean HTTP/1.1 client for the router's forwarding hop (the request a user waits on).

Why not aiohttp's client here: measured in one process on a kept-alive
connection, aiohttp's ``ClientSession.post`` to the first streamed event cost
0.86-0.91 ms against 0.35 ms for a raw asyncio stream sending the same request
(docs/router.md); the hop's goal is <= 1 ms added. This client is an
``asyncio.Protocol`` per connection with ``httptools`` (llhttp, C) parsing the
response, and nothing else on the path: no cookie jar, no redirects, no
decompression, no proxies, no HTTP/2, no tracing hooks. aiohttp keeps the
router's server side and every call that is not on the per-token path
(``/tokenize``, the prefill call, scrapes, health).

What it does:

- ``http://host:port[/prefix]``, ``https://`` (the system's default trust, as
  aiohttp's default) and ``unix:/path`` engines;
- one bounded pool of kept-alive connections per engine (at most ``max_idle``
  idle ones, LIFO so the warmest is reused, each closed after
  ``idle_timeout_s`` idle, under uvicorn's 5 s keep-alive so the engine rarely
  closes one first); a connection the engine closed, that answered
  ``Connection: close`` (or HTTP/1.0 without keep-alive), or whose answer was
  not read to its end is never reused;
- the keep-alive race: a reused connection that the engine closed before
  answering a single byte (it had decided to close it as the request went
  out) is retried once on a fresh connection;
- Content-Length, chunked and close-delimited bodies, handed out as they
  arrive (``Response.next_chunk``); at most ``MAX_BUFFER_BYTES`` read ahead of
  the caller, then the socket is paused (the client's backpressure reaches the
  engine);
- bounds: the response head (status line and headers) ``MAX_HEAD_BYTES`` and
  ``MAX_HEADERS``; llhttp refuses malformed lines and over-long chunk sizes; a
  buffered ``read`` is bounded by its caller's ``max_bytes``.

Errors (kvstore.errors), chosen so the router can tell them apart:

    Unavailable        could not connect, or not within connect_timeout_s: nothing
                       was sent (another engine may take it)
    DeadlineExceeded   read_timeout_s without a byte from the engine
    BackendError       the engine broke the exchange after the request went out:
                       closed or reset the connection, or answered malformed HTTP
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from collections.abc import Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools

from kvstore.errors import BackendError, DeadlineExceeded, InvalidRequest, Unavailable

MAX_HEAD_BYTES = 64 << 10
"""Largest response head (status line + headers): vLLM's are ~200 bytes."""
MAX_HEADERS = 128
MAX_INTERIM = 8
"""Interim (1xx) answers skipped before the final one."""
MAX_BUFFER_BYTES = 256 << 10
"""Body bytes read ahead of the caller before the socket is paused."""
MAX_IDLE = 64
"""Idle kept-alive connections held per engine (in-flight ones are bounded by the
router's max_inflight: each request holds one connection)."""
IDLE_TIMEOUT_S = 4.0
"""An idle connection is closed after this (uvicorn, vLLM's server, closes its
own after 5 s: closing ours first keeps the keep-alive race rare)."""


class _Conn(asyncio.Protocol):
    """One connection and the response being read on it (at most one at a time)."""

    def __init__(self, pool: Upstream) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.idle_timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.parser: httptools.HttpResponseParser | None = None
        self.answered = False
        """Any byte of a response arrived (a stale connection has none)."""
        self.head_bytes = 0
        self.fed_bytes = 0
        self.header_count = 0
        self.interim = 0
        self.refused: BackendError | None = None
        """Why a callback refused the response (httptools re-raises its own error)."""
        self.head_done = False
        self.done = False
        self.keep_alive = False
        self.framed = False
        """The body has a length or is chunked (else it ends when the engine closes)."""
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None

    # -- the request -------------------------------------------------------------

    def send(self, data: bytes, body: bytes) -> None:
        assert self.transport is not None and self.parser is None
        self._reset()
        self.parser = httptools.HttpResponseParser(self)
        if len(body) <= 65536:
            self.transport.write(data + body)  # one segment for a small request
        else:
            self.transport.write(data)
            self.transport.write(body)

    async def wait(self, timeout_s: float) -> None:
        """Until something new arrived (head, body, end, error), at most ``timeout_s``."""
        loop = asyncio.get_running_loop()
        self.waiter = loop.create_future()
        timer = loop.call_later(timeout_s, self._timed_out, self.waiter, timeout_s)
        try:
            await self.waiter
        finally:
            timer.cancel()
            self.waiter = None

    def _timed_out(self, waiter: asyncio.Future[None], timeout_s: float) -> None:
        if not waiter.done():
            waiter.set_exception(
                DeadlineExceeded(f"no bytes from {self.pool.name} within {timeout_s:g} s")
            )

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()
        self._wake()

    # -- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport subclasses: no isinstance)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None or self.done:
            self._out_of_step()
            return
        self.answered = True
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(BackendError(f"{self.pool.name} answered a protocol upgrade"))
            return
        except httptools.HttpParserError as e:
            if self.done:  # bytes past a complete answer (on_message_begin refused them)
                self._out_of_step()
                return
            self._fail(
                self.refused or BackendError(f"malformed HTTP response from {self.pool.name}: {e}")
            )
            return
        if not self.head_done:
            # A head still incomplete: what llhttp holds of it is bounded by what
            # was fed (one read past the bound at most); on_header counts the rest.
            self.fed_bytes += len(data)
            if self.fed_bytes > MAX_HEAD_BYTES:
                self._fail(self._head_too_large())

    def _out_of_step(self) -> None:
        """Bytes nobody asked for (while idle, or past the answer's end): the
        connection is out of step, never reused; an answer already complete stands."""
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        if self.head_done and not self.done and not self.framed and self.error is None:
            self.done = True  # a close-delimited body ends here
        elif not self.done and self.parser is not None and self.error is None:
            why = f": {exc}" if exc else ""
            where = "mid-response" if self.answered else "before answering"
            self.error = BackendError(f"{self.pool.name} closed the connection {where}{why}")
        self._wake()

    # -- httptools callbacks ----------------------------------------------------------

    def _refuse(self, exc: BackendError) -> BackendError:
        self.refused = exc
        return exc

    def _head_too_large(self) -> BackendError:
        return BackendError(f"{self.pool.name}'s response head is over {MAX_HEAD_BYTES} bytes")

    def on_message_begin(self) -> None:
        if self.done:  # a second answer to one request: stop parsing it
            raise self._refuse(BackendError(f"{self.pool.name} answered twice"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_bytes += len(name) + len(value) + 4
        self.header_count += 1
        if self.head_bytes > MAX_HEAD_BYTES:
            raise self._refuse(self._head_too_large())
        if self.header_count > MAX_HEADERS:
            raise self._refuse(
                BackendError(f"{self.pool.name} sent over {MAX_HEADERS} response headers")
            )
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        self.status = self.parser.get_status_code()
        if self.status < 200:
            # An interim answer (100 Continue, 103 Early Hints): skipped, as
            # aiohttp's client does; the final one follows on the same parser.
            self.interim += 1
            if self.interim > MAX_INTERIM:
                raise self._refuse(
                    BackendError(f"{self.pool.name} sent over {MAX_INTERIM} interim answers")
                )
            self.headers = {}
            return
        self.framed = (
            "content-length" in self.headers
            or "chunked" in self.headers.get("transfer-encoding", "").lower()
        )
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > MAX_BUFFER_BYTES and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        assert self.parser is not None
        if not self.head_done:
            return  # the end of an interim answer
        self.keep_alive = self.parser.should_keep_alive()
        self.done = True
        self._wake()

    # -- the body, for Response ----------------------------------------------------------

    def take(self) -> bytes:
        data = self.body.popleft() if len(self.body) == 1 else b"".join(self.body)
        self.body.clear()
        self.buffered = 0
        if self.paused and self.transport is not None and not self.lost:
            self.paused = False
            self.transport.resume_reading()
        return data


class Response:
    """An engine's answer: status and headers read, the body still coming.

    Read it with ``next_chunk`` (streaming) or ``read`` (bounded), then
    ``release`` (its connection goes back to the pool if the answer was read to
    its end and may be kept alive) or ``close`` (the connection is closed: the
    engine sees its client go away and aborts)."""

    __slots__ = ("_conn", "_pool", "_timeout_s", "headers", "status")

    def __init__(self, pool: Upstream, conn: _Conn, timeout_s: float) -> None:
        self._pool, self._conn, self._timeout_s = pool, conn, timeout_s
        self.status = conn.status
        self.headers = conn.headers
        """Response headers, names lower-cased (a repeated name: its last value)."""

    @property
    def content_type(self) -> str:
        """The media type without parameters (aiohttp's default when none is given)."""
        value = self.headers.get("content-type", "")
        return value.partition(";")[0].strip().lower() or "application/octet-stream"

    async def next_chunk(self) -> bytes:
        """The body bytes that arrived since the last call, waiting for some
        (at most ``read_timeout_s``); b"" at the end of the body."""
        c = self._conn
        while True:
            if c.body:
                return c.take()
            if c.error is not None:
                raise c.error
            if c.done:
                return b""
            await c.wait(self._timeout_s)

    async def read(self, max_bytes: int) -> bytes:
        """The whole body; BackendError past ``max_bytes``."""
        parts: list[bytes] = []
        size = 0
        while chunk := await self.next_chunk():
            size += len(chunk)
            if size > max_bytes:
                self.close()
                raise BackendError(f"{self._pool.name}'s answer is over {max_bytes} bytes")
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        self._pool.release(self._conn)

    def close(self) -> None:
        self._conn.keep_alive = False
        self._pool.release(self._conn)


class Upstream:
    """One engine's kept-alive HTTP/1.1 connections and the requests sent on them."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float,
        max_idle: int = MAX_IDLE,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        self.name = url
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self.idle_timeout_s = idle_timeout_s
        self._ssl: ssl.SSLContext | None = None
        if url.startswith("unix:"):
            self._path: str | None = url[len("unix:") :]
            self._host, self._port, self._prefix = "localhost", 0, ""
            host_header = "localhost"
        else:
            u = urlsplit(url)
            try:
                port = u.port
            except ValueError:  # not a number, or past 65535
                port = -1
            if u.scheme not in ("http", "https") or not u.hostname or port == -1:
                raise InvalidRequest(
                    f"engine URL {url!r}: http://host[:port], https://host[:port] or unix:/path"
                )
            self._path = None
            self._host = u.hostname
            self._port = port or (443 if u.scheme == "https" else 80)
            self._prefix = u.path.rstrip("/")
            host_header = u.netloc.rpartition("@")[2]
            if u.scheme == "https":
                self._ssl = ssl.create_default_context()
        self._host_line = f"Host: {host_header}\r\n".encode("latin-1")
        self._idle: list[_Conn] = []
        self._closed = False
        self.opened = 0
        """Connections opened so far (tests and the bench read it: reuse works)."""
        self.stale_retries = 0
        """Requests retried on a fresh connection after a reused one was found closed."""

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                if self._path is not None:
                    _, conn = await loop.create_unix_connection(lambda: _Conn(self), self._path)
                else:
                    _, conn = await loop.create_connection(
                        lambda: _Conn(self),
                        self._host,
                        self._port,
                        ssl=self._ssl,
                        server_hostname=self._host if self._ssl is not None else None,
                    )
        except TimeoutError:
            # Not a DeadlineExceeded: nothing was sent, so the engine counts as down
            # and the next one may take the request (router.connect_timeout_s).
            raise Unavailable(
                f"connecting to {self.name}: no answer within {self.connect_timeout_s:g} s"
            ) from None
        except OSError as e:  # refused, no such socket, unreachable, TLS refused
            raise Unavailable(f"connecting to {self.name}: {e}") from None
        self.opened += 1
        return conn

    def _take_idle(self) -> _Conn | None:
        while self._idle:
            conn = self._idle.pop()
            if conn.idle_timer is not None:
                conn.idle_timer.cancel()
                conn.idle_timer = None
            if not conn.lost and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    def _head(self, method: str, path: str, body: bytes, headers: Mapping[str, str]) -> bytes:
        lines = [f"{method} {self._prefix}{path} HTTP/1.1\r\n".encode("latin-1"), self._host_line]
        for k, v in headers.items():
            if "\r" in v or "\n" in v or "\r" in k or "\n" in k or ":" in k:
                raise InvalidRequest(f"header {k!r}: a line break or colon where none may be")
            lines.append(f"{k}: {v}\r\n".encode("latin-1"))
        lines.append(b"Content-Length: %d\r\n\r\n" % len(body))
        return b"".join(lines)

    async def request(
        self,
        method: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        read_timeout_s: float,
    ) -> Response:
        """Send the request; return once the response's head has arrived."""
        if self._closed:
            raise Unavailable(f"{self.name}: the client is closed")
        head = self._head(method, path, body, headers)
        conn = self._take_idle()
        reused = conn is not None
        if conn is None:
            conn = await self._connect()
        while True:
            conn.send(head, body)
            try:
                while not conn.head_done:
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait(read_timeout_s)
            except BackendError:
                self._discard(conn)
                if reused and not conn.answered and conn.lost:
                    # The keep-alive race: the engine closed this idle connection
                    # as the request went out; it never read it. Once, afresh.
                    self.stale_retries += 1
                    reused = False
                    conn = await self._connect()
                    continue
                raise
            except BaseException:  # a timeout, or our caller cancelled: never reused
                self._discard(conn)
                raise
            return Response(self, conn, read_timeout_s)

    def release(self, conn: _Conn) -> None:
        """Back to the pool if it may carry another request, else closed."""
        if (
            conn.done
            and conn.keep_alive
            and conn.error is None
            and not conn.lost
            and not self._closed
            and len(self._idle) < self.max_idle
        ):
            conn.parser = None
            conn.take()  # an empty body part left: none; resumes a paused socket
            loop = asyncio.get_running_loop()
            conn.idle_timer = loop.call_later(self.idle_timeout_s, self._expire, conn)
            self._idle.append(conn)
        else:
            self._discard(conn)

    def _expire(self, conn: _Conn) -> None:
        conn.idle_timer = None
        self._discard(conn)

    def _discard(self, conn: _Conn) -> None:
        self.forget(conn)
        conn.keep_alive = False
        if conn.transport is not None:
            conn.transport.close()

    def forget(self, conn: _Conn) -> None:
        """Drop ``conn`` from the idle pool (it is closing)."""
        if conn.idle_timer is not None:
            conn.idle_timer.cancel()
            conn.idle_timer = None
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)

    def idle(self) -> int:
        return len(self._idle)

    async def close(self) -> None:
        """Close the idle connections; in-flight ones close when released."""
        self._closed = True
        while self._idle:
            self._discard(self._idle[-1])
