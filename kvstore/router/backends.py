"""The engines behind the router: their HTTP clients, health, models and load.

A background task reads every engine's ``/metrics`` (vLLM's
``vllm:num_requests_running`` / ``_waiting``, ``vllm:kv_cache_usage_perc``,
``vllm:cache_config_info`` for the block size and hash algorithm) and
``/v1/models`` every ``scrape_interval_s``. An engine that fails a read, or
refuses a connection while proxying, leaves the candidate set until a read
succeeds again. The router's own in-flight count per engine is kept here too
(the engines' gauges lag by up to one scrape).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.errors import InvalidRequest, KVStoreError
from kvstore.router.upstream import Upstream
from kvstore.tls import env_client_credentials
from kvstore_router_client.policy import NodeLoad

log = logging.getLogger("kvstore.router")

# Bounds: an engine's /metrics and /v1/models bodies (vLLM's are ~100 KiB).
MAX_SCRAPE_BYTES = 4 << 20
# Bound on the ranks counted from one engine's gauges (vLLM's DP sizes are far below).
MAX_DP_RANKS = 1024
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class EngineInfo:
    block_size: int = 0
    hash_algo: str = ""
    dp_ranks: int = 0
    """Data-parallel ranks the engine serves: the distinct ``engine`` labels of its
    vLLM gauges (vLLM labels each rank's engine core by its rank; 0 = not seen)."""


@dataclass(frozen=True)
class ModelInfo:
    max_model_len: int
    root: str
    """The engine's model path (vLLM's ``root``): the connector's namespace model by default."""


@dataclass
class Backend:
    node: str
    url: str
    base: str
    session: aiohttp.ClientSession
    """Scrapes, /tokenize and the prefill call (off the per-token path)."""
    upstream: Upstream
    """The forwarded request the user waits on (kvstore.router.upstream: lean)."""
    healthy: bool = False
    models: dict[str, ModelInfo] = field(default_factory=dict)
    """Served model id -> its info, from /v1/models."""
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    inflight: int = 0
    others: float = 0.0
    """The engine's running + waiting requests that are not this router's (other
    router replicas', direct clients'), at the last scrape."""
    info: EngineInfo = field(default_factory=EngineInfo)
    last_error: str = ""
    scraped_at: float = 0.0
    daemon: str = ""
    """The node's daemon gRPC address ("" = not watched)."""
    daemon_serving: bool = True
    """The daemon's grpc.health.v1 status is SERVING (True when not watched)."""
    dp_ranks: int = 0
    """The engine's data-parallel ranks at the last scrape (``EngineInfo.dp_ranks``)."""

    def load(self, capacity: float) -> NodeLoad:
        return NodeLoad(
            running=self.running,
            waiting=self.waiting,
            kv_usage=self.kv_usage,
            inflight=float(self.inflight),
            capacity=capacity,
        )

    def mark_down(self, why: str) -> None:
        if self.healthy:
            log.warning("backend %s (%s) is down: %s", self.node, self.url, why)
        self.healthy = False
        self.last_error = why


def parse_metrics(text: str) -> tuple[float, float, float, EngineInfo]:
    """(running, waiting, kv_usage, engine info) from vLLM's Prometheus text."""
    running = waiting = kv = 0.0
    info = EngineInfo()
    ranks: set[str] = set()
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        if name not in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:cache_config_info",
        ):
            continue
        labels, _, value = rest.rpartition("}")
        try:
            v = float(value.split()[0])
        except (ValueError, IndexError):
            continue
        if name == "vllm:num_requests_running":
            engine = dict(_LABEL_RE.findall(labels)).get("engine")
            if engine is not None and len(ranks) < MAX_DP_RANKS:
                ranks.add(engine)
            running += v
        elif name == "vllm:num_requests_waiting":
            waiting += v
        elif name == "vllm:kv_cache_usage_perc":
            kv = max(kv, v)
        else:
            lab = dict(_LABEL_RE.findall(labels))
            with contextlib.suppress(ValueError):
                info.block_size = int(lab.get("block_size", "0"))
            info.hash_algo = lab.get("prefix_caching_hash_algo", "")
    info.dp_ranks = len(ranks)
    return running, waiting, kv, info


def _base_and_connector(url: str) -> tuple[str, aiohttp.BaseConnector]:
    if url.startswith("unix:"):
        return "http://localhost", aiohttp.UnixConnector(path=url[len("unix:") :])
    return url.rstrip("/"), aiohttp.TCPConnector(limit=0)


