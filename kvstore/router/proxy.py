"""`kvstore router`: an OpenAI-compatible reverse proxy that routes by cache and load.

Each completion request:

  1. parsed (malformed JSON -> 400, unknown model -> 404, body too large -> 413,
     router at ``max_inflight`` -> 429 + Retry-After, no engine up -> 503:
     the statuses and error body an OpenAI/vLLM server gives);
  2. token ids: a prompt of token ids is used as is; text and chat messages go
     to one engine's own ``/tokenize`` (the chat template applied exactly as
     that engine applies it);
  3. block hashes, incrementally (``kvstore_router_client.PrefixHashCache``: a re-sent
     context hashes only its new tail), with the request's ``cache_salt``;
  4. the indexer's Score within ``decision_deadline_s`` (late or failing: the
     choice falls back to load), then ``kvstore_router_client``'s strategy;
  5. forwarded byte for byte; a streamed answer (SSE) is passed through chunk by
     chunk as the engine writes it. An engine that refuses the connection is
     marked down and the next candidate is tried; one that dies mid-stream ends
     the client's stream with an error event (never a hang); a client that goes
     away closes the upstream connection, so the engine aborts the request.

The server is aiohttp's (per-request cancellation on client disconnect; vLLM
already depends on it). The forwarded request goes through
``kvstore.router.upstream``, a lean HTTP/1.1 client (asyncio + httptools) with
kept-alive connections per engine: aiohttp's client cost ~0.5 ms more per
request to the first event (docs/router.md). The calls off the per-token path
(``/tokenize``, the prefill call, scrapes) keep aiohttp's client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import msgspec
import numpy as np
from aiohttp import web

from kvstore.config import RouterConfig
from kvstore.errors import BackendError, DeadlineExceeded, InvalidRequest, KVStoreError, Unavailable
from kvstore.hashing import BlockHasher
from kvstore.heap import CollectorPauses, settle_heap
from kvstore.router.backends import Backend, Fleet
from kvstore.router.flow import FlowControl, Shed
from kvstore.router.local_index import LocalIndex
from kvstore.router.metrics import RouterMetrics
from kvstore.router.prompt_cache import PromptBytesCache
from kvstore.router.upstream import Response
from kvstore.sdnotify import SdNotifier
from kvstore_router_client.policy import Decision, Policy, ScoreResult
from kvstore_router_client.prefix_cache import Hashed, KnownPrefix, PrefixHashCache
from kvstore_router_client.scorer import AsyncIndexClient
from kvstore_router_client.strategies import make_strategy

log = logging.getLogger("kvstore.router")

COMPLETIONS = "/v1/completions"
PEER_HINT = "kvstore_peer"  # kv_transfer_params key the KVStore connector reads
# The P/D hand-over (docs/peer-transfer.md, "Handed-over pins"): the prefill
# request asks its connector to pin the prompt's blocks for the decode node
# (HAND_OVER); the prefill answer's kv_transfer_params carry the pin (TICKET),
# passed on to the decode request so its daemon reads with no pin round trip.
HAND_OVER = "kvstore_hand_over"
TICKET = "kvstore_ticket"
# vLLM's OpenAI server pins a request to this data-parallel rank
# (OpenAIServing._get_data_parallel_rank, vLLM 0.32 and 0.33); without it vLLM's
# own balancer picks one.
DP_RANK_HEADER = "X-data-parallel-rank"
CHAT = "/v1/chat/completions"
SCORE_WARN_EVERY_S = 30.0
# Bound on a non-streamed (or error) answer read whole before it is passed on.
MAX_ANSWER_BYTES = 64 << 20
# Chat fields /tokenize needs to apply the template as the chat endpoint does.
CHAT_TOKENIZE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)


class RouteError(Exception):
    """An answer to give the client instead of forwarding (status + OpenAI error body)."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        return error_response(self.status, self.message, self.kind, self.param, headers)


def error_response(
    status: int,
    message: str,
    kind: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status, headers=headers)


def _token_array(value: msgspec.Raw) -> bool:
    """Whether a prompt's JSON is an array whose first element is a number."""
    head = bytes(memoryview(value)[:64]).lstrip()
    if not head.startswith(b"["):
        return False
    first = head[1:].lstrip()[:1]
    return first.isdigit() or first == b"-"


