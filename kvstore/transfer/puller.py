"""The pull protocol, puller side: this daemon (B) fetches blocks a peer (A) holds.

One pull, for one namespace and a run of block hashes in prefix order:

1. skip the prefix B already holds (local lookup);
2. A's metadata: fetched once per A incarnation and cached; a new incarnation
   in a pin reply (A restarted) drops the stale NIXL peer and loads the new one;
3. ``PinForPull`` on A: A pins its longest present prefix under a lease that
   expires on its own, and returns offsets, block size and xxh3 checksums;
4. ``prepare_store`` on B for those blocks (present or in-flight ones skipped);
5. one transport read for the whole batch, bounded by ``timeout_s``;
6. xxh3 of every landed block against A's: mismatches are dropped, never served;
7. ``commit_store`` of the verified blocks; ``ReleasePull`` on A.

Any failure in 5 frees B's prepared slots at once (the store lease is
released) and releases A's pin best-effort; a dead A then costs B at most
``timeout_s``, and A's pin expires by itself if B dies. Blocks evicted on A
between a caller's lookup and the pin simply shorten A's prefix: a clean
partial result.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import msgspec
import numpy as np

from kvstore.checksums import checksums_into, checksums_of, compile_checksums, lock_free
from kvstore.errors import DeadlineExceeded, InvalidRequest, KVStoreError, Unavailable
from kvstore.manager import STORE_ALLOCATED, BlockManager
from kvstore.namespace import NamespaceSpec
from kvstore.tls import ClientCredentials
from kvstore.transfer.base import (
    KIND_NIXL,
    MAX_HINT_CHANNELS,
    PeerChannels,
    PeerLink,
    ReadBatch,
    Transport,
)
from kvstore.transfer.grpc_stream import SECRET_METADATA_KEY, error_from_rpc
from kvstore.transfer.pin_channel import PinClient
from kvstore.transfer.ticket import PullTicket
from kvstore.v1 import peer_pb2, peer_pb2_grpc, store_pb2

log = logging.getLogger(__name__)
_U64 = struct.Struct("<Q")

# Control calls to a peer (metadata, pin, release) are small: bound them apart
# from the data transfer so a hung peer is noticed quickly.
CONTROL_TIMEOUT_S = 2.0
# The owner's pin must outlive our transfer deadline, and not much more: it is
# what a puller that died strands on the owner.
PIN_TTL_MARGIN_S = 5.0
# The longest pin an owner grants (a dead puller strands blocks at most this long).
MAX_PIN_TTL_S = 120.0
# A pull of at least 2 x PIECE_MIN_BYTES (peer.pull_piece_bytes) is read as up
# to MAX_PIECES pieces, READS_IN_FLIGHT at a time in prefix order; each piece is
# verified in a thread as soon as it lands, while the next ones are read
# (docs/peer-transfer.md "The pull pipeline").
PIECE_MIN_BYTES = 32 << 20
MAX_PIECES = 32
READS_IN_FLIGHT = 2
# Pin releases in flight at once; beyond it pins are left to expire on the owner.
MAX_PENDING_RELEASES = 256
# Blocks at least this big are hashed in a thread; smaller ones on the loop, in
# slices of HASH_SLICE_BYTES (~1-2 ms) between which other calls run.
THREAD_HASH_MIN_BLOCK_BYTES = 1 << 20
HASH_SLICE_BYTES = 8 << 20
# A one-piece pull of at most this many bytes is hashed on the loop whatever its
# block size: the thread hand-off (~0.1-0.3 ms on a busy 2-core machine) costs
# more than hashing it (2 MiB: ~0.3 ms), and it is on the first byte's path.
INLINE_HASH_MAX_BYTES = 4 << 20
# python-xxhash drops the GIL only for large inputs (measured: a 0.5 ms sleep on
# another thread took 5.7 ms beside a thread hashing 16 or 64 KiB blocks, 0.6 ms
# beside 256 KiB or 2 MiB ones). So the hashing thread hands the GIL over itself
# after about this many bytes of small blocks, or the event loop (posting and
# polling the next READs) waits a whole switch interval (5 ms) each time it
# comes back from a call that released the GIL. The hand-off is a short sleep,
# not os.sched_yield(): that returns (and retakes the GIL) before the waiting
# thread has woken (~50-70 us across CPUs here); measured, 256 MiB of 64 KiB
# blocks read as 8 pieces while hashed: 101 ms with it, 90 ms with the sleep
# (bare READ 66-79 ms, no hashing 71-78 ms).
GIL_HANDOFF_BYTES = 1 << 20
GIL_HANDOFF_S = 50e-6


@dataclass(slots=True)
class PeerInfo:
    node_id: str
    address: str
    incarnation: str
    transport: str
    key: str
    region_base: int
    region_bytes: int
    pin_port: int = 0
    """The owner's pin channel (0: none, or not reachable from here: pins over gRPC)."""


