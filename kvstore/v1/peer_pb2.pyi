from kvstore.v1 import store_pb2 as _store_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetAgentMetadataRequest(_message.Message):
    __slots__ = ("requester_node_id",)
    REQUESTER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    requester_node_id: str
    def __init__(self, requester_node_id: _Optional[str] = ...) -> None: ...

class GetAgentMetadataResponse(_message.Message):
    __slots__ = ("node_id", "incarnation", "transport", "agent_name", "agent_metadata", "region_base", "region_bytes", "pin_port")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    REGION_BASE_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIN_PORT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: str
    transport: str
    agent_name: str
    agent_metadata: bytes
    region_base: int
    region_bytes: int
    pin_port: int
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., transport: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., region_base: _Optional[int] = ..., region_bytes: _Optional[int] = ..., pin_port: _Optional[int] = ...) -> None: ...

class PinForPullRequest(_message.Message):
    __slots__ = ("spec", "block_hashes", "lease_ttl_s", "requester_node_id", "transport")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    spec: _store_pb2.NamespaceSpec
    block_hashes: bytes
    lease_ttl_s: float
    requester_node_id: str
    transport: str
    def __init__(self, spec: _Optional[_Union[_store_pb2.NamespaceSpec, _Mapping]] = ..., block_hashes: _Optional[bytes] = ..., lease_ttl_s: _Optional[float] = ..., requester_node_id: _Optional[str] = ..., transport: _Optional[str] = ...) -> None: ...

class PinForPullResponse(_message.Message):
    __slots__ = ("lease_id", "found_blocks", "offsets", "block_bytes", "checksums", "incarnation", "lease_ttl_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    FOUND_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    found_blocks: int
    offsets: bytes
    block_bytes: int
    checksums: bytes
    incarnation: str
    lease_ttl_s: float
    def __init__(self, lease_id: _Optional[int] = ..., found_blocks: _Optional[int] = ..., offsets: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., checksums: _Optional[bytes] = ..., incarnation: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class ReleasePullRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleasePullResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class StreamBlocksRequest(_message.Message):
    __slots__ = ("lease_id", "offsets", "chunk_bytes")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    offsets: bytes
    chunk_bytes: int
    def __init__(self, lease_id: _Optional[int] = ..., offsets: _Optional[bytes] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class FetchFromPeerRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes", "peer_node_id", "peer_address", "timeout_s", "ticket")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PEER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    block_hashes: bytes
    peer_node_id: str
    peer_address: str
    timeout_s: float
    ticket: bytes
    def __init__(self, namespace_id: _Optional[str] = ..., block_hashes: _Optional[bytes] = ..., peer_node_id: _Optional[str] = ..., peer_address: _Optional[str] = ..., timeout_s: _Optional[float] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class FetchFromPeerResponse(_message.Message):
    __slots__ = ("prefix_blocks", "fetched_blocks", "local_blocks", "corrupt_blocks", "transport", "pin_s", "transfer_s", "verify_s", "pieces")
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FETCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PIN_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    prefix_blocks: int
    fetched_blocks: int
    local_blocks: int
    corrupt_blocks: int
    transport: str
    pin_s: float
    transfer_s: float
    verify_s: float
    pieces: int
    def __init__(self, prefix_blocks: _Optional[int] = ..., fetched_blocks: _Optional[int] = ..., local_blocks: _Optional[int] = ..., corrupt_blocks: _Optional[int] = ..., transport: _Optional[str] = ..., pin_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., pieces: _Optional[int] = ...) -> None: ...

class HandOverRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes", "ttl_s")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    block_hashes: bytes
    ttl_s: float
    def __init__(self, namespace_id: _Optional[str] = ..., block_hashes: _Optional[bytes] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class HandOverResponse(_message.Message):
    __slots__ = ("found_blocks", "ticket", "ttl_s")
    FOUND_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    found_blocks: int
    ticket: bytes
    ttl_s: float
    def __init__(self, found_blocks: _Optional[int] = ..., ticket: _Optional[bytes] = ..., ttl_s: _Optional[float] = ...) -> None: ...
