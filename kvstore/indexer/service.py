"""The indexer process: index + subscriber + registrations, served over gRPC.

``Indexer`` is the domain object (usable embedded, without gRPC);
``IndexerServicer`` is the only place that maps kvstore errors to gRPC status
codes. A Score for a model the index has never seen is an empty answer, not
an error: routers ask before any engine has stored anything.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore.errors import (
    BackendError,
    ConfigError,
    InvalidRequest,
    KVStoreError,
    NotFound,
    Unavailable,
)
from kvstore.hashing import BlockHasher
from kvstore.indexer.backend import IndexBackend, NodeScore
from kvstore.indexer.config import IndexerConfig
from kvstore.indexer.memory import MemoryIndex
from kvstore.indexer.subscriber import SourceSpec, Subscriber
from kvstore.v1 import indexer_pb2, indexer_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "kvstore.v1.IndexerService"
_REAP_INTERVAL_S = 0.5


def make_backend(cfg: IndexerConfig) -> IndexBackend:
    if cfg.backend == "redis":
        from kvstore.indexer.redis_index import RedisIndex  # redis is an optional dependency

        index = RedisIndex(cfg.redis_url, cfg.redis_key_prefix, max_nodes=cfg.redis_max_nodes)
        if cfg.ingest and cfg.redis_read == "mirror":
            from kvstore.indexer.mirror import MirroredIndex

            return MirroredIndex(index)
        return index
    return MemoryIndex()


class Indexer:
    """Index, event subscriber and node registrations of one indexer process."""

    def __init__(self, cfg: IndexerConfig, index: IndexBackend | None = None) -> None:
        cfg.check()
        self.cfg = cfg
        self.index = index if index is not None else make_backend(cfg)
        self.lock = threading.Lock()
        self.subscriber = Subscriber(
            self.index,
            self.lock,
            replay_timeout_s=cfg.replay_timeout_s,
            node_gone_s=cfg.node_gone_s,
        )
        self._hashers: dict[tuple[int, str], BlockHasher] = {}
        self._registered: dict[str, tuple[SourceSpec, float]] = {}  # key -> (spec, expires_at|0)
        self._reg_lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="kv-indexer-reaper", daemon=True)

    def start(self) -> None:
        if self.cfg.ingest:
            self.subscriber.start()
            for spec in self.cfg.sources:
                self.subscriber.add_source(spec)
        self._reaper.start()

    def close(self) -> None:
        self._stop.set()
        if self.cfg.ingest:
            self.subscriber.close()
        if self._reaper.is_alive():
            self._reaper.join(2.0)
        self.index.close()

    # --- scoring ----------------------------------------------------------------------

    def _hasher(self, block_size: int, algo: str) -> BlockHasher:
        key = (block_size, algo)
        h = self._hashers.get(key)
        if h is None:
            if len(self._hashers) >= 64:
                self._hashers.clear()  # bounded: a handful of (size, algo) pairs in practice
            h = self._hashers[key] = BlockHasher(block_size, algo, self.cfg.hash_seed or None)
        return h

    def hash_request(
        self,
        token_ids: bytes,
        *,
        block_size: int = 0,
        algo: str = "",
        cache_salt: str = "",
        lora: tuple[str, str] | None = None,
    ) -> np.ndarray:
        if len(token_ids) % 4:
            raise InvalidRequest(f"token_ids must be packed int32 LE; got {len(token_ids)} bytes")
        n_tokens = len(token_ids) // 4
        if n_tokens > self.cfg.max_request_tokens:
            raise InvalidRequest(
                f"{n_tokens} tokens exceed the indexer's max_request_tokens "
                f"({self.cfg.max_request_tokens})"
            )
        bs = block_size or self.cfg.block_size_tokens
        if bs > 1 << 20:
            raise InvalidRequest(f"block_size_tokens {bs} is out of range")
        hasher = self._hasher(bs, algo or self.cfg.hash_algo)
        return hasher.hash_tokens_int(
            token_ids,
            cache_salt=cache_salt or None,
            lora=lora,
            max_blocks=self.cfg.max_request_blocks,
        )

    def parse_hashes(self, block_hashes: bytes) -> np.ndarray:
        if len(block_hashes) % 8:
            raise InvalidRequest(
                f"block_hashes must be packed uint64 LE; got {len(block_hashes)} bytes"
            )
        n = len(block_hashes) // 8
        if n > self.cfg.max_request_blocks:
            raise InvalidRequest(
                f"{n} block hashes exceed the indexer's max_request_blocks ({self.cfg.max_request_blocks})"
            )
        return np.frombuffer(block_hashes, dtype="<u8").astype(np.uint64)

    def score(
        self, model: str, hashes: np.ndarray, candidates: list[str] | None = None
    ) -> list[NodeScore]:
        with self.lock:
            scores = self.index.score(model, hashes, candidates or None)
            if candidates:
                have = {s.node for s in scores}
                known = set(self.index.nodes())
                scores += [NodeScore(n, 0) for n in candidates if n in known and n not in have]
        return scores

    # --- nodes ------------------------------------------------------------------------

    def register(self, spec: SourceSpec, ttl_s: float) -> None:
        if not self.cfg.ingest:
            raise Unavailable("this indexer replica does not ingest events (ingest = false)")
        if ttl_s < 0 or ttl_s != ttl_s:
            raise InvalidRequest(f"ttl_s must be >= 0; got {ttl_s}")
        try:
            spec.check()
        except ConfigError as e:
            raise InvalidRequest(str(e)) from None
        with self._reg_lock:
            self._registered[spec.key] = (spec, time.monotonic() + ttl_s if ttl_s else 0.0)
        self.subscriber.add_source(spec)

    def unregister(self, node: str, endpoint: str = "") -> int:
        keys = [
            s.key
            for s in self.subscriber.sources()
            if s.node == node and (not endpoint or s.endpoint == endpoint)
        ]
        if not keys:
            raise NotFound(
                f"no event source for node {node!r}" + (f" at {endpoint}" if endpoint else "")
            )
        with self._reg_lock:
            for k in keys:
                self._registered.pop(k, None)
        for k in keys:
            self.subscriber.remove_source(k, drop_entries=True)
        return len(keys)

    def sources(self) -> list[tuple[SourceSpec, bool, float]]:
        now = time.monotonic()
        with self._reg_lock:
            reg = dict(self._registered)
        out = []
        for spec in self.subscriber.sources():
            r = reg.get(spec.key)
            expires = max(0.0, r[1] - now) if r and r[1] else 0.0
            out.append((spec, r is not None, expires))
        return out

    def _reap(self) -> None:
        while not self._stop.wait(_REAP_INTERVAL_S):
            now = time.monotonic()
            with self._reg_lock:
                expired = [k for k, (_, exp) in self._registered.items() if exp and exp < now]
                for k in expired:
                    del self._registered[k]
            for k in expired:
                log.warning("registration of KV event source %s lapsed; dropping it", k)
                self.subscriber.remove_source(k, drop_entries=True)


def _spec_from_pb(src: indexer_pb2.EventSource) -> SourceSpec:
    return SourceSpec(
        node=src.node,
        endpoint=src.endpoint,
        replay_endpoint=src.replay_endpoint,
        kind=src.kind or "daemon",
        model=src.model,
    )


_STATUS: list[tuple[type[KVStoreError], grpc.StatusCode]] = [
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (BackendError, grpc.StatusCode.INTERNAL),
]


def _abort(context: grpc.ServicerContext, e: KVStoreError) -> None:
    code = next((c for cls, c in _STATUS if isinstance(e, cls)), grpc.StatusCode.INTERNAL)
    context.abort(code, str(e))


class IndexerServicer(indexer_pb2_grpc.IndexerServiceServicer):
    def __init__(self, indexer: Indexer) -> None:
        self._ix = indexer

    def Score(self, request, context):
        try:
            if request.token_ids and request.block_hashes:
                raise InvalidRequest("send token_ids or block_hashes, not both")
            if request.token_ids:
                lora = (request.lora_name, request.lora_path) if request.lora_name else None
                hashes = self._ix.hash_request(
                    request.token_ids,
                    block_size=request.block_size_tokens,
                    algo=request.hash_algo,
                    cache_salt=request.cache_salt,
                    lora=lora,
                )
            else:
                hashes = self._ix.parse_hashes(request.block_hashes)
            scores = self._ix.score(request.model, hashes, list(request.candidate_nodes))
        except KVStoreError as e:
            _abort(context, e)
            raise AssertionError("unreachable") from e
        return indexer_pb2.ScoreResponse(
            scores=[
                indexer_pb2.NodeScore(
                    node=s.node,
                    prefix_blocks=s.prefix_blocks,
                    gpu_blocks=s.gpu_blocks,
                    cpu_blocks=s.cpu_blocks,
                    disk_blocks=s.disk_blocks,
                )
                for s in scores
            ],
            request_blocks=int(hashes.size),
        )

    def RegisterNode(self, request, context):
        try:
            self._ix.register(_spec_from_pb(request.source), request.ttl_s)
        except KVStoreError as e:
            _abort(context, e)
        return indexer_pb2.RegisterNodeResponse()

    def UnregisterNode(self, request, context):
        try:
            n = self._ix.unregister(request.node, request.endpoint)
        except KVStoreError as e:
            _abort(context, e)
            raise AssertionError("unreachable") from e
        return indexer_pb2.UnregisterNodeResponse(removed_sources=n)

    def ListNodes(self, request, context):
        try:
            with self._ix.lock:
                indexed = self._ix.index.nodes()
        except KVStoreError as e:
            _abort(context, e)
            raise AssertionError("unreachable") from e
        return indexer_pb2.ListNodesResponse(
            sources=[
                indexer_pb2.NodeInfo(
                    source=indexer_pb2.EventSource(
                        node=s.node,
                        endpoint=s.endpoint,
                        replay_endpoint=s.replay_endpoint,
                        kind=s.kind,
                        model=s.model,
                    ),
                    registered=reg,
                    expires_in_s=exp,
                )
                for s, reg, exp in self._ix.sources()
            ],
            indexed_nodes=indexed,
        )


def serve(indexer: Indexer, address: str) -> tuple[grpc.Server, int]:
    """Start the gRPC server for ``indexer`` on ``address``; returns it and the bound port."""
    max_msg = indexer.cfg.max_request_tokens * 4 + (1 << 16)
    server = grpc.server(
        futures.ThreadPoolExecutor(
            max_workers=indexer.cfg.max_workers, thread_name_prefix="kv-idx"
        ),
        options=[
            ("grpc.max_receive_message_length", max_msg),
            ("grpc.max_send_message_length", 64 << 20),
        ],
    )
    indexer_pb2_grpc.add_IndexerServiceServicer_to_server(IndexerServicer(indexer), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in (SERVICE_NAME, ""):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (
            indexer_pb2.DESCRIPTOR.services_by_name["IndexerService"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    port = server.add_insecure_port(address)
    if port == 0:
        raise ConfigError(f"cannot listen on {address!r}")
    server.start()
    return server, port
