"""The indexer's typed configuration (TOML ``[indexer]`` table -> flags).

Every field has its default here and only here; unknown keys are rejected
with their path, like the daemon's config.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import msgspec

from kvstore.errors import ConfigError
from kvstore.hashing import ALGOS
from kvstore.identity import Authorizer, PrincipalConfig
from kvstore.indexer.subscriber import SourceSpec
from kvstore.indexer.vllm_sources import VllmServer
from kvstore.tls import TlsFiles


class IndexerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    address: str = "127.0.0.1:50061"
    """gRPC listen address (host:port; port 0 picks a free one)."""
    backend: str = "memory"
    """"memory" (in-process) or "redis" (shared by replicas, survives restarts)."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis/Valkey URL for backend = "redis"."""
    redis_key_prefix: str = "kvidx"
    """Prefix of every Redis key this index writes."""
    redis_max_nodes: int = 128
    """Node ids the Redis layout has room for (multiple of 64; fixed per prefix)."""
    redis_read: str = "mirror"
    """"mirror": an ingesting replica answers Scores from a local copy it keeps
    in step with Redis (in-memory speed); "direct": every Score reads Redis
    (replicas that do not ingest always read directly)."""
    ingest: bool = True
    """Follow event sources. Extra replicas on one Redis may set false and only serve."""
    sources: list[SourceSpec] = msgspec.field(default_factory=list)
    """Statically configured event streams; more can register over gRPC."""
    vllm_servers: list[VllmServer] = msgspec.field(default_factory=list)
    """vLLM OpenAI servers whose KV event streams are followed, one source per
    data-parallel rank, as their ``GET /kv_event_sources`` lists them (retried
    until the server answers, then re-read every ``vllm_servers_refresh_s``)."""
    vllm_servers_refresh_s: float = 30.0
    """How often each vllm_servers listing is re-read (an engine restarted with
    port-0 endpoints binds new ports); a server that does not answer is retried
    sooner (doubling from 1 s up to this)."""
    block_size_tokens: int = 16
    """Tokens per block when a Score request sends token ids without a block size."""
    hash_algo: str = "sha256"
    """vLLM's --prefix-caching-hash-algo: "sha256" (default) or "sha256_cbor"."""
    hash_seed: str = ""
    """NONE_HASH seed; "" = what vLLM uses (PYTHONHASHSEED or "vllm-none-hash")."""
    max_request_tokens: int = 2_097_152
    """Largest Score request in token ids (bounds hashing time and memory)."""
    max_request_blocks: int = 262_144
    """Largest Score request in block hashes."""
    replay_timeout_s: float = 2.0
    """How long a replay from a publisher may take before the source is resynced."""
    node_gone_s: float = 30.0
    """A source disconnected this long has its entries dropped."""
    max_workers: int = 8
    """gRPC worker threads."""
    snapshot_timeout_s: float = 30.0
    """How long one Snapshot call to a daemon may take (a big node's is long)."""
    snapshot_interval_s: float = 600.0
    """A source with a snapshot_address is re-checked against a snapshot this
    often, so even an undetected loss heals in bounded time; 0 = only when needed."""
    tail_check_s: float = 5.0
    """An idle source's replay buffer is asked this often for batches past the
    last one applied (a dropped tail is otherwise invisible until the next batch)."""
    error_log_interval_s: float = 10.0
    """Each kind of ingestion error is logged at most once per interval (counted always)."""
    cluster_secret: str = ""
    """The cluster secret (the daemons' peer.secret): sent on Snapshot calls, and
    required from RegisterNode / UnregisterNode callers when set. `kvstore indexer`
    takes KVSTORE_SECRET when the file does not set it."""
    metrics_address: str = ""
    """Prometheus /metrics host:port (port 0 picks one); "" = off."""
    max_registered_sources: int = 256
    """Sources RegisterNode may add; past it registrations get RESOURCE_EXHAUSTED."""
    tls_cert_path: str = ""
    """PEM certificate chain the indexer presents to its gRPC callers and, as a client
    certificate, on Snapshot calls to daemons. All three tls_* or none; "" = plaintext."""
    tls_key_path: str = ""
    """PEM private key of tls_cert_path."""
    tls_ca_path: str = ""
    """PEM CA bundle: gRPC callers must present a certificate it signed (mutual TLS,
    as the daemon's tls.ca_path); daemons' certificates are verified against it."""

    principals: dict[str, PrincipalConfig] = msgspec.field(default_factory=dict)
    """Identities of the indexer's callers (as the daemon's auth.principals: token_sha256,
    cert_names; roles): set, Score, ListNodes and Models need the router or node role,
    RegisterNode / UnregisterNode the node role (admin: all); the cluster secret counts
    as every role. {} = as before (RegisterNode needs cluster_secret when set)."""
    events_curve_key_file: str = ""
    """The indexer's ZMQ CURVE secret key file (`kvstore keys curve`, NAME.key_secret, mode
    0600): its client key on every source with a curve_server_key (its public key must be
    in those daemons' events.curve_allowed_keys). "" = plaintext sources only."""

    def tls(self) -> TlsFiles:
        return TlsFiles(
            self.tls_cert_path, self.tls_key_path, self.tls_ca_path, section="indexer.tls_"
        )

    def check(self) -> None:
        if self.backend not in ("memory", "redis"):
            raise ConfigError(f"indexer.backend must be 'memory' or 'redis'; got {self.backend!r}")
        if self.redis_read not in ("mirror", "direct"):
            raise ConfigError(
                f"indexer.redis_read must be 'mirror' or 'direct'; got {self.redis_read!r}"
            )
        if self.hash_algo not in ALGOS:
            raise ConfigError(f"indexer.hash_algo must be one of {ALGOS}; got {self.hash_algo!r}")
        for name in (
            "block_size_tokens",
            "max_request_tokens",
            "max_request_blocks",
            "max_workers",
            "snapshot_timeout_s",
            "tail_check_s",
            "error_log_interval_s",
            "max_registered_sources",
            "vllm_servers_refresh_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"indexer.{name} must be > 0")
        Authorizer.from_config(self.principals, "indexer.principals")  # its own checks
        tls_problems = self.tls().problems()
        if tls_problems:
            raise ConfigError("; ".join(tls_problems))
        if self.snapshot_interval_s < 0:
            raise ConfigError("indexer.snapshot_interval_s must be >= 0")
        if self.redis_max_nodes <= 0 or self.redis_max_nodes % 64:
            raise ConfigError("indexer.redis_max_nodes must be a positive multiple of 64")
        for i, src in enumerate(self.sources):
            try:
                src.check()
            except ConfigError as e:
                raise ConfigError(f"indexer.sources[{i}]: {e}") from None
            if src.curve_server_key and not self.events_curve_key_file:
                raise ConfigError(
                    f"indexer.sources[{i}] ({src.node}) has a curve_server_key: "
                    "indexer.events_curve_key_file (the indexer's own CURVE key) is needed"
                )
        seen: set[tuple[str, str]] = set()
        for i, srv in enumerate(self.vllm_servers):
            try:
                srv.check()
            except ConfigError as e:
                raise ConfigError(f"indexer.vllm_servers[{i}]: {e}") from None
            if (srv.node, srv.url) in seen:
                raise ConfigError(
                    f"indexer.vllm_servers[{i}]: {srv.url} of {srv.node} is listed twice"
                )
            seen.add((srv.node, srv.url))


def load(path: str | None, overrides: dict[str, Any]) -> IndexerConfig:
    """TOML file (its ``[indexer]`` table, or the top level) then overrides."""
    raw: dict[str, Any] = {}
    if path:
        try:
            doc = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read indexer config {path}: {e}") from e
        raw = dict(doc.get("indexer", doc))
    raw.update(overrides)
    try:
        cfg = msgspec.convert(raw, IndexerConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"indexer config: {e}") from None
    cfg.check()
    return cfg


def parse_source(text: str) -> SourceSpec:
    """``node=N,endpoint=tcp://h:p[,replay_endpoint=...][,snapshot_address=h:p]
    [,kind=engine,model=M[,data_parallel_rank=R]][,engine_url=http://h:p]
    [,curve_server_key=Z85]`` (a Z85 key has no comma; its '=' are kept)."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(f"--source wants key=value pairs separated by commas; got {text!r}")
        fields[key.strip()] = value.strip()
    try:
        # strict=False: "data_parallel_rank=1" is text on a command line
        spec = msgspec.convert(fields, SourceSpec, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"--source {text!r}: {e}") from None
    spec.check()
    return spec


def _pairs(text: str, flag: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(f"{flag} wants key=value pairs separated by commas; got {text!r}")
        fields[key.strip()] = value.strip()
    return fields


def parse_vllm_server(text: str) -> VllmServer:
    """``node=N,url=http://h:p|unix:PATH,model=M[,host=H][,engine_url=U][,per_rank=true]``."""
    fields: dict[str, Any] = dict(_pairs(text, "--vllm-server"))
    if "per_rank" in fields:
        flag = str(fields["per_rank"]).lower()
        if flag not in ("true", "false"):
            raise ConfigError(f"--vllm-server {text!r}: per_rank must be true or false")
        fields["per_rank"] = flag == "true"
    try:
        server = msgspec.convert(fields, VllmServer)
    except msgspec.ValidationError as e:
        raise ConfigError(f"--vllm-server {text!r}: {e}") from None
    try:
        server.check()
    except ConfigError as e:
        raise ConfigError(f"--vllm-server {text!r}: {e}") from None
    return server
