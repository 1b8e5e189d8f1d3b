from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreRequest(_message.Message):
    __slots__ = ("model", "token_ids", "block_hashes", "candidate_nodes", "block_size_tokens", "hash_algo", "cache_salt", "lora_name", "lora_path", "lookahead_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_NODES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids: bytes
    block_hashes: bytes
    candidate_nodes: _containers.RepeatedScalarFieldContainer[str]
    block_size_tokens: int
    hash_algo: str
    cache_salt: str
    lora_name: str
    lora_path: str
    lookahead_tokens: int
    def __init__(self, model: _Optional[str] = ..., token_ids: _Optional[bytes] = ..., block_hashes: _Optional[bytes] = ..., candidate_nodes: _Optional[_Iterable[str]] = ..., block_size_tokens: _Optional[int] = ..., hash_algo: _Optional[str] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., lookahead_tokens: _Optional[int] = ...) -> None: ...

class RankScore(_message.Message):
    __slots__ = ("rank", "prefix_blocks", "gpu_blocks", "cpu_blocks", "disk_blocks")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    prefix_blocks: int
    gpu_blocks: int
    cpu_blocks: int
    disk_blocks: int
    def __init__(self, rank: _Optional[int] = ..., prefix_blocks: _Optional[int] = ..., gpu_blocks: _Optional[int] = ..., cpu_blocks: _Optional[int] = ..., disk_blocks: _Optional[int] = ...) -> None: ...

class NodeScore(_message.Message):
    __slots__ = ("node", "prefix_blocks", "gpu_blocks", "cpu_blocks", "disk_blocks", "rank", "ranks")
    NODE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    node: str
    prefix_blocks: int
    gpu_blocks: int
    cpu_blocks: int
    disk_blocks: int
    rank: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankScore]
    def __init__(self, node: _Optional[str] = ..., prefix_blocks: _Optional[int] = ..., gpu_blocks: _Optional[int] = ..., cpu_blocks: _Optional[int] = ..., disk_blocks: _Optional[int] = ..., rank: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankScore, _Mapping]]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores", "request_blocks")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[NodeScore]
    request_blocks: int
    def __init__(self, scores: _Optional[_Iterable[_Union[NodeScore, _Mapping]]] = ..., request_blocks: _Optional[int] = ...) -> None: ...

class EventSource(_message.Message):
    __slots__ = ("node", "endpoint", "replay_endpoint", "kind", "model", "snapshot_address", "engine_url", "data_parallel_rank", "curve_server_key")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_URL_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    CURVE_SERVER_KEY_FIELD_NUMBER: _ClassVar[int]
    node: str
    endpoint: str
    replay_endpoint: str
    kind: str
    model: str
    snapshot_address: str
    engine_url: str
    data_parallel_rank: int
    curve_server_key: str
    def __init__(self, node: _Optional[str] = ..., endpoint: _Optional[str] = ..., replay_endpoint: _Optional[str] = ..., kind: _Optional[str] = ..., model: _Optional[str] = ..., snapshot_address: _Optional[str] = ..., engine_url: _Optional[str] = ..., data_parallel_rank: _Optional[int] = ..., curve_server_key: _Optional[str] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("source", "ttl_s", "owner_token")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    OWNER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    source: EventSource
    ttl_s: float
    owner_token: str
    def __init__(self, source: _Optional[_Union[EventSource, _Mapping]] = ..., ttl_s: _Optional[float] = ..., owner_token: _Optional[str] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("owner_token",)
    OWNER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    owner_token: str
    def __init__(self, owner_token: _Optional[str] = ...) -> None: ...

class UnregisterNodeRequest(_message.Message):
    __slots__ = ("node", "endpoint", "owner_token")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    OWNER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    node: str
    endpoint: str
    owner_token: str
    def __init__(self, node: _Optional[str] = ..., endpoint: _Optional[str] = ..., owner_token: _Optional[str] = ...) -> None: ...

class UnregisterNodeResponse(_message.Message):
    __slots__ = ("removed_sources",)
    REMOVED_SOURCES_FIELD_NUMBER: _ClassVar[int]
    removed_sources: int
    def __init__(self, removed_sources: _Optional[int] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("source", "registered", "expires_in_s", "last_event_age_s", "since_snapshot_s", "connected", "next_seq", "errors", "snapshots", "handshake_error")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    SINCE_SNAPSHOT_S_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKE_ERROR_FIELD_NUMBER: _ClassVar[int]
    source: EventSource
    registered: bool
    expires_in_s: float
    last_event_age_s: float
    since_snapshot_s: float
    connected: bool
    next_seq: int
    errors: int
    snapshots: int
    handshake_error: str
    def __init__(self, source: _Optional[_Union[EventSource, _Mapping]] = ..., registered: _Optional[bool] = ..., expires_in_s: _Optional[float] = ..., last_event_age_s: _Optional[float] = ..., since_snapshot_s: _Optional[float] = ..., connected: _Optional[bool] = ..., next_seq: _Optional[int] = ..., errors: _Optional[int] = ..., snapshots: _Optional[int] = ..., handshake_error: _Optional[str] = ...) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("sources", "indexed_nodes")
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    INDEXED_NODES_FIELD_NUMBER: _ClassVar[int]
    sources: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    indexed_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sources: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., indexed_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class ModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "block_size_tokens", "first_blocks_checked", "first_blocks_mismatched", "hash_algo", "hash_lookahead_tokens", "hash_scheme_learned")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCKS_CHECKED_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCKS_MISMATCHED_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    HASH_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HASH_SCHEME_LEARNED_FIELD_NUMBER: _ClassVar[int]
    model: str
    block_size_tokens: int
    first_blocks_checked: int
    first_blocks_mismatched: int
    hash_algo: str
    hash_lookahead_tokens: int
    hash_scheme_learned: bool
    def __init__(self, model: _Optional[str] = ..., block_size_tokens: _Optional[int] = ..., first_blocks_checked: _Optional[int] = ..., first_blocks_mismatched: _Optional[int] = ..., hash_algo: _Optional[str] = ..., hash_lookahead_tokens: _Optional[int] = ..., hash_scheme_learned: _Optional[bool] = ...) -> None: ...

class ModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...
