"""The daemon's end of the lean local channel (kvstore.local_wire), on the daemon's loop.

One asyncio Unix-socket server at ``<server.socket_path>.lean``. Each connection
reads frames, runs their requests in order through ``kvstore.handling`` (the
code the gRPC service runs) and writes one reply frame per request frame.

Auth is the Unix socket's, as for gRPC's socket (docs/security.md): local
only, the socket file made ``0600`` (``0660`` of ``server.file_group`` when
one is named: its members map the region anyway) before it appears at its
path (bound in a private directory, then renamed), a stale one replaced, a
live one never stolen; a peer whose uid (SO_PEERCRED) is neither this
daemon's nor root is refused when no group is named. With principals
configured (``kvstore.identity``) the connection's identity is set at
``hello``: its token's principal, else its uid's, else its gid's; none of
them: ``hello`` is refused (PERMISSION_DENIED, audited) and the connection
closed. Every request then runs as that principal (``kvstore.handling``).

Bounds: a frame over ``server.max_message_bytes`` is answered with an
``invalid_request`` Error and the connection closed (its bytes are not read);
at most ``MAX_MESSAGES_PER_FRAME`` requests a frame; at most
``server.local_max_connections`` connections (one more is answered
``capacity_exhausted`` and closed). A malformed frame, an unknown op or a
field of the wrong type is answered with an ``invalid_request`` Error naming
the problem, and the connection goes on.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import socket
import struct
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import msgspec

from kvstore import audit, errors
from kvstore.files import FilePolicy, claim_socket_path
from kvstore.handling import Chain, StoreRequests
from kvstore.identity import Caller
from kvstore.local_wire import (
    HEADER,
    PROTOCOL_VERSION,
    REQUEST_TAGS,
    CommitStore,
    Committed,
    Declare,
    Declared,
    Delete,
    Deleted,
    Error,
    Fetched,
    FetchFromPeer,
    HandedOver,
    HandOver,
    Hello,
    HelloReply,
    LoadedDirect,
    LoadPrepared,
    LoadsCounted,
    Looked,
    Lookup,
    MapTenant,
    PrepareLoad,
    PrepareStore,
    Release,
    Released,
    ReserveStore,
    StorePrepared,
    TenantRange,
    raw_decoder,
    request_decoder,
)
from kvstore.metrics import RpcMetrics

log = logging.getLogger("kvstore.local")

# each request as the gRPC method it stands for (metrics)
_RPC_NAMES: dict[type, str] = {
    Declare: "DeclareNamespace",
    Lookup: "Lookup",
    PrepareStore: "PrepareStore",
    ReserveStore: "PrepareStore",
    CommitStore: "CommitStore",
    PrepareLoad: "PrepareLoad",
    Release: "Release",
    LoadedDirect: "LoadedDirect",
    Delete: "Delete",
    FetchFromPeer: "FetchFromPeer",
    HandOver: "HandOver",
    MapTenant: "MapTenant",
}
LOCAL_OWNER = "unix"  # what kvstore.service.caller_of answers for the gRPC Unix socket
SUFFIX = ".lean"


def local_socket_path(socket_path: str) -> str:
    """Where the lean channel of the daemon serving gRPC at ``socket_path`` listens."""
    return socket_path + SUFFIX


def _bind_private(path: str, mode: int, policy: FilePolicy) -> socket.socket:
    """A listening socket at ``path`` that was never reachable with a wider mode:
    bound in a fresh 0700 directory beside it, given its mode, then renamed in."""
    parent = os.path.dirname(path) or "."
    tmpdir = tempfile.mkdtemp(prefix=".kvl", dir=parent)  # short: AF_UNIX paths stop at 107
    tmp = os.path.join(tmpdir, "s")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(tmp)
        os.chmod(tmp, mode)
        if policy.gid >= 0 and mode & 0o070:
            os.chown(tmp, -1, policy.gid)
        os.rename(tmp, path)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(tmpdir)
    return sock


def _peer_creds(sock: Any) -> tuple[int | None, int | None]:
    """(uid, gid) of the connected process (SO_PEERCRED: its primary gid only)."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None, None
    _, uid, gid = struct.unpack("3i", creds)
    return uid, gid


