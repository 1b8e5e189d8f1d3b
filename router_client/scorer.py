"""Cache-aware node choice for a router: hash, ask the indexer, pick.

    rc = RouterClient("10.0.0.9:50061", deadline_s=0.02)
    d = rc.pick("meta-llama/Llama-3.1-8B", token_ids, candidates=["a", "b", "c"],
                default="b", load={"a": 0.9, "b": 0.2, "c": 0.4})
    send_to(d.node)          # d.reason: "prefix", "no_hit" or "fallback"

Policy (documented in docs/events-indexer.md): for each candidate,

    value = (gpu_weight * gpu_blocks + cpu_weight * cpu_blocks
             + disk_weight * disk_blocks) / request_blocks
            - load_weight * load[node]

where the block counts are the node's longest cached prefix of the request
split by the fastest tier holding each block, and ``load`` is whatever the
caller measures, scaled to [0, 1] (queue depth / capacity, KV usage...). The
highest value wins; ties go to the lower load, then the name. If no
candidate holds at least ``min_prefix_blocks`` blocks, or the indexer does
not answer within ``deadline_s``, the caller's ``default`` is returned: the
router's own balancing applies whenever there is no cache signal.

Hashing happens here (the vLLM-compatible hasher), so only 8 bytes per block
cross the network instead of 4 per token. The block size is, by default, the
one the indexer learned from the engines' events for the model (asked with
``Models`` and cached for ``BLOCK_SIZE_TTL_S``); until the indexer knows one,
``FALLBACK_BLOCK_SIZE_TOKENS``. Pass ``block_size_tokens`` to pin it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import msgspec
import numpy as np

from kvstore.errors import DeadlineExceeded, InvalidRequest, Unavailable
from kvstore.hashing import BlockHasher
from kvstore.v1 import indexer_pb2, indexer_pb2_grpc

FALLBACK_BLOCK_SIZE_TOKENS = 16
BLOCK_SIZE_TTL_S = 30.0
# a model the indexer does not know yet is asked about again this soon
_UNKNOWN_TTL_S = 1.0
_MAX_CACHED_MODELS = 4096


class Policy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    gpu_weight: float = 1.0
    """Value of a prefix block already in an engine's GPU cache (no copy at all)."""
    cpu_weight: float = 0.8
    """Value of a block in the node's DRAM tier (one host-to-device copy)."""
    disk_weight: float = 0.5
    """Value of a block on the node's disk tier (a read, then a copy)."""
    load_weight: float = 1.0
    """Weight of the caller's load term (load in [0, 1])."""
    min_prefix_blocks: int = 1
    """Prefixes shorter than this are no signal: fall back to the default."""


DEFAULT_POLICY = Policy()


class NodeHit(msgspec.Struct, frozen=True):
    node: str
    prefix_blocks: int
    gpu_blocks: int
    cpu_blocks: int
    disk_blocks: int


class ScoreResult(msgspec.Struct, frozen=True):
    request_blocks: int
    hits: list[NodeHit]


class Decision(msgspec.Struct, frozen=True):
    node: str
    reason: str
    """"prefix": chosen by cache score; "no_hit": no candidate holds a prefix;
    "fallback": the indexer failed or missed the deadline (see ``error``)."""
    value: float = 0.0
    hit: NodeHit | None = None
    error: str = ""


def node_value(hit: NodeHit, request_blocks: int, load: float, policy: Policy) -> float:
    if request_blocks <= 0:
        return -policy.load_weight * load
    cached = (
        policy.gpu_weight * hit.gpu_blocks
        + policy.cpu_weight * hit.cpu_blocks
        + policy.disk_weight * hit.disk_blocks
    )
    return cached / request_blocks - policy.load_weight * load


