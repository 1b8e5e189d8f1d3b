"""The engines behind the router: their HTTP sessions, health, models and load.

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
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp

from router_client.policy import NodeLoad

log = logging.getLogger("kvstore.router")

# Bounds: an engine's /metrics and /v1/models bodies (vLLM's are ~100 KiB).
MAX_SCRAPE_BYTES = 4 << 20
_LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class EngineInfo:
    block_size: int = 0
    hash_algo: str = ""


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
    healthy: bool = False
    models: dict[str, ModelInfo] = field(default_factory=dict)
    """Served model id -> its info, from /v1/models."""
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    inflight: int = 0
    info: EngineInfo = field(default_factory=EngineInfo)
    last_error: str = ""
    scraped_at: float = 0.0

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
    return running, waiting, kv, info


def _base_and_connector(url: str) -> tuple[str, aiohttp.BaseConnector]:
    if url.startswith("unix:"):
        return "http://localhost", aiohttp.UnixConnector(path=url[len("unix:") :])
    return url.rstrip("/"), aiohttp.TCPConnector(limit=0)


class Fleet:
    """Every configured engine; ``candidates(model)`` are the healthy ones serving it."""

    def __init__(
        self,
        backends: Mapping[str, str],
        *,
        connect_timeout_s: float,
        scrape_interval_s: float,
        capacity: float,
    ) -> None:
        self._spec = dict(backends)
        self.connect_timeout_s = connect_timeout_s
        self.scrape_interval_s = scrape_interval_s
        self.capacity = capacity
        self.backends: dict[str, Backend] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        for node in sorted(self._spec):
            url = self._spec[node]
            base, conn = _base_and_connector(url)
            self.backends[node] = Backend(
                node=node, url=url, base=base, session=aiohttp.ClientSession(connector=conn)
            )
        await self.scrape_all()
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for b in self.backends.values():
            await b.session.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.scrape_interval_s)
            try:
                await self.scrape_all()
            except Exception:  # a scrape bug must not stop the loop that heals backends
                log.exception("scraping backends failed")

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(b) for b in self.backends.values()))

    async def _scrape(self, b: Backend) -> None:
        timeout = aiohttp.ClientTimeout(
            total=max(self.scrape_interval_s, self.connect_timeout_s),
            connect=self.connect_timeout_s,
        )
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
        return [b for b in self.backends.values() if b.healthy and model in b.models]

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
