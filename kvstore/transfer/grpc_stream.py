"""The fallback transport: block bytes streamed over gRPC.

Used only when NIXL cannot load on this daemon or on the peer (the choice is
logged as a warning by ``select_transport``): Python gRPC streams bytes at
~0.5 GB/s here, 10-40x below NIXL. The owner side is
``PeerService.StreamBlocks``, which serves only blocks of a live pin; this
module holds both the reading side (``GrpcStreamTransport``) and the chunker
the owner streams with (``iter_chunks``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

import grpc
import numpy as np

from kvstore import errors, memcopy
from kvstore.auth import SECRET_METADATA_KEY
from kvstore.errors import InvalidRequest, KVStoreError, Unavailable
from kvstore.tls import ClientCredentials
from kvstore.transfer.base import KIND_GRPC_STREAM, PeerChannels, PeerLink, ReadBatch
from kvstore.v1 import peer_pb2, peer_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 16 << 20


def error_from_rpc(exc: grpc.RpcError, what: str) -> KVStoreError:
    """A peer's failed call as the class it raised (``errors.error_from_rpc``). A
    status no class is sent with (a peer that failed oddly) reads as the peer
    being unavailable: the puller drops its cached info and the hint is skipped."""
    return errors.error_from_rpc(exc, what, unclassified=Unavailable)


def iter_chunks(
    region: np.ndarray, offsets: np.ndarray, block_bytes: int, chunk_bytes: int
) -> Iterator[bytes]:
    """The bytes of the blocks at ``offsets``, concatenated, in chunks of <= chunk_bytes."""
    pending: list[bytes] = []
    pending_bytes = 0
    for off in offsets.tolist():
        pos = 0
        while pos < block_bytes:
            take = min(block_bytes - pos, chunk_bytes - pending_bytes)
            pending.append(region[off + pos : off + pos + take].tobytes())
            pending_bytes += take
            pos += take
            if pending_bytes == chunk_bytes:
                yield b"".join(pending)
                pending, pending_bytes = [], 0
    if pending:
        yield b"".join(pending)


class GrpcStreamTransport:
    """``Transport`` that asks the owner to stream the pinned blocks' bytes."""

    kind = KIND_GRPC_STREAM

    def __init__(
        self,
        region: np.ndarray,
        secret: str,
        max_message_bytes: int = 64 << 20,
        known_peers: Sequence[str] = (),
        *,
        credentials: ClientCredentials | None = None,
    ) -> None:
        assert region.dtype == np.uint8 and region.ndim == 1
        self._region = region
        self._metadata = ((SECRET_METADATA_KEY, secret),)
        self._channels = PeerChannels(max_message_bytes, known=known_peers, credentials=credentials)
        self.chunk_bytes = min(DEFAULT_CHUNK_BYTES, max_message_bytes // 2)

    def local_info(self) -> bytes:
        return b""

    def add_peer(self, info: bytes) -> str:
        return ""

    def forget_peer(self, key: str) -> None:
        return None

    def has_peer(self, key: str) -> bool:
        return True

    def _stub(self, address: str) -> peer_pb2_grpc.PeerServiceStub:
        return peer_pb2_grpc.PeerServiceStub(self._channels.get(address))

    async def read(
        self,
        peer: PeerLink,
        batch: ReadBatch,
        timeout_s: float,
        *,
        share_gil: Callable[[], bool] | None = None,  # awaits per chunk: the GIL is shared
    ) -> None:
        if not len(batch):
            return
        batch.check_bounds(peer.region_bytes, len(self._region))
        sizes = batch.sizes
        if not (sizes == sizes[0]).all():
            raise InvalidRequest("grpc_stream reads whole blocks of one size")
        block_bytes = int(sizes[0])
        request = peer_pb2.StreamBlocksRequest(
            lease_id=peer.lease_id,
            offsets=batch.remote_offsets.astype("<u8").tobytes(),
            chunk_bytes=self.chunk_bytes,
        )
        local = batch.local_offsets.tolist()
        total = batch.nbytes
        got = 0
        call = self._stub(peer.address).StreamBlocks(
            request, metadata=self._metadata, timeout=timeout_s
        )
        try:
            async for chunk in call:
                data = np.frombuffer(chunk.data, dtype=np.uint8)
                if got + len(data) > total:
                    raise Unavailable(f"peer {peer.node_id} streamed more bytes than asked")
                pos = 0
                while pos < len(data):
                    index, within = divmod(got, block_bytes)
                    take = min(block_bytes - within, len(data) - pos)
                    dst = local[index] + within
                    memcopy.copy(self._region[dst : dst + take], data[pos : pos + take])
                    pos += take
                    got += take
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, f"stream from {peer.node_id}") from exc
        finally:
            call.cancel()
        if got != total:
            raise Unavailable(f"peer {peer.node_id} ended the stream after {got} of {total} bytes")

    def close(self) -> None:
        # Channels close with the event loop; grpc.aio needs a loop to close them cleanly.
        self._channels.forget_all()

    async def aclose(self) -> None:
        await self._channels.aclose()
