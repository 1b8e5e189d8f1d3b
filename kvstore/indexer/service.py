"""The indexer process: index + subscriber + registrations, served over gRPC.

``Indexer`` is the domain object (usable embedded, without gRPC);
``IndexerServicer`` fails calls through ``errors.abort_sync`` (status and
reason from the error's class: capacity is RESOURCE_EXHAUSTED, never INTERNAL).
A Score for a model the index has never seen is an empty answer, not an
error: routers ask before any engine has stored anything.

Health: the gRPC health status (and the systemd watchdog, see ``cli``) follow
``Indexer.health()``: NOT_SERVING while the ingestion thread is dead or
stalled or the backend is unreachable. A dead thread is restarted.

Registrations (``RegisterNode``) are bounded (``max_registered_sources``,
then RESOURCE_EXHAUSTED), never replace or remove a configured source
(PERMISSION_DENIED), and a registered node name belongs to its first
registrant: later registrations and ``UnregisterNode`` of that name must
present the owner token the first one got (or chose). With a cluster secret
configured, both RPCs also need it (``x-kvstore-cluster-secret``). With
principals configured (``principals``, ``kvstore.identity``) every call needs
an identity of a role: Score, ListNodes, Models the router or node role,
RegisterNode/UnregisterNode the node role (admin: all; the cluster secret:
all); others get PERMISSION_DENIED, audited.

Block sizes: the index learns each model's block size from the events and
snapshots it ingests. A Score with token ids and no block size hashes at the
learned size; one whose block size the sources do not publish is rejected.

vLLM servers (``vllm_servers``): a thread reads each one's ``/kv_event_sources``
(retried, doubling from 1 s, until it answers; then every
``vllm_servers_refresh_s``) and follows one engine source per listed rank,
replacing the sources of a server whose listing changed. Their nodes count as
configured (a registration cannot replace them).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from concurrent import futures
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore import audit, identity
from kvstore.auth import secret_matches
from kvstore.errors import (
    CapacityExhausted,
    ConfigError,
    InvalidRequest,
    KVStoreError,
    NotFound,
    PermissionDenied,
    Unavailable,
    abort_sync,
)
from kvstore.events.curve import load_keypair
from kvstore.hashing import BlockHasher, HashScheme
from kvstore.indexer.backend import IndexBackend, NodeScore
from kvstore.indexer.config import IndexerConfig
from kvstore.indexer.memory import MemoryIndex
from kvstore.indexer.seedcheck import SeedVerdict
from kvstore.indexer.subscriber import SourceSpec, SourceStatus, Subscriber
from kvstore.indexer.vllm_sources import VllmServer, discover
from kvstore.rpc_guard import SyncParseGuardInterceptor
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
        self.auth = identity.Authorizer.from_config(cfg.principals, "indexer.principals")
        self.index = index if index is not None else make_backend(cfg)
        self.lock = threading.Lock()
        self.subscriber = Subscriber(
            self.index,
            self.lock,
            replay_timeout_s=cfg.replay_timeout_s,
            node_gone_s=cfg.node_gone_s,
            snapshot_timeout_s=cfg.snapshot_timeout_s,
            snapshot_interval_s=cfg.snapshot_interval_s,
            tail_check_s=cfg.tail_check_s,
            error_log_interval_s=cfg.error_log_interval_s,
            cluster_secret=cfg.cluster_secret,
            # Read (and checked) here: a bad file stops the indexer at start, naming it.
            snapshot_credentials=(cfg.tls().client_credentials() if cfg.tls().enabled else None),
            hash_algo=cfg.hash_algo,
            hash_seed=cfg.hash_seed or None,
            # read and checked (0600, ours) here: a bad key file stops the start, naming it
            curve_keys=(
                load_keypair(cfg.events_curve_key_file, "indexer.events_curve_key_file")
                if cfg.events_curve_key_file
                else None
            ),
        )
        self._hashers: dict[tuple[int, str], BlockHasher] = {}
        self._registered: dict[str, tuple[SourceSpec, float]] = {}  # key -> (spec, expires_at|0)
        self._owners: dict[str, str] = {}  # registered node -> its owner token
        self._configured_nodes = {s.node for s in cfg.sources} | {v.node for v in cfg.vllm_servers}
        self._discovered: list[dict[str, SourceSpec]] = [{} for _ in cfg.vllm_servers]
        """Per vllm_servers entry: the sources its last listing gave (key -> spec)."""
        self._discovery_errors: list[str] = ["" for _ in cfg.vllm_servers]
        self._discovery = threading.Thread(
            target=self._discover_loop, name="kv-indexer-vllm-sources", daemon=True
        )
        self._reg_lock = threading.Lock()
        self._health: Any = None  # grpc_health HealthServicer once served
        self._healthy: tuple[bool, str] = (True, "")
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="kv-indexer-reaper", daemon=True)

    def start(self) -> None:
        if self.cfg.ingest:
            self.subscriber.start()
            for spec in self.cfg.sources:
                self.subscriber.add_source(spec)
            if self.cfg.vllm_servers:
                self._discovery.start()
        self._reaper.start()

    def health(self) -> tuple[bool, str]:
        """(ok, why not): ingestion runs and the backend answers (see the module doc)."""
        if self.cfg.ingest:
            return self.subscriber.health()
        try:
            with self.lock:
                self.index.ping()
        except KVStoreError as e:
            return False, f"the index backend is unreachable: {e}"
        return True, ""

    @property
    def healthy(self) -> bool:
        """The last health check's verdict (the reaper refreshes it twice a second)."""
        return self._healthy[0]

    def attach_health(self, servicer: Any) -> None:
        self._health = servicer
        self._publish_health()

    def _publish_health(self) -> None:
        if self.cfg.ingest:
            self.subscriber.restart_if_dead()
        ok, why = self.health()
        if ok != self._healthy[0]:
            if ok:
                log.warning("indexer healthy again")
            else:
                log.error("indexer unhealthy: %s", why)
        self._healthy = (ok, why)
        if self._health is not None:
            status = health_pb2.HealthCheckResponse.SERVING
            if not ok:
                status = health_pb2.HealthCheckResponse.NOT_SERVING
            for name in (SERVICE_NAME, ""):
                self._health.set(name, status)

    def close(self) -> None:
        self._stop.set()
        if self.cfg.ingest:
            self.subscriber.close()
        if self._reaper.is_alive():
            self._reaper.join(2.0)
        if self._discovery.is_alive():
            self._discovery.join(12.0)  # one listing read is bounded by 10 s
        self.index.close()

    # --- vLLM servers' rank sources -----------------------------------------------------

    def discover_once(self, i: int) -> bool:
        """Read vllm_servers[i]'s listing and follow what it lists now; False (and
        one warning per distinct error) when it cannot be read or followed."""
        server: VllmServer = self.cfg.vllm_servers[i]
        try:
            found = discover(server, timeout_s=min(10.0, self.cfg.vllm_servers_refresh_s))
        except KVStoreError as e:
            why = str(e)
            if why != self._discovery_errors[i]:
                log.warning("vLLM server %s (node %s): %s; retrying", server.url, server.node, why)
            self._discovery_errors[i] = why
            return False
        if self._discovery_errors[i]:
            log.warning("vLLM server %s (node %s) answers again", server.url, server.node)
        self._discovery_errors[i] = ""
        static = {s.key for s in self.cfg.sources}
        new = {s.key: s for s in found if s.key not in static}
        old = self._discovered[i]
        if not found and old:
            log.warning("vLLM server %s lists no ZMQ KV event streams now", server.url)
        for key, spec in old.items():
            if new.get(key) != spec:
                self.subscriber.remove_source(key, drop_entries=True)
        for key, spec in new.items():
            if old.get(key) != spec:
                log.info(
                    "vLLM server %s: following rank %d at %s",
                    server.url,
                    spec.data_parallel_rank,
                    spec.endpoint,
                )
                self.subscriber.add_source(spec)
        self._discovered[i] = new
        return True

    def _discover_loop(self) -> None:
        n = len(self.cfg.vllm_servers)
        refresh_s = self.cfg.vllm_servers_refresh_s
        retry_s = [min(1.0, refresh_s)] * n
        due = [0.0] * n
        while not self._stop.is_set():
            for i in range(n):
                if time.monotonic() < due[i] or self._stop.is_set():
                    continue
                try:
                    ok = self.discover_once(i)
                except Exception:  # the loop must outlive a bug in one server's listing
                    log.exception("reading vLLM server %s failed", self.cfg.vllm_servers[i].url)
                    ok = False
                if ok:
                    retry_s[i] = min(1.0, refresh_s)
                    due[i] = time.monotonic() + refresh_s
                else:
                    due[i] = time.monotonic() + retry_s[i]
                    retry_s[i] = min(2 * retry_s[i], refresh_s)
            self._stop.wait(max(0.05, min(due) - time.monotonic()))

    # --- scoring ----------------------------------------------------------------------

    def _hasher(self, block_size: int, algo: str) -> BlockHasher:
        key = (block_size, algo)
        h = self._hashers.get(key)
        if h is None:
            if len(self._hashers) >= 64:
                self._hashers.clear()  # bounded: a handful of (size, algo) pairs in practice
            h = self._hashers[key] = BlockHasher(block_size, algo, self.cfg.hash_seed or None)
        return h

    def block_size_for(self, model: str, requested: int = 0) -> int:
        """The block size to hash a token-id request at: the one the sources publish.

        Raises ``InvalidRequest`` (naming both) when the request's size is not
        one the model's sources publish, or when they publish several and the
        request does not say which.
        """
        learned = self.subscriber.block_sizes(model)
        if not learned:
            return requested or self.cfg.block_size_tokens
        if requested:
            if requested not in learned:
                raise InvalidRequest(
                    f"block_size_tokens {requested} cannot match model {model!r}: its engines "
                    f"publish blocks of {_sizes(learned)} tokens"
                )
            return requested
        if len(learned) > 1:
            raise InvalidRequest(
                f"model {model!r} is published with block sizes {_sizes(learned)}: "
                "send block_size_tokens"
            )
        return learned[0]

    def hash_request(
        self,
        token_ids: bytes,
        *,
        model: str = "",
        block_size: int = 0,
        algo: str = "",
        cache_salt: str = "",
        lora: tuple[str, str] | None = None,
        lookahead_tokens: int | None = None,
    ) -> np.ndarray:
        """Block hashes of packed int32 token ids, as the model's engines hash them
        (``hash_scheme_for``; ``algo``/``lookahead_tokens`` override it)."""
        if len(token_ids) % 4:
            raise InvalidRequest(f"token_ids must be packed int32 LE; got {len(token_ids)} bytes")
        n_tokens = len(token_ids) // 4
        if n_tokens > self.cfg.max_request_tokens:
            raise InvalidRequest(
                f"{n_tokens} tokens exceed the indexer's max_request_tokens "
                f"({self.cfg.max_request_tokens})"
            )
        bs = self.block_size_for(model, block_size)
        if bs > 1 << 20:
            raise InvalidRequest(f"block_size_tokens {bs} is out of range")
        scheme = self.hash_scheme_for(model)
        hasher = self._hasher(bs, algo or scheme.algo)
        lookahead = scheme.lookahead_tokens if lookahead_tokens is None else lookahead_tokens
        if lookahead > bs * 64:
            raise InvalidRequest(f"lookahead_tokens {lookahead} is out of range")
        return hasher.hash_tokens_int(
            token_ids,
            cache_salt=cache_salt or None,
            lora=lora,
            max_blocks=self.cfg.max_request_blocks,
            lookahead_tokens=lookahead,
        )

    def hash_scheme_for(self, model: str) -> HashScheme:
        """How ``model``'s engines hash token ids: the scheme their chains' first
        blocks were reproduced with (``seedcheck``), else this indexer's
        configured algorithm and the legacy scheme."""
        learned = self.subscriber.seeds.schemes.get(model)
        return learned if learned is not None else HashScheme(self.cfg.hash_algo, 0)

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

    def _check_owner(self, node: str, token: str) -> None:
        """Under _reg_lock: a registered node name is its first registrant's."""
        owner = self._owners.get(node)
        if owner is not None and not hmac.compare_digest(owner.encode(), token.encode()):
            raise PermissionDenied(
                f"node {node!r} is registered by another caller; its owner token is required"
            )

    def register(self, spec: SourceSpec, ttl_s: float, owner_token: str = "") -> str:
        """Add (or renew) a registered source; returns the node's owner token."""
        if not self.cfg.ingest:
            raise Unavailable("this indexer replica does not ingest events (ingest = false)")
        if ttl_s < 0 or ttl_s != ttl_s:
            raise InvalidRequest(f"ttl_s must be >= 0; got {ttl_s}")
        try:
            spec.check()
            self.subscriber.check_curve(spec)
        except ConfigError as e:
            raise InvalidRequest(str(e)) from None
        if len(owner_token) > 256:
            raise InvalidRequest("owner_token is longer than 256 characters")
        if spec.node in self._configured_nodes:
            raise PermissionDenied(
                f"node {spec.node!r} is a configured source; a registration cannot replace it"
            )
        with self._reg_lock:
            self._check_owner(spec.node, owner_token)
            # one source per (node, kind): the owner moving its stream (a new
            # address) replaces its old one instead of feeding the node twice
            moved = [
                k
                for k, (other, _) in self._registered.items()
                if k != spec.key and other.node == spec.node and other.kind == spec.kind
            ]
            new = spec.key not in self._registered and not moved
            if new and len(self._registered) >= self.cfg.max_registered_sources:
                raise CapacityExhausted(
                    f"{len(self._registered)} sources are registered already "
                    f"(max_registered_sources = {self.cfg.max_registered_sources})"
                )
            for k in moved:
                del self._registered[k]
            token = self._owners.get(spec.node) or owner_token or secrets.token_hex(16)
            self._owners[spec.node] = token
            self._registered[spec.key] = (spec, time.monotonic() + ttl_s if ttl_s else 0.0)
        for k in moved:
            self.subscriber.remove_source(k, drop_entries=True)
        self.subscriber.add_source(spec)
        return token

    def unregister(self, node: str, endpoint: str = "", owner_token: str = "") -> int:
        if node in self._configured_nodes:
            raise PermissionDenied(f"node {node!r} is a configured source; it cannot be removed")
        with self._reg_lock:
            keys = [
                k
                for k, (s, _) in self._registered.items()
                if s.node == node and (not endpoint or s.endpoint == endpoint)
            ]
            if not keys:
                raise NotFound(
                    f"no registered event source for node {node!r}"
                    + (f" at {endpoint}" if endpoint else "")
                )
            self._check_owner(node, owner_token)
            for k in keys:
                self._registered.pop(k, None)
            self._forget_owner_if_unused(node)
        for k in keys:
            self.subscriber.remove_source(k, drop_entries=True)
        return len(keys)

    def _forget_owner_if_unused(self, node: str) -> None:
        if not any(s.node == node for s, _ in self._registered.values()):
            self._owners.pop(node, None)

    def source_status(self) -> dict[str, SourceStatus]:
        return {s.key: s for s in self.subscriber.source_status()}

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
            try:
                self._publish_health()
            except Exception:  # the health loop must outlive anything it checks
                log.exception("indexer health check failed")
            now = time.monotonic()
            with self._reg_lock:
                expired = [k for k, (_, exp) in self._registered.items() if exp and exp < now]
                for k in expired:
                    node = self._registered.pop(k)[0].node
                    self._forget_owner_if_unused(node)
            for k in expired:
                log.warning("registration of KV event source %s lapsed; dropping it", k)
                self.subscriber.remove_source(k, drop_entries=True)