Discover = Callable[[], Awaitable[dict[str, str]]]
"""Node -> engine URL from a catalog (the indexer's ListNodes)."""


class Fleet:
    """Every configured engine; ``candidates(model)`` are the healthy ones serving it.

    With ``discover``, the engines it lists join too (re-read every ``refresh_s``,
    at most ``max_discovered``): a node that leaves the list leaves the fleet; its
    HTTP session is closed once its in-flight requests end. Static backends win
    for a node in both."""

    def __init__(
        self,
        backends: Mapping[str, str],
        *,
        connect_timeout_s: float,
        scrape_interval_s: float,
        capacity: float,
        daemons: Mapping[str, str] | None = None,
    ) -> None:
        self._spec = dict(backends)
        self._daemons = dict(daemons or {})
        self._channels: dict[str, tuple[grpc.aio.Channel, int]] = {}  # channel, TLS generation
        # Daemons with mutual TLS: the router's certificate from KVSTORE_TLS_* (read now,
        # so a bad file stops the router at start, naming it).
        # Renewed files are used for new channels (kvstore.tls.ClientCredentials).
        self._credentials = env_client_credentials()
        self.connect_timeout_s = connect_timeout_s
        self.scrape_interval_s = scrape_interval_s
        self.capacity = capacity
        self.backends: dict[str, Backend] = {}
        self._task: asyncio.Task[None] | None = None
        self._refresh_task: asyncio.Task[None] | None = None
        self._discover: Discover | None = None
        self.refresh_s = 5.0
        self.max_discovered = 256
        self._discovered: set[str] = set()
        self._retired: list[Backend] = []
        """Backends that left the list, kept until their in-flight requests end."""
        self.on_scraped: Callable[[], None] | None = None
        """Called after each round of scrapes (the router re-sizes its flow control)."""

    def _add(self, node: str, url: str) -> Backend:
        # First: it refuses a URL it cannot reach (InvalidRequest), before a session opens.
        upstream = Upstream(url, connect_timeout_s=self.connect_timeout_s)
        base, conn = _base_and_connector(url)
        b = self.backends[node] = Backend(
            node=node,
            url=url,
            base=base,
            # No cookie jar: a proxy keeps no engine cookies (a jar would send one
            # user's Set-Cookie on every later user's request; and it filters and
            # updates cookies on every request and response).
            session=aiohttp.ClientSession(connector=conn, cookie_jar=aiohttp.DummyCookieJar()),
            upstream=upstream,
            daemon=self._daemons.get(node, ""),
        )
        return b

    async def start(
        self, discover: Discover | None = None, *, refresh_s: float = 5.0, max_discovered: int = 256
    ) -> None:
        for node in sorted(self._spec):
            self._add(node, self._spec[node])
        self._discover, self.refresh_s, self.max_discovered = discover, refresh_s, max_discovered
        if discover is not None:
            await self.refresh()
        await self.scrape_all()
        self._task = asyncio.create_task(self._loop())
        if discover is not None:
            self._refresh_task = asyncio.create_task(self._refresh_loop())

    async def refresh(self) -> None:
        """Re-read the catalog: new nodes join (scraped at once), gone ones leave."""
        assert self._discover is not None
        try:
            found = await self._discover()
        except KVStoreError as e:  # keep the last list: the indexer may be restarting
            log.warning("reading the backends from the indexer failed (list kept): %s", e)
            return
        wanted: dict[str, str] = {}
        for node in sorted(found):
            url = found[node]
            if node in self._spec:
                continue
            if not url.startswith(("http://", "https://", "unix:")):
                log.warning(
                    "indexer lists node %s with engine_url %r: not a URL, ignored", node, url
                )
                continue
            if len(wanted) >= self.max_discovered:
                log.warning(
                    "the indexer lists more than max_backends = %d engines: %d left out",
                    self.max_discovered,
                    len(found) - len(wanted),
                )
                break
            wanted[node] = url
        for node in sorted(self._discovered):
            b = self.backends[node]
            if wanted.get(node) != b.url:
                log.info("backend %s (%s) left the indexer's list", node, b.url)
                del self.backends[node]
                self._discovered.discard(node)
                self._retired.append(b)
        fresh = []
        for node, url in wanted.items():
            if node not in self.backends:
                try:
                    fresh.append(self._add(node, url))
                except InvalidRequest as e:
                    log.warning("indexer lists node %s: %s; ignored", node, e)
                    continue
                log.info("backend %s (%s) joins from the indexer's list", node, url)
                self._discovered.add(node)
        await asyncio.gather(*(self._scrape(b) for b in fresh))
        still = []
        for b in self._retired:
            if b.inflight:
                still.append(b)
            else:
                await b.session.close()
                await b.upstream.close()
        self._retired = still

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception:  # a bug here must not stop the list from being re-read
                log.exception("refreshing backends from the indexer failed")

    async def close(self) -> None:
        for t in (self._task, self._refresh_task):
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
        for b in [*self.backends.values(), *self._retired]:
            await b.session.close()
            await b.upstream.close()
        for ch, _ in self._channels.values():
            await ch.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.scrape_interval_s)
            try:
                await self.scrape_all()
            except Exception:  # a scrape bug must not stop the loop that heals backends
                log.exception("scraping backends failed")

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(b) for b in self.backends.values()))
        if self.on_scraped is not None:
            self.on_scraped()

    async def _daemon_health(self, b: Backend) -> None:
        """A daemon draining for a restart says NOT_SERVING, then stops answering."""
        credentials, generation = (
            self._credentials.current() if self._credentials is not None else (None, 0)
        )
        held = self._channels.get(b.node)
        if held is not None and held[1] != generation:
            # renewed certificate files: reconnect with them (the health check is
            # this channel's only call, and it is not in flight now)
            await held[0].close()
            held = None
        if held is None:
            held = self._channels[b.node] = (
                grpc.aio.secure_channel(b.daemon, credentials)
                if credentials is not None
                else grpc.aio.insecure_channel(b.daemon),
                generation,
            )
        ch = held[0]
        try:
            reply = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=self.connect_timeout_s
            )
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            serving = False
        if serving != b.daemon_serving:
            log.warning(
                "backend %s: its daemon (%s) %s",
                b.node,
                b.daemon,
                "serves again" if serving else "is not serving: drained from the candidates",
            )
        b.daemon_serving = serving

    async def _scrape(self, b: Backend) -> None:
        if b.daemon:
            await self._daemon_health(b)
        timeout = aiohttp.ClientTimeout(
            total=max(self.scrape_interval_s, self.connect_timeout_s),
            connect=self.connect_timeout_s,
        )
        mine = b.inflight
        try:
            async with b.session.get(b.base + "/metrics", timeout=timeout) as r:
                if r.status != 200:
                    raise aiohttp.ClientResponseError(
                        r.request_info, (), status=r.status, message="/metrics"
                    )
                text = (await r.content.read(MAX_SCRAPE_BYTES)).decode(errors="replace")
            async with b.session.get(b.base + "/v1/models", timeout=timeout) as r:
                body = await r.json(content_type=None) if r.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            b.mark_down(f"{type(exc).__name__}: {exc}")
            return
        b.running, b.waiting, b.kv_usage, info = parse_metrics(text)
        # Ours are the requests in flight when the gauges were read: the larger of
        # the counts before and after, so a request of ours that started or ended
        # meanwhile is never taken for someone else's (that errs toward admitting).
        b.others = max(0.0, b.running + b.waiting - max(mine, b.inflight))
        b.dp_ranks = info.dp_ranks
        if info.block_size:
            b.info = info
        models: dict[str, ModelInfo] = {}
        for m in body.get("data", []) if isinstance(body, dict) else []:
            if isinstance(m, dict) and isinstance(m.get("id"), str):
                models[m["id"]] = ModelInfo(
                    int(m.get("max_model_len") or 0), str(m.get("root") or m["id"])
                )
        b.models = models
        b.scraped_at = time.monotonic()
        if not b.healthy:
            log.info("backend %s (%s) is up: models %s", b.node, b.url, sorted(models))
        b.healthy = True
        b.last_error = ""

    def candidates(self, model: str) -> list[Backend]:
        up = [b for b in self.backends.values() if b.healthy and model in b.models]
        # Nodes whose daemon drains (a restart) are left out, unless that is all of
        # them: an engine without its daemon still answers (it recomputes).
        serving = [b for b in up if b.daemon_serving]
        return serving or up

    def models(self) -> dict[str, ModelInfo]:
        out: dict[str, ModelInfo] = {}
        for b in self.backends.values():
            if b.healthy:
                for m, n in b.models.items():
                    out.setdefault(m, n)
        return out

    def engine_info(self) -> EngineInfo | None:
        for b in self.backends.values():
            if b.info.block_size:
                return b.info
        return None
