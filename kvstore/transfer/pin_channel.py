"""The lean pin channel: PinForPull and ReleasePull between daemons without gRPC.

A pull's first byte waits for the owner's pin: over gRPC aio that is one
unary call, ~0.7-1.4 ms of round trip on the project's 2-core VM, several
times the bare NIXL READ of a block. The pin channel carries the same two
calls, the same protobuf messages and the same errors, over one persistent
TCP connection per peer pair, as length-prefixed frames (tens of
microseconds a call); gRPC stays for the metadata (``GetAgentMetadata``,
which advertises the channel's port), the stream fallback, and as the
fallback for pins whenever the channel cannot be used.

Trust (the cluster secret, as on ``PeerService``): a connection is usable
only after a mutual HMAC-SHA256 challenge over fresh nonces from both sides.
The owner proves the secret too, so a puller never takes offsets and
checksums from a stranger listening on the port; the secret itself never
crosses the wire (gRPC sends it in the clear in its metadata). A wrong proof
is audited and the connection closed, before any work. Not served when TLS is
configured for peers (the channel is plaintext): pins then stay on gRPC.

Frames: a 4-byte little-endian length, then one byte op, a 4-byte
little-endian seq, and the protobuf message. Ops: ``PIN`` (a
``PinForPullRequest``, answered ``PINNED`` with a ``PinForPullResponse``),
``RELEASE`` (a ``ReleasePullRequest``; seq 0 asks for no answer, else
``RELEASED``), ``ERROR`` (msgpack ``[reason, message]``: the
``kvstore.errors`` class's reason code). Requests of one connection run
concurrently (a pin that promotes disk blocks does not hold up the next);
answers carry their request's seq.

Bounds: frames of at most ``max_frame_bytes`` (the gRPC message limit),
``MAX_CONNECTIONS`` connections, ``MAX_IN_FLIGHT`` requests per connection
(past it: ``capacity_exhausted``), a handshake done within
``HANDSHAKE_TIMEOUT_S``; a caller's wait is bounded by its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from kvstore import audit, errors
from kvstore.v1 import peer_pb2

log = logging.getLogger(__name__)

MAGIC = b"KVPIN1"
NONCE_BYTES = 32
MAC_BYTES = 32
HANDSHAKE_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 256
MAX_IN_FLIGHT = 256
# Pin releases are sent this long after the pull that asked (or ahead of the next
# pin), up to this many in one frame: the owner keeps a pin ~1 ms longer.
RELEASE_DELAY_S = 0.001
MAX_RELEASE_BATCH = 256
_LEN = struct.Struct("<I")
_HEAD = struct.Struct("<BI")  # op, seq

PIN = 1
RELEASE = 2
WELCOME = 0x10  # the owner's proof, ending the handshake
PINNED = 0x81
RELEASED = 0x82
ERROR = 0xFF


def _mac(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(
        secret, b"kvstore-pin-channel-v1 " + role + first + second, hashlib.sha256
    ).digest()


def _frame(op: int, seq: int, body: bytes) -> bytes:
    return _LEN.pack(_HEAD.size + len(body)) + _HEAD.pack(op, seq) + body


async def _read_frame(reader: asyncio.StreamReader, max_frame_bytes: int) -> tuple[int, int, bytes]:
    (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if not _HEAD.size <= size <= max_frame_bytes:
        raise errors.InvalidRequest(f"pin channel frame of {size} bytes (max {max_frame_bytes})")
    data = await reader.readexactly(size)
    op, seq = _HEAD.unpack_from(data)
    return op, seq, data[_HEAD.size :]


def _release_frame(lease_ids: list[int]) -> bytes:
    """A release without an answer (seq 0)."""
    return _frame(RELEASE, 0, peer_pb2.ReleasePullRequest(lease_ids=lease_ids).SerializeToString())


def _error_body(exc: errors.KVStoreError) -> bytes:
    return msgspec.msgpack.encode([exc.reason, str(exc)])


def _error_of(body: bytes, what: str) -> errors.KVStoreError:
    """The exact class the owner raised (its reason code), with the status a gRPC
    call would have had, as ``errors.error_from_rpc`` rebuilds it."""
    try:
        reason, message = msgspec.msgpack.decode(body, type=tuple[str, str])
    except msgspec.DecodeError:
        return errors.Unavailable(f"{what}: malformed error from the peer")
    cls = errors.BY_REASON.get(reason, errors.Unavailable)
    err = cls(f"{what}: {message}")
    err.status_code = cls.status
    return err


# ------------------------------------------------------------------ owner side

Pin = Callable[[Any], Awaitable[Any]]
"""PinForPullRequest -> PinForPullResponse, raising KVStoreError (PeerService.pin)."""
Release = Callable[[Any], Awaitable[Any]]


class PinServer:
    """The owner's end: serves pins and releases to peers that prove the secret."""

    def __init__(
        self, secret: str, pin: Pin, release: Release, *, max_frame_bytes: int = 64 << 20
    ) -> None:
        if not secret:
            raise errors.ConfigError("the pin channel needs peer.secret")
        self._secret = secret.encode()
        self._pin = pin
        self._release = release
        self.max_frame_bytes = max_frame_bytes
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on host:port (0: a free port); return the port (advertised by
        GetAgentMetadata)."""
        self._server = await asyncio.start_server(self._serve, host.strip("[]") or None, port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=2.0)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        peer = writer.get_extra_info("peername")
        if isinstance(peer, tuple):  # as gRPC names TCP peers (audit keys by host)
            who = f"{'ipv6' if ':' in peer[0] else 'ipv4'}:{peer[0]}:{peer[1]}"
        else:
            who = str(peer)
        if len(self._connections) >= MAX_CONNECTIONS:
            writer.write(
                _frame(
                    ERROR,
                    0,
                    _error_body(errors.CapacityExhausted("too many pin channel connections")),
                )
            )
            writer.close()
            return
        self._connections.add(task)
        try:
            if await self._handshake(reader, writer, who):
                await self._requests(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass  # the peer went away (or stalled in its handshake): nothing held
        except errors.InvalidRequest as exc:
            log.warning("pin channel from %s closed: %s", who, exc)
        finally:
            self._connections.discard(task)
            writer.close()

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, who: str
    ) -> bool:
        nonce_s = os.urandom(NONCE_BYTES)
        writer.write(MAGIC + nonce_s)
        proof = await asyncio.wait_for(
            reader.readexactly(NONCE_BYTES + MAC_BYTES), HANDSHAKE_TIMEOUT_S
        )
        nonce_c, mac_c = proof[:NONCE_BYTES], proof[NONCE_BYTES:]
        if not hmac.compare_digest(mac_c, _mac(self._secret, b"client", nonce_s, nonce_c)):
            audit.denied(who, "pin channel", audit.PEER_WRONG_SECRET, audit.tcp_caller(who))
            denied = errors.PermissionDenied("wrong or missing cluster secret")
            writer.write(_frame(ERROR, 0, _error_body(denied)))
            await writer.drain()
            return False
        writer.write(_frame(WELCOME, 0, _mac(self._secret, b"server", nonce_c, nonce_s)))
        return True

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        running: set[asyncio.Task[None]] = set()
        try:
            while True:
                # Answers not read by the peer stop us reading its requests (the
                # transport's write buffer bounds what is queued for it).
                await writer.drain()
                op, seq, body = await _read_frame(reader, self.max_frame_bytes)
                if len(running) >= MAX_IN_FLIGHT:
                    busy = errors.CapacityExhausted(
                        f"more than {MAX_IN_FLIGHT} pin requests in flight"
                    )
                    writer.write(_frame(ERROR, seq, _error_body(busy)))
                    continue
                job = asyncio.get_running_loop().create_task(self._one(op, seq, body, writer))
                running.add(job)
                job.add_done_callback(running.discard)
        finally:
            for job in list(running):
                job.cancel()

    async def _one(self, op: int, seq: int, body: bytes, writer: asyncio.StreamWriter) -> None:
        try:
            if op == PIN:
                reply = await self._pin(peer_pb2.PinForPullRequest.FromString(body))
                answer = _frame(PINNED, seq, reply.SerializeToString())
            elif op == RELEASE:
                reply = await self._release(peer_pb2.ReleasePullRequest.FromString(body))
                answer = _frame(RELEASED, seq, reply.SerializeToString())
            else:
                raise errors.InvalidRequest(f"unknown pin channel op {op}")
        except errors.KVStoreError as exc:
            answer = _frame(ERROR, seq, _error_body(exc))
        except Exception as exc:  # a message that does not parse (protobuf DecodeError)
            answer = _frame(ERROR, seq, _error_body(errors.InvalidRequest(f"bad message: {exc}")))
        if seq and not writer.is_closing():
            writer.write(answer)


# ----------------------------------------------------------------- puller side


class PinClient:
    """The puller's end of one connection to one owner. Connect with ``open``;
    once ``broken`` (the owner went away) it is dropped and a new one opened."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        name: str,
        max_frame_bytes: int,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.name = name
        self.max_frame_bytes = max_frame_bytes
        self._seq = 0
        self._waiting: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self._in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)
        self.broken: errors.KVStoreError | None = None
        # Releases waiting to be sent (release_soon): one frame for all of them,
        # sent RELEASE_DELAY_S later or ahead of the next pin, whichever is first.
        self._releases: list[int] = []
        self._release_timer: asyncio.TimerHandle | None = None
        self._reading = asyncio.get_running_loop().create_task(self._read_answers())

    @classmethod
    async def open(
        cls, host: str, port: int, secret: str, *, name: str, timeout_s: float, max_frame_bytes: int
    ) -> PinClient:
        """Connect and prove the secret both ways; Unavailable if the owner cannot be
        reached, PermissionDenied if either side's proof is wrong."""
        key = secret.encode()
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host.strip("[]"), port), timeout_s
            )
        except (OSError, TimeoutError) as exc:
            raise errors.Unavailable(f"pin channel to {name} ({host}:{port}): {exc}") from exc
        try:
            hello = await asyncio.wait_for(reader.readexactly(len(MAGIC) + NONCE_BYTES), timeout_s)
            if not hello.startswith(MAGIC):
                raise errors.Unavailable(f"{name} at {host}:{port} is not a pin channel")
            nonce_s = hello[len(MAGIC) :]
            nonce_c = os.urandom(NONCE_BYTES)
            writer.write(nonce_c + _mac(key, b"client", nonce_s, nonce_c))
            op, _, body = await asyncio.wait_for(_read_frame(reader, 4096), timeout_s)
            if op == ERROR:
                raise _error_of(body, f"pin channel to {name}")  # our secret was refused
            if op != WELCOME or not hmac.compare_digest(
                body, _mac(key, b"server", nonce_c, nonce_s)
            ):
                # The peer's failing, as its refusal over gRPC would be (status set:
                # PeerNode.fill then skips the hint instead of failing the lookup).
                impostor = errors.PermissionDenied(f"{name} did not prove the cluster secret")
                impostor.status_code = errors.PermissionDenied.status
                raise impostor
        except asyncio.IncompleteReadError as exc:
            writer.close()
            raise errors.Unavailable(f"pin channel to {name}: closed during the handshake") from exc
        except (OSError, TimeoutError) as exc:
            writer.close()
            raise errors.Unavailable(f"pin channel to {name}: {exc}") from exc
        except errors.InvalidRequest as exc:  # a frame too big: not our protocol
            writer.close()
            raise errors.Unavailable(f"pin channel to {name}: {exc}") from exc
        except errors.KVStoreError:
            writer.close()
            raise
        return cls(reader, writer, name=name, max_frame_bytes=max_frame_bytes)

    async def _read_answers(self) -> None:
        try:
            while True:
                op, seq, body = await _read_frame(self._reader, self.max_frame_bytes)
                waiter = self._waiting.pop(seq, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result((op, body))
                elif op == ERROR and seq == 0:
                    log.debug("pin channel %s: %s", self.name, _error_of(body, self.name))
        except (asyncio.IncompleteReadError, ConnectionError, errors.InvalidRequest) as exc:
            self._break(errors.Unavailable(f"pin channel to {self.name} lost: {exc!r}"))
        except asyncio.CancelledError:
            self._break(errors.Unavailable(f"pin channel to {self.name} closed"))
            raise

    def _break(self, exc: errors.KVStoreError) -> None:
        if self.broken is None:
            self.broken = exc
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_exception(self.broken)
        self._waiting.clear()
        self._writer.close()

    async def call(self, op: int, message: Any, timeout_s: float) -> bytes:
        """Send one request, wait for its answer; the answer's bytes or its error."""
        if self.broken is None and self._writer.is_closing():
            self._break(errors.Unavailable(f"pin channel to {self.name} closed"))
        if self.broken is not None:
            raise self.broken
        async with self._in_flight:
            self._seq = self._seq % 0xFFFFFFFF + 1
            seq = self._seq
            waiter: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
            self._waiting[seq] = waiter
            # Releases due ride ahead of the request, in the same send.
            self._writer.write(self._take_releases() + _frame(op, seq, message.SerializeToString()))
            try:
                got_op, body = await asyncio.wait_for(waiter, timeout_s)
            except TimeoutError:
                self._waiting.pop(seq, None)
                late = errors.DeadlineExceeded(
                    f"pin channel to {self.name}: no answer in {timeout_s:.3g} s"
                )
                late.status_code = errors.DeadlineExceeded.status  # as the gRPC call's
                raise late from None
        if got_op == ERROR:
            raise _error_of(body, f"pin on peer {self.name}")
        if got_op != op | 0x80:
            raise errors.Unavailable(f"pin channel to {self.name}: answer op {got_op} to {op}")
        return body

    async def pin(self, request: Any, timeout_s: float) -> Any:
        body = await self.call(PIN, request, timeout_s)
        try:
            return peer_pb2.PinForPullResponse.FromString(body)
        except Exception as exc:
            raise errors.Unavailable(f"{self.name} sent a malformed pin reply") from exc

    def release_nowait(self, lease_ids: list[int]) -> bool:
        """Release pins without waiting for an answer (a lost one expires on the
        owner); False if the channel is broken (the caller may use gRPC)."""
        if self.broken is not None or self._writer.is_closing():
            return False
        self._writer.write(self._take_releases() + _release_frame(lease_ids))
        return True

    def release_soon(self, lease_id: int) -> bool:
        """Release a pin a little later (RELEASE_DELAY_S, or ahead of the next pin),
        without an answer: the send and the owner's wake-up then come after the
        pull's reply to its caller, not before it (measured ~60-140 us of a
        one-block pull's first byte). False if the channel is broken."""
        if self.broken is not None or self._writer.is_closing():
            return False
        self._releases.append(lease_id)
        if len(self._releases) >= MAX_RELEASE_BATCH:
            self._flush_releases()
        elif self._release_timer is None:
            loop = asyncio.get_running_loop()
            self._release_timer = loop.call_later(RELEASE_DELAY_S, self._flush_releases)
        return True

    def _take_releases(self) -> bytes:
        """The frame of the releases waiting (b"" if none); they count as sent."""
        if self._release_timer is not None:
            self._release_timer.cancel()
            self._release_timer = None
        if not self._releases:
            return b""
        lease_ids, self._releases = self._releases, []
        return _release_frame(lease_ids)

    def _flush_releases(self) -> None:
        frame = self._take_releases()
        if frame and self.broken is None and not self._writer.is_closing():
            self._writer.write(frame)

    async def aclose(self) -> None:
        self._flush_releases()  # pins released before the connection goes
        self._reading.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reading
        self._writer.close()