def decode_body(raw: bytes) -> dict[str, Any]:
    """The request body as a dict; a token-id ``prompt`` stays ``msgspec.Raw`` (its
    ints are parsed by the router's PromptBytesCache, incrementally, and Raw
    re-encodes verbatim when the body is rebuilt). The whole body is validated."""
    try:
        fields = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError:
        raise RouteError(400, "the body must be a JSON object", "BadRequestError") from None
    except msgspec.DecodeError as e:
        raise RouteError(400, f"malformed JSON body: {e}", "BadRequestError") from None
    body: dict[str, Any] = {}
    for k, v in fields.items():
        body[k] = v if k == "prompt" and _token_array(v) else msgspec.json.decode(v)
    return body


def tenant_salt(tenant: str) -> str:
    """The cache_salt of a tenant: the same on every router replica (stateless)."""
    return f"kvstore-tenant:{tenant}"


def sse_error(message: str, status: int = 502) -> bytes:
    body = {"error": {"message": message, "type": "BadGatewayError", "param": None, "code": status}}
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.fleet = Fleet(
            config.backends,
            connect_timeout_s=config.connect_timeout_s,
            scrape_interval_s=config.scrape_interval_s,
            capacity=config.backend_capacity,
            daemons=config.daemons,
        )
        self.metrics = RouterMetrics(self.fleet, lambda: self.local)
        self.policy = Policy(load_weight=config.load_weight, peer_weight=config.peer_weight)
        self.strategy = make_strategy(config.strategy, policy=self.policy)
        self._index: AsyncIndexClient | None = None
        self._catalog: AsyncIndexClient | None = None
        """The indexer's ListNodes, with backends_from_indexer or index = "local"."""
        self.local: LocalIndex | None = None
        """index = "local": the index in this process (kvstore.router.local_index)."""
        self._local_task: asyncio.Task[None] | None = None
        self._check_task: asyncio.Task[None] | None = None
        """index = "local": its readiness re-checked between requests, not in a decision."""
        self._hashes: PrefixHashCache | None = None
        self._prompts = PromptBytesCache(config.hash_cache_tokens)
        self._inflight = 0
        self._score_warned_at = -math.inf
        """When an indexer failure was last logged (one line per SCORE_WARN_EVERY_S)."""
        self._hasher_warned = False
        self.flow = FlowControl(
            classes=config.priority_classes,
            slots=max(1, int(len(config.backends) * config.backend_capacity)),
            queue_max=config.queue_max,
            low_max_wait_s=config.low_max_wait_s,
            weights=config.tenant_weights,
        )
        if config.flow_control:
            self.fleet.on_scraped = self._resize_flow
        self.app = web.Application(client_max_size=config.max_body_bytes)
        self.app.add_routes(
            [
                web.post(COMPLETIONS, self.completions),
                web.post(CHAT, self.completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/metrics", self.prometheus),
            ]
        )
        self.app.on_startup.append(self._start)
        self.app.on_cleanup.append(self._stop)

    # -- lifecycle -------------------------------------------------------------

    async def _start(self, app: web.Application) -> None:
        c = self.config
        if c.backends_from_indexer or c.index == "local":
            self._catalog = AsyncIndexClient(c.indexer, deadline_s=c.connect_timeout_s)
        if c.index == "local":
            self.local = LocalIndex(
                max_bytes=c.local_index_max_bytes,
                hash_algo=c.hash_algo,
                hash_seed=c.hash_seed,
                cluster_secret=os.environ.get("KVSTORE_SECRET", ""),
                curve_key_file=c.local_index_curve_key_file,
            )
            self.local.start()
            assert self._catalog is not None
            await self.local.refresh(self._catalog, c.connect_timeout_s)
            self._local_task = asyncio.create_task(self._follow_loop())
            self._check_task = asyncio.create_task(self.local.keep_checked())
        if c.backends_from_indexer:
            catalog = self._catalog
            assert catalog is not None
            await self.fleet.start(
                lambda: catalog.engines(c.connect_timeout_s),
                refresh_s=c.backends_refresh_s,
                max_discovered=c.max_backends,
            )
        else:
            await self.fleet.start()
        self._ensure_hasher()
        if self._index is not None and not await self._index.connect(c.connect_timeout_s):
            log.warning(
                "indexer %s not reachable within %.1fs: decisions route by load until it is",
                c.indexer,
                c.connect_timeout_s,
            )

    async def _follow_loop(self) -> None:
        """Keep the local index following the indexer's sources."""
        assert self.local is not None and self._catalog is not None
        while True:
            await asyncio.sleep(self.config.local_index_refresh_s)
            try:
                await self.local.refresh(self._catalog, self.config.connect_timeout_s)
            except Exception:  # a bug here must not stop the list from being re-read
                log.exception("refreshing the local index's sources failed")

    async def _stop(self, app: web.Application) -> None:
        for task in (self._local_task, self._check_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.local is not None:
            self.local.close()
        await self.fleet.close()
        if self._catalog is not None:
            await self._catalog.close()
        if self._index is not None:
            await self._index.close()

    def _ensure_hasher(self) -> PrefixHashCache | None:
        """The hasher needs the engines' block size and hash: from config or their /metrics."""
        if self._hashes is not None:
            return self._hashes
        c = self.config
        info = self.fleet.engine_info()
        block_size = c.block_size_tokens or (info.block_size if info else 0)
        algo = c.hash_algo or (info.hash_algo if info and info.hash_algo else "sha256")
        if not block_size:
            if not self._hasher_warned:  # one line: every decision until then is a fallback
                self._hasher_warned = True
                log.warning(
                    "no engine has told its block size yet (vllm:cache_config_info) and "
                    "router.block_size_tokens is unset: decisions route by load until one does"
                )
            return None
        seed = c.hash_seed or None
        self._hashes = PrefixHashCache(BlockHasher(block_size, algo, seed), c.hash_cache_tokens)
        if c.indexer:
            self._index = AsyncIndexClient(c.indexer, deadline_s=c.decision_deadline_s)
        log.info("router hashing: block_size=%d algo=%s", block_size, algo)
        return self._hashes

    # -- small endpoints ---------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        up = [b.node for b in self.fleet.backends.values() if b.healthy]
        drained = [b.node for b in self.fleet.backends.values() if not b.daemon_serving]
        status = 200 if up else 503
        return web.json_response({"healthy_backends": up, "drained": drained}, status=status)

    async def models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        data = [
            {
                "id": m,
                "object": "model",
                "created": now,
                "owned_by": "kvstore-router",
                "root": info.root,
                "max_model_len": info.max_model_len,
            }
            for m, info in sorted(self.fleet.models().items())
        ]
        return web.json_response({"object": "list", "data": data})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain")

    # -- completions -------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        endpoint = request.path
        if self._inflight >= self.config.max_inflight:
            self.metrics.shed.inc()
            self.metrics.requests.labels(endpoint, "", "429").inc()
            return error_response(
                429,
                f"the router is at its limit of {self.config.max_inflight} requests",
                "RateLimitError",
                headers={"Retry-After": "1"},
            )
        self._inflight += 1
        try:
            resp, node = await self._complete(request)
        except RouteError as e:
            resp, node = e.response(), ""
        except Shed as e:
            self.metrics.shed.inc()
            kind = "RateLimitError" if e.status == 429 else "ServiceUnavailableError"
            retry = {"Retry-After": str(max(1, round(e.retry_after_s)))}
            resp, node = error_response(e.status, e.message, kind, headers=retry), ""
        finally:
            self._inflight -= 1
        self.metrics.requests.labels(endpoint, node, str(resp.status)).inc()
        return resp

    async def _complete(self, request: web.Request) -> tuple[web.StreamResponse, str]:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RouteError(
                413,
                f"request body over the router's limit of {self.config.max_body_bytes} bytes",
                "BadRequestError",
            ) from None
        body = decode_body(raw)
        if self.config.tenants:
            tenant = self._tenant(request)
            # The tenant's salt replaces whatever the client sent: KV is shared
            # within a tenant only (the engines' prefix caches and the daemons).
            body["cache_salt"] = tenant_salt(tenant)
            raw = msgspec.json.encode(body)
        model = body.get("model")
        models = self.fleet.models()
        if not models:
            raise RouteError(503, "no backend is up", "ServiceUnavailableError")
        if not isinstance(model, str) or model not in models:
            raise RouteError(
                404,
                f"The model `{model}` does not exist. Valid models: {', '.join(sorted(models))}.",
                "NotFoundError",
                "model",
            )
        candidates = self.fleet.candidates(model)
        if not self.config.flow_control:
            return await self._route(request, raw, body, model, candidates)
        tenant = self._tenant(request) if self.config.tenants else ""
        klass = self._priority(request, body, tenant)
        self._resize_flow()
        t0 = time.perf_counter()
        await self.flow.acquire(klass, tenant)
        self.metrics.queue_s.labels(klass).observe(time.perf_counter() - t0)
        try:
            return await self._route(request, raw, body, model, candidates)
        finally:
            self.flow.release()

    def _resize_flow(self) -> None:
        """This router's slots: each healthy engine's capacity less the requests it
        runs for others (other replicas, direct clients; from its gauges at the last
        scrape), so N replicas together keep each engine at ``backend_capacity``
        instead of N times it. Run per request and after each scrape (which wakes
        waiters once others' work drains)."""
        cap = self.fleet.capacity
        healthy = [b for b in self.fleet.backends.values() if b.healthy]
        others = sum(min(cap, b.others) for b in healthy)
        self.flow.set_slots(int(len(healthy) * cap - others), floor=0 if others else 1)

    def _priority(self, request: web.Request, body: dict[str, Any], tenant: str) -> str:
        classes = self.config.priority_classes
        claimed = request.headers.get("x-kvstore-priority", "")
        if tenant and tenant in self.config.tenant_priority:
            return self.config.tenant_priority[tenant]
        if claimed:
            if claimed not in classes:
                raise RouteError(
                    400,
                    f"x-kvstore-priority {claimed!r}: one of {', '.join(classes)}",
                    "BadRequestError",
                )
            return claimed
        prio = body.get("priority")
        if isinstance(prio, int) and not isinstance(prio, bool) and prio:
            return classes[0] if prio < 0 else classes[-1]  # vLLM: lower = sooner
        return self.config.default_priority

    async def _route(
        self,
        request: web.Request,
        raw: bytes,
        body: dict[str, Any],
        model: str,
        candidates: list[Backend],
    ) -> tuple[web.StreamResponse, str]:
        chat = request.path == CHAT
        headers = {"content-type": "application/json"}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        stream = bool(body.get("stream"))
        if self.config.prefill:
            return await self._complete_split(request, model, body, chat, candidates, headers)
        order, decision = await self._decide(model, body, chat, candidates)
        if (
            self.config.peer_hints
            and decision.peer
            and decision.peer_blocks > 0
            and "kv_transfer_params" not in body
        ):
            # The chosen engine lacks part of the prefix another node holds: its
            # daemon pulls those blocks over NIXL before the forward (the policy
            # credited the pull with peer_weight).
            raw = msgspec.json.encode({**body, "kv_transfer_params": {PEER_HINT: decision.peer}})
            self.metrics.peer_hints.inc()
        return await self._forward(request, raw, order, decision, headers, stream)

    def _tenant(self, request: web.Request) -> str:
        auth = request.headers.get("Authorization", "")
        key = auth[len("Bearer ") :].strip() if auth.startswith("Bearer ") else ""
        tenant = self.config.tenants.get(key) if key else None
        if tenant is None:
            raise RouteError(
                401,
                "missing or unknown API key (Authorization: Bearer <key>)",
                "AuthenticationError",
            )
        return tenant

    async def _complete_split(
        self,
        request: web.Request,
        model: str,
        body: dict[str, Any],
        chat: bool,
        candidates: list[Backend],
        headers: dict[str, str],
    ) -> tuple[web.StreamResponse, str]:
        """Prefill on a prefill engine (max_tokens=1: its connector stores every full
        block in its daemon), then decode with a kvstore_peer hint naming it, so the
        decode node's daemon pulls the KV over NIXL; the client's answer (and
        stream) comes from decode. A failed or late prefill: decode computes it."""
        prefill = [b for b in candidates if b.node in self.config.prefill]
        decode = [b for b in candidates if b.node in self.config.decode]
        if not decode:
            raise RouteError(503, "no decode engine is up", "ServiceUnavailableError")
        t0 = time.perf_counter()
        hashed = await self._hash_request(model, body, chat, self._least_loaded(decode))
        # One Score for both pools: the decode and the prefill choice read the same
        # prefix map (a second round trip would only add its latency).
        both = (
            (await self._scores(model, hashed, [b.node for b in decode + prefill]),)
            if hashed is not None and self.strategy.uses_index
            else None
        )
        d = await self._choose_among(model, hashed, decode, both)
        self.metrics.decisions.labels(d.reason).inc()
        self.metrics.decision_s.observe(time.perf_counter() - t0)
        chosen = next(b for b in decode if b.node == d.node)
        order = [chosen, *(b for b in self._by_load(decode) if b is not chosen)]
        why = "no prefill engine up"
        if prefill:
            p = await self._choose_among(model, hashed, prefill, both)
            pb = next(b for b in prefill if b.node == p.node)
            why, ticket = await self._prefill(request.path, body, pb, headers, p.rank)
        raw: bytes
        if not why:
            params = body.get("kv_transfer_params")
            hint = {**(params if isinstance(params, dict) else {}), PEER_HINT: pb.node}
            if ticket:
                hint[TICKET] = ticket
                self.metrics.pd_tickets.inc()
            raw = msgspec.json.encode({**body, "kv_transfer_params": hint})
            pd = f"prefill={pb.node}"
        else:
            raw = msgspec.json.encode(body)
            pd = f"fallback: {why}"
            self.metrics.pd_fallbacks.labels(why.split(":")[0]).inc()
            log.warning("prefill skipped (%s): decode computes the prompt", why)
        stream = bool(body.get("stream"))
        return await self._forward(
            request, raw, order, d, headers, stream, extra={"x-kvstore-pd": pd}
        )

    async def _prefill(
        self, path: str, body: dict[str, Any], b: Backend, headers: dict[str, str], rank: int
    ) -> tuple[str, str]:
        """Run the prompt on prefill engine ``b`` (its DP rank ``rank``; -1: any):
        ("", the pin its connector handed over, "" if none) when it answered, else
        (why not, "")."""
        pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        params = body.get("kv_transfer_params")
        pre["kv_transfer_params"] = {
            **(params if isinstance(params, dict) else {}),
            HAND_OVER: True,
        }
        pre["max_tokens"] = 1
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        timeout = aiohttp.ClientTimeout(
            total=self.config.prefill_deadline_s, connect=self.config.connect_timeout_s
        )
        if rank >= 0:
            headers = {**headers, DP_RANK_HEADER: str(rank)}
        b.inflight += 1
        try:
            async with b.session.post(
                b.base + path, data=msgspec.json.encode(pre), headers=headers, timeout=timeout
            ) as r:
                answer = await r.read()
                if r.status != 200:
                    return f"status: prefill {b.node} answered {r.status}", ""
        except aiohttp.ClientConnectorError as e:
            b.mark_down(f"connect: {e}")
            return f"connect: prefill {b.node}: {e}", ""
        except TimeoutError:
            return f"deadline: prefill {b.node} past {self.config.prefill_deadline_s:g} s", ""
        except aiohttp.ClientError as e:
            return f"error: prefill {b.node}: {type(e).__name__}: {e}", ""
        finally:
            b.inflight -= 1
        return "", _ticket_of(answer)

    def _by_load(self, backends: list[Backend]) -> list[Backend]:
        return sorted(backends, key=lambda b: (b.load(self.fleet.capacity).load(), b.node))

    def _least_loaded(self, backends: list[Backend]) -> Backend:
        return self._by_load(backends)[0]

    async def _decide(
        self, model: str, body: dict[str, Any], chat: bool, candidates: list[Backend]
    ) -> tuple[list[Backend], Decision]:
        t0 = time.perf_counter()
        by_load = self._by_load(candidates)
        # One engine has nothing to choose among, unless it serves several DP
        # ranks: then the Score picks the rank (the one whose GPU cache holds most).
        ranked = candidates[0].dp_ranks > 1 and self.strategy.uses_index
        if len(candidates) == 1 and not ranked:
            d = Decision(node=candidates[0].node, reason="only")
        else:
            hashed = await self._hash_request(model, body, chat, by_load[0])
            d = await self._choose_among(model, hashed, candidates)
        self.metrics.decisions.labels(d.reason).inc()
        self.metrics.decision_s.observe(time.perf_counter() - t0)
        chosen = next(b for b in candidates if b.node == d.node)
        return [chosen, *(b for b in by_load if b is not chosen)], d

    async def _hash_request(
        self, model: str, body: dict[str, Any], chat: bool, via: Backend
    ) -> Hashed | None:
        """The request's block hashes (None: no tokens or no hasher: route by load)."""
        if self.strategy.name in ("random", "round-robin"):
            return None  # they look at nothing: no tokenizing, no hashing
        hashes_cache = self._ensure_hasher()
        prompt = None if chat else body.get("prompt")
        known: KnownPrefix | None = None
        ids: list[int] | np.ndarray | None
        if isinstance(prompt, msgspec.Raw):
            ids, known = self._raw_token_ids(prompt)
        else:
            ids = await self._token_ids(model, body, chat, via)
        if ids is None or hashes_cache is None:
            return None
        salt = body.get("cache_salt")
        try:
            hashed = hashes_cache.hash(
                ids,
                cache_salt=salt if isinstance(salt, str) else None,
                # ids parsed here (PromptBytesCache) are the router's, never changed
                owned=isinstance(ids, np.ndarray),
                known=known,
            )
        except KVStoreError as e:
            raise RouteError(400, f"prompt: {e}", "BadRequestError", "prompt") from None
        self.metrics.hash_blocks.labels("reused").inc(hashed.reused_blocks)
        self.metrics.hash_hinted.inc(hashed.hinted)
        self.metrics.hash_blocks.labels("hashed").inc(hashed.hashes.size - hashed.reused_blocks)
        return hashed

    async def _choose_among(
        self,
        model: str,
        hashed: Hashed | None,
        candidates: list[Backend],
        fetched: tuple[ScoreResult | None] | None = None,
    ) -> Decision:
        """The strategy's choice among ``candidates``; ``fetched``: a Score already
        made for them (and maybe more nodes: the policy looks at candidates only)."""
        names = [b.node for b in candidates]
        loads = {b.node: b.load(self.fleet.capacity) for b in candidates}
        if hashed is None:
            return self.strategy.choose(np.zeros(0, np.uint64), names, loads, None)
        if fetched is not None:
            scores = fetched[0]
        elif self.strategy.uses_index:
            scores = await self._scores(model, hashed, names)
        else:
            scores = None
        d = self.strategy.choose(hashed.hashes, names, loads, scores, hashed.previous_node)
        PrefixHashCache.routed(hashed, d.node)
        self.strategy.routed(d.node, hashed.hashes)
        return d

    async def _scores(self, model: str, hashed: Hashed, names: Sequence[str]) -> ScoreResult | None:
        if self._index is None or hashed.hashes.size == 0:
            return None
        # The index knows blocks under the connector's namespace model: the engine's
        # model path (vLLM's "root") unless the connector sets model_name.
        info = self.fleet.models().get(model)
        index_model = self.config.index_models.get(model) or (info.root if info else model)
        t0 = time.perf_counter()
        if self.local is not None and self.local.ready()[0]:
            try:
                return self.local.score(index_model, hashed.hashes, names)
            except KVStoreError as e:  # e.g. more nodes than the index has ids for
                log.warning("local index: %s; scoring at the indexer", e)
            finally:
                self.metrics.scores.labels("local").inc()
                self.metrics.score_s.observe(time.perf_counter() - t0)
            t0 = time.perf_counter()
        self.metrics.scores.labels("indexer").inc()
        try:
            return await self._index.scores(index_model, hashed.hashes, names)
        except KVStoreError as e:
            # Every such decision is counted (decisions{reason="fallback"}); the cause
            # is logged, at most once per SCORE_WARN_EVERY_S so an outage is one line.
            now = time.monotonic()
            if now - self._score_warned_at >= SCORE_WARN_EVERY_S:
                self._score_warned_at = now
                log.warning("indexer Score failed, routing by load: %s: %s", type(e).__name__, e)
            return None
        finally:
            self.metrics.score_s.observe(time.perf_counter() - t0)

    def _raw_token_ids(self, prompt: msgspec.Raw) -> tuple[np.ndarray, KnownPrefix | None]:
        """A token-id prompt's ids, parsed past the previous turn's bytes only, and
        which of them equal an array parsed before (the hasher's hint)."""
        reused = self._prompts.reused_tokens
        try:
            ids, known = self._prompts.token_ids_known(bytes(memoryview(prompt)))
        except KVStoreError as e:
            raise RouteError(400, f"prompt: {e}", "BadRequestError", "prompt") from None
        reused = self._prompts.reused_tokens - reused
        self.metrics.prompt_tokens.labels("reused").inc(reused)
        self.metrics.prompt_tokens.labels("parsed").inc(ids.size - reused)
        return ids, known

    async def _token_ids(
        self, model: str, body: dict[str, Any], chat: bool, via: Backend
    ) -> list[int] | np.ndarray | None:
        """The prompt's token ids, or None when they cannot be had (route by load).
        A raw token-id prompt (``msgspec.Raw``) is read by ``_raw_token_ids`` first."""
        if not chat:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
                prompt = prompt[0]  # a batch goes to one engine: route by its first prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, list):
                return prompt  # token ids: the hasher checks they are integers (400 if not)
            if not isinstance(prompt, str):
                raise RouteError(400, "prompt: a string or token ids", "BadRequestError", "prompt")
            req: dict[str, Any] = {"model": model, "prompt": prompt}
            if "add_special_tokens" in body:
                req["add_special_tokens"] = body["add_special_tokens"]
        else:
            messages = body.get("messages")
            if not isinstance(messages, list):
                raise RouteError(400, "messages: a list", "BadRequestError", "messages")
            req = {"model": model, "messages": messages}
            req.update({k: body[k] for k in CHAT_TOKENIZE_FIELDS if k in body})
        t0 = time.perf_counter()
        timeout = aiohttp.ClientTimeout(
            total=max(self.config.decision_deadline_s * 20, 5.0),
            connect=self.config.connect_timeout_s,
        )
        try:
            async with via.session.post(via.base + "/tokenize", json=req, timeout=timeout) as r:
                got = await r.json(content_type=None)
                status = r.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            log.warning("tokenize via %s failed (%s); routing by load", via.node, e)
            return None
        finally:
            self.metrics.tokenize_s.observe(time.perf_counter() - t0)
        if status >= 500 or not isinstance(got, dict):
            return None
        if status != 200:
            got_err = got.get("error")
            err: dict[str, Any] = got_err if isinstance(got_err, dict) else {}
            raise RouteError(
                status,
                str(err.get("message", got)),
                str(err.get("type", "BadRequestError")),
                err.get("param"),
            )
        tokens = got.get("tokens")
        return tokens if isinstance(tokens, list) else None

    async def _forward(
        self,
        request: web.Request,
        raw: bytes,
        order: list[Backend],
        decision: Decision,
        headers: dict[str, str],
        stream: bool,
        extra: dict[str, str] | None = None,
    ) -> tuple[web.StreamResponse, str]:
        tried: list[str] = []
        for b in order:
            tried.append(b.node)
            route = {
                "x-kvstore-backend": b.node,
                "x-kvstore-route": decision.reason,
                **(extra or {}),
            }
            up_headers = headers
            if b.node != decision.node:
                route["x-kvstore-route"] = "retry"
            elif decision.rank >= 0:
                # The rank is the chosen node's: a retry elsewhere goes rank-less.
                up_headers = {**headers, DP_RANK_HEADER: str(decision.rank)}
                route["x-kvstore-rank"] = str(decision.rank)
            b.inflight += 1
            t0 = time.perf_counter()
            try:
                up = await b.upstream.request(
                    "POST",
                    request.path,
                    raw,
                    up_headers,
                    read_timeout_s=self.config.upstream_timeout_s,
                )
                self.metrics.first_byte_s.observe(time.perf_counter() - t0)
                try:
                    if up.status != 200 or not stream:
                        data = await up.read(MAX_ANSWER_BYTES)
                        resp = web.Response(
                            body=data,
                            status=up.status,
                            content_type=up.content_type,
                            headers=route,
                        )
                        return resp, b.node
                    return await self._stream(request, up, b, route), b.node
                finally:
                    up.release()  # back to the pool only if read to its end
            except DeadlineExceeded as e:  # before Unavailable: it is one
                self.metrics.upstream_errors.labels(b.node, "timeout").inc()
                raise RouteError(504, f"backend {b.node} failed: {e}", "BadGatewayError") from None
            except Unavailable as e:
                # Never connected: the request was not sent, the next engine may take it.
                self.metrics.upstream_errors.labels(b.node, "connect").inc()
                b.mark_down(f"connect: {e}")
                continue
            except BackendError as e:
                self.metrics.upstream_errors.labels(b.node, "upstream").inc()
                raise RouteError(502, f"backend {b.node} failed: {e}", "BadGatewayError") from None
            except InvalidRequest as e:  # a header the client sent cannot be forwarded
                raise RouteError(400, str(e), "BadRequestError") from None
            finally:
                b.inflight -= 1
        raise RouteError(
            503,
            f"no backend reachable for this request (tried {', '.join(tried)})",
            "ServiceUnavailableError",
        )

    async def _stream(
        self,
        request: web.Request,
        up: Response,
        b: Backend,
        route: dict[str, str],
    ) -> web.StreamResponse:
        resp = web.StreamResponse(status=up.status, headers=route)
        # an SSE stream that names no type is still one (not application/octet-stream)
        resp.content_type = up.content_type if "content-type" in up.headers else "text/event-stream"
        resp.headers["Cache-Control"] = "no-cache"
        await resp.prepare(request)
        try:
            while chunk := await up.next_chunk():
                await resp.write(chunk)
        except (ConnectionResetError, asyncio.CancelledError):
            # The client went away: close the engine's connection so it aborts.
            self.metrics.client_disconnects.inc()
            up.close()
            raise
        except (BackendError, DeadlineExceeded) as e:
            kind = "timeout" if isinstance(e, DeadlineExceeded) else "mid_stream"
            self.metrics.upstream_errors.labels(b.node, kind).inc()
            log.warning("backend %s failed mid-stream: %s", b.node, e)
            up.close()
            with contextlib.suppress(ConnectionResetError):
                await resp.write(sse_error(f"backend {b.node} failed mid-stream: {e}"))
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp


async def serve(config: RouterConfig, ready: asyncio.Event | None = None) -> None:
    """Run until cancelled (the CLI cancels on SIGTERM/SIGINT)."""
    router = Router(config)
    # handler_cancellation: a client that disconnects cancels its handler at once,
    # even while the engine is still silent (a long prefill), closing the upstream.
    runner = web.AppRunner(router.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    host, _, port = config.listen.rpartition(":")
    site = web.TCPSite(runner, host or "127.0.0.1", int(port), shutdown_timeout=5.0)
    await site.start()
    pauses = CollectorPauses()  # kvstore_gc_pause_seconds, as the daemon's
    pauses.export(router.metrics.registry)
    settle_heap()  # after start-up (the local index and its compiled walk are built)
    for addr in runner.addresses:
        h, p = addr[0], addr[1]
        print(f"kvstore router listening on http://{h}:{p}", flush=True)
    if ready is not None:
        ready.set()
    # systemd Type=notify (deploy/systemd/kvstore-router.service): ready once listening.
    notifier = SdNotifier.from_env()
    notifier.ready(f"routing to {len(config.backends)} backends")
    try:
        await asyncio.Event().wait()
    finally:
        pauses.uninstall()
        notifier.stopping()
        notifier.close()
        await runner.cleanup()


class _PrefillAnswer(msgspec.Struct):
    """The one field of a prefill engine's answer the split reads (the rest skipped)."""

    kv_transfer_params: dict[str, Any] | None = None


_prefill_answer = msgspec.json.Decoder(_PrefillAnswer)


def _ticket_of(answer: bytes) -> str:
    """The pin a prefill engine's connector handed over (kv_transfer_params), or ""
    (an engine without the KVStore connector, or whose daemon pinned nothing): the
    decode node's daemon then pins as usual."""
    try:
        params = _prefill_answer.decode(answer).kv_transfer_params
    except msgspec.DecodeError:
        return ""
    ticket = (params or {}).get(TICKET)
    return ticket if isinstance(ticket, str) else ""
