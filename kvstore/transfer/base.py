"""What a peer transport is.

A transport moves block bytes from a peer daemon's DRAM region into this
daemon's DRAM region. It knows nothing of namespaces, hashes or leases beyond
carrying the lease id the owner pinned the blocks under; the pull protocol
(``kvstore.transfer.puller``) decides what to read and checks what arrived.

Primitives:

- ``local_info()``: the bytes a peer needs to read from us (NIXL agent
  metadata; empty for the gRPC stream). Handed out by ``PeerService``.
- ``add_peer(info)`` / ``forget_peer(key)``: load or drop a peer's info
  (re-done when the peer restarts: its key changes with its incarnation).
- ``read(peer, batch, timeout_s)``: one batched read of
  (remote offset, local offset, nbytes) descriptors; returns when every byte
  has landed, raises ``Unavailable`` (peer gone) or ``DeadlineExceeded``
  (gave up after ``timeout_s``). Never returns early with part of a batch.
"""

from __future__ import annotations

import asyncio
import operator
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np

from kvstore.errors import InvalidRequest
from kvstore.tls import ClientCredentials

KIND_NIXL = "nixl"
KIND_GRPC_STREAM = "grpc_stream"
# Channels kept open to peers that are not configured (addresses named only by
# hints); each costs ~20 KB of daemon memory and a socket, so they are bounded.
MAX_HINT_CHANNELS = 64
# After client certificates are renewed, pulls in flight on the old channels get this
# long before those channels close (a pull times out well before: peer.transfer_timeout_s).
RENEWAL_GRACE_S = 60.0


# A hostname or IPv4 address, or an IPv6 address in brackets: what a hint may name.
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\]")


def check_address(address: str) -> str:
    """``address`` if it is a plain host:port (a peer hint's form), else InvalidRequest.

    Checked before a channel is opened, so a hint cannot make the daemon dial a
    unix socket, a name with a scheme or options, or port 0.
    """
    host, sep, port = address.rpartition(":")
    if not (sep and _HOST.fullmatch(host) and port.isdigit() and 0 < int(port) < 65536):
        raise InvalidRequest(
            f"peer address {address[:80]!r} is not host:port (a name or IP, and a port 1-65535)"
        )
    return address


SHORT_BATCH = 16
"""Up to this many descriptors a batch is worked on as Python ints: each numpy
call costs a few microseconds more (several times that in a daemon that was
idle), and a one-block pull's first byte is made of such steps."""


@dataclass(frozen=True, slots=True)
class PeerLink:
    """Where and how to read from one peer, for one pinned batch."""

    node_id: str
    address: str
    """The peer daemon's gRPC address (host:port)."""
    key: str
    """Transport-level name of the peer: its NIXL agent name (changes on restart)."""
    region_base: int
    """Address of the peer's DRAM region in the peer's own address space (NIXL)."""
    region_bytes: int
    lease_id: int
    """The owner-side pin these reads are covered by."""


@dataclass(frozen=True, slots=True)
class ReadBatch:
    """Descriptors of one batched read, as three equal-length uint64 arrays."""

    remote_offsets: np.ndarray
    local_offsets: np.ndarray
    sizes: np.ndarray

    @staticmethod
    def of(remote_offsets, local_offsets, sizes) -> ReadBatch:  # type: ignore[no-untyped-def]
        r = np.ascontiguousarray(remote_offsets, dtype=np.uint64)
        loc = np.ascontiguousarray(local_offsets, dtype=np.uint64)
        s = np.ascontiguousarray(sizes, dtype=np.uint64)
        if not (r.ndim == loc.ndim == s.ndim == 1 and len(r) == len(loc) == len(s)):
            raise InvalidRequest("read batch: offsets and sizes must be 1-D and of equal length")
        return ReadBatch(r, loc, s)

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum()) if len(self.sizes) else 0

    def check_bounds(self, remote_region_bytes: int, local_region_bytes: int) -> None:
        """Refuse descriptors that leave either region (a bad peer reply, not a bug here)."""
        if not len(self):
            return
        if _last_end(self.remote_offsets, self.sizes) > remote_region_bytes:
            raise InvalidRequest("read batch leaves the peer's region")
        if _last_end(self.local_offsets, self.sizes) > local_region_bytes:
            raise InvalidRequest("read batch leaves the local region")


def _last_end(offsets: np.ndarray, sizes: np.ndarray) -> int:
    """The highest offset + size of a non-empty batch."""
    if len(sizes) <= SHORT_BATCH:
        return max(map(operator.add, offsets.tolist(), sizes.tolist()))
    return int((offsets + sizes).max())