def _unknown_ops(body: bytes) -> list[str]:
    """The op names of a frame that no request has (for a precise error)."""
    try:
        raw = raw_decoder.decode(body)
    except msgspec.DecodeError:
        return []
    if not isinstance(raw, list):
        return []
    return [
        repr(m[0])[:64]
        for m in raw
        if isinstance(m, list) and m and isinstance(m[0], str) and m[0] not in REQUEST_TAGS
    ]


class _Connection(asyncio.Protocol):
    """One client's connection: frames parsed as they arrive, run in order."""

    def __init__(self, server: LocalServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.client = ""  # the lease-count key, from hello; "" until then
        self.uid: int | None = None  # the peer's credentials (SO_PEERCRED)
        self.gid: int | None = None
        self.who: Caller | None = None  # its identity, from hello (principals configured)
        self.owner = LOCAL_OWNER  # the owner of its leases (handling.owner_of)
        self.busy: asyncio.Task[Any] | None = None  # a load that may wait (moves between tiers)
        self.paused = False  # the client is not reading its answers: read no more
        self.closed = False
        # A tenant region's descriptor for the answer being built (map_tenant).
        self.fd_out: int | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport: asyncio's, or uvloop's (server.event_loop), which has the
        # same methods without deriving from asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)
        self.server.opened(self)
        self.uid, self.gid = _peer_creds(transport.get_extra_info("socket"))
        refusal = self.server.refusal(self.uid)
        if refusal is not None:
            self._refuse(Error(0, refusal.reason, str(refusal)))

    def connection_lost(self, exc: Exception | None) -> None:
        # The client went away (closed, or killed: its leases expire).
        self.closed = True
        if self.busy is not None:
            self.busy.cancel()
        self.server.lost(self)

    def pause_writing(self) -> None:
        # Answers pile up unread: stop reading requests until they drain (bounded).
        self.paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()
            self._process()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._process()

    def _refuse(self, error: Error) -> None:
        """Answer ``error`` and close: the rest of the stream cannot be trusted."""
        self._reply([error])
        self.closed = True
        assert self.transport is not None
        self.transport.close()

    def _reply(self, replies: list[Any]) -> None:
        assert self.transport is not None
        body = msgspec.msgpack.encode(replies)
        if self.fd_out is not None:
            fd, self.fd_out = self.fd_out, None
            self._reply_with_fd(replies, HEADER.pack(len(body)) + body, fd)
            return
        self.transport.write(HEADER.pack(len(body)) + body)

    def _reply_with_fd(self, replies: list[Any], data: bytes, fd: int) -> None:
        """Send a map_tenant answer with the descriptor on its first byte (SCM_RIGHTS).

        Written past the transport, so only when its buffer is empty (nothing
        queued could then come after the answer); the map_tenant was alone in
        its frame and the client waits for it, so that is the normal case."""
        assert self.transport is not None
        sent = 0
        if not self.transport.get_write_buffer_size():
            sock = self.transport.get_extra_info("socket")
            # A socket object of our own over a copy of the descriptor (the
            # transport's stays untouched); sendmsg on a non-blocking socket.
            own = socket.socket(fileno=os.dup(sock.fileno()))
            handed: int | None = None
            try:
                # Not the daemon's own descriptor: that open file holds the region's
                # flock(), and a client's mapping keeps its open file alive, so a
                # client that outlives this daemon would keep the lock and the next
                # daemon on these files could not start (and the client could
                # unlock it). A new open of the same file shares no lock.
                handed = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
                sent = own.sendmsg(
                    [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [handed]))]
                )
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                log.debug("lean channel: map_tenant answer not sent: %s", exc)
                self.close()
                return
            finally:
                own.close()
                if handed is not None:
                    os.close(handed)
        if sent:
            if sent < len(data):
                self.transport.write(data[sent:])
            return
        seq = replies[0].seq
        retry = Error(seq, errors.Unavailable.reason, "map_tenant: the connection is busy; retry")
        body = msgspec.msgpack.encode([retry])
        self.transport.write(HEADER.pack(len(body)) + body)

    def _process(self) -> None:
        server = self.server
        buf = self.buf
        while self.busy is None and not self.closed and not self.paused:
            if len(buf) < HEADER.size:
                return
            (size,) = HEADER.unpack_from(buf)
            if size > server.max_frame_bytes:
                # Not read on (a 4 GiB claim would cost 4 GiB): answer, then close.
                self._refuse(
                    Error(
                        0,
                        errors.InvalidRequest.reason,
                        f"frame of {size} bytes exceeds server.max_message_bytes="
                        f"{server.max_frame_bytes}; closing the connection",
                    )
                )
                return
            end = HEADER.size + size
            if len(buf) < end:
                return
            body = bytes(buf[HEADER.size : end])
            del buf[:end]
            server.frames += 1
            try:
                messages = request_decoder.decode(body)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                unknown = _unknown_ops(body)
                text = (
                    f"unknown op {', '.join(unknown)} (known: {', '.join(REQUEST_TAGS)})"
                    if unknown
                    else f"malformed frame: {exc}"
                )
                self._reply([Error(0, errors.InvalidRequest.reason, text[:1024])])
                continue
            if len(messages) > 1 and any(isinstance(m, MapTenant) for m in messages):
                # Its descriptor rides on the answer frame's first byte: alone, or not at all.
                self._reply(
                    [
                        Error(
                            0, errors.InvalidRequest.reason, "map_tenant must be alone in its frame"
                        )
                    ]
                )
                continue
            self._run(messages, 0, [])

    def _run(self, messages: list[Any], start: int, replies: list[Any]) -> None:
        """Requests ``messages[start:]`` in order; their answers in one frame. A load
        that has to wait holds the rest (and later frames) until it is done."""
        for i in range(start, len(messages)):
            message = messages[i]
            started_s = time.perf_counter()
            done, out = self.server.handle(self, message)
            if not done:
                self.busy = out
                out.add_done_callback(
                    lambda task, i=i, t=started_s: self._resumed(task, messages, i, replies, t)
                )
                return
            self._keep(message, out, replies, started_s)
        if replies:
            self._reply(replies)

    def _resumed(
        self,
        task: asyncio.Task[Any],
        messages: list[Any],
        i: int,
        replies: list[Any],
        started_s: float,
    ) -> None:
        self.busy = None
        if self.closed or task.cancelled():
            return
        self._keep(messages[i], task.result(), replies, started_s)
        self._run(messages, i + 1, replies)
        self._process()

    def _keep(self, message: Any, reply: Any, replies: list[Any], started_s: float) -> None:
        self.server.count(message, reply, time.perf_counter() - started_s)
        if message.seq:
            replies.append(reply)
        elif isinstance(reply, Error):
            log.debug(
                "lean channel: unanswered %s failed: %s", type(message).__name__, reply.message
            )

    def close(self) -> None:
        self.closed = True
        if self.busy is not None:
            self.busy.cancel()
        if self.transport is not None:
            self.transport.close()


