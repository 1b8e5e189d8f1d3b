"""The lean local channel's wire format: length-prefixed msgpack frames of msgspec Structs.

A frame is a 4-byte little-endian length, then that many bytes of msgpack: an
array of messages. Each message is an array whose first element names it (the
tag below), then its fields in order. Clients send requests; the daemon
answers every request whose ``seq`` is not 0 with one reply carrying the same
``seq``, in order, the replies to one frame in one frame. ``seq`` 0 asks for no
reply (batched releases): its errors are dropped (logged by the daemon), as a
lost release over gRPC would be (the lease expires).

The operations are the gRPC ``StoreService`` calls the engines' hot path makes,
with their semantics: the same fields (packed little-endian uint64 hashes and
offsets, packed int32 token ids), the same validation and bounds, the same
leases (owner "unix", charged to the client id of ``Hello``), the same
errors (``Error`` carries the ``kvstore.errors`` reason; the client raises
that exact class). ``FetchFromPeer`` (the ``PeerFetchService`` call: this
daemon pulls from a peer now) rides here too when the daemon names it in
``HelloReply.ops``, so a local pull's first byte waits for one gRPC call (the
pin on the owner), not two. Everything else (inline data, stats, snapshots,
health) stays on gRPC. See docs/local-channel.md.
"""

from __future__ import annotations

import struct
from typing import Annotated

import msgspec

from kvstore.namespace import NamespaceSpec

# Version of this format, checked in Hello (a mismatch: the client uses gRPC).
PROTOCOL_VERSION = 1
HEADER = struct.Struct("<I")
# A frame holds at most this many messages (a client batches releases into one).
MAX_MESSAGES_PER_FRAME = 4096
MAX_CLIENT_ID_CHARS = 64
MAX_TOKEN_CHARS = 4096  # kvstore.identity.MAX_TOKEN_BYTES
MAX_ID_CHARS = 256  # namespace ids are 32 hex characters; room for another scheme

Seq = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints stop at 2**64 - 1
Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
Tier = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Ttl = Annotated[float, msgspec.Meta(ge=0.0)]


class _Message(msgspec.Struct, array_like=True, frozen=True, tag=True):
    seq: Seq


# ---------------------------------------------------------------- requests


class Hello(_Message, frozen=True, tag="hello"):
    client_id: Annotated[str, msgspec.Meta(max_length=MAX_CLIENT_ID_CHARS)]
    version: int = PROTOCOL_VERSION
    # A bearer token (kvstore.identity): the connection's identity when the daemon maps
    # callers to tenants; "" = the peer's uid/gid (SO_PEERCRED) decides. Last and
    # defaulted, so a client that sends none still decodes.
    token: Annotated[str, msgspec.Meta(max_length=MAX_TOKEN_CHARS)] = ""


class Declare(_Message, frozen=True, tag="declare"):
    spec: NamespaceSpec


class Lookup(_Message, frozen=True, tag="lookup"):
    namespace_id: Id
    block_hashes: bytes


class PrepareStore(_Message, frozen=True, tag="prepare_store"):
    namespace_id: Id
    block_hashes: bytes
    lease_ttl_s: Ttl = 0.0
    tier: Tier = 0


class ReserveStore(_Message, frozen=True, tag="reserve_store"):
    """Slots reserved ahead of their blocks (answered ``store_prepared``): the
    commit binds the real hashes to lease positions (CommitStore.positions).
    Lean channel only; HelloReply.ops names it."""

    namespace_id: Id
    blocks: Annotated[int, msgspec.Meta(ge=1, lt=1 << 32)]
    lease_ttl_s: Ttl = 0.0
    tier: Tier = 0


class Chain(msgspec.Struct, array_like=True, frozen=True):
    blocks: Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
    parent_block_hash: U64 | None
    token_ids: bytes = b""


class CommitStore(_Message, frozen=True, tag="commit_store"):
    lease_id: U64
    block_hashes: bytes = b""  # b"": every block of the lease
    parent_block_hash: U64 | None = None
    token_ids: bytes = b""
    chains: list[Chain] = []
    # A reserve's commit: packed little-endian uint32 lease positions, one per
    # hash (None: not a reserve). Last and defaulted: older clients still decode.
    positions: bytes | None = None
    # A reserve's commit that keeps its slots not named, at their positions, for
    # later commits (HelloReply.reserve_keep says the daemon serves it: an older
    # one would decode the frame without it and free them).
    keep_rest: bool = False


class PrepareLoad(_Message, frozen=True, tag="prepare_load"):
    namespace_id: Id
    block_hashes: bytes
    lease_ttl_s: Ttl = 0.0
    tier: Tier = 0


class Release(_Message, frozen=True, tag="release"):
    lease_ids: list[U64]


class LoadedDirect(_Message, frozen=True, tag="loaded_direct"):
    """Blocks this client read straight from the region, found in the presence
    table (no lease: kvstore.presence ``locate`` / ``intact``): the daemon counts
    them as loads and as hits for eviction. Usually seq 0 (no answer wanted).
    HelloReply.direct_loads says the daemon serves it."""

    namespace_id: Id
    block_hashes: bytes


class Delete(_Message, frozen=True, tag="delete"):
    namespace_id: Id
    block_hashes: bytes