class Transport(Protocol):
    kind: str
    """KIND_NIXL or KIND_GRPC_STREAM."""

    def local_info(self) -> bytes: ...

    def add_peer(self, info: bytes) -> str:
        """Load a peer's info; return its key."""
        ...

    def forget_peer(self, key: str) -> None: ...

    def has_peer(self, key: str) -> bool: ...

    async def read(
        self,
        peer: PeerLink,
        batch: ReadBatch,
        timeout_s: float,
        *,
        share_gil: Callable[[], bool] | None = None,
    ) -> None:
        """Read ``batch`` from ``peer`` into the local region, bounded by ``timeout_s``.

        ``share_gil``: while it returns True another thread of this process
        (checksum verification) needs the GIL now and then; a transport that
        polls in a tight loop hands it over between polls."""
        ...

    def close(self) -> None:
        """Drop peers and deregister memory. Call before the region is unmapped."""
        ...


class PeerChannels:
    """gRPC channels to peers, one per address, shared by the puller and the stream.

    Tuned for peers that restart: reconnect backoff is capped at 1 s (gRPC's
    default grows to 120 s), and each channel has its own subchannels, because
    gRPC otherwise shares them (and their backoff) across channels to one
    address, so a fresh channel after ``drop`` would not start afresh.

    Bounded: any client may name a host:port as a peer hint, so channels to
    addresses that are not configured peers (``known``) live in an LRU of
    ``max_channels``; the least recently used one is closed when a new one is
    needed. Configured peers are never evicted (a flood of hints cannot cut an
    in-flight pull from a real peer) and do not count against the bound.
    """

    def __init__(
        self,
        max_message_bytes: int,
        *,
        known: Iterable[str] = (),
        max_channels: int = MAX_HINT_CHANNELS,
        credentials: ClientCredentials | None = None,
    ) -> None:
        assert max_channels >= 1, "max_channels must be >= 1"
        self._credentials = credentials  # mutual TLS to peers (kvstore.tls); None = plaintext
        self._generation = 0  # of the credentials the open channels were made with
        self._options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.use_local_subchannel_pool", 1),
        ]
        self.known = frozenset(known)
        self.max_channels = max_channels
        self._known_channels: dict[str, grpc.aio.Channel] = {}
        self._channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()  # LRU, oldest first
        self._closing: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        """Open channels, configured peers included."""
        return len(self._known_channels) + len(self._channels)

    def get(self, address: str) -> grpc.aio.Channel:
        if self._credentials is not None:
            _, generation = self._credentials.current()
            if generation != self._generation:
                # renewed certificate files: new pulls connect with them; pulls in
                # flight on the old channels get RENEWAL_GRACE_S to finish
                self._generation = generation
                for channel in [*self._known_channels.values(), *self._channels.values()]:
                    self._close_later(channel, RENEWAL_GRACE_S)
                self._known_channels.clear()
                self._channels.clear()
        if address in self.known:
            channel = self._known_channels.get(address)
            if channel is None:
                channel = self._known_channels[address] = self._open(address)
            return channel
        channel = self._channels.get(address)
        if channel is not None:
            self._channels.move_to_end(address)
            return channel
        while len(self._channels) >= self.max_channels:
            _, oldest = self._channels.popitem(last=False)
            self._close_later(oldest)
        channel = self._channels[address] = self._open(address)
        return channel

    def _open(self, address: str) -> grpc.aio.Channel:
        if self._credentials is not None:
            credentials, _ = self._credentials.current()
            return grpc.aio.secure_channel(address, credentials, options=self._options)
        return grpc.aio.insecure_channel(address, options=self._options)

    def _close_later(self, channel: grpc.aio.Channel, grace_s: float | None = None) -> None:
        # get() is called on the event loop but is not a coroutine: close in a task
        # (held until done, so it is not collected half-way).
        task = asyncio.get_running_loop().create_task(channel.close(grace_s))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def drop(self, address: str) -> None:
        """Close the channel to address; the next get() opens a fresh one."""
        channel = self._known_channels.pop(address, None) or self._channels.pop(address, None)
        if channel is not None:
            await channel.close(None)

    async def aclose(self) -> None:
        for address in [*self._known_channels, *self._channels]:
            await self.drop(address)
        if self._closing:
            await asyncio.wait(list(self._closing))

    def forget_all(self) -> None:
        """Drop references without closing (no event loop left to close them on)."""
        self._known_channels.clear()
        self._channels.clear()