class LocalServer:
    def __init__(
        self,
        requests: StoreRequests,
        path: str,
        *,
        node_id: str,
        region_id: Any,
        max_frame_bytes: int,
        max_connections: int,
        policy: FilePolicy,
        metrics: RpcMetrics | None = None,
        fetch: Callable[..., Awaitable[Any]] | None = None,
        presence_path: str = "",
        hand_over: Callable[..., Awaitable[Any]] | None = None,
    ) -> None:
        self.requests = requests
        self.presence_path = presence_path  # the presence table, for hello ("" = none)
        # PeerFetchService.fetch and .hand_over when peers are enabled:
        # FetchFromPeer and HandOver are served here.
        self._fetch = fetch
        self._hand_over = hand_over
        self.path = path
        self.node_id = node_id
        self._region_id = region_id  # () -> int: the region answers name
        self.max_frame_bytes = max_frame_bytes
        self.max_connections = max_connections
        self.policy = policy
        # Counted as the gRPC call of the same name (kvstore_rpc_*): one view of the load.
        self._metrics = metrics
        self._timers: dict[str, Any] = {}  # method -> its duration child
        self._counts: dict[tuple[str, str], Any] = {}  # (method, code) -> its counter child
        self.connections = 0
        self.frames = 0  # request frames served (tests count them)
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()

    async def start(self) -> None:
        claim_socket_path(self.path, "server.socket_path (lean channel)")
        sock = _bind_private(self.path, self.policy.shared_mode, self.policy)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), sock=sock)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for conn in list(self._connections):
            conn.close()
        self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    # ------------------------------------------------------------ connections

    def opened(self, conn: _Connection) -> None:
        self._connections.add(conn)
        self.connections = len(self._connections)

    def lost(self, conn: _Connection) -> None:
        self._connections.discard(conn)
        self.connections = len(self._connections)

    def refusal(self, uid: int | None) -> errors.KVStoreError | None:
        if self.connections > self.max_connections:
            return errors.CapacityExhausted(
                f"{self.max_connections} lean-channel connections are open "
                "(server.local_max_connections); use gRPC or close one"
            )
        if self.requests.auth is not None:
            return None  # hello decides, by token or by this uid's principal
        if self.policy.gid < 0 and uid is not None and uid not in (os.geteuid(), 0):
            audit.denied(f"uid {uid}", "lean channel connection", audit.LOCAL_UID)
            return errors.PermissionDenied(
                f"uid {uid} may not use this daemon's lean channel (no server.file_group)"
            )
        return None

    def count(self, message: Any, reply: Any, duration_s: float) -> None:
        if self._metrics is None or isinstance(message, Hello):
            return
        method = _RPC_NAMES[type(message)]
        timer = self._timers.get(method)
        if timer is None:  # labels() looks the child up under a lock: once per method
            timer = self._timers[method] = self._metrics.duration.labels(method)
        timer.observe(duration_s)
        code = "OK"
        if isinstance(reply, Error):
            code = errors.BY_REASON.get(reply.reason, errors.KVStoreError).status.name
        counter = self._counts.get((method, code))
        if counter is None:  # bounded: methods x status codes
            counter = self._counts[method, code] = self._metrics.requests.labels(method, code)
        counter.inc()

    def handle(self, conn: _Connection, m: Any) -> tuple[bool, Any]:
        """(True, the answer), or (False, a Task giving it: a load that may wait)."""
        if isinstance(m, Hello):
            refused = self._identify(conn, m)
            if refused is not None:
                # nothing more from this connection: answer, then close (after the reply)
                asyncio.get_running_loop().call_soon(conn.close)
                return True, refused
            conn.client = "id:" + m.client_id
            return True, self._hello(m)
        if not conn.client:
            return True, Error(m.seq, errors.StateConflict.reason, "send hello first")
        if isinstance(m, FetchFromPeer):
            # A pull waits for the peer: a task, the connection's later requests
            # wait for it, in order (as a load that promotes from disk).
            return False, asyncio.ensure_future(self._fetch_from_peer(m, conn))
        if isinstance(m, HandOver):
            # The pin may promote blocks from disk first: a task, in order.
            return False, asyncio.ensure_future(self._hand_over_pin(m, conn))
        if isinstance(m, MapTenant):
            return True, self._map_tenant(conn, m)
        if isinstance(m, PrepareLoad) and self.requests.loads_may_wait:
            # Moves between tiers first (disk promotion): a task; the connection's
            # later requests wait for it, in order.
            return False, asyncio.ensure_future(self._load(m, conn))
        return True, self._one(m, conn)

    def _identify(self, conn: _Connection, m: Hello) -> Error | None:
        """Set the connection's identity from its hello (principals configured):
        None, or the refusal to answer (audited)."""
        auth = self.requests.auth
        if auth is None:
            return None
        label = f"uid {conn.uid}"
        if m.token:
            principal = auth.from_token(m.token)
            why = "its token is no principal's"
        else:
            principal = auth.from_peer(conn.uid, conn.gid)
            why = f"uid {conn.uid} / gid {conn.gid} is no principal's and it sent no token"
        if principal is None:
            audit.denied(label, "lean channel hello", audit.NO_IDENTITY)
            return Error(
                m.seq,
                errors.PermissionDenied.reason,
                f"this daemon maps callers to tenants (auth.principals): {why}",
            )
        conn.who = Caller(principal, f"{principal.name} ({label})")
        conn.owner = self.requests.owner_of(LOCAL_OWNER, conn.who)
        return None

    def _hello(self, message: Hello) -> Any:
        if message.version != PROTOCOL_VERSION:
            return Error(
                message.seq,
                errors.StateConflict.reason,
                f"lean channel version {message.version} is not served here "
                f"({PROTOCOL_VERSION} is)",
            )
        ops = [
            op
            for op, served in (("fetch_from_peer", self._fetch), ("hand_over", self._hand_over))
            if served is not None
        ]
        return HelloReply(
            message.seq,
            self.node_id,
            self._region_id(),
            self.max_frame_bytes,
            ops,
            self.presence_path,
            reserves=True,
            direct_loads=bool(self.presence_path),
            reserve_keep=True,
        )

    async def _fetch_from_peer(self, m: FetchFromPeer, conn: _Connection) -> Any:
        async def run(fetch: Callable[..., Awaitable[Any]]) -> Any:
            r = await fetch(
                m.namespace_id,
                m.block_hashes,
                m.peer_node_id,
                m.peer_address,
                m.timeout_s,
                who=conn.who,
                ticket=m.ticket,
            )
            return Fetched(
                m.seq,
                r.prefix_blocks,
                r.fetched_blocks,
                r.local_blocks,
                r.corrupt_blocks,
                r.transport,
                r.pin_s,
                r.transfer_s,
                r.verify_s,
                r.pieces,
            )

        return await self._peer_op(m.seq, "FetchFromPeer", self._fetch, run)

    async def _hand_over_pin(self, m: HandOver, conn: _Connection) -> Any:
        async def run(hand_over: Callable[..., Awaitable[Any]]) -> Any:
            found, ticket, ttl_s = await hand_over(
                m.namespace_id, m.block_hashes, m.ttl_s, who=conn.who
            )
            return HandedOver(m.seq, found, ticket, ttl_s)

        return await self._peer_op(m.seq, "HandOver", self._hand_over, run)

    async def _peer_op(
        self,
        seq: int,
        name: str,
        served: Callable[..., Awaitable[Any]] | None,
        run: Callable[[Callable[..., Awaitable[Any]]], Awaitable[Any]],
    ) -> Any:
        """The answer of peer op ``name`` (``run`` with the daemon's ``served``), or its
        refusal: errors answered as the gRPC call would answer them."""
        if served is None:
            refused = errors.StateConflict(f"{name} needs peer.enabled on this daemon")
            return Error(seq, refused.reason, str(refused))
        try:
            return await run(served)
        except errors.KVStoreError as exc:
            return Error(seq, exc.reason, errors.details_of(exc))
        except Exception as exc:  # a bug: answered (as gRPC would, UNKNOWN), connection kept
            log.exception("lean channel: %s failed", name)
            return Error(seq, errors.KVStoreError.reason, f"internal error: {exc}"[:1024])

    def _map_tenant(self, conn: _Connection, m: MapTenant) -> Any:
        try:
            offset, nbytes, fd = self.requests.map_tenant(m.namespace_id, conn.who)
        except errors.KVStoreError as exc:  # refusals are audited where they are decided
            return Error(m.seq, exc.reason, errors.details_of(exc))
        if fd is not None and m.seq:
            conn.fd_out = fd
        return TenantRange(m.seq, offset, nbytes, self._region_id())

    async def _load(self, m: PrepareLoad, conn: _Connection) -> Any:
        try:
            q = await self.requests.prepare_load(
                m.namespace_id,
                m.block_hashes,
                m.lease_ttl_s,
                m.tier,
                "",
                0.0,
                conn.owner,
                conn.client,
                conn.who,
            )
        except errors.KVStoreError as exc:
            return Error(m.seq, exc.reason, errors.details_of(exc))
        except Exception as exc:  # a bug: answered (as gRPC would, UNKNOWN), connection kept
            log.exception("lean channel: PrepareLoad failed")
            return Error(m.seq, errors.KVStoreError.reason, f"internal error: {exc}"[:1024])
        return _load_prepared(m.seq, q)

    def _one(self, m: Any, conn: _Connection) -> Any:
        r = self.requests
        who, owner, client = conn.who, conn.owner, conn.client
        try:
            if isinstance(m, Lookup):
                result = r.lookup(m.namespace_id, m.block_hashes, who)
                return Looked(
                    m.seq, result.prefix_blocks, [(int(t), n) for t, n in result.by_tier.items()]
                )
            if isinstance(m, PrepareStore):
                p = r.prepare_store(
                    m.namespace_id, m.block_hashes, m.lease_ttl_s, m.tier, owner, client, who
                )
                return StorePrepared(
                    m.seq, p.lease_id, p.statuses, p.offsets, p.tier, p.lease_ttl_s, p.region_id
                )
            if isinstance(m, CommitStore):
                n = r.commit_store(
                    m.lease_id,
                    m.block_hashes,
                    m.parent_block_hash,
                    m.token_ids,
                    [Chain(c.blocks, c.parent_block_hash, c.token_ids) for c in m.chains],
                    owner,
                    who,
                    m.positions,
                    m.keep_rest,
                )
                return Committed(m.seq, n)
            if isinstance(m, ReserveStore):
                p = r.reserve_store(
                    m.namespace_id, m.blocks, m.lease_ttl_s, m.tier, owner, client, who
                )
                return StorePrepared(
                    m.seq, p.lease_id, p.statuses, p.offsets, p.tier, p.lease_ttl_s, p.region_id
                )
            if isinstance(m, PrepareLoad):  # nothing to move on this node: no await
                q = r.load_now(
                    m.namespace_id, m.block_hashes, m.lease_ttl_s, m.tier, owner, client, who
                )
                return _load_prepared(m.seq, q)
            if isinstance(m, Release):
                return Released(m.seq, r.release(list(m.lease_ids), owner, who))
            if isinstance(m, LoadedDirect):
                return LoadsCounted(m.seq, r.loaded_direct(m.namespace_id, m.block_hashes, who))
            if isinstance(m, Delete):
                deleted, busy = r.delete(m.namespace_id, m.block_hashes, who)
                return Deleted(m.seq, deleted, busy)
            if isinstance(m, Declare):
                d = r.declare_namespace(m.spec, who)
                return Declared(m.seq, d.namespace_id, d.block_bytes, d.sibling_layouts)
            raise AssertionError(f"unhandled lean request {type(m).__name__}")
        except errors.KVStoreError as exc:
            return Error(m.seq, exc.reason, errors.details_of(exc))
        except Exception as exc:  # a bug: answered (as gRPC would, UNKNOWN), connection kept
            log.exception("lean channel: %s failed", type(m).__name__)
            return Error(m.seq, errors.KVStoreError.reason, f"internal error: {exc}"[:1024])


def _load_prepared(seq: int, q: Any) -> LoadPrepared:
    """The answer to a PrepareLoad, from the request handler's result."""
    return LoadPrepared(
        seq, q.lease_id, q.found_blocks, q.offsets, q.checksums, q.tier, q.lease_ttl_s, q.region_id
    )