@dataclass(slots=True)
class PullResult:
    prefix_blocks: int
    """Longest prefix of the requested hashes present here after the pull."""
    fetched_blocks: int
    local_blocks: int
    corrupt_blocks: int
    transport: str
    pin_s: float = 0.0
    """Seconds of the PinForPull round trip (the owner's pin and checksums included)."""
    transfer_s: float = 0.0
    """Seconds until the last byte landed."""
    verify_s: float = 0.0
    """Seconds of checksum work after the last byte landed (the rest overlaps the read)."""
    commit_s: float = 0.0
    fetched_bytes: int = 0
    """Bytes of the fetched blocks."""
    pieces: int = 0
    """Pieces the read was split into (1: read, then verified; more: pipelined)."""
    handed_over: bool = False
    """Read from a pin the owner handed over (a ticket): no pin round trip."""


async def checksums_async(
    region: np.ndarray, offsets: Sequence[int], block_bytes: int
) -> list[int]:
    """xxh3 of each block, without stalling the event loop for long.

    Compiled (kvstore.checksums holds no interpreter lock while it hashes) or
    large blocks (python-xxhash drops it for those): in a thread, beside reads
    still in flight. Else small blocks are hashed on the loop in slices: one
    lock hand-off per small block costs more than the hash while the loop is
    busy polling NIXL.
    """
    if lock_free() and len(offsets) * block_bytes <= INLINE_HASH_MAX_BYTES:
        return checksums_of(region, offsets, block_bytes)
    if lock_free() or block_bytes >= THREAD_HASH_MIN_BLOCK_BYTES:
        return await asyncio.to_thread(checksums_of, region, list(offsets), block_bytes)
    per_slice = max(1, HASH_SLICE_BYTES // block_bytes)
    out: list[int] = []
    for i in range(0, len(offsets), per_slice):
        if i:
            await asyncio.sleep(0)
        out += checksums_of(region, offsets[i : i + per_slice], block_bytes)
    return out


class Puller:
    def __init__(
        self,
        manager: BlockManager,
        region: np.ndarray,
        *,
        node_id: str,
        secret: str,
        nixl: Transport | None,
        stream: Transport,
        transfer_timeout_s: float,
        max_message_bytes: int = 64 << 20,
        known_peers: Sequence[str] = (),
        piece_bytes: int = PIECE_MIN_BYTES,
        credentials: ClientCredentials | None = None,
        pin_channel: bool = True,
    ) -> None:
        if piece_bytes <= 0:
            raise InvalidRequest(f"piece_bytes must be > 0, not {piece_bytes}")
        compile_checksums()  # in the background; python-xxhash hashes until it is done
        self.piece_bytes = piece_bytes
        self.manager = manager
        self.region = region
        self.node_id = node_id
        self.nixl = nixl
        self.stream = stream
        self.transfer_timeout_s = transfer_timeout_s
        self._metadata = ((SECRET_METADATA_KEY, secret),)
        self._secret = secret
        self._max_message_bytes = max_message_bytes
        # Pins over the owners' pin channels (kvstore.transfer.pin_channel): one
        # connection per peer address, kept while its PeerInfo is (so bounded alike).
        self.pin_channel = pin_channel
        self._pin_clients: dict[str, PinClient] = {}
        self._closing_pins: set[asyncio.Task[None]] = set()
        self._channels = PeerChannels(max_message_bytes, known=known_peers, credentials=credentials)
        # By address, oldest first; peers that are not configured are bounded like
        # their channels (MAX_HINT_CHANNELS), configured ones are always kept.
        self._peers: dict[str, PeerInfo] = {}
        self._releases: set[asyncio.Task[None]] = set()

    # ----------------------------------------------------------------- peers

    def _stub(self, address: str) -> peer_pb2_grpc.PeerServiceStub:
        return peer_pb2_grpc.PeerServiceStub(self._channels.get(address))

    def transport_to(self, address: str) -> str:
        """The transport a pull from ``address`` uses (or would: the peer's is not known yet)."""
        info = self._peers.get(address)
        if info is not None:
            return self._transport_for(info).kind
        return self.nixl.kind if self.nixl is not None else self.stream.kind

    def _transport_for(self, info: PeerInfo) -> Transport:
        if info.transport == KIND_NIXL and self.nixl is not None:
            return self.nixl
        return self.stream

    async def _peer(self, address: str, *, refresh: bool = False) -> PeerInfo:
        info = self._peers.get(address)
        if info is not None and not refresh:
            return info
        try:
            reply = await self._stub(address).GetAgentMetadata(
                peer_pb2.GetAgentMetadataRequest(requester_node_id=self.node_id),
                metadata=self._metadata,
                timeout=CONTROL_TIMEOUT_S,
            )
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise error_from_rpc(exc, f"peer {address} metadata") from exc
            # The cached channel may be in reconnect backoff after the peer
            # restarted; one fresh channel connects at once (or fails at once).
            await self._channels.drop(address)
            try:
                reply = await self._stub(address).GetAgentMetadata(
                    peer_pb2.GetAgentMetadataRequest(requester_node_id=self.node_id),
                    metadata=self._metadata,
                    timeout=CONTROL_TIMEOUT_S,
                )
            except grpc.RpcError as exc2:
                # Nothing answers there (or not a peer): keep no channel for it, so
                # hints naming dead addresses leave nothing behind.
                await self._channels.drop(address)
                raise error_from_rpc(exc2, f"peer {address} metadata") from exc2
        if info is not None:
            self._forget(info)
        key = ""
        if reply.transport == KIND_NIXL and self.nixl is not None:
            key = self.nixl.add_peer(reply.agent_metadata)
        elif reply.transport == KIND_NIXL or self.nixl is None:
            log.warning(
                "peer %s (%s) will be read over the gRPC stream fallback, ~10x slower than NIXL "
                "(NIXL not loaded %s)",
                reply.node_id,
                address,
                "here" if self.nixl is None else "there",
            )
        info = PeerInfo(
            node_id=reply.node_id,
            address=address,
            incarnation=reply.incarnation,
            transport=reply.transport,
            key=key,
            region_base=reply.region_base,
            region_bytes=reply.region_bytes,
            pin_port=reply.pin_port if self.pin_channel else 0,
        )
        self._peers[address] = info
        hinted = [a for a in self._peers if a not in self._channels.known]
        for stale in hinted[: max(0, len(hinted) - MAX_HINT_CHANNELS)]:
            self._forget(self._peers[stale])
        return info

    @property
    def open_channels(self) -> int:
        """gRPC channels this puller keeps to peers (bounded; for tests and status)."""
        return len(self._channels)

    def _forget(self, info: PeerInfo) -> None:
        self._peers.pop(info.address, None)
        self._drop_pin_client(info.address)
        if info.key and self.nixl is not None:
            self.nixl.forget_peer(info.key)

    def _drop_pin_client(self, address: str) -> None:
        client = self._pin_clients.pop(address, None)
        if client is not None:
            task = asyncio.get_running_loop().create_task(client.aclose())
            self._closing_pins.add(task)
            task.add_done_callback(self._closing_pins.discard)

    @property
    def pin_channels(self) -> int:
        """Open pin channel connections (bounded like the peers; for tests and status)."""
        return len(self._pin_clients)

    async def _pin_client(self, info: PeerInfo) -> PinClient | None:
        """The connection to ``info``'s pin channel, opened on first use; None when the
        owner serves none or it cannot be reached (then pins go over gRPC for this
        incarnation: a port a firewall drops must not cost every pull a timeout)."""
        if not info.pin_port:
            return None
        client = self._pin_clients.get(info.address)
        if client is not None:
            if client.broken is None:
                return client
            # The connection was lost: the owner died or restarted (a restarted one
            # listens on a new port, with a new agent and region). Forget it all;
            # the pull's retry starts from fresh metadata.
            self._forget(info)
            raise client.broken
        host = info.address.rpartition(":")[0]
        try:
            client = await PinClient.open(
                host,
                info.pin_port,
                self._secret,
                name=info.node_id,
                timeout_s=CONTROL_TIMEOUT_S,
                max_frame_bytes=self._max_message_bytes,
            )
        except Unavailable as exc:
            log.warning(
                "peer %s: pin channel unreachable (%s); pinning over gRPC", info.node_id, exc
            )
            info.pin_port = 0
            return None
        if self._peers.get(info.address) is not info:
            await client.aclose()  # forgotten while we connected
            return None
        other = self._pin_clients.get(info.address)
        if other is not None and other.broken is None:
            await client.aclose()  # a concurrent pull connected first: one connection
            return other
        self._pin_clients[info.address] = client
        return client

    # ------------------------------------------------------------------ pull

    async def pull(
        self,
        ns_id: str,
        hashes: Sequence[int],
        address: str,
        timeout_s: float = 0.0,
        ticket: PullTicket | None = None,
    ) -> PullResult:
        """Pull what this node lacks of ``hashes``' prefix from the peer at ``address``.
        ``ticket``: a pin the peer handed over (opened and checked against ``ns_id``
        by the caller, kvstore.peer_service): read at once, no pin round trip."""
        timeout_s = timeout_s or self.transfer_timeout_s
        if not 0 < timeout_s <= MAX_PIN_TTL_S - PIN_TTL_MARGIN_S:
            raise InvalidRequest(f"timeout_s must be in (0, {MAX_PIN_TTL_S - PIN_TTL_MARGIN_S}]")
        if not address:
            raise InvalidRequest("no peer address")
        ns = self.manager.namespace(ns_id)
        start = ticket_start(ticket, hashes) if ticket is not None else 0
        local_prefix = self.manager.lookup(ns_id, hashes).prefix_blocks
        wanted = list(hashes[local_prefix:])
        info = await self._peer(address)
        if ticket is not None:
            if ticket.node_id != info.node_id:
                raise InvalidRequest(
                    f"ticket is from node {ticket.node_id!r}, the peer is {info.node_id!r}"
                )
            handed = await self._handed_over(
                info, address, ticket, start, len(hashes), local_prefix, timeout_s
            )
            if handed is not None:
                info, pin = handed
                try:
                    result = await self._pull_pinned(
                        ns_id, hashes, info, pin, local_prefix, 0.0, timeout_s
                    )
                    result.handed_over = pin.found_blocks > 0
                    covered = ticket.blocks - start
                    if result.prefix_blocks < covered or covered >= len(hashes):
                        return result
                    # The ticket ends before the wanted blocks do (the owner had not
                    # committed them all when it was made): the rest, if the owner
                    # has it now, by an ordinary pull.
                    return _merged(result, await self.pull(ns_id, hashes, address, timeout_s))
                except DeadlineExceeded:
                    raise  # a stalled peer: waiting again would double the bound
                except Unavailable:
                    # Nothing asked the owner before this read, so our cache and the
                    # ticket can both predate a restart: the read then fails on the
                    # dead agent. A new incarnation: an ordinary pull from it.
                    info = await self._peer(address, refresh=True)
                    if info.incarnation == ticket.incarnation:
                        raise
                    log.info("peer %s restarted since its ticket: pinning", info.node_id)
        if not wanted:
            return PullResult(local_prefix, 0, local_prefix, 0, info.transport)

        t_pin = time.monotonic()
        try:
            pin = await self._pin(info, ns.spec, wanted, timeout_s)
        except DeadlineExceeded:
            raise  # a stalled peer: waiting again would double the bound
        except Unavailable:
            # Refused on a channel cached from before a restart: once more on a
            # fresh channel, with fresh metadata. A dead peer fails here at once.
            info = await self._peer(address, refresh=True)
            pin = await self._pin(info, ns.spec, wanted, timeout_s)
        pin_s = time.monotonic() - t_pin
        return await self._pull_pinned(ns_id, hashes, info, pin, local_prefix, pin_s, timeout_s)

    async def _handed_over(
        self,
        info: PeerInfo,
        address: str,
        ticket: PullTicket,
        start: int,
        wanted_blocks: int,
        local_prefix: int,
        timeout_s: float,
    ) -> tuple[PeerInfo, peer_pb2.PinForPullResponse] | None:
        """The ticket's pin, as the owner's PinForPull would have answered for the
        wanted blocks (the ticket's from ``start``) past ``local_prefix``; None when
        it cannot serve (its owner restarted, or it expires before the read could
        end): then an ordinary pull. A ticket with nothing to read is released."""
        if ticket.incarnation != info.incarnation:
            info = await self._peer(address, refresh=True)  # cached from before a restart?
            if ticket.incarnation != info.incarnation:
                log.info("ticket from %s is of an earlier incarnation: pinning", info.node_id)
                return None  # its lease died with that daemon: nothing to release
        if ticket.expires_unix_s - time.time() < min(timeout_s, PIN_TTL_MARGIN_S):
            log.info("ticket from %s expires before a read could end: pinning", info.node_id)
            self._schedule_release(info, ticket.lease_id)
            return None
        # The wanted blocks the ticket holds; a pull of a ticket reads no others.
        covered = min(ticket.blocks - start, wanted_blocks)
        if local_prefix >= covered:
            self._schedule_release(info, ticket.lease_id)  # all of it is here already
            return info, peer_pb2.PinForPullResponse(incarnation=info.incarnation)
        skip = slice(8 * (start + local_prefix), 8 * (start + covered))
        return info, peer_pb2.PinForPullResponse(
            lease_id=ticket.lease_id,
            found_blocks=covered - local_prefix,
            offsets=ticket.offsets[skip],
            block_bytes=ticket.block_bytes,
            checksums=ticket.checksums[skip],
            incarnation=ticket.incarnation,
        )

    async def _pull_pinned(
        self,
        ns_id: str,
        hashes: Sequence[int],
        info: PeerInfo,
        pin: peer_pb2.PinForPullResponse,
        local_prefix: int,
        pin_s: float,
        timeout_s: float,
    ) -> PullResult:
        """Read, verify and commit the blocks ``pin`` holds on the owner (the blocks
        of ``hashes`` past ``local_prefix``), then release it."""
        address = info.address
        wanted = list(hashes[local_prefix:])
        if pin.incarnation != info.incarnation:
            # The owner restarted since we cached it: its agent and region are new.
            log.info("peer %s at %s restarted: re-fetching its metadata", info.node_id, address)
            info = await self._peer(address, refresh=True)
        found = pin.found_blocks
        if found == 0:
            return PullResult(local_prefix, 0, local_prefix, 0, info.transport)
        try:
            result = await self._fill(ns_id, info, pin, wanted[:found], timeout_s)
        finally:
            self._schedule_release(info, pin.lease_id)
        prefix = self.manager.lookup(ns_id, hashes).prefix_blocks
        result.prefix_blocks = prefix
        result.local_blocks += local_prefix
        result.pin_s = pin_s
        log.debug(
            "pulled %d blocks from %s: pin %.2f ms, read %.2f ms, verify %.2f ms, commit %.2f ms",
            result.fetched_blocks,
            info.node_id,
            pin_s * 1e3,
            result.transfer_s * 1e3,
            result.verify_s * 1e3,
            result.commit_s * 1e3,
        )
        return result

    async def _pin(
        self, info: PeerInfo, spec: NamespaceSpec, wanted: list[int], timeout_s: float
    ) -> peer_pb2.PinForPullResponse:
        request = peer_pb2.PinForPullRequest(
            spec=store_pb2.NamespaceSpec(**msgspec.structs.asdict(spec)),
            block_hashes=np.asarray(wanted, dtype="<u8").tobytes(),
            lease_ttl_s=min(timeout_s + PIN_TTL_MARGIN_S, MAX_PIN_TTL_S),
            requester_node_id=self.node_id,
            transport=self._transport_for(info).kind,
        )
        client = await self._pin_client(info)
        if client is not None:
            try:
                return await client.pin(request, CONTROL_TIMEOUT_S)
            except Unavailable:
                # The owner went away (or restarted: its channel is new): forget it,
                # so the caller's retry starts from fresh metadata. DeadlineExceeded
                # (an owner that stalled) counts as that too.
                self._forget(info)
                raise
        try:
            return await self._stub(info.address).PinForPull(
                request, metadata=self._metadata, timeout=CONTROL_TIMEOUT_S
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                await self._channels.drop(info.address)  # the next pull starts on a fresh one
            err = error_from_rpc(exc, f"pin on peer {info.node_id}")
            if isinstance(err, Unavailable):
                self._forget(info)
            raise err from exc

    async def _fill(
        self,
        ns_id: str,
        info: PeerInfo,
        pin: peer_pb2.PinForPullResponse,
        hashes: list[int],
        timeout_s: float,
    ) -> PullResult:
        n = len(hashes)
        remote_offsets = np.frombuffer(pin.offsets, dtype="<u8")
        checksums = np.frombuffer(pin.checksums, dtype="<u8")
        block_bytes = pin.block_bytes
        ns = self.manager.namespace(ns_id)
        if len(remote_offsets) != n or len(checksums) != n or block_bytes != ns.block_bytes:
            raise Unavailable(f"peer {info.node_id} sent a malformed pin reply")
        plan = self.manager.prepare_store(ns_id, hashes, timeout_s + PIN_TTL_MARGIN_S)
        transport = self._transport_for(info)
        local_offsets = np.asarray(plan.offsets, dtype=np.uint64)
        if plan.statuses.count(STORE_ALLOCATED) == n:
            # Every block gets a slot (the usual pull): no picking (on the first
            # byte's path, each numpy call is several microseconds).
            chosen, remote, expected = hashes, remote_offsets, checksums
        else:  # some are here already, or arriving by another store
            picked = np.flatnonzero(np.frombuffer(plan.statuses, dtype=np.uint8) == STORE_ALLOCATED)
            chosen = [hashes[i] for i in picked.tolist()]
            remote, expected = remote_offsets[picked], checksums[picked]
            local_offsets = local_offsets[picked]
        skipped = n - len(chosen)
        if not chosen:
            return PullResult(0, 0, skipped, 0, transport.kind)
        batch = ReadBatch(remote, local_offsets, np.full(len(chosen), block_bytes, dtype=np.uint64))
        link = PeerLink(
            node_id=info.node_id,
            address=info.address,
            key=info.key,
            region_base=info.region_base,
            region_bytes=info.region_bytes,
            lease_id=pin.lease_id,
        )
        # The pipeline: pieces are read in prefix order, READS_IN_FLIGHT at a time
        # (the next READ is posted before the current one ends, so the wire never
        # idles), and each landed piece is handed to one hashing thread, which
        # hashes it while the next ones are read. xxh3 releases the GIL while it
        # hashes; the NIXL poll loop does not, so while pieces wait to be hashed it
        # hands the GIL over between polls (share_gil), or the hashing thread would
        # wait a switch interval (5 ms) per block.
        landed = np.zeros(len(chosen), dtype=np.uint64)
        pieces = _pieces(len(chosen), block_bytes, self.piece_bytes)
        reads = asyncio.Semaphore(READS_IN_FLIGHT)
        hasher = (
            _PieceHasher(self.region, batch.local_offsets, block_bytes, landed)
            if len(pieces) > 1
            else None
        )
        started = time.monotonic()
        deadline_s = started + timeout_s
        reads_done_s = [started]

        def share_gil() -> bool:
            # (a compiled hash holds no lock to share: kvstore.checksums)
            return hasher is not None and hasher.pending > 0 and not lock_free()

        async def piece(lo: int, hi: int) -> None:
            sub = ReadBatch(
                batch.remote_offsets[lo:hi], batch.local_offsets[lo:hi], batch.sizes[lo:hi]
            )
            async with reads:
                await transport.read(
                    link, sub, max(deadline_s - time.monotonic(), 0.001), share_gil=share_gil
                )
            reads_done_s[0] = max(reads_done_s[0], time.monotonic())
            if len(pieces) == 1:
                # Nothing to overlap with: hash on the loop (no thread hand-off).
                if (hi - lo) * block_bytes <= INLINE_HASH_MAX_BYTES:
                    checksums_into(
                        self.region, batch.local_offsets[lo:hi], block_bytes, landed[lo:hi]
                    )
                else:
                    offsets = batch.local_offsets[lo:hi].tolist()
                    landed[lo:hi] = await checksums_async(self.region, offsets, block_bytes)
                return
            assert hasher is not None
            hasher.submit(lo, hi)
            # A READ over CMA lands inside its post (no poll, no await): give the
            # loop a turn between pieces, so other calls are served during a pull.
            await asyncio.sleep(0)

        try:
            try:
                if hasher is None:  # one piece: no task, no group (on the first byte's path)
                    await piece(*pieces[0])
                else:
                    try:
                        async with asyncio.TaskGroup() as group:
                            for lo, hi in pieces:
                                group.create_task(piece(lo, hi))
                    except BaseException:
                        await hasher.finish(stop=True)  # the thread ends at its current piece
                        raise
                    await hasher.finish()  # every piece hashed
            except BaseExceptionGroup as eg:
                # Report the peer's failure, not the cancellations it caused.
                first = next(
                    (e for e in eg.exceptions if isinstance(e, KVStoreError)), eg.exceptions[0]
                )
                if any(getattr(e, "slots_in_use", False) for e in eg.exceptions):
                    first.slots_in_use = True  # type: ignore[union-attr]
                raise first from None
        except BaseException as exc:
            if getattr(exc, "slots_in_use", False):
                # NIXL could not cancel a READ: it may still land, so the slots are
                # left to the store lease's expiry instead of being reused now.
                log.error(
                    "pull from %s: READ not cancellable; slots expire with their lease",
                    info.node_id,
                )
            else:
                self.manager.release([plan.lease_id])
            if isinstance(exc, Unavailable):  # includes DeadlineExceeded
                self._forget(info)  # re-fetch metadata next time: the peer may be back, new
            raise
        transfer_s = reads_done_s[0] - started
        verify_s = time.monotonic() - reads_done_s[0]  # the checksum work not hidden by reads
        if landed.tobytes() == expected.tobytes():  # all good (the usual pull)
            verified, sums, corrupt = chosen, landed.tolist(), 0
        else:
            good = landed == expected
            verified = [h for h, ok in zip(chosen, good.tolist(), strict=True) if ok]
            sums, corrupt = landed[good].tolist(), int((~good).sum())
        if corrupt:
            log.error(
                "peer %s: %d of %d blocks failed their checksum; dropped",
                info.node_id,
                corrupt,
                len(chosen),
            )
        started = time.monotonic()
        try:
            if verified:
                # Their checksums kept (verified: the next peer need not rehash), and
                # the copies noted as the peer's too (copy-aware eviction, pulled
                # copies as replicas: docs/eviction.md).
                self.manager.commit_pulled(plan.lease_id, verified, sums, info.node_id)
            else:
                self.manager.release([plan.lease_id])
        except KVStoreError:
            # The store lease expired while we read (a timeout longer than its TTL).
            log.warning("pull from %s: local store lease ended before commit", info.node_id)
            raise
        return PullResult(
            0,
            len(verified),
            skipped,
            corrupt,
            transport.kind,
            transfer_s=transfer_s,
            verify_s=verify_s,
            commit_s=time.monotonic() - started,
            fetched_bytes=len(verified) * block_bytes,
            pieces=len(pieces),
        )

    def _schedule_release(self, info: PeerInfo, lease_id: int) -> None:
        """Release the owner's pin off the reply path: the caller need not wait a round
        trip for it, and a lost release only means the pin expires a bit later."""
        if not lease_id:
            return
        client = self._pin_clients.get(info.address)
        if client is not None and client.release_soon(lease_id):
            return  # one frame (shared), after the reply, no answer awaited, no task
        if len(self._releases) >= MAX_PENDING_RELEASES:
            log.warning(
                "%d pin releases pending; letting pin %d expire", len(self._releases), lease_id
            )
            return
        task = asyncio.get_running_loop().create_task(self._release_pin(info, lease_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release_pin(self, info: PeerInfo, lease_id: int) -> None:
        if not lease_id:
            return
        try:
            # A pull of a handed-over pin may be the first call to this owner:
            # its release opens the pin channel (a frame, not a gRPC call, for it
            # and every later release).
            client = await self._pin_client(info)
        except KVStoreError:
            client = None
        if client is not None and client.release_soon(lease_id):
            return
        try:
            await self._stub(info.address).ReleasePull(
                peer_pb2.ReleasePullRequest(lease_ids=[lease_id]),
                metadata=self._metadata,
                timeout=CONTROL_TIMEOUT_S,
            )
        except grpc.RpcError as exc:
            # The pin expires on the owner by itself; nothing is stranded.
            log.info("release of pin %d on %s failed: %s", lease_id, info.node_id, exc.code())

    async def aclose(self) -> None:
        if self._releases:
            await asyncio.wait(list(self._releases), timeout=CONTROL_TIMEOUT_S)
        for address in list(self._pin_clients):
            self._drop_pin_client(address)
        if self._closing_pins:
            await asyncio.wait(list(self._closing_pins), timeout=CONTROL_TIMEOUT_S)
        await self._channels.aclose()
        for info in list(self._peers.values()):
            self._forget(info)


def _merged(first: PullResult, then: PullResult) -> PullResult:
    """One pull's result from two in a row over the same blocks (``then`` ran last)."""
    return PullResult(
        prefix_blocks=then.prefix_blocks,
        fetched_blocks=first.fetched_blocks + then.fetched_blocks,
        local_blocks=first.local_blocks,
        corrupt_blocks=first.corrupt_blocks + then.corrupt_blocks,
        transport=first.transport,
        pin_s=then.pin_s,
        transfer_s=first.transfer_s + then.transfer_s,
        verify_s=first.verify_s + then.verify_s,
        commit_s=first.commit_s + then.commit_s,
        fetched_bytes=first.fetched_bytes + then.fetched_bytes,
        pieces=first.pieces + then.pieces,
        handed_over=first.handed_over,
    )


def ticket_start(ticket: PullTicket, hashes: Sequence[int]) -> int:
    """Where ``hashes`` start among the ticket's blocks: they must be a run of them
    (a decode side asks from its first missing block, the prefill side handed over
    the whole prompt), as far as the ticket goes; InvalidRequest otherwise.

    On the packed bytes, no arrays: this is on a handed-over pull's first byte,
    where each numpy call costs several microseconds in a daemon that was idle."""
    if not len(hashes):
        return 0
    mine = ticket.block_hashes
    first = _U64.pack(hashes[0])
    at = mine.find(first)
    while at > 0 and at % 8:  # a match across two hashes' bytes is no block
        at = mine.find(first, at + 1)
    if at < 0:
        raise InvalidRequest("block_hashes do not start at a block of the ticket")
    covered = min(len(mine) - at, 8 * len(hashes))
    if mine[at : at + covered] != np.asarray(hashes[: covered // 8], dtype="<u8").tobytes():
        raise InvalidRequest("block_hashes leave the ticket's run of blocks")
    return at // 8


class _PieceHasher:
    """One thread that hashes the landed pieces of one pull as they are handed over.

    Not a task per piece awaiting ``to_thread``: a NIXL READ over CMA (same host)
    completes inside its post, so the pieces' reads run back to back on the loop
    and a hashing task would be resumed only after the last one: measured, all
    but the first piece were hashed after the last byte (verify_s ~ the whole
    xxh3 work). This thread needs no turn of the loop to pick up the next piece.
    """

    def __init__(
        self, region: np.ndarray, offsets: np.ndarray, block_bytes: int, out: np.ndarray
    ) -> None:
        self._region = region
        self._offsets = offsets
        self._block_bytes = block_bytes
        self._out = out
        self._queue: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._submitted = 0  # written by the loop's thread only
        self._hashed = 0  # written by the hashing thread only
        self._stop = False
        loop = asyncio.get_running_loop()
        self._done: asyncio.Future[None] = loop.create_future()
        self._thread = threading.Thread(
            target=self._run, args=(loop,), name="pull-verify", daemon=True
        )
        self._thread.start()

    @property
    def pending(self) -> int:
        """Pieces handed over and not hashed yet."""
        return self._submitted - self._hashed

    def submit(self, lo: int, hi: int) -> None:
        self._submitted += 1
        self._queue.put((lo, hi))

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        error: BaseException | None = None
        try:
            while (item := self._queue.get()) is not None:
                if self._stop:
                    continue  # the pull failed: drain without hashing
                lo, hi = item
                # Whole piece in one call when xxh3 drops the GIL itself; else in
                # runs of ~GIL_HANDOFF_BYTES with the GIL handed over between them.
                step = hi - lo
                if self._block_bytes < GIL_HANDOFF_BYTES and not lock_free():
                    step = max(1, GIL_HANDOFF_BYTES // self._block_bytes)
                for i in range(lo, hi, step):
                    if i > lo:
                        time.sleep(GIL_HANDOFF_S)
                    j = min(hi, i + step)
                    checksums_into(
                        self._region, self._offsets[i:j], self._block_bytes, self._out[i:j]
                    )
                self._hashed += 1
        except BaseException as exc:  # reported to finish(), never lost in the thread
            error = exc
        loop.call_soon_threadsafe(self._finished, error)

    def _finished(self, error: BaseException | None) -> None:
        if self._done.done():
            return
        if error is not None:
            self._done.set_exception(error)
        else:
            self._done.set_result(None)

    async def finish(self, *, stop: bool = False) -> None:
        """Wait until every piece handed over is hashed; ``stop`` (the pull failed):
        only until the thread ends the piece it is hashing."""
        self._stop = stop
        self._queue.put(None)
        await asyncio.shield(self._done)


def _pieces(n: int, block_bytes: int, piece_bytes: int = PIECE_MIN_BYTES) -> list[tuple[int, int]]:
    """Index ranges of the pieces of an n-block read, in order: one piece below
    2 x ``piece_bytes`` in all, at most MAX_PIECES (pieces grow past that)."""
    count = max(1, min(MAX_PIECES, n * block_bytes // piece_bytes, n))
    if count == 1:
        return [(0, n)]  # on the first byte's path (np.linspace alone costs ~15 us)
    return list(itertools.pairwise(n * i // count for i in range(count + 1)))