class FetchFromPeer(_Message, frozen=True, tag="fetch_from_peer"):
    """As the gRPC FetchFromPeerRequest (its checks are the handler's, so a bad
    timeout or an unknown peer is answered with the same error)."""

    namespace_id: Id
    block_hashes: bytes
    peer_node_id: Id = ""
    peer_address: Id = ""
    timeout_s: float = 0.0
    ticket: bytes = b""  # a HandOver's ticket (kvstore.transfer.ticket); b"" = none


class HandOver(_Message, frozen=True, tag="hand_over"):
    """As the gRPC HandOverRequest: pin blocks for a peer that will pull them."""

    namespace_id: Id
    block_hashes: bytes
    ttl_s: float = 0.0


class MapTenant(_Message, frozen=True, tag="map_tenant"):
    """Where the namespace's tenant keeps its DRAM blocks: the answer carries the
    descriptor of the tenant's own region file (SCM_RIGHTS) when it has one
    (dram.tenant_regions). Alone in its frame, on a connection with nothing else
    in flight (the client opens one for it): the descriptor rides on the
    answer's first byte."""

    namespace_id: Id


Request = (
    Hello
    | Declare
    | Lookup
    | PrepareStore
    | ReserveStore
    | CommitStore
    | PrepareLoad
    | Release
    | LoadedDirect
    | Delete
    | FetchFromPeer
    | HandOver
    | MapTenant
)
REQUEST_TAGS = (
    "hello",
    "declare",
    "lookup",
    "prepare_store",
    "reserve_store",
    "commit_store",
    "prepare_load",
    "release",
    "loaded_direct",
    "delete",
    "fetch_from_peer",
    "hand_over",
    "map_tenant",
)
# Ops a daemon serves only when configured so (peers); HelloReply.ops lists them.
OPTIONAL_OPS = ("fetch_from_peer", "hand_over")

# ---------------------------------------------------------------- replies


class HelloReply(_Message, frozen=True, tag="hello"):
    node_id: str
    region_id: int
    max_frame_bytes: int
    # The OPTIONAL_OPS this daemon serves. Last and defaulted: an older client
    # ignores it, an older daemon's reply reads as none (the client uses gRPC).
    ops: list[str] = []
    # The presence table's path (as gRPC HelloResponse.presence_path); "" = none.
    presence_path: str = ""
    # Whether it serves ``reserve_store`` (and CommitStore.positions): an older
    # daemon's reply reads as False (the client prepares every store).
    reserves: bool = False
    # Whether it serves ``loaded_direct`` and publishes slot locations in its
    # presence table: clients may load DRAM blocks without a lease.
    direct_loads: bool = False
    # Whether it serves CommitStore.keep_rest: a reserve committed in parts.
    reserve_keep: bool = False


class Declared(_Message, frozen=True, tag="declared"):
    namespace_id: str
    block_bytes: int
    sibling_layouts: list[str]


class Looked(_Message, frozen=True, tag="looked"):
    prefix_blocks: int
    by_tier: list[tuple[int, int]]  # (tier, blocks)


class StorePrepared(_Message, frozen=True, tag="store_prepared"):
    lease_id: int
    statuses: bytes
    offsets: bytes
    tier: int
    lease_ttl_s: float
    region_id: int


class Committed(_Message, frozen=True, tag="committed"):
    committed: int


class LoadPrepared(_Message, frozen=True, tag="load_prepared"):
    lease_id: int
    found_blocks: int
    offsets: bytes
    checksums: bytes
    tier: int
    lease_ttl_s: float
    region_id: int


class Released(_Message, frozen=True, tag="released"):
    released: int


class LoadsCounted(_Message, frozen=True, tag="loads_counted"):
    blocks: int  # of those named, the blocks still held in DRAM (counted)


class Deleted(_Message, frozen=True, tag="deleted"):
    deleted: int
    busy: int


class Fetched(_Message, frozen=True, tag="fetched"):
    """As the gRPC FetchFromPeerResponse."""

    prefix_blocks: int
    fetched_blocks: int
    local_blocks: int
    corrupt_blocks: int
    transport: str
    pin_s: float
    transfer_s: float
    verify_s: float
    pieces: int


class HandedOver(_Message, frozen=True, tag="hand_over"):
    """As the gRPC HandOverResponse."""

    found_blocks: int
    ticket: bytes
    ttl_s: float


class TenantRange(_Message, frozen=True, tag="map_tenant"):
    """The tenant's range of the region's offsets: bytes 0 = none of its own (it
    shares the region file at Hello's path); else the frame carries one descriptor
    to map over [offset, offset + nbytes). ``region_id`` as in Hello."""

    offset: int
    nbytes: int
    region_id: int


class Error(_Message, frozen=True, tag="error"):
    """A refused request: ``reason`` is the kvstore.errors class's reason code.
    ``seq`` 0: the frame itself was refused (malformed, oversize), not one request."""

    reason: str
    message: str


Reply = (
    HelloReply
    | Declared
    | Looked
    | StorePrepared
    | Committed
    | LoadPrepared
    | Released
    | LoadsCounted
    | Deleted
    | Fetched
    | HandedOver
    | TenantRange
    | Error
)

request_encoder = msgspec.msgpack.Encoder()
reply_decoder = msgspec.msgpack.Decoder(list[Reply])
request_decoder = msgspec.msgpack.Decoder(
    Annotated[list[Request], msgspec.Meta(max_length=MAX_MESSAGES_PER_FRAME)]
)
raw_decoder = msgspec.msgpack.Decoder()


def frame(messages: list[msgspec.Struct]) -> bytes:
    body = request_encoder.encode(messages)
    return HEADER.pack(len(body)) + body