def choose(
    result: ScoreResult,
    candidates: Sequence[str],
    default: str,
    load: Mapping[str, float] | None = None,
    policy: Policy = DEFAULT_POLICY,
) -> Decision:
    """The policy above, on an indexer answer (pure; no I/O)."""
    load = load or {}
    hits = {h.node: h for h in result.hits if h.prefix_blocks >= policy.min_prefix_blocks}
    best: tuple[float, float, str] | None = None
    for node in candidates:
        hit = hits.get(node)
        if hit is None:
            continue
        ld = float(load.get(node, 0.0))
        v = node_value(hit, result.request_blocks, ld, policy)
        key = (-v, ld, node)
        if best is None or key < best:
            best = key
    if best is None:
        return Decision(node=default, reason="no_hit")
    node = best[2]
    return Decision(node=node, reason="prefix", value=-best[0], hit=hits[node])


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
    ) -> None:
        if deadline_s <= 0:
            raise InvalidRequest(f"deadline_s must be > 0; got {deadline_s}")
        self._block_size = block_size_tokens
        self._hash_algo = hash_algo
        self._hash_seed = hash_seed
        self._hashers: dict[int, BlockHasher] = {}
        self._sizes: dict[str, tuple[int, float]] = {}  # model -> (block size, valid until)
        self.hasher = self._hasher(block_size_tokens or FALLBACK_BLOCK_SIZE_TOKENS)
        self.deadline_s = deadline_s
        self.policy = policy
        self._channel = channel or grpc.insecure_channel(
            address, options=[("grpc.max_send_message_length", 64 << 20)]
        )
        self._stub = indexer_pb2_grpc.IndexerServiceStub(self._channel)

    def _hasher(self, block_size: int) -> BlockHasher:
        h = self._hashers.get(block_size)
        if h is None:
            if len(self._hashers) >= 64:
                self._hashers.clear()  # bounded: a handful of sizes in practice
            h = self._hashers[block_size] = BlockHasher(
                block_size, self._hash_algo, self._hash_seed
            )
        return h

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
            resp = self._stub.Models(indexer_pb2.ModelsRequest(), timeout=self.deadline_s)
            for m in resp.models:
                if m.block_size_tokens:
                    self._sizes[m.model] = (m.block_size_tokens, now + BLOCK_SIZE_TTL_S)
        except grpc.RpcError:
            pass  # the Score that follows reports the indexer's trouble
        if model not in self._sizes or self._sizes[model][1] <= now:
            self._sizes[model] = (FALLBACK_BLOCK_SIZE_TOKENS, now + _UNKNOWN_TTL_S)
        return self._sizes[model][0]

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
        hasher = self.hasher if model is None else self._hasher(self.block_size_for(model))
        return hasher.hash_tokens_int(token_ids, cache_salt=cache_salt, lora=lora)

    def scores(
        self,
        model: str,
        block_hashes: np.ndarray,
        candidates: Sequence[str] = (),
        deadline_s: float | None = None,
    ) -> ScoreResult:
        """Raises ``DeadlineExceeded`` / ``Unavailable`` / ``InvalidRequest``."""
        req = indexer_pb2.ScoreRequest(
            model=model,
            block_hashes=np.asarray(block_hashes, dtype="<u8").tobytes(),
            candidate_nodes=list(candidates),
        )
        try:
            resp = self._stub.Score(req, timeout=deadline_s or self.deadline_s)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            detail = e.details() if hasattr(e, "details") else str(e)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceeded(f"indexer did not answer in time: {detail}") from None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidRequest(detail) from None
            raise Unavailable(f"indexer: {code}: {detail}") from None
        return ScoreResult(
            request_blocks=resp.request_blocks,
            hits=[
                NodeHit(s.node, s.prefix_blocks, s.gpu_blocks, s.cpu_blocks, s.disk_blocks)
                for s in resp.scores
            ],
        )

    def pick(
        self,
        model: str,
        token_ids: Any,
        candidates: Sequence[str],
        *,
        default: str,
        load: Mapping[str, float] | None = None,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
    ) -> Decision:
        """Best candidate by the policy; ``default`` on no hit or any indexer trouble.

        The deadline covers the indexer call; hashing (~10 ms for 195k tokens)
        is local and comes before it.
        """
        hashes = self.hash(token_ids, cache_salt=cache_salt, lora=lora, model=model)
        if hashes.size == 0:
            return Decision(node=default, reason="no_hit")
        t0 = time.monotonic()
        try:
            result = self.scores(model, hashes, candidates)
        except (Unavailable, InvalidRequest) as e:
            return Decision(
                node=default,
                reason="fallback",
                error=f"{type(e).__name__} after {time.monotonic() - t0:.3f}s: {e}",
            )
        return choose(result, candidates, default, load, self.policy)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
