from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_GPU: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]

class StoreStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STORE_ALLOCATED: _ClassVar[StoreStatus]
    STORE_PRESENT: _ClassVar[StoreStatus]
    STORE_IN_FLIGHT: _ClassVar[StoreStatus]
    STORE_NO_ROOM: _ClassVar[StoreStatus]
TIER_UNSPECIFIED: Tier
TIER_GPU: Tier
TIER_DRAM: Tier
TIER_DISK: Tier
STORE_ALLOCATED: StoreStatus
STORE_PRESENT: StoreStatus
STORE_IN_FLIGHT: StoreStatus
STORE_NO_ROOM: StoreStatus

class NamespaceSpec(_message.Message):
    __slots__ = ("model", "dtype", "block_size_tokens", "num_layers", "num_kv_heads", "head_dim", "tp_rank", "tp_world_size", "pp_rank", "pp_world_size", "tenant", "layout", "block_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    block_size_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int
    tp_world_size: int
    pp_rank: int
    pp_world_size: int
    tenant: str
    layout: str
    block_bytes: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size_tokens: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_world_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., pp_world_size: _Optional[int] = ..., tenant: _Optional[str] = ..., layout: _Optional[str] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HelloResponse(_message.Message):
    __slots__ = ("node_id", "version", "region_path", "region_bytes", "max_message_bytes", "default_lease_ttl_s", "max_block_bytes", "max_blocks_per_request", "gpu_device", "gpu_pool_bytes", "gpu_ipc_handle", "gpu_region_path", "socket_path", "tcp_address", "metrics_address", "events_publish_address", "events_replay_address", "peer_transport", "region_id", "presence_path")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REGION_PATH_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    GPU_DEVICE_FIELD_NUMBER: _ClassVar[int]
    GPU_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    GPU_REGION_PATH_FIELD_NUMBER: _ClassVar[int]
    SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    TCP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_PUBLISH_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_REPLAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PEER_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PATH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    version: str
    region_path: str
    region_bytes: int
    max_message_bytes: int
    default_lease_ttl_s: float
    max_block_bytes: int
    max_blocks_per_request: int
    gpu_device: str
    gpu_pool_bytes: int
    gpu_ipc_handle: bytes
    gpu_region_path: str
    socket_path: str
    tcp_address: str
    metrics_address: str
    events_publish_address: str
    events_replay_address: str
    peer_transport: str
    region_id: int
    presence_path: str
    def __init__(self, node_id: _Optional[str] = ..., version: _Optional[str] = ..., region_path: _Optional[str] = ..., region_bytes: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., default_lease_ttl_s: _Optional[float] = ..., max_block_bytes: _Optional[int] = ..., max_blocks_per_request: _Optional[int] = ..., gpu_device: _Optional[str] = ..., gpu_pool_bytes: _Optional[int] = ..., gpu_ipc_handle: _Optional[bytes] = ..., gpu_region_path: _Optional[str] = ..., socket_path: _Optional[str] = ..., tcp_address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., events_publish_address: _Optional[str] = ..., events_replay_address: _Optional[str] = ..., peer_transport: _Optional[str] = ..., region_id: _Optional[int] = ..., presence_path: _Optional[str] = ...) -> None: ...

class DeclareNamespaceRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: NamespaceSpec
    def __init__(self, spec: _Optional[_Union[NamespaceSpec, _Mapping]] = ...) -> None: ...

class DeclareNamespaceResponse(_message.Message):
    __slots__ = ("namespace_id", "block_bytes", "sibling_layouts")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIBLING_LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    block_bytes: int
    sibling_layouts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace_id: _Optional[str] = ..., block_bytes: _Optional[int] = ..., sibling_layouts: _Optional[_Iterable[str]] = ...) -> None: ...

class PrepareStoreRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes", "lease_ttl_s", "tier")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    block_hashes: bytes
    lease_ttl_s: float
    tier: Tier
    def __init__(self, namespace_id: _Optional[str] = ..., block_hashes: _Optional[bytes] = ..., lease_ttl_s: _Optional[float] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class PrepareStoreResponse(_message.Message):
    __slots__ = ("lease_id", "statuses", "offsets", "tier", "lease_ttl_s", "region_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    statuses: bytes
    offsets: bytes
    tier: Tier
    lease_ttl_s: float
    region_id: int
    def __init__(self, lease_id: _Optional[int] = ..., statuses: _Optional[bytes] = ..., offsets: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ..., lease_ttl_s: _Optional[float] = ..., region_id: _Optional[int] = ...) -> None: ...

class CommitStoreRequest(_message.Message):
    __slots__ = ("lease_id", "block_hashes", "has_parent_block_hash", "parent_block_hash", "token_ids", "chains")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    HAS_PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAINS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    block_hashes: bytes
    has_parent_block_hash: bool
    parent_block_hash: int
    token_ids: bytes
    chains: _containers.RepeatedCompositeFieldContainer[StoreChain]
    def __init__(self, lease_id: _Optional[int] = ..., block_hashes: _Optional[bytes] = ..., has_parent_block_hash: _Optional[bool] = ..., parent_block_hash: _Optional[int] = ..., token_ids: _Optional[bytes] = ..., chains: _Optional[_Iterable[_Union[StoreChain, _Mapping]]] = ...) -> None: ...

class StoreChain(_message.Message):
    __slots__ = ("blocks", "has_parent_block_hash", "parent_block_hash", "token_ids")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HAS_PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    has_parent_block_hash: bool
    parent_block_hash: int
    token_ids: bytes
    def __init__(self, blocks: _Optional[int] = ..., has_parent_block_hash: _Optional[bool] = ..., parent_block_hash: _Optional[int] = ..., token_ids: _Optional[bytes] = ...) -> None: ...

class CommitStoreResponse(_message.Message):
    __slots__ = ("committed",)
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    committed: int
    def __init__(self, committed: _Optional[int] = ...) -> None: ...

class TierCount(_message.Message):
    __slots__ = ("tier", "blocks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    blocks: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., blocks: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes", "peer_hint", "peer_timeout_s")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PEER_HINT_FIELD_NUMBER: _ClassVar[int]
    PEER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    block_hashes: bytes
    peer_hint: str
    peer_timeout_s: float
    def __init__(self, namespace_id: _Optional[str] = ..., block_hashes: _Optional[bytes] = ..., peer_hint: _Optional[str] = ..., peer_timeout_s: _Optional[float] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_blocks", "by_tier")
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BY_TIER_FIELD_NUMBER: _ClassVar[int]
    prefix_blocks: int
    by_tier: _containers.RepeatedCompositeFieldContainer[TierCount]
    def __init__(self, prefix_blocks: _Optional[int] = ..., by_tier: _Optional[_Iterable[_Union[TierCount, _Mapping]]] = ...) -> None: ...

class PrepareLoadRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes", "lease_ttl_s", "peer_hint", "peer_timeout_s", "tier")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    PEER_HINT_FIELD_NUMBER: _ClassVar[int]
    PEER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    block_hashes: bytes
    lease_ttl_s: float
    peer_hint: str
    peer_timeout_s: float
    tier: Tier
    def __init__(self, namespace_id: _Optional[str] = ..., block_hashes: _Optional[bytes] = ..., lease_ttl_s: _Optional[float] = ..., peer_hint: _Optional[str] = ..., peer_timeout_s: _Optional[float] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class PrepareLoadResponse(_message.Message):
    __slots__ = ("lease_id", "found_blocks", "offsets", "checksums", "tier", "lease_ttl_s", "region_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    FOUND_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    found_blocks: int
    offsets: bytes
    checksums: bytes
    tier: Tier
    lease_ttl_s: float
    region_id: int
    def __init__(self, lease_id: _Optional[int] = ..., found_blocks: _Optional[int] = ..., offsets: _Optional[bytes] = ..., checksums: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ..., lease_ttl_s: _Optional[float] = ..., region_id: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    block_hashes: bytes
    def __init__(self, namespace_id: _Optional[str] = ..., block_hashes: _Optional[bytes] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted", "busy")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    busy: int
    def __init__(self, deleted: _Optional[int] = ..., busy: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("namespace_id",)
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    def __init__(self, namespace_id: _Optional[str] = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "blocks", "pinned_blocks", "huge_page_bytes", "collapsing")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HUGE_PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    COLLAPSING_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity_bytes: int
    used_bytes: int
    blocks: int
    pinned_blocks: int
    huge_page_bytes: int
    collapsing: bool
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., huge_page_bytes: _Optional[int] = ..., collapsing: _Optional[bool] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("node_id", "uptime_s", "tiers", "namespaces", "active_leases", "lookup_hit_blocks", "lookup_miss_blocks", "evicted_blocks", "expired_leases", "stored_blocks", "loaded_blocks", "demoted_blocks", "promoted_blocks", "peer", "tenants", "replica_blocks", "admitted_replicas", "promoted_replicas", "evicted_replica_blocks", "evicted_redundant_blocks")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MISS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASES_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEMOTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_REPLICA_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_REDUNDANT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    uptime_s: float
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    namespaces: int
    active_leases: int
    lookup_hit_blocks: int
    lookup_miss_blocks: int
    evicted_blocks: int
    expired_leases: int
    stored_blocks: int
    loaded_blocks: int
    demoted_blocks: int
    promoted_blocks: int
    peer: _containers.RepeatedCompositeFieldContainer[PeerTransportStats]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    replica_blocks: int
    admitted_replicas: int
    promoted_replicas: int
    evicted_replica_blocks: int
    evicted_redundant_blocks: int
    def __init__(self, node_id: _Optional[str] = ..., uptime_s: _Optional[float] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., namespaces: _Optional[int] = ..., active_leases: _Optional[int] = ..., lookup_hit_blocks: _Optional[int] = ..., lookup_miss_blocks: _Optional[int] = ..., evicted_blocks: _Optional[int] = ..., expired_leases: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., loaded_blocks: _Optional[int] = ..., demoted_blocks: _Optional[int] = ..., promoted_blocks: _Optional[int] = ..., peer: _Optional[_Iterable[_Union[PeerTransportStats, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., replica_blocks: _Optional[int] = ..., admitted_replicas: _Optional[int] = ..., promoted_replicas: _Optional[int] = ..., evicted_replica_blocks: _Optional[int] = ..., evicted_redundant_blocks: _Optional[int] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "namespaces", "tenants", "dram_bytes", "dram_quota_bytes", "disk_bytes", "disk_quota_bytes", "gpu_bytes", "gpu_quota_bytes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    DRAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAM_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    namespaces: int
    tenants: int
    dram_bytes: int
    dram_quota_bytes: int
    disk_bytes: int
    disk_quota_bytes: int
    gpu_bytes: int
    gpu_quota_bytes: int
    def __init__(self, tenant: _Optional[str] = ..., namespaces: _Optional[int] = ..., tenants: _Optional[int] = ..., dram_bytes: _Optional[int] = ..., dram_quota_bytes: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., disk_quota_bytes: _Optional[int] = ..., gpu_bytes: _Optional[int] = ..., gpu_quota_bytes: _Optional[int] = ...) -> None: ...

class PeerTransportStats(_message.Message):
    __slots__ = ("transport", "pulls", "pull_failures", "fetched_blocks", "fetched_bytes", "checksum_failed_blocks", "pull_s", "serve_pins", "serve_failures", "served_blocks", "served_bytes", "handed_over_pulls")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    PULL_FAILURES_FIELD_NUMBER: _ClassVar[int]
    FETCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FETCHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PULL_S_FIELD_NUMBER: _ClassVar[int]
    SERVE_PINS_FIELD_NUMBER: _ClassVar[int]
    SERVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    SERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HANDED_OVER_PULLS_FIELD_NUMBER: _ClassVar[int]
    transport: str
    pulls: int
    pull_failures: int
    fetched_blocks: int
    fetched_bytes: int
    checksum_failed_blocks: int
    pull_s: float
    serve_pins: int
    serve_failures: int
    served_blocks: int
    served_bytes: int
    handed_over_pulls: int
    def __init__(self, transport: _Optional[str] = ..., pulls: _Optional[int] = ..., pull_failures: _Optional[int] = ..., fetched_blocks: _Optional[int] = ..., fetched_bytes: _Optional[int] = ..., checksum_failed_blocks: _Optional[int] = ..., pull_s: _Optional[float] = ..., serve_pins: _Optional[int] = ..., serve_failures: _Optional[int] = ..., served_blocks: _Optional[int] = ..., served_bytes: _Optional[int] = ..., handed_over_pulls: _Optional[int] = ...) -> None: ...

class PutInlineRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes", "data")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    block_hashes: bytes
    data: bytes
    def __init__(self, namespace_id: _Optional[str] = ..., block_hashes: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutInlineResponse(_message.Message):
    __slots__ = ("stored", "skipped", "no_room")
    STORED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    NO_ROOM_FIELD_NUMBER: _ClassVar[int]
    stored: int
    skipped: int
    no_room: int
    def __init__(self, stored: _Optional[int] = ..., skipped: _Optional[int] = ..., no_room: _Optional[int] = ...) -> None: ...

class GetInlineRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: str
    block_hashes: bytes
    def __init__(self, namespace_id: _Optional[str] = ..., block_hashes: _Optional[bytes] = ...) -> None: ...

class GetInlineResponse(_message.Message):
    __slots__ = ("found_blocks", "data")
    FOUND_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    found_blocks: int
    data: bytes
    def __init__(self, found_blocks: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("model", "max_hashes_per_message")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_HASHES_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_hashes_per_message: int
    def __init__(self, model: _Optional[str] = ..., max_hashes_per_message: _Optional[int] = ...) -> None: ...

class SnapshotChunk(_message.Message):
    __slots__ = ("next_seq", "model", "tier", "block_hashes", "block_size_tokens", "done")
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    next_seq: int
    model: str
    tier: Tier
    block_hashes: bytes
    block_size_tokens: int
    done: bool
    def __init__(self, next_seq: _Optional[int] = ..., model: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., block_hashes: _Optional[bytes] = ..., block_size_tokens: _Optional[int] = ..., done: _Optional[bool] = ...) -> None: ...
