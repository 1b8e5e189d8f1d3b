"""Peer transfer in the daemon: the owner's PeerService, the clients' FetchFromPeer,
and ``PeerNode``, which assembles them with a transport.

Trust: every PeerService call must carry the cluster's shared secret
(``x-kvstore-cluster-secret`` metadata), compared in constant time; anything
else is PERMISSION_DENIED before any work is done. Pins handed to peers are
ordinary load leases of the manager, owned by ``PEER_OWNER`` (they expire and
are quarantined by themselves, like any lease): a peer can release or stream
only those, never a local client's lease, and a local client never a peer's
(the owner check of kvstore.leases; no caller identity of the store service is
``PEER_OWNER``).

Transport choice (``peer.transport``): "auto" loads NIXL and falls back to the
gRPC stream, loudly, only if NIXL cannot load; "nixl" refuses to start
without it; "grpc_stream" forces the fallback (tests, NIXL-less nodes). A
puller reads with NIXL only when both sides have it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from kvstore import audit, errors
from kvstore.auth import secret_matches
from kvstore.identity import CURRENT
from kvstore.manager import BlockManager
from kvstore.service import call_async, pack_u64, spec_from_pb, unpack_u64
from kvstore.tls import TlsFiles
from kvstore.transfer.base import KIND_GRPC_STREAM, KIND_NIXL, Transport, check_address
from kvstore.transfer.grpc_stream import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    GrpcStreamTransport,
    iter_chunks,
)
from kvstore.transfer.pin_channel import PinServer
from kvstore.transfer.puller import (
    MAX_PIN_TTL_S,
    PIECE_MIN_BYTES,
    PIN_TTL_MARGIN_S,
    Puller,
    checksums_async,
)
from kvstore.transfer.ticket import PullTicket, open_ticket, seal, ticket_key
from kvstore.v1 import peer_pb2, peer_pb2_grpc

if TYPE_CHECKING:
    from kvstore.leases import Lease
    from kvstore.metrics import PeerMetrics

log = logging.getLogger(__name__)

# Live pins this daemon holds for peers; beyond it new pins are refused
# (RESOURCE_EXHAUSTED) instead of growing without bound.
MAX_PEER_PINS = 4096
# A pin's lifetime when the puller asks for none, and the longest allowed.
DEFAULT_PIN_TTL_S = 10.0
# A handed-over pin's lifetime when its maker asks for none: it must cover the
# trip from the prefill engine through the router to the decode engine's
# scheduler (a queued request waits there), and no more than it must: an
# unused ticket strands its blocks' slots until then.
DEFAULT_HANDOVER_TTL_S = 30.0
# The owner (and the client, for the lease limits) of every lease handed to a
# peer. The store service's caller identities are gRPC peer kinds ("unix",
# "ipv4:<host>", ...), never this.
PEER_OWNER = "peer-pull"


class PeerService(peer_pb2_grpc.PeerServiceServicer):
    """The owner side: metadata, pins, releases, and the fallback byte stream."""

    def __init__(
        self,
        manager: BlockManager,
        *,
        secret: str,
        incarnation: str,
        nixl: Transport | None,
        agent_name: str,
        on_pin: Any = None,
        on_unpin: Any = None,
    ) -> None:
        if not secret:
            raise errors.ConfigError("peer transfer needs peer.secret")
        self.manager = manager
        self._secret = secret.encode()
        self._ticket_key = ticket_key(self._secret)
        self.incarnation = incarnation
        self.nixl = nixl
        self.agent_name = agent_name
        self._on_pin = on_pin or (lambda lease_id, ttl_s: None)
        self._on_unpin = on_unpin or (lambda lease_id: None)
        self.pin_port = 0  # of the pin channel once it listens (PeerNode.start); 0 = none

    async def _auth(self, context: grpc.aio.ServicerContext, method: str) -> None:
        if not secret_matches(context.invocation_metadata(), self._secret):
            peer = context.peer()
            what = f"/kvstore.v1.PeerService/{method}"
            audit.denied(peer, what, audit.PEER_WRONG_SECRET, audit.tcp_caller(peer))
            await errors.abort(context, errors.PermissionDenied("wrong or missing cluster secret"))

    def _live_pin(self, lease_id: int) -> Lease | None:
        """The peer pin (a load lease of PEER_OWNER) while it is live, else None."""
        lease = self.manager.leases.get(lease_id, PEER_OWNER)
        if lease is None or time.monotonic() >= lease.expires_at_s:
            return None  # past its time it is quarantined at the next reaper pass
        return lease

    async def GetAgentMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._auth(context, "GetAgentMetadata")
        region = self.manager.region
        nixl = self.nixl
        return peer_pb2.GetAgentMetadataResponse(
            node_id=self.manager.node_id,
            incarnation=self.incarnation,
            transport=KIND_NIXL if nixl is not None else KIND_GRPC_STREAM,
            agent_name=self.agent_name if nixl is not None else "",
            agent_metadata=nixl.local_info() if nixl is not None else b"",
            region_base=int(region.array.ctypes.data),
            region_bytes=region.capacity_bytes,
            pin_port=self.pin_port,
        )

    async def PinForPull(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._auth(context, "PinForPull")
        return await call_async(context, lambda: self.pin(request))

    async def pin(self, request: Any) -> Any:
        """One pin (PinForPullRequest -> PinForPullResponse), whichever channel asked
        (gRPC above, or the pin channel, kvstore.transfer.pin_channel, which proved
        the secret on its connection); refusals raise KVStoreError."""
        if not request.HasField("spec"):
            raise errors.InvalidRequest("spec is required")
        ttl_s = request.lease_ttl_s or DEFAULT_PIN_TTL_S
        if not 0 < ttl_s <= MAX_PIN_TTL_S:
            raise errors.InvalidRequest(f"lease_ttl_s must be in (0, {MAX_PIN_TTL_S}]")
        ns_id = spec_from_pb(request.spec).namespace_id()
        hashes = unpack_u64(request.block_hashes)
        return await self.pin_blocks(ns_id, hashes, ttl_s, request.requester_node_id)

    async def pin_blocks(
        self, ns_id: str, hashes: list[int], ttl_s: float, requester_node_id: str
    ) -> Any:
        """Pin the longest present prefix of ``hashes`` for a peer (PinForPullResponse);
        ``requester_node_id`` "" when the reader is not known yet (a hand-over)."""
        if self.manager.leases.held_by(PEER_OWNER) >= MAX_PEER_PINS:
            raise errors.CapacityExhausted("too many outstanding peer pins")
        try:
            # Disk-tier blocks of the prefix are promoted to DRAM first: peers
            # read only DRAM.
            plan = await self.manager.prepare_load_async(
                ns_id, hashes, ttl_s, owner=PEER_OWNER, client=PEER_OWNER
            )
        except errors.NamespaceNotFound:
            plan = None  # never declared here: nothing to offer
        reply = peer_pb2.PinForPullResponse(incarnation=self.incarnation, lease_ttl_s=ttl_s)
        if plan is None or not plan.lease_id:
            return reply
        blocks = plan.blocks
        block_bytes = blocks[0].namespace.block_bytes
        offsets = [b.offset for b in blocks]
        # Blocks are immutable once committed and pinned now: hash each once and keep it.
        todo = [i for i, b in enumerate(blocks) if b.checksum == 0]
        if todo:
            array = self.manager.region.array
            sums = await checksums_async(array, [offsets[i] for i in todo], block_bytes)
            self.manager.set_checksums([blocks[i] for i in todo], sums)
        if requester_node_id:
            # The requester is about to hold these too (copy-aware eviction,
            # eviction.copy_learn = served|both; docs/eviction.md).
            self.manager.note_held_elsewhere(blocks, requester_node_id, served=True)
        # The pump's fast polling starts right after the reply is on its way, not
        # before: waking its thread cost ~85 us of the pin (its GIL hand-off),
        # on the puller's first byte. Nothing it polls for exists before the
        # puller has the reply; a later frame (the release) runs after this.
        asyncio.get_running_loop().call_soon(self._on_pin, plan.lease_id, ttl_s)
        reply.lease_id = plan.lease_id
        reply.found_blocks = len(blocks)
        reply.offsets = pack_u64(offsets)
        reply.block_bytes = block_bytes
        reply.checksums = pack_u64([b.checksum for b in blocks])
        return reply

    @property
    def transport(self) -> str:
        """How peers read from here (what a hand-over's pin is counted under)."""
        return KIND_NIXL if self.nixl is not None else KIND_GRPC_STREAM

    async def hand_over(
        self, ns_id: str, hashes: list[int], ttl_s: float = 0.0
    ) -> tuple[Any, bytes]:
        """Pin the longest present prefix of ``hashes`` for a peer not known yet and
        seal the pin as a ticket (kvstore.transfer.ticket): (the pin, as a
        PinForPullResponse; the ticket, b"" when nothing was found)."""
        ttl_s = ttl_s or DEFAULT_HANDOVER_TTL_S
        if not 0 < ttl_s <= MAX_PIN_TTL_S:
            raise errors.InvalidRequest(f"ttl_s must be in (0, {MAX_PIN_TTL_S}]")
        self.manager.namespace(ns_id)  # NamespaceNotFound: the caller declared none here
        pin = await self.pin_blocks(ns_id, hashes, ttl_s, "")
        if not pin.lease_id:
            return pin, b""
        found = pin.found_blocks
        ticket = PullTicket(
            node_id=self.manager.node_id,
            incarnation=self.incarnation,
            namespace_id=ns_id,
            lease_id=pin.lease_id,
            expires_unix_s=time.time() + ttl_s,
            block_bytes=pin.block_bytes,
            block_hashes=pack_u64(hashes[:found]),
            offsets=pin.offsets,
            checksums=pin.checksums,
        )
        return pin, seal(self._ticket_key, ticket)

    async def ReleasePull(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._auth(context, "ReleasePull")
        return await self.release(request)

    async def release(self, request: Any) -> Any:
        """ReleasePullRequest -> ReleasePullResponse (either channel)."""
        released = 0
        for lease_id in request.lease_ids:
            try:
                # PEER_OWNER's only: a local client's lease is "not found" here
                released += self.manager.release([lease_id], PEER_OWNER)
            except errors.LeaseNotFound:  # LeaseExpired too
                continue  # not a peer pin, or gone (expired: unpinned by the reaper)
            self._on_unpin(lease_id)
        return peer_pb2.ReleasePullResponse(released=released)

    async def StreamBlocks(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        await self._auth(context, "StreamBlocks")
        pin = self._live_pin(request.lease_id)
        if pin is None:
            await errors.abort(
                context, errors.LeaseNotFound(f"no live peer pin {request.lease_id}")
            )
            return
        offsets = (
            np.frombuffer(request.offsets, dtype="<u8") if len(request.offsets) % 8 == 0 else None
        )
        if offsets is None or not set(offsets.tolist()) <= {b.offset for b in pin.blocks}:
            await errors.abort(
                context, errors.InvalidRequest("offsets must be packed uint64 blocks of the pin")
            )
            return
        chunk_bytes = min(request.chunk_bytes or DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES)
        block_bytes = pin.namespace.block_bytes
        for chunk in iter_chunks(self.manager.region.array, offsets, block_bytes, chunk_bytes):
            if self._live_pin(request.lease_id) is not pin:
                # Past its pin a block may be evicted and its slot reused: stop here
                # (the puller's checksums would catch it anyway).
                await errors.abort(
                    context, errors.LeaseNotFound("pin released or expired mid-stream")
                )
                return
            yield peer_pb2.BlockChunk(data=chunk)


class PeerFetchService(peer_pb2_grpc.PeerFetchServiceServicer):
    """FetchFromPeer: a local client asks this daemon to pull blocks from a peer now."""

    def __init__(
        self,
        puller: Any,  # Puller, maybe wrapped
        peers: dict[str, str],
        owner: Any = None,  # PeerService, maybe wrapped
        secret: str = "",
    ) -> None:
        self.puller = puller
        self.peers = peers  # node id -> gRPC address
        self.owner = owner  # mints the tickets of HandOver
        self._ticket_key = ticket_key(secret) if secret else None  # opens them
        # (caller, namespace id, what) -> raises PERMISSION_DENIED: the store's tenant
        # check (kvstore.handling.StoreRequests.allow_namespace), set by the daemon.
        self.allow: Callable[[Any, str, str], None] | None = None

    def resolve(self, node_id: str = "", address: str = "") -> str:
        """A peer's gRPC address: given, or looked up by node id in [peer] peers."""
        if address:
            return check_address(address)
        address = self.peers.get(node_id, "")
        if not address:
            raise errors.InvalidRequest(
                f"unknown peer {node_id!r}: give its host:port or list it in [peer] peers"
            )
        return address

    async def fetch(
        self,
        namespace_id: str,
        block_hashes: bytes,
        peer_node_id: str = "",
        peer_address: str = "",
        timeout_s: float = 0.0,
        who: Any = None,
        ticket: bytes = b"",
    ) -> Any:
        """One FetchFromPeer, whichever channel asked (gRPC here, or the lean local
        channel, kvstore.local_server): the same checks, the same pull (PullResult).
        ``who``: the caller's identity (kvstore.identity.Caller, None without
        principals), checked against the namespace's tenant first."""
        if self.allow is not None:
            self.allow(who, namespace_id, "FetchFromPeer")
        opened = self._open(ticket, namespace_id, who) if ticket else None
        if opened is not None and not (peer_node_id or peer_address):
            peer_node_id = opened.node_id  # the ticket names its owner
        address = self.resolve(peer_node_id, peer_address)
        if timeout_s < 0:
            raise errors.InvalidRequest("timeout_s must be >= 0")
        hashes = unpack_u64(block_hashes)
        if opened is None:
            return await self.puller.pull(namespace_id, hashes, address, timeout_s)
        return await self.puller.pull(namespace_id, hashes, address, timeout_s, ticket=opened)

    def _open(self, blob: bytes, namespace_id: str, who: Any) -> PullTicket:
        """The ticket, proved this cluster's and of the caller's namespace; a forged
        one or another namespace's is PERMISSION_DENIED and audited (it would read
        bytes the caller is not owed)."""
        if self._ticket_key is None:  # no secret, no seal to prove: never open one
            raise errors.StateConflict("pull tickets need peer.secret on this daemon")
        try:
            ticket = open_ticket(self._ticket_key, blob)
            if ticket.namespace_id != namespace_id:
                raise errors.PermissionDenied(
                    "pull ticket is for another namespace than namespace_id"
                )
        except errors.PermissionDenied as exc:
            caller = who.label if who is not None else "a local client"
            audit.denied(caller, f"FetchFromPeer ticket: {exc}", audit.PULL_TICKET_REFUSED)
            raise
        return ticket

    async def hand_over(
        self, namespace_id: str, block_hashes: bytes, ttl_s: float = 0.0, who: Any = None
    ) -> tuple[int, bytes, float]:
        """One HandOver, whichever channel asked: pin the longest present prefix for
        a peer that will pull it with the ticket (kvstore.transfer.ticket)."""
        if self.allow is not None:
            self.allow(who, namespace_id, "HandOver")
        if self.owner is None:
            raise errors.StateConflict("HandOver needs peer.enabled on this daemon")
        if ttl_s < 0:
            raise errors.InvalidRequest("ttl_s must be >= 0")
        pin, ticket = await self.owner.hand_over(namespace_id, unpack_u64(block_hashes), ttl_s)
        return pin.found_blocks, ticket, pin.lease_ttl_s

    async def HandOver(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        who = CURRENT.get()

        async def run() -> Any:
            found, ticket, ttl_s = await self.hand_over(
                request.namespace_id, request.block_hashes, request.ttl_s, who=who
            )
            return peer_pb2.HandOverResponse(found_blocks=found, ticket=ticket, ttl_s=ttl_s)

        return await call_async(context, run)

    async def FetchFromPeer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        who = CURRENT.get()

        async def run() -> Any:
            result = await self.fetch(
                request.namespace_id,
                request.block_hashes,
                request.peer_node_id,
                request.peer_address,
                request.timeout_s,
                who=who,
                ticket=request.ticket,
            )
            return peer_pb2.FetchFromPeerResponse(
                prefix_blocks=result.prefix_blocks,
                fetched_blocks=result.fetched_blocks,
                local_blocks=result.local_blocks,
                corrupt_blocks=result.corrupt_blocks,
                transport=result.transport,
                pin_s=result.pin_s,
                transfer_s=result.transfer_s,
                verify_s=result.verify_s,
                pieces=result.pieces,
            )

        return await call_async(context, run)


def load_nixl_transport(
    mode: str, agent_name: str, region_addr: int, region_bytes: int
) -> Transport | None:
    """The NIXL transport per ``peer.transport``; None means the gRPC stream fallback."""
    if mode == KIND_GRPC_STREAM:
        log.warning(
            "peer.transport = grpc_stream: block bytes go through gRPC (~10x slower than NIXL)"
        )
        return None
    try:
        from kvstore.transfer.nixl_agent import NixlAgent, NixlTransport

        agent = NixlAgent(agent_name)
        agent.register_region(region_addr, region_bytes)
        return NixlTransport(agent)
    except errors.KVStoreError as exc:
        if mode == KIND_NIXL:
            raise errors.ConfigError(f"peer.transport = nixl but {exc}") from exc
        log.warning(
            "NIXL unavailable (%s): FALLING BACK to the gRPC stream for peer transfer, "
            "~10x slower; install nixl-cu12==1.5.1 for NIXL",
            exc,
        )
        return None


class PeerNode:
    """Everything peer transfer adds to a daemon. Build after the region and the
    manager; ``add_to_server`` before the server starts; ``close`` before the
    region is unmapped (NIXL must deregister it first)."""

    def __init__(
        self,
        manager: BlockManager,
        *,
        secret: str,
        transport: str = "auto",
        transfer_timeout_s: float = 5.0,
        peers: dict[str, str] | None = None,
        max_message_bytes: int = 64 << 20,
        metrics: PeerMetrics | None = None,
        pull_piece_bytes: int = PIECE_MIN_BYTES,
        tls: TlsFiles | None = None,
        pin_channel: bool = True,
        pin_port: int = 0,
    ) -> None:
        if pull_piece_bytes < 4096:
            raise errors.ConfigError(
                f"peer.pull_piece_bytes must be at least 4096, not {pull_piece_bytes}"
            )
        if transport not in ("auto", KIND_NIXL, KIND_GRPC_STREAM):
            raise errors.ConfigError(
                f"peer.transport must be auto, nixl or grpc_stream, not {transport!r}"
            )
        if not 0 < transfer_timeout_s <= MAX_PIN_TTL_S - PIN_TTL_MARGIN_S:
            raise errors.ConfigError(
                f"peer.transfer_timeout_s must be in (0, {MAX_PIN_TTL_S - PIN_TTL_MARGIN_S}]"
            )
        self.manager = manager
        self._secret = secret
        # The pin channel is plaintext: under TLS, pins stay on the (mutual TLS) gRPC.
        self.pin_channel = pin_channel and not (tls is not None and tls.enabled)
        self._pin_port = pin_port
        self._pin_server: PinServer | None = None
        self._max_message_bytes = max_message_bytes
        self.incarnation = secrets.token_hex(8)
        self.agent_name = f"kvstore-{manager.node_id}-{self.incarnation}"
        region = manager.region
        self.nixl = load_nixl_transport(
            transport, self.agent_name, int(region.array.ctypes.data), region.capacity_bytes
        )
        known_peers = list((peers or {}).values())
        # Pulls present our certificate and verify the peer's (mutual TLS), if configured.
        credentials = tls.client_credentials() if tls is not None and tls.enabled else None
        self.stream = GrpcStreamTransport(
            region.array, secret, max_message_bytes, known_peers, credentials=credentials
        )
        pump = getattr(self.nixl, "pump", None)
        service = PeerService(
            manager,
            secret=secret,
            incarnation=self.incarnation,
            nixl=self.nixl,
            agent_name=self.agent_name,
            on_pin=pump.hold if pump is not None else None,
            on_unpin=pump.release if pump is not None else None,
        )
        self.service: Any = service
        self.puller: Any = Puller(
            manager,
            region.array,
            node_id=manager.node_id,
            secret=secret,
            nixl=self.nixl,
            stream=self.stream,
            transfer_timeout_s=transfer_timeout_s,
            max_message_bytes=max_message_bytes,
            known_peers=known_peers,
            piece_bytes=pull_piece_bytes,
            credentials=credentials,
            pin_channel=self.pin_channel,
        )
        self._peer_service = service
        if metrics is not None:  # counted by wrapping: the pull path itself knows nothing of it
            self.puller = metrics.wrap_puller(self.puller)
            self.service = metrics.wrap_service(self.service)
        self.fetch_service = PeerFetchService(
            self.puller, dict(peers or {}), owner=self.service, secret=secret
        )

    async def fill(self, ns_id: str, hashes: list[int], hint: str, timeout_s: float) -> None:
        """Pull what the local prefix of `hashes` lacks from the hinted peer, if it can.

        `hint` is a node id of [peer] peers or a host:port. A peer that is down,
        slow or lacks the blocks leaves the local answer as it is (logged): a
        hint may be stale, and a lookup must still answer.
        """
        address = check_address(hint) if ":" in hint else self.fetch_service.resolve(node_id=hint)
        try:
            await self.puller.pull(ns_id, hashes, address, timeout_s)
        except (errors.Unavailable, errors.BackendError, errors.DataCorruption) as exc:
            log.warning("peer hint %s: pull failed, answering from local blocks: %s", hint, exc)
        except (errors.CapacityExhausted, errors.PermissionDenied) as exc:
            if exc.status_code is None:
                raise  # no room on this daemon: the caller hears of it, as before
            # The peer's own answer over gRPC: out of pins (as good as busy), or it
            # refused our secret (a misconfigured peer: loud, but the hint is advice).
            log.warning("peer hint %s: pull failed, answering from local blocks: %s", hint, exc)

    async def start(self, host: str) -> None:
        """Listen for the pin channel on ``host`` (server.tcp_address's), if it is on;
        a port that cannot be bound leaves pins on gRPC (logged)."""
        if not self.pin_channel:
            return
        server = PinServer(
            self._secret,
            self.service.pin,  # through the metrics wrapper: counted like PinForPull
            self.service.release,
            max_frame_bytes=self._max_message_bytes,
        )
        try:
            port = await server.start(host, self._pin_port)
        except OSError as exc:
            log.warning(
                "pin channel not served (%s:%d: %s); peers pin over gRPC", host, self._pin_port, exc
            )
            return
        self._pin_server = server
        self._peer_service.pin_port = port
        log.info("pin channel on %s:%d", host, port)

    @property
    def transport_kind(self) -> str:
        return KIND_NIXL if self.nixl is not None else KIND_GRPC_STREAM

    def add_to_server(self, server: grpc.aio.Server) -> list[str]:
        """Register both services; return their full names (for health and reflection)."""
        peer_pb2_grpc.add_PeerServiceServicer_to_server(self.service, server)
        peer_pb2_grpc.add_PeerFetchServiceServicer_to_server(self.fetch_service, server)
        services = peer_pb2.DESCRIPTOR.services_by_name
        return [services["PeerService"].full_name, services["PeerFetchService"].full_name]

    async def close(self) -> None:
        """Close channels, stop the progress pump, deregister NIXL memory."""
        if self._pin_server is not None:
            self._peer_service.pin_port = 0
            await self._pin_server.close()
        try:
            await asyncio.wait_for(self.puller.aclose(), 2.0)
            await asyncio.wait_for(self.stream.aclose(), 2.0)
        except TimeoutError:
            log.warning("peer channels did not close in 2 s")
        if self.nixl is not None:
            self.nixl.close()
