"""The indexer client a router uses: hash, ask the indexer, pick.

    rc = RouterClient("10.0.0.9:50061", deadline_s=0.02)
    d = rc.pick("meta-llama/Llama-3.1-8B", token_ids, candidates=["a", "b", "c"],
                default="b", load={"a": NodeLoad(running=3, capacity=8), ...})
    send_to(d.node)          # d.reason: "prefix", "load", "no_hit" or "fallback"

The policy is ``kvstore_router_client.policy`` (documented in docs/router.md). If the
indexer does not answer within ``deadline_s``, the choice falls back to load
alone (or the caller's ``default`` when no load is given): a slow indexer never
stalls routing.

Hashing happens here (the vLLM-compatible hasher, incrementally through
``PrefixHashCache``: a re-sent context hashes only its new tail), so only 8
bytes per block cross the network instead of 4 per token. The block size is, by
default, the one the indexer learned from the engines' events for the model
(asked with ``Models`` and cached for ``BLOCK_SIZE_TTL_S``); until the indexer
knows one, ``FALLBACK_BLOCK_SIZE_TOKENS``. Pass ``block_size_tokens`` to pin it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from kvstore.errors import InvalidRequest, KVStoreError, Unavailable, error_from_rpc
from kvstore.hashing import BlockHasher
from kvstore.identity import client_token, token_metadata
from kvstore.tls import ClientCredentials, env_client_credentials
from kvstore.v1 import indexer_pb2, indexer_pb2_grpc
from kvstore_router_client.policy import (
    DEFAULT_POLICY,
    NO_SCORES,
    Decision,
    LoadArg,
    NodeHit,
    Policy,
    RankHit,
    ScoreResult,
    choose,
)
from kvstore_router_client.prefix_cache import Hashed, PrefixHashCache

FALLBACK_BLOCK_SIZE_TOKENS = 16
BLOCK_SIZE_TTL_S = 30.0
# a model the indexer does not know yet is asked about again this soon
_UNKNOWN_TTL_S = 1.0
_MAX_CACHED_MODELS = 4096
# block sizes with a hasher and a prefix cache each: a handful in practice
_MAX_BLOCK_SIZES = 16
# calls in flight on a channel replaced after a certificate renewal get this long
_RENEWAL_GRACE_S = 5.0


def score_request(
    model: str, block_hashes: np.ndarray, candidates: Sequence[str]
) -> indexer_pb2.ScoreRequest:
    return indexer_pb2.ScoreRequest(
        model=model,
        block_hashes=np.asarray(block_hashes, dtype="<u8").tobytes(),
        candidate_nodes=list(candidates),
    )


def _hit(s: indexer_pb2.NodeScore) -> NodeHit:
    if not s.ranks:  # a node without DP ranks (or an indexer that predates them)
        return NodeHit(s.node, s.prefix_blocks, s.gpu_blocks, s.cpu_blocks, s.disk_blocks)
    ranks = tuple(
        RankHit(r.rank, r.prefix_blocks, r.gpu_blocks, r.cpu_blocks, r.disk_blocks) for r in s.ranks
    )
    return NodeHit(
        s.node, s.prefix_blocks, s.gpu_blocks, s.cpu_blocks, s.disk_blocks, s.rank, ranks
    )


def score_result(resp: indexer_pb2.ScoreResponse) -> ScoreResult:
    return ScoreResult(request_blocks=resp.request_blocks, hits=[_hit(s) for s in resp.scores])


def score_error(e: grpc.RpcError) -> KVStoreError:
    """The kvstore error for a failed Score call: the class the indexer raised
    (``errors.error_from_rpc``); a status no class is sent with reads as the
    indexer being unavailable."""
    return error_from_rpc(e, "indexer", unclassified=Unavailable)


class AsyncIndexClient:
    """The indexer's Score for an asyncio router (grpc.aio: no thread hop per
    decision). Create it inside the running loop."""

    def __init__(self, address: str, *, deadline_s: float = 0.05, token: str | None = None) -> None:
        if deadline_s <= 0:
            raise InvalidRequest(f"deadline_s must be > 0; got {deadline_s}")
        self.deadline_s = deadline_s
        # The router's own identity for an indexer with principals (kvstore.identity):
        # the token given, else $KVSTORE_TOKEN / $KVSTORE_TOKEN_FILE.
        self._metadata = token_metadata(client_token(token))
        self._address = address
        # an indexer with mutual TLS (KVSTORE_TLS_*); renewed files: a new channel
        self._credentials = env_client_credentials()
        self._generation = 0
        self._channel = self._open()
        self._grpc_stub = indexer_pb2_grpc.IndexerServiceStub(self._channel)
        self._retired: set[asyncio.Task[None]] = set()

    def _open(self) -> grpc.aio.Channel:
        options = [("grpc.max_send_message_length", 64 << 20)]
        if self._credentials is None:
            return grpc.aio.insecure_channel(self._address, options=options)
        credentials, self._generation = self._credentials.current()
        return grpc.aio.secure_channel(self._address, credentials, options=options)

    @property
    def _stub(self) -> indexer_pb2_grpc.IndexerServiceStub:
        if self._credentials is not None and self._credentials.current()[1] != self._generation:
            old, self._channel = self._channel, self._open()
            self._grpc_stub = indexer_pb2_grpc.IndexerServiceStub(self._channel)
            task = asyncio.get_running_loop().create_task(old.close(_RENEWAL_GRACE_S))
            self._retired.add(task)  # held until done, so it is not collected half-way
            task.add_done_callback(self._retired.discard)
        return self._grpc_stub

    async def scores(
        self,
        model: str,
        block_hashes: np.ndarray,
        candidates: Sequence[str] = (),
        deadline_s: float | None = None,
    ) -> ScoreResult:
        """Raises the indexer's error (``DeadlineExceeded``, ``Unavailable``...)."""
        req = score_request(model, block_hashes, candidates)
        try:
            resp = await self._stub.Score(
                req, timeout=deadline_s or self.deadline_s, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise score_error(e) from None
        return score_result(resp)

    async def connect(self, timeout_s: float) -> bool:
        """Open the connection now (True once it is ready within ``timeout_s``), so
        the first decision does not pay the TCP and HTTP/2 set-up inside its deadline."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def engines(self, deadline_s: float) -> dict[str, str]:
        """Node -> engine URL of the indexer's sources that name one (ListNodes).

        A node with several sources naming different URLs keeps the first by
        endpoint order (the indexer lists them sorted). Raises the indexer's error."""
        resp = await self.list_nodes(deadline_s)
        out: dict[str, str] = {}
        for info in resp.sources:
            if info.source.engine_url:
                out.setdefault(info.source.node, info.source.engine_url)
        return out

    async def list_nodes(self, deadline_s: float) -> indexer_pb2.ListNodesResponse:
        """The indexer's ListNodes: every source it follows (configured and
        registered). Raises the indexer's error."""
        try:
            resp: indexer_pb2.ListNodesResponse = await self._stub.ListNodes(
                indexer_pb2.ListNodesRequest(), timeout=deadline_s, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise score_error(e) from None
        return resp

    async def close(self) -> None:
        await self._channel.close()


class RouterClient:
    """Asks an indexer for prefix scores; never lets a slow indexer stall routing."""

    def __init__(
        self,
        address: str,
        *,
        block_size_tokens: int | None = None,
        hash_algo: str = "sha256",
        hash_seed: str | None = None,
        deadline_s: float = 0.05,
        policy: Policy = DEFAULT_POLICY,
        channel: grpc.Channel | None = None,
        hash_cache_tokens: int = 8 << 20,
        token: str | None = None,
    ) -> None:
        if deadline_s <= 0:
            raise InvalidRequest(f"deadline_s must be > 0; got {deadline_s}")
        # our identity for an indexer with principals: token, else $KVSTORE_TOKEN(_FILE)
        self._metadata = token_metadata(client_token(token))
        self._block_size = block_size_tokens
        self._hash_algo = hash_algo
        self._hash_seed = hash_seed
        self._hash_cache_tokens = hash_cache_tokens
        self._caches: dict[int, PrefixHashCache] = {}
        self._sizes: dict[str, tuple[int, float]] = {}  # model -> (block size, valid until)
        self.hash_cache = self._cache(block_size_tokens or FALLBACK_BLOCK_SIZE_TOKENS)
        self.hasher = self.hash_cache.hasher
        self.deadline_s = deadline_s
        self.policy = policy
        self._address = address
        # mutual TLS (KVSTORE_TLS_*), renewed files followed, on a channel we make
        self._credentials: ClientCredentials | None = None
        self._generation = 0
        if channel is None:
            self._credentials = env_client_credentials()
            channel = self._open()
        self._channel = channel
        self._grpc_stub = indexer_pb2_grpc.IndexerServiceStub(self._channel)

    def _open(self) -> grpc.Channel:
        options = [("grpc.max_send_message_length", 64 << 20)]
        if self._credentials is None:
            return grpc.insecure_channel(self._address, options=options)
        credentials, self._generation = self._credentials.current()
        return grpc.secure_channel(self._address, credentials, options=options)

    @property
    def _stub(self) -> indexer_pb2_grpc.IndexerServiceStub:
        if self._credentials is not None and self._credentials.current()[1] != self._generation:
            # the old channel is dropped, not closed: a call in flight on it finishes
            self._channel = self._open()
            self._grpc_stub = indexer_pb2_grpc.IndexerServiceStub(self._channel)
        return self._grpc_stub

    def _cache(self, block_size: int) -> PrefixHashCache:
        cache = self._caches.get(block_size)
        if cache is None:
            if len(self._caches) >= _MAX_BLOCK_SIZES:
                self._caches.clear()
            hasher = BlockHasher(block_size, self._hash_algo, self._hash_seed)
            cache = self._caches[block_size] = PrefixHashCache(hasher, self._hash_cache_tokens)
        return cache

    def block_size_for(self, model: str) -> int:
        """The block size to hash ``model``'s requests at (see the module doc)."""
        if self._block_size:
            return self._block_size
        now = time.monotonic()
        cached = self._sizes.get(model)
        if cached is not None and cached[1] > now:
            return cached[0]
        if len(self._sizes) >= _MAX_CACHED_MODELS:
            self._sizes.clear()
        try:
            resp = self._stub.Models(
                indexer_pb2.ModelsRequest(), timeout=self.deadline_s, metadata=self._metadata
            )
            for m in resp.models:
                if m.block_size_tokens:
                    self._sizes[m.model] = (m.block_size_tokens, now + BLOCK_SIZE_TTL_S)
        except grpc.RpcError:
            pass  # the Score that follows reports the indexer's trouble
        if model not in self._sizes or self._sizes[model][1] <= now:
            self._sizes[model] = (FALLBACK_BLOCK_SIZE_TOKENS, now + _UNKNOWN_TTL_S)
        return self._sizes[model][0]

    def _cache_for(self, model: str | None) -> PrefixHashCache:
        return self.hash_cache if model is None else self._cache(self.block_size_for(model))

    def hash(
        self,
        token_ids: Any,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        *,
        model: str | None = None,
    ) -> np.ndarray:
        """Block hashes (uint64) of the full blocks of ``token_ids``, as vLLM computes them.

        With ``model`` (and no pinned block size), at the block size the
        indexer learned for it; else at the pinned or fallback size.
        """
        return self.hash_incremental(token_ids, cache_salt, lora, model=model).hashes

    def hash_incremental(
        self,
        token_ids: Any,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        *,
        model: str | None = None,
    ) -> Hashed:
        """``hash`` with what was reused and where the previous turn went (affinity)."""
        return self._cache_for(model).hash(token_ids, cache_salt=cache_salt, lora=lora)

    def scores(
        self,
        model: str,
        block_hashes: np.ndarray,
        candidates: Sequence[str] = (),
        deadline_s: float | None = None,
    ) -> ScoreResult:
        """Raises the indexer's error (``DeadlineExceeded``, ``Unavailable``...)."""
        req = score_request(model, block_hashes, candidates)
        try:
            resp = self._stub.Score(
                req, timeout=deadline_s or self.deadline_s, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise score_error(e) from None
        return score_result(resp)

    def pick(
        self,
        model: str,
        token_ids: Any,
        candidates: Sequence[str],
        *,
        default: str,
        load: LoadArg | None = None,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> Decision:
        """Best candidate by the policy; on no hit or any indexer trouble, the least
        loaded (when ``load`` is given) or ``default``.

        The deadline covers the indexer call; hashing is local and comes before it.
        The choice is recorded for the next turn's affinity.
        """
        cache = self._cache_for(model)
        hashed = cache.hash(token_ids, cache_salt=cache_salt, lora=lora)
        d = self.decide(model, hashed, candidates, default=default, load=load)
        cache.routed(hashed, d.node)
        return d

    def decide(
        self,
        model: str,
        hashed: Hashed,
        candidates: Sequence[str],
        *,
        default: str,
        load: LoadArg | None = None,
    ) -> Decision:
        """``pick`` on hashes already computed (records nothing)."""
        if hashed.hashes.size == 0:
            return choose(NO_SCORES, candidates, default, load, self.policy)
        t0 = time.monotonic()
        try:
            result = self.scores(model, hashed.hashes, candidates)
        except KVStoreError as e:  # any indexer trouble: route without it
            d = choose(
                ScoreResult(request_blocks=int(hashed.hashes.size), hits=[]),
                candidates,
                default,
                load,
                self.policy,
                affinity=hashed.previous_node,
                reason_without_hit="fallback",
            )
            return Decision(
                node=d.node,
                reason="fallback",
                value=d.value,
                error=f"{type(e).__name__} after {time.monotonic() - t0:.3f}s: {e}",
            )
        return choose(result, candidates, default, load, self.policy, affinity=hashed.previous_node)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