def _sizes(sizes: list[int]) -> str:
    return " or ".join(map(str, sizes))


def spec_from_pb(src: indexer_pb2.EventSource) -> SourceSpec:
    """A source as the protos carry it (RegisterNode, ListNodes: routers follow them too)."""
    return SourceSpec(
        node=src.node,
        endpoint=src.endpoint,
        replay_endpoint=src.replay_endpoint,
        kind=src.kind or "daemon",
        model=src.model,
        snapshot_address=src.snapshot_address,
        engine_url=src.engine_url,
        data_parallel_rank=(src.data_parallel_rank if src.HasField("data_parallel_rank") else -1),
        curve_server_key=src.curve_server_key,
    )


class IndexerServicer(indexer_pb2_grpc.IndexerServiceServicer):
    def __init__(self, indexer: Indexer) -> None:
        self._ix = indexer

    def _authorize(self, context: grpc.ServicerContext, what: str, *roles: str) -> None:
        """With principals configured: the caller's principal must have one of ``roles``
        (or admin); PERMISSION_DENIED (audited) otherwise. Without: nothing to check."""
        auth = self._ix.auth
        if auth is None:
            return
        metadata = context.invocation_metadata()
        token = identity.presented_token(metadata)
        secret = self._ix.cfg.cluster_secret
        principal = None
        if token:
            principal = auth.from_token(token)
        elif secret and secret_matches(metadata, secret.encode()):
            principal = identity.CLUSTER
        else:
            principal = auth.from_cert_names(identity.cert_names(context))
        peer = context.peer()
        if principal is None:
            audit.denied(peer, what, audit.NO_IDENTITY, audit.tcp_caller(peer))
            raise PermissionDenied(
                f"{what.split()[0]} needs an identity here (indexer.principals): a token "
                f"({identity.TOKEN_METADATA_KEY}, KVSTORE_TOKEN), a mapped client "
                "certificate, or the cluster secret"
            )
        if not principal.has_role(*roles):
            audit.denied(
                f"{principal.name} ({peer})", what, audit.ROLE_DENIED, audit.tcp_caller(peer)
            )
            raise PermissionDenied(
                f"{what.split()[0]} needs the role {' or '.join(('admin', *roles))}; "
                f"{principal.name} has {', '.join(sorted(principal.roles)) or 'none'}"
            )

    def Score(self, request, context):
        try:
            self._authorize(context, "Score", "router", "node")
            if request.token_ids and request.block_hashes:
                raise InvalidRequest("send token_ids or block_hashes, not both")
            if request.token_ids:
                lora = (request.lora_name, request.lora_path) if request.lora_name else None
                hashes = self._ix.hash_request(
                    request.token_ids,
                    model=request.model,
                    block_size=request.block_size_tokens,
                    algo=request.hash_algo,
                    cache_salt=request.cache_salt,
                    lora=lora,
                    lookahead_tokens=(
                        request.lookahead_tokens if request.HasField("lookahead_tokens") else None
                    ),
                )
            else:
                hashes = self._ix.parse_hashes(request.block_hashes)
            scores = self._ix.score(request.model, hashes, list(request.candidate_nodes))
        except KVStoreError as e:
            abort_sync(context, e)
        return indexer_pb2.ScoreResponse(
            scores=[
                indexer_pb2.NodeScore(
                    node=s.node,
                    prefix_blocks=s.prefix_blocks,
                    gpu_blocks=s.gpu_blocks,
                    cpu_blocks=s.cpu_blocks,
                    disk_blocks=s.disk_blocks,
                    rank=s.rank,
                    ranks=[
                        indexer_pb2.RankScore(
                            rank=r.rank,
                            prefix_blocks=r.prefix_blocks,
                            gpu_blocks=r.gpu_blocks,
                            cpu_blocks=r.cpu_blocks,
                            disk_blocks=r.disk_blocks,
                        )
                        for r in s.ranks
                    ],
                )
                for s in scores
            ],
            request_blocks=int(hashes.size),
        )

    def _check_secret(self, context: grpc.ServicerContext, what: str) -> None:
        secret = self._ix.cfg.cluster_secret
        if secret and not secret_matches(context.invocation_metadata(), secret.encode()):
            peer = context.peer()
            audit.denied(peer, what, audit.INDEXER_WRONG_SECRET, audit.tcp_caller(peer))
            raise PermissionDenied("this call needs the cluster secret (x-kvstore-cluster-secret)")

    @staticmethod
    def _audit_node(context: grpc.ServicerContext, what: str) -> None:
        peer = context.peer()
        audit.denied(peer, what, audit.INDEXER_NODE_REFUSED, audit.tcp_caller(peer))

    def RegisterNode(self, request, context):
        try:
            what = f"RegisterNode {request.source.node!r}"
            if self._ix.auth is not None:
                self._authorize(context, what, "node")
            else:
                self._check_secret(context, what)  # audits a refusal itself
        except KVStoreError as e:
            abort_sync(context, e)
        try:
            token = self._ix.register(
                spec_from_pb(request.source), request.ttl_s, request.owner_token
            )
        except PermissionDenied as e:  # another caller's node, or a configured one
            self._audit_node(context, what)
            abort_sync(context, e)
        except KVStoreError as e:
            abort_sync(context, e)
        return indexer_pb2.RegisterNodeResponse(owner_token=token)

    def UnregisterNode(self, request, context):
        try:
            what = f"UnregisterNode {request.node!r}"
            if self._ix.auth is not None:
                self._authorize(context, what, "node")
            else:
                self._check_secret(context, what)
        except KVStoreError as e:
            abort_sync(context, e)
        try:
            n = self._ix.unregister(request.node, request.endpoint, request.owner_token)
        except PermissionDenied as e:
            self._audit_node(context, what)
            abort_sync(context, e)
        except KVStoreError as e:
            abort_sync(context, e)
        return indexer_pb2.UnregisterNodeResponse(removed_sources=n)

    def Models(self, request, context):
        try:
            self._authorize(context, "Models", "router", "node")
        except KVStoreError as e:
            abort_sync(context, e)
        learned = self._ix.subscriber.learned_models()
        seeds = dict(self._ix.subscriber.seeds.verdicts)
        with self._ix.lock:
            try:
                indexed = self._ix.index.models()
            except KVStoreError as e:
                abort_sync(context, e)
        return indexer_pb2.ModelsResponse(
            models=[
                indexer_pb2.ModelInfo(
                    model=m,
                    # several sizes: none is "the" size; the caller must choose
                    block_size_tokens=sizes[0] if len(sizes := learned.get(m, [])) == 1 else 0,
                    first_blocks_checked=(v := seeds.get(m, SeedVerdict())).checked,
                    first_blocks_mismatched=v.mismatched,
                    hash_algo=(sc := self._ix.hash_scheme_for(m)).algo,
                    hash_lookahead_tokens=sc.lookahead_tokens,
                    hash_scheme_learned=m in self._ix.subscriber.seeds.schemes,
                )
                for m in sorted(set(indexed) | set(learned))
            ]
        )

    def ListNodes(self, request, context):
        try:
            self._authorize(context, "ListNodes", "router", "node")
            with self._ix.lock:
                indexed = self._ix.index.nodes()
        except KVStoreError as e:
            abort_sync(context, e)
        status = self._ix.source_status()
        infos = []
        for s, reg, exp in self._ix.sources():
            st = status.get(s.key)
            infos.append(
                indexer_pb2.NodeInfo(
                    source=indexer_pb2.EventSource(
                        node=s.node,
                        endpoint=s.endpoint,
                        replay_endpoint=s.replay_endpoint,
                        kind=s.kind,
                        model=s.model,
                        snapshot_address=s.snapshot_address,
                        engine_url=s.engine_url,
                        data_parallel_rank=(
                            s.data_parallel_rank if s.data_parallel_rank >= 0 else None
                        ),
                        curve_server_key=s.curve_server_key,
                    ),
                    registered=reg,
                    expires_in_s=exp,
                    last_event_age_s=st.last_event_age_s if st else -1.0,
                    since_snapshot_s=st.since_snapshot_s if st else -1.0,
                    connected=st.connected if st else False,
                    next_seq=st.next_seq if st else 0,
                    errors=st.errors if st else 0,
                    snapshots=st.snapshots if st else 0,
                    handshake_error=st.handshake_error if st else "",
                )
            )
        return indexer_pb2.ListNodesResponse(sources=infos, indexed_nodes=indexed)


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
        # bytes that are not the method's message: INVALID_ARGUMENT, not INTERNAL
        interceptors=[SyncParseGuardInterceptor()],
    )
    indexer_pb2_grpc.add_IndexerServiceServicer_to_server(IndexerServicer(indexer), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    indexer.attach_health(health_servicer)
    reflection.enable_server_reflection(
        (
            indexer_pb2.DESCRIPTOR.services_by_name["IndexerService"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    tls = indexer.cfg.tls()
    if tls.enabled:  # a client certificate of tls_ca_path is required (kvstore/tls.py)
        port = server.add_secure_port(address, tls.server_credentials())
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise ConfigError(f"cannot listen on {address!r}")
    server.start()
    return server, port
