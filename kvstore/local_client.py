"""The client's end of the lean local channel (kvstore.local_wire): one blocking Unix socket.

``kvstore.client.Client`` opens one per client when its daemon is local (the
socket ``<socket_path>.lean`` exists and answers Hello) and sends its hot-path
calls here; everything else, and everything when this channel cannot be
opened, goes over gRPC.

    ch = LocalChannel.open(path, client_id, timeout_s)
    reply = ch.call(lambda seq: Lookup(seq, ns_id, packed))      # one round trip
    ch.post(Release(0, [lease_id]))                              # no answer wanted
    ch.call_later(lambda seq: CommitStore(seq, ...), on_done)    # answer read later
    ch.calls_later([(commit, on_done), (reserve, on_reserved)])  # both in one frame
    ch.collect()                                                 # wait for those answers

A call that waits for its answer first polls the socket, without sleeping, for
up to ``SPIN_US`` microseconds (``KVSTORE_SPIN_US``; 0: never), then sleeps in
``recv``. A sleeping thread's wake-up costs ~30 µs on these VMs, twice per
round trip counting the daemon's (measured: a bare Unix-socket ping-pong
between two processes, 44 µs p50 blocking, 18 µs with the client polling), and
a daemon's answer to a store or load request takes 100-300 µs to compute: the
poll turns the client's wake-up into a read. The cost is that much CPU of one
core per waited call, only while waiting, bounded; no thread here waits for
an answer it could do without (commits, releases and reserves are sent
without waiting).

Requests queued by ``post`` ride in the next frame (or go at ``flush``). An
answer a ``call_later`` does not wait for is read when the next call reads its
own (the daemon answers in order), at ``collect`` or at ``close``: so a commit
sent without waiting has landed once the client is closed. At most
``MAX_UNANSWERED`` such answers are outstanding (one more waits for the oldest)
and ``MAX_QUEUED`` posted messages (one more sends the queue).

Not thread-safe on its own: Client serialises its use with a lock.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import socket
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvstore import errors
from kvstore.local_wire import (
    HEADER,
    Error,
    Hello,
    HelloReply,
    MapTenant,
    TenantRange,
    reply_decoder,
    request_encoder,
)

log = logging.getLogger(__name__)

MAX_UNANSWERED = 1024
MAX_QUEUED = 1024
# Polled this long for an answer before sleeping (module doc); KVSTORE_SPIN_US overrides.
SPIN_US = 300
RECV_BYTES = 1 << 16


def spin_from_env() -> float:
    """The poll before a waited answer sleeps, in seconds: ``KVSTORE_SPIN_US`` or SPIN_US."""
    raw = os.environ.get("KVSTORE_SPIN_US", "")
    try:
        us = float(raw) if raw else SPIN_US
    except ValueError:
        raise errors.ConfigError(
            f"KVSTORE_SPIN_US={raw!r} is not a number of microseconds"
        ) from None
    if not 0 <= us <= 100_000:
        raise errors.ConfigError(f"KVSTORE_SPIN_US={raw!r}: expected 0 to 100000 microseconds")
    return us / 1e6


OnDone = Callable[[Any], None]  # called with the reply, or the KVStoreError it stands for


def error_of(reply: Error) -> errors.KVStoreError:
    """The exact kvstore.errors class an Error reply names (as errors.error_from_rpc
    rebuilds it from gRPC trailers): the reason chooses the class, never the message."""
    cls = errors.BY_REASON.get(reply.reason, errors.KVStoreError)
    err = cls(f"{cls.status.name}: {reply.message}")
    err.status_code = cls.status
    return err


class LocalChannel:
    def __init__(self, sock: socket.socket, timeout_s: float, spin_s: float | None = None) -> None:
        self._sock = sock
        # Bytes read and not yet decoded: a frame read whole, or part of one. Our
        # own buffer (not a buffered reader's): whether the next answer is already
        # here decides whether to poll for it.
        self._rbuf = bytearray()
        self.spin_s = spin_from_env() if spin_s is None else spin_s
        self.polled_reads = 0  # socket reads whose bytes the poll saw arrive (tests count them)
        # Readable or hung up (quiet()): polled with no wait before a presence probe.
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN | select.POLLPRI)
        self.timeout_s = timeout_s
        self._seq = 0
        self._queued: list[msgspec.Struct] = []
        # (seq, on_done) of answers sent for and not read yet, oldest first
        self._unanswered: collections.deque[tuple[int, OnDone | None]] = collections.deque()
        self.max_frame_bytes = 0
        self.region_id = 0
        self.node_id = ""
        self.ops: frozenset[str] = frozenset()  # optional ops the daemon serves (HelloReply.ops)
        self.presence_path = ""  # the daemon's presence table (HelloReply.presence_path)
        self._pending: collections.deque[Any] = collections.deque()  # read, not yet consumed
        self.broken: errors.KVStoreError | None = None
        # broken while sending: the daemon never got the frame (safe to send again)
        self.failed_unsent = False
        self.frames_sent = 0  # request frames written (tests count them)
        self.waits = 0  # calls that waited for their answer (tests count them)
        self.reserves = False  # the daemon serves reserve_store (HelloReply.reserves)
        self.direct_loads = False  # it serves loaded_direct (HelloReply.direct_loads)
        self.reserve_keep = False  # it serves CommitStore.keep_rest (HelloReply.reserve_keep)

    def quiet(self) -> bool:
        """Nothing to read and not hung up: as far as this connection knows, the
        daemon is up (a killed daemon's end is closed by the kernel at once: the
        socket turns readable, at EOF). One poll(2), no wait."""
        return self.broken is None and not self._unanswered and not self._poll.poll(0)

    def settle(self) -> bool:
        """quiet(), once the answers that have already arrived are read (none waited
        for): a commit sent without waiting whose answer is here no longer keeps a
        presence probe from being trusted (the daemon wrote the table before it
        answered). False while an answer is still out (its commit may not show in
        the table yet), the daemon hung up, or the stream broke. The answers'
        ``on_done`` run here, as in any call that reads them."""
        try:
            while self._unanswered and self.broken is None:
                if not self._pending and not self._frame_end():
                    if not self._poll.poll(0):
                        return False  # still out: the daemon has not answered yet
                    self._take_bytes(socket.MSG_DONTWAIT)
                    continue
                self._read_one()  # a whole answer is here: no wait
        except BlockingIOError:
            return False  # (readable, then nothing: read again next time)
        except OSError as exc:
            self._break(f"reading failed: {exc}")
            return False
        except errors.KVStoreError:
            return False  # the stream broke (self.broken): the next call raises it
        return self.quiet()

    def _frame_end(self) -> int:
        """Where the first whole frame in the read buffer ends; 0: none is whole yet."""
        buf = self._rbuf
        if len(buf) < HEADER.size:
            return 0
        end = HEADER.size + HEADER.unpack_from(buf)[0]
        return end if len(buf) >= end else 0

    @classmethod
    def open(
        cls,
        path: str,
        client_id: str,
        timeout_s: float,
        token: str = "",
        *,
        spin_s: float | None = None,
    ) -> LocalChannel:
        """Connect and Hello; OSError or a KVStoreError when the channel is not usable."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(path)
            ch = cls(sock, timeout_s, spin_s)
            reply = ch.call(lambda seq: Hello(seq, client_id, token=token))
        except BaseException:
            sock.close()
            raise
        assert isinstance(reply, HelloReply)
        ch.max_frame_bytes = reply.max_frame_bytes
        ch.region_id = reply.region_id
        ch.node_id = reply.node_id
        ch.ops = frozenset(reply.ops)
        ch.presence_path = reply.presence_path
        ch.reserves = reply.reserves
        ch.direct_loads = reply.direct_loads
        ch.reserve_keep = reply.reserve_keep
        return ch

    def map_tenant(self, namespace_id: str) -> tuple[TenantRange, int | None]:
        """The namespace's tenant range and, when it has its own, the descriptor of its
        region file (the caller closes it). For a channel of its own that nothing
        else uses (``open`` then this): the answer is read with recvmsg, past the
        buffered reader, for the descriptor it carries."""
        seq = self._next_seq()
        self._send([MapTenant(seq, namespace_id)])
        data = b""
        fds: list[int] = []
        try:
            while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
                want = HEADER.size if len(data) < HEADER.size else HEADER.unpack_from(data)[0]
                chunk, got, _, _ = socket.recv_fds(self._sock, max(want, 1), 1)
                fds += got
                if not chunk:
                    raise self._break("the daemon closed the connection mid-answer")
                data += chunk
            (reply,) = reply_decoder.decode(data[HEADER.size :])
            if isinstance(reply, Error):
                raise error_of(reply)
            if not isinstance(reply, TenantRange) or reply.seq != seq:
                raise self._break("bad answer to map_tenant")
            if reply.nbytes and len(fds) != 1:
                raise errors.Unavailable("the daemon sent no region descriptor")
        except TimeoutError:
            raise self._break(f"no answer within {self.timeout_s}s", deadline=True) from None
        except (OSError, ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            for fd in fds:
                os.close(fd)
            raise self._break(f"map_tenant failed: {exc}") from None
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        if not reply.nbytes:
            for fd in fds:
                os.close(fd)
            return reply, None
        return reply, fds[0]

    # ------------------------------------------------------------ sending

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _send(self, messages: list[msgspec.Struct]) -> None:
        if self.broken is not None:
            raise self.broken
        body = request_encoder.encode(messages)
        if self.max_frame_bytes and len(body) > self.max_frame_bytes:
            # the daemon's own bound, checked here so the link survives
            raise errors.InvalidRequest(
                f"frame of {len(body)} bytes exceeds server.max_message_bytes="
                f"{self.max_frame_bytes}; send fewer blocks per call"
            )
        try:
            self._sock.sendall(HEADER.pack(len(body)) + body)
        except OSError as exc:
            if self.broken is None:
                self.failed_unsent = True
            raise self._break(f"sending failed: {exc}") from None
        self.frames_sent += 1

    def post(self, message: msgspec.Struct) -> None:
        """Queue a request with seq 0 (no answer); sent with the next frame or at flush."""
        self._queued.append(message)
        if len(self._queued) >= MAX_QUEUED:
            self.flush()

    def flush(self) -> None:
        """Send what post queued (without waiting for anything)."""
        if self._queued:
            queued, self._queued = self._queued, []
            self._send(queued)

    def _take_queued(self, message: msgspec.Struct) -> list[msgspec.Struct]:
        queued, self._queued = self._queued, []
        queued.append(message)
        return queued

    # ------------------------------------------------------------ calls

    def call(self, make: Callable[[int], msgspec.Struct], timeout_s: float | None = None) -> Any:
        """One request, its answer waited for (earlier answers read on the way);
        ``timeout_s`` bounds each read instead of the channel's own (a peer pull)."""
        seq = self._next_seq()
        self._send(self._take_queued(make(seq)))
        self.waits += 1
        if timeout_s is None:
            return self._read_until(seq)
        self._sock.settimeout(timeout_s)
        try:
            return self._read_until(seq)
        finally:
            if self.broken is None:
                self._sock.settimeout(self.timeout_s)

    def call_later(self, make: Callable[[int], msgspec.Struct], on_done: OnDone | None) -> None:
        """Send a request now; its answer goes to ``on_done`` when read (see module doc)."""
        self.calls_later([(make, on_done)])

    def calls_later(
        self, calls: list[tuple[Callable[[int], msgspec.Struct], OnDone | None]]
    ) -> None:
        """call_later for several requests, sent in one frame (a commit and the
        next reserve: one send, one wake-up of the daemon)."""
        assert 0 < len(calls) <= MAX_UNANSWERED, "a bounded batch of calls"
        while len(self._unanswered) + len(calls) > MAX_UNANSWERED:
            self._read_one()
        seqs = [self._next_seq() for _ in calls]
        queued, self._queued = self._queued, []
        self._send(queued + [make(seq) for seq, (make, _) in zip(seqs, calls, strict=True)])
        self._unanswered.extend(
            (seq, on_done) for seq, (_, on_done) in zip(seqs, calls, strict=True)
        )

    def collect(self) -> None:
        """Send what is queued, then read every outstanding answer (commits have landed)."""
        self.flush()
        while self._unanswered:
            self._read_one()

    @property
    def unanswered(self) -> int:
        return len(self._unanswered)

    @property
    def queued(self) -> int:
        """Messages ``post`` queued that no frame has carried yet."""
        return len(self._queued)

    def close(self) -> None:
        """Flush and collect (bounded by timeout_s per read), then close the socket."""
        try:
            if self.broken is None:
                self.collect()
        except errors.KVStoreError as exc:
            log.debug("kvstore: lean channel: closing with answers lost: %s", exc)
        finally:
            self._fail_unanswered(self.broken or errors.Unavailable("the lean channel was closed"))
            self._sock.close()

    # ------------------------------------------------------------ reading

    def _read_until(self, seq: int) -> Any:
        while True:
            got, reply = self._read_reply()
            if got == seq:
                if isinstance(reply, Error):
                    raise error_of(reply)
                return reply
            self._deliver(got, reply)

    def _read_one(self) -> None:
        got, reply = self._read_reply()
        self._deliver(got, reply)

    def _deliver(self, got: int, reply: Any) -> None:
        if not self._unanswered or self._unanswered[0][0] != got:
            raise self._break(f"answer {got} arrived out of order")
        _, on_done = self._unanswered.popleft()
        if on_done is not None:
            on_done(error_of(reply) if isinstance(reply, Error) else reply)

    def _read_reply(self) -> tuple[int, Any]:
        """The next answer: (seq, reply). A frame-level Error (seq 0) raises."""
        if self.broken is not None:
            raise self.broken
        if not self._pending:
            self._pending.extend(self._read_frame())
        reply = self._pending.popleft()
        if reply.seq == 0:
            # The daemon refused a whole frame (this library never sends a malformed
            # one: oversize, or a bug): its answers will not come; start over.
            err = error_of(reply) if isinstance(reply, Error) else errors.Unavailable("bad answer")
            self.broken = err
            self._fail_unanswered(err)
            raise err
        return reply.seq, reply

    def _read_frame(self) -> list[Any]:
        buf = self._rbuf
        try:
            while not (end := self._frame_end()):
                self._receive()
            body = bytes(buf[HEADER.size : end])
            del buf[:end]
        except TimeoutError:
            waited_s = self._sock.gettimeout()
            raise self._break(f"no answer within {waited_s}s", deadline=True) from None
        except OSError as exc:
            raise self._break(f"reading failed: {exc}") from None
        try:
            return reply_decoder.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise self._break(f"undecodable answer: {exc}") from None

    def _receive(self) -> None:
        """Read what the socket has into the buffer: polled for up to ``spin_s``
        first (module doc), then waited for (the socket's timeout)."""
        if self.spin_s:
            poll, clock = self._poll.poll, time.perf_counter
            end_s = clock() + self.spin_s
            while True:
                if poll(0):
                    self.polled_reads += 1
                    break
                if clock() >= end_s:
                    break
        self._take_bytes()

    def _take_bytes(self, flags: int = 0) -> None:
        """One recv into the read buffer (``flags``: MSG_DONTWAIT for no wait);
        the daemon's end closed breaks the stream."""
        chunk = self._sock.recv(RECV_BYTES, flags)
        if not chunk:
            part = " mid-answer" if self._rbuf else ""
            raise self._break(f"the daemon closed the connection{part}")
        self._rbuf += chunk

    def _break(self, why: str, *, deadline: bool = False) -> errors.KVStoreError:
        """The stream can no longer be trusted: every later use raises this."""
        cls = errors.DeadlineExceeded if deadline else errors.Unavailable
        err = cls(f"lean channel to the daemon: {why}")
        if self.broken is None:
            self.broken = err
            self._fail_unanswered(err)
            self._queued.clear()
        return err

    def _fail_unanswered(self, err: errors.KVStoreError) -> None:
        unanswered, self._unanswered = self._unanswered, collections.deque()
        for _, on_done in unanswered:
            if on_done is not None:
                on_done(err)
