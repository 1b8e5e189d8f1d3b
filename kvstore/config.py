"""One typed configuration tree for the daemon.

Sources, later wins: the defaults below -> a TOML file (``--config``) ->
``KVSTORE_*`` environment variables (nesting with ``__``:
``KVSTORE_DRAM__CAPACITY_BYTES=4GiB``) -> ``--set section.key=value`` flags.
The merged tree is converted once with ``msgspec.convert``; unknown keys are
rejected with the path of the typo (``unknown field `capacty_bytes` - at
`$.dram```). Every field has its default here and only here.

Fields whose name ends in ``_bytes`` also accept sizes such as ``"512MiB"``
or ``"4G"``; ``_s`` fields are seconds.
"""

from __future__ import annotations

import os
import re
import socket
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from kvstore.errors import ConfigError
from kvstore.identity import Authorizer, PrincipalConfig, split_list_fields

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

ENV_PREFIX = "KVSTORE_"


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class ServerConfig(_Section):
    socket_path: str = "/tmp/kvstore.sock"
    """Unix socket for local clients (engines, connectors). "" = off."""
    tcp_address: str = "127.0.0.1:50051"
    """host:port for peers, routers and tools. Port 0 picks a free port. "" = off."""
    max_message_bytes: int = 64 * MiB
    """Largest gRPC message accepted or sent (bounds the *Inline calls)."""
    drain_timeout_s: float = 10.0
    """On SIGTERM: how long in-flight calls may take before the daemon exits."""
    max_concurrent_rpcs: int = 1024
    """Calls beyond this are refused with RESOURCE_EXHAUSTED instead of queueing."""
    local_channel: bool = True
    """Also serve the lean local channel at <socket_path>.lean (msgpack frames, tens of
    microseconds a call; see docs/local-channel.md): kvstore.client uses it for the hot
    path when it can connect, gRPC otherwise. false = gRPC only."""
    event_loop: Literal["asyncio", "uvloop", "auto"] = "auto"
    """The daemon's event loop (gRPC, the lean channel, peer pulls): "auto" = uvloop
    when installed (the router extra installs it; fewer microseconds per lean call,
    see docs/local-channel.md), else asyncio's; "uvloop" = libuv's or an error when
    it is missing; "asyncio" = asyncio's own."""
    local_max_connections: int = 256
    """Lean-channel connections open at once; one more is refused (RESOURCE_EXHAUSTED)."""
    file_group: str = ""
    """Group whose members may map the DRAM region (it becomes 0660, of this group). "" =
    the daemon's user only (0600). Manifest, disk and lock files are always 0600."""
    presence_table: bool = True
    """Publish which blocks this daemon holds in <dram.path>.presence (the region's mode and
    group), so local clients answer Lookup by probing it instead of calling
    (docs/presence.md). Never with dram.tenant_regions: lookups stay calls there."""


class DramConfig(_Section):
    path: str = ""
    """Shared-memory file of the DRAM tier. "" = /dev/shm/kvstore-<node_id>.dram."""
    capacity_bytes: int = 1 * GiB
    """Hard cap of the DRAM tier; the region is exactly this size."""
    chunk_bytes: int = 64 * MiB
    """Slab size: the region is carved into chunks of this size, each serving one
    block size. Also the largest block a namespace may declare."""
    eviction_policy: str = "lru"
    """lru | s3fifo."""
    prefault: bool = True
    """Touch every page at start: first touch runs at ~1 GB/s on these machines."""
    huge_pages: Literal["auto", "on", "off"] = "auto"
    """Back the region with hugetlbfs when it has room (auto), require it (on), or not
    (off). auto without hugetlbfs room: once pre-faulted, the region's 4 KiB pages are
    collapsed into 2 MiB pages in the background (Linux 6.1+, no reservation)."""
    warm_restart: bool = True
    """On SIGTERM keep the region file and write <path>.manifest, so a restart with the
    same config serves its blocks again; false = unlink the region on exit."""
    tenant_regions: bool = False
    """Give each [quotas.tenants.<name>] with a dram_bytes cap its own region file
    (<path>.tenant-<name>, 0600, sized by the cap in whole chunks), so a local client can
    map only its tenant's blocks; the rest of capacity_bytes is the shared region of the
    other tenants (docs/tenants.md). Needs capacity_bytes in whole chunks."""


class EvictionConfig(_Section):
    copy_aware: bool = False
    """When DRAM must make room, drop a block a peer with a lower node id is believed to
    hold too (learnt from peer pulls) before a sole copy, among the coldest
    copy_window (docs/eviction.md). false = plain per-node LRU / S3-FIFO."""
    copy_learn: Literal["pulled", "served", "both"] = "served"
    """Which pulls teach "a peer holds this block too": served = the peer pulled it from
    this daemon (this daemon's copy, which the work moved away from, is the redundant
    one; learnt when the peer pins it); pulled = this daemon pulled the block from the
    peer (its new copy is: measured worse, docs/eviction.md); both. Either way only a
    lower-id peer counts (the tie-break)."""
    copy_window: int = 64
    """Unpinned blocks at the cold end looked at for a redundant copy before a sole copy
    goes (1..4096): larger drops redundant copies sooner, at that many checks per
    eviction."""
    copy_order: Literal["window", "fifo"] = "window"
    """How redundant copies are found: window = the coldest redundant one among the
    coldest copy_window; fifo = marking moves a copy into the low-priority FIFO the
    replicas use (first to go, O(1) per eviction whatever its recency; one local load
    makes it a normal block again; an expired mark puts it back)."""
    copy_ttl_s: float = 300.0
    """How long "a peer holds this block too" is believed after the pull that learned
    it; past it the copy counts as a sole copy again (the staleness bound)."""
    pulled_admission: Literal["full", "replica"] = "replica"
    """How a block pulled from a peer enters this node's DRAM: replica = a low-priority
    copy, first to go (ahead of the LRU / S3-FIFO order), promoted to a normal block at
    its replica_promote_loads-th local load (measured better: docs/eviction.md); full =
    a normal block of the eviction order."""
    replica_promote_loads: int = 2
    """Local loads that promote a replica to a normal block (>= 1); the pull's own
    load counts, so 2 = the first reuse by a later request."""


class LeaseConfig(_Section):
    default_ttl_s: float = 30.0
    """Lease lifetime when the client asks for none: a dead client strands nothing longer."""
    max_ttl_s: float = 600.0
    """Longest lease a client may ask for."""
    reap_interval_s: float = 0.25
    """How often expired leases are reclaimed."""
    quarantine_s: float = 2.0
    """An expired lease's slots stay reserved (and its blocks pinned) this much longer
    before reuse: a client that stalled mid-copy past its lease is done by then (clients
    stop copying at their own deadline, with a margin, in bounded chunks)."""


class LimitsConfig(_Section):
    max_blocks_per_request: int = 65536
    """Requests naming more blocks are refused (INVALID_ARGUMENT)."""
    max_namespaces: int = 4096
    """Declaring more namespaces than this is refused (RESOURCE_EXHAUSTED), unless an empty
    one can be dropped (see namespace_idle_s)."""
    namespace_idle_s: float = 300.0
    """An empty namespace (no block in any tier, no lease) unused this long is dropped when a
    declare finds max_namespaces reached; a Clear that empties a namespace drops it at once.
    Clients re-declare a dropped namespace on their next call."""
    max_leases_per_client: int = 8192
    """Live leases one client (kvstore.client.Client id, else the connection) may hold;
    more are refused with RESOURCE_EXHAUSTED until it releases some."""
    max_leases: int = 65536
    """Live leases of all clients together (bounds daemon memory whatever the client ids)."""
    namespace_quota_bytes: int = 0
    """Per-namespace cap in the DRAM tier; 0 = none."""


class TenantQuotaConfig(_Section):
    """One tenant's caps (a ``[quotas.tenants.<name>]`` table; docs/tenants.md)."""

    tenant: str
    """The namespace's tenant this entry caps (vLLM cache_salt; "" = the default tenant)."""
    dram_bytes: int = 0
    """Cap in the DRAM tier; 0 = none."""
    disk_bytes: int = 0
    """Cap in the disk tier; 0 = none."""
    gpu_bytes: int = 0
    """Cap in the GPU tier; 0 = none."""


class QuotasConfig(_Section):
    tenants: dict[str, TenantQuotaConfig] = msgspec.field(default_factory=dict)
    """Per-tenant caps in bytes per tier, by a name Stats, /metrics and `kvstore status`
    show instead of the tenant's cache_salt: [quotas.tenants.<name>] with tenant =
    "<cache_salt>" and dram_bytes / disk_bytes / gpu_bytes (0 = no cap). A tenant at its
    cap evicts only its own blocks (docs/tenants.md)."""
    default_dram_bytes: int = 0
    """DRAM cap of each tenant not listed in quotas.tenants (each on its own); 0 = none."""
    default_disk_bytes: int = 0
    """Disk cap of each tenant not listed in quotas.tenants; 0 = none."""
    default_gpu_bytes: int = 0
    """GPU cap of each tenant not listed in quotas.tenants; 0 = none."""


class MetricsConfig(_Section):
    address: str = "127.0.0.1:9400"
    """host:port of the Prometheus /metrics endpoint; port 0 picks one; "" = off."""


class EventsConfig(_Section):
    enabled: bool = False
    """Publish vLLM-format KV events over ZMQ."""
    publish_address: str = "tcp://127.0.0.1:5557"
    """ZMQ PUB endpoint."""
    replay_address: str = "tcp://127.0.0.1:5558"
    """ZMQ ROUTER endpoint answering replay requests; "" = off."""
    buffer_batches: int = 10000
    """Batches kept for replay (bounded)."""
    queue_batches: int = 10000
    """Batches queued for the sender thread before new ones are dropped (counted)."""
    max_events_per_batch: int = 256
    """Events coalesced into one batch."""
    topic_ids: str = ""
    """Who the events name in their topic `kv@<id>@<model>`, comma-separated; "" =
    node_id. For llm-d's precise-prefix scorer: the serving address:port of each engine
    that loads from this daemon (llm-d's pod id, e.g. "10.0.0.5:8000"); every event is
    sent once per id (docs/events-indexer.md)."""
    curve_secret_key_file: str = ""
    """ZMQ CURVE secret key file (`kvstore keys curve`, NAME.key_secret, mode 0600, owned by
    the daemon's user) of the PUB and replay sockets: set, both authenticate and encrypt
    (the streams carry every tenant's token ids), and only curve_allowed_keys may
    subscribe. "" = plaintext: a private network only (docs/security.md)."""
    curve_allowed_keys: str = ""
    """Subscribers (indexers, routers) allowed with CURVE, comma-separated: Z85 public keys
    or public key files (NAME.key). Any other key is refused and audited."""

    def topic_id_list(self) -> list[str]:
        return [t.strip() for t in self.topic_ids.split(",") if t.strip()]


class DiskConfig(_Section):
    path: str = ""
    """Directory of the disk tier (must exist and be writable). "" = no disk tier."""
    capacity_bytes: int = 0
    """Hard cap of the disk tier: its data file is preallocated to exactly this size."""
    slab_bytes: int = 64 * MiB
    """Slab size of the data file (one block size per slab); at least dram.chunk_bytes."""
    io_threads: int = 4
    """Threads doing disk reads and writes (each with at most 2 operations queued)."""
    direct_io: bool = True
    """Use O_DIRECT where the filesystem takes it (bypasses the page cache)."""
    demote_free_fraction: float = 0.25
    """Keep at least this share of DRAM free or already on disk, demoting the oldest
    blocks in the background. 1.0 = write every block to disk (write-behind)."""
    eviction_policy: str = "lru"
    """Order in which the disk drops its copies when full: lru | s3fifo."""
    when_full: Literal["reject", "drop"] = "reject"
    """When the disk cannot take writes (filesystem out of space, every slot busy) and
    DRAM has no free or clean room: reject = stores fail with RESOURCE_EXHAUSTED;
    drop = stores succeed by dropping the coldest blocks not yet on disk."""


class GpuConfig(_Section):
    device: str = ""
    """Device of the GPU tier: "cuda:N"; "" = no GPU tier. "cpu" runs the same tier over a
    shared-memory file (tests and CPU-only demos; no speed-up)."""
    capacity_bytes: int = 0
    """Hard cap of the GPU tier's pool (allocated once at start)."""
    chunk_bytes: int = 64 * MiB
    """Slab size of the pool, as dram.chunk_bytes."""
    demote_free_fraction: float = 0.1
    """Keep at least this share of the pool free, moving the coldest blocks to DRAM in
    the background, so a store into the GPU tier rarely waits for a demotion.
    0 = demote only when a store needs the slot."""


class PeerConfig(_Section):
    enabled: bool = False
    """Serve and pull blocks to and from peer daemons."""
    secret: str = ""
    """Cluster shared secret a peer must present. Required when enabled."""
    transfer_timeout_s: float = 5.0
    """A pull that has not finished by then fails and frees its slots."""
    transport: Literal["auto", "nixl", "grpc_stream"] = "auto"
    """auto = NIXL, or the gRPC stream fallback (logged loudly) when NIXL cannot load."""
    peers: dict[str, str] = msgspec.field(default_factory=dict)
    """Known peers: node id -> gRPC host:port (FetchFromPeer may name a peer by node id)."""
    pull_piece_bytes: int = 32 << 20
    """A pull of at least twice this is read in pieces (at most 32), two in flight,
    each verified while the next ones are read (docs/peer-transfer.md)."""
    pin_channel: bool = True
    """Serve and use the pin channel: pins and releases between daemons over one
    persistent TCP connection per peer (mutual HMAC proof of the secret) instead of
    gRPC calls, ~1 ms less before a pull's first byte. Off under TLS (it is plaintext):
    pins then go over gRPC, as they do to a peer that does not serve it."""
    pin_port: int = 0
    """TCP port of the pin channel, on server.tcp_address's host. 0 = a free port
    (advertised to peers by GetAgentMetadata)."""


class TlsConfig(_Section):
    cert_path: str = ""
    """PEM certificate chain this daemon presents: to TCP callers, and as its client
    certificate to the peers it pulls from. All three tls paths or none; "" = no TLS,
    TCP is plaintext (docs/security.md, "TLS"). scripts/make_certs.sh makes a set."""
    key_path: str = ""
    """PEM private key of cert_path (keep it 0600)."""
    ca_path: str = ""
    """PEM CA bundle. TCP callers must present a certificate it signed (no certificate, or
    another CA: the handshake fails); peers' certificates are verified against it. A
    verified caller may make data calls without peer.secret; with peer.secret set, it
    needs the secret as well. Changed files are reloaded for new connections."""


class AuthConfig(_Section):
    principals: dict[str, PrincipalConfig] = msgspec.field(default_factory=dict)
    """Identities mapped to tenants (docs/security.md, "Identities"): name -> { token_sha256
    (hex SHA-256 of a bearer token), cert_names (client certificate CN/SAN), uids / gids
    (lean-channel peers), tenants (cache_salts; "*" = all; "" = the default tenant),
    models, namespaces ([] = any), roles (admin: Clear, Snapshot; node: Snapshot) }. Set:
    every data call needs an identity and may use only its tenants' namespaces
    (PERMISSION_DENIED otherwise); gRPC on the Unix socket needs a token. {} = no
    identities: one trust domain, as before. Env/flags take lists comma-separated
    (--set auth.principals.a.tenants=t1,t2)."""


class LogConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["text", "json"] = "text"


class RouterConfig(_Section):
    """`kvstore router`: the OpenAI-compatible proxy in front of the engines (docs/router.md)."""

    listen: str = "127.0.0.1:8000"
    """host:port the proxy serves HTTP on. Port 0 picks a free port (logged)."""
    backends: dict[str, str] = msgspec.field(default_factory=dict)
    """Engines: node id (the daemon's node_id, as the indexer knows it) -> the engine's
    OpenAI server, "http://host:port" or "unix:/path/to.sock"."""
    indexer: str = ""
    """host:port of the indexer's gRPC Score. "" = no cache signal (load decides)."""
    index_models: dict[str, str] = msgspec.field(default_factory=dict)
    """Served model id -> the model its blocks are indexed under, where the connector
    sets model_name (docs/vllm.md). Unlisted: the engine's model path (vLLM's root)."""
    backends_from_indexer: bool = False
    """Also route to the nodes the indexer lists (ListNodes) with an engine_url on a
    source (configured --source ...,engine_url=... or RegisterNode). The static backends
    win for a node in both. Needs indexer."""
    backends_refresh_s: float = 5.0
    """How often the indexer's node list is read (each read bounded by connect_timeout_s;
    a failed read keeps the last list)."""
    max_backends: int = 256
    """Most backends taken from the indexer (beyond, the rest by node id are left out, logged)."""
    daemons: dict[str, str] = msgspec.field(default_factory=dict)
    """Node id -> that node's daemon gRPC address (host:port or unix:path). A node whose
    daemon's health is not SERVING (draining for a restart, down) leaves the candidates
    until it serves again, unless every node is in that state."""
    strategy: Literal["random", "round-robin", "approximate", "precise-only", "cache+load"] = (
        "cache+load"
    )
    """Routing strategy (kvstore_router_client.strategies)."""
    decision_deadline_s: float = 0.05
    """The indexer must answer within this; past it the choice falls back to load."""
    index: Literal["indexer", "local"] = "indexer"
    """Where decisions are scored: "indexer" = its Score over gRPC; "local" = an index in
    the router, fed by the event streams the indexer lists (ListNodes), scored in
    process (no round trip); the indexer's Score while it is out of step (docs/router.md)."""
    local_index_refresh_s: float = 2.0
    """index = "local": how often the indexer's source list is re-read (a node registered
    or lapsed there is followed or dropped here within this)."""
    event_loop: Literal["auto", "asyncio", "uvloop"] = "auto"
    """The router's event loop: "auto" = uvloop when installed (the router extra
    installs it: less loop overhead per relayed request), else asyncio's."""
    local_index_max_bytes: int = 1024 * MiB
    """index = "local": largest size of its tables; beyond, it is dropped for good and
    decisions are scored at the indexer (logged, metric)."""
    local_index_curve_key_file: str = ""
    """index = "local": the router's ZMQ CURVE secret key file (`kvstore keys curve`,
    mode 0600) for sources listed with a curve_server_key (as the indexer's
    events_curve_key_file; its public key must be in those daemons'
    events.curve_allowed_keys). "" = plaintext sources only."""
    block_size_tokens: int = 0
    """The engines' KV block size. 0 = read it from the engines' /metrics."""
    hash_algo: Literal["", "sha256", "sha256_cbor"] = ""
    """The engines' prefix-caching hash. "" = read it from the engines' /metrics."""
    hash_seed: str = ""
    """The engines' NONE_HASH seed. "" = PYTHONHASHSEED or "vllm-none-hash", as vLLM."""
    hash_cache_tokens: int = 8 * 1024 * 1024
    """Tokens of recent prefix hash chains kept for incremental hashing (int64 each)."""
    backend_capacity: float = 8.0
    """Requests an engine runs at once (its --max-num-seqs): the policy's load scale."""
    load_weight: float = 0.05
    """Policy: cost of one backend_capacity of queued work, in units of a full prefill."""
    peer_weight: float = 0.0
    """Policy: share of a block's prefill credited to pulling it from a peer (the pull
    hint is sent either way; see peer_hints)."""
    scrape_interval_s: float = 1.0
    """How often each engine's /metrics (load, KV usage) and /health are read."""
    connect_timeout_s: float = 2.0
    """Connecting to an engine; past it the engine counts as down and the next one is tried."""
    upstream_timeout_s: float = 600.0
    """Longest wait for an engine's next bytes (a silent engine fails the request)."""
    max_body_bytes: int = 64 * MiB
    """Largest request body accepted (413 beyond)."""
    max_inflight: int = 1024
    """Requests proxied at once; beyond, new ones get 429 with Retry-After."""
    peer_hints: bool = True
    """Send a chosen engine that lacks part of the prefix kv_transfer_params
    {"kvstore_peer": <node holding it>}, so its daemon pulls the blocks (needs [peer])."""
    prefill: list[str] = msgspec.field(default_factory=list)
    """Prefill/decode split: node ids (of backends) that only prefill. [] = no split."""
    decode: list[str] = msgspec.field(default_factory=list)
    """Node ids that decode: they get the prompt with a kvstore_peer hint naming the
    prefill node, whose daemon holds the KV. Required with prefill."""
    prefill_deadline_s: float = 30.0
    """A prefill that has not answered by then is abandoned: decode computes locally."""
    flow_control: bool = True
    """Hold requests at the router once every engine runs backend_capacity of them, in
    per-class queues (priorities, fair share between tenants, 429 for the lowest)."""
    priority_classes: list[str] = msgspec.field(default_factory=lambda: ["high", "normal", "low"])
    """Priority classes, most important first. A request's class: its
    x-kvstore-priority header, else its tenant's (tenant_priority), else the body's
    vLLM "priority" (< 0: the first class, > 0: the last), else default_priority."""
    default_priority: str = "normal"
    """The class of a request that names none."""
    queue_max: int = 1024
    """Waiting requests per class; beyond, 429 (the first class: 503, never shed)."""
    low_max_wait_s: float = 5.0
    """The last class waits at most this for a slot, then gets 429 + Retry-After."""
    tenant_weights: dict[str, float] = msgspec.field(default_factory=dict)
    """Fair-share weight per tenant (default 1): slots given in proportion while waiting."""
    tenant_priority: dict[str, str] = msgspec.field(default_factory=dict)
    """Tenant -> priority class (overrides the request's own claim)."""
    tenants: dict[str, str] = msgspec.field(default_factory=dict)
    """API key (Authorization: Bearer <key>) -> tenant. Set: a request without a known
    key gets 401, and the router sets its cache_salt from the tenant (a client's own
    cache_salt is replaced, never trusted), so tenants never share KV."""


class Config(_Section):
    node_id: str = ""
    """This node's id in events, peer transfer and the indexer. "" = the host name."""
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    dram: DramConfig = msgspec.field(default_factory=DramConfig)
    eviction: EvictionConfig = msgspec.field(default_factory=EvictionConfig)
    leases: LeaseConfig = msgspec.field(default_factory=LeaseConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    quotas: QuotasConfig = msgspec.field(default_factory=QuotasConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    events: EventsConfig = msgspec.field(default_factory=EventsConfig)
    disk: DiskConfig = msgspec.field(default_factory=DiskConfig)
    gpu: GpuConfig = msgspec.field(default_factory=GpuConfig)
    peer: PeerConfig = msgspec.field(default_factory=PeerConfig)
    tls: TlsConfig = msgspec.field(default_factory=TlsConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    router: RouterConfig = msgspec.field(default_factory=RouterConfig)

    def resolved(self) -> Config:
        """Fill the defaults that depend on other fields (node id, region path)."""
        node_id = self.node_id or socket.gethostname()
        dram = self.dram
        if not dram.path:
            dram = msgspec.structs.replace(dram, path=f"/dev/shm/kvstore-{node_id}.dram")
        return msgspec.structs.replace(self, node_id=node_id, dram=dram)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'64MiB' -> 67108864; '4G' -> 4 GiB (binary units throughout); '100' -> 100."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r}")
    number, unit = float(m.group(1)), m.group(2).upper()
    return int(number * {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": 1024 * GiB}[unit])


def _normalise_sizes(tree: Any, path: str = "$") -> Any:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            if isinstance(key, str) and key.endswith("_bytes") and isinstance(value, str):
                try:
                    value = parse_bytes(value)
                except ValueError as exc:
                    raise ConfigError(f"{exc} - at `{path}.{key}`") from None
            out[key] = _normalise_sizes(value, f"{path}.{key}")
        return out
    return tree


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = [p for p in dotted.split(".") if p]
    if not parts:
        raise ConfigError(f"empty config key in {dotted!r}")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


# KVSTORE_* variables that are not daemon config: read by clients, tools and
# tests. Every other KVSTORE_* variable must name a config field (a typo fails).
NON_CONFIG_ENV = frozenset(
    {
        "KVSTORE_CONFIG",
        "KVSTORE_ADDRESS",
        "KVSTORE_SECRET",
        "KVSTORE_TOKEN",  # a client's bearer token (kvstore.identity)
        "KVSTORE_TOKEN_FILE",
        "KVSTORE_VLLM_PYTHON",
        "KVSTORE_VLLM_ANY_VERSION",  # no longer read; still tolerated where set
        "KVSTORE_TEST_RUN",  # names a test run's regions (kvstore.process)
        "KVSTORE_NT_COPY",  # 0 / 1 / auto: how block copies are made (kvstore.memcopy)
        "KVSTORE_COPY_THREADS",  # 1: large block batches copied by one thread (kvstore.memcopy)
        "KVSTORE_NATIVE_WALK",  # 0: the index Score walks in numpy (kvstore.indexer.walk)
        "KVSTORE_NATIVE_PROBE",  # 0: a client probes the presence table in numpy (kvstore.presence)
        "KVSTORE_NATIVE_CHECKSUM",  # 0: blocks hashed by python-xxhash (kvstore.checksums)
        "KVSTORE_NATIVE_PRESENCE_WRITE",  # 0: the daemon writes presence in numpy (kvstore.presence)
        "KVSTORE_SPIN_US",  # a client's poll for an answer before it sleeps (kvstore.local_client)
        "KVSTORE_LOCAL_CHANNEL",  # 0: a client's calls go over gRPC (kvstore.client)
        "KVSTORE_DIRECT_LOADS",  # 0: a client's loads take leases (kvstore.client)
    }
)
NON_CONFIG_ENV_PREFIXES = ("KVSTORE_BENCH_",)


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """KVSTORE_DRAM__CAPACITY_BYTES=1G -> {"dram": {"capacity_bytes": "1G"}}."""
    tree: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name in NON_CONFIG_ENV:
            continue
        if name.startswith(NON_CONFIG_ENV_PREFIXES):
            continue
        _set_path(tree, name[len(ENV_PREFIX) :].lower().replace("__", "."), value)
    return tree


def flag_overrides(assignments: Sequence[str]) -> dict[str, Any]:
    """['dram.capacity_bytes=1G'] -> {"dram": {"capacity_bytes": "1G"}}."""
    tree: dict[str, Any] = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set takes section.key=value, got {item!r}")
        _set_path(tree, key.strip(), value)
    return tree


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    assignments: Sequence[str] = (),
) -> Config:
    """Merge file -> env -> flags over the defaults; raise ConfigError on any problem."""
    environ = os.environ if environ is None else environ
    tree: dict[str, Any] = {}
    path = path or environ.get("KVSTORE_CONFIG") or None
    if path:
        try:
            tree = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
    # Env and flag values are strings: msgspec's lax mode converts "1" -> 1 and
    # "true" -> True for typed fields, so no hand-made parsers here.
    tree = _deep_merge(tree, env_overrides(environ))
    tree = _deep_merge(tree, flag_overrides(assignments))
    auth = tree.get("auth")
    if isinstance(auth, dict) and "principals" in auth:
        tree["auth"] = {**auth, "principals": split_list_fields(auth["principals"])}
    try:
        config = msgspec.convert(_normalise_sizes(tree), Config, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid config: {exc}") from None
    validate(config)
    return config.resolved()


def validate(config: Config) -> None:
    """Cross-field and range checks that types alone cannot express."""
    problems = []
    if config.dram.capacity_bytes <= 0:
        problems.append("dram.capacity_bytes must be > 0")
    if config.dram.chunk_bytes <= 0 or config.dram.chunk_bytes % 4096:
        problems.append("dram.chunk_bytes must be a positive multiple of 4096")
    elif config.dram.capacity_bytes < config.dram.chunk_bytes:
        problems.append("dram.capacity_bytes must be at least dram.chunk_bytes")
    if not config.server.socket_path and not config.server.tcp_address:
        problems.append("server.socket_path and server.tcp_address are both off")
    if config.server.local_max_connections <= 0:
        problems.append("server.local_max_connections must be > 0")
    if config.leases.default_ttl_s <= 0 or config.leases.max_ttl_s < config.leases.default_ttl_s:
        problems.append("leases: need 0 < default_ttl_s <= max_ttl_s")
    if not config.leases.quarantine_s >= 0:
        problems.append("leases.quarantine_s must be >= 0")
    if config.limits.max_blocks_per_request <= 0:
        problems.append("limits.max_blocks_per_request must be > 0")
    elif config.server.max_message_bytes < config.limits.max_blocks_per_request * 8 + 64 * KiB:
        problems.append(
            "server.max_message_bytes must hold a request of limits.max_blocks_per_request "
            f"hashes: at least {config.limits.max_blocks_per_request * 8 + 64 * KiB} bytes"
        )
    if config.limits.namespace_idle_s < 0:
        problems.append("limits.namespace_idle_s must be >= 0")
    if config.limits.max_leases_per_client <= 0 or config.limits.max_leases <= 0:
        problems.append("limits.max_leases_per_client and limits.max_leases must be > 0")
    problems.extend(_quota_problems(config.quotas))
    if config.gpu.device and (
        config.gpu.chunk_bytes <= 0 or config.gpu.capacity_bytes < config.gpu.chunk_bytes
    ):
        problems.append("gpu: need 0 < gpu.chunk_bytes <= gpu.capacity_bytes")
    if not 0.0 <= config.gpu.demote_free_fraction < 1.0:
        problems.append("gpu.demote_free_fraction must be within [0, 1)")
    if config.peer.enabled and not config.peer.secret:
        problems.append("peer.enabled needs peer.secret")
    tls = config.tls
    if (tls.cert_path or tls.key_path or tls.ca_path) and not (
        tls.cert_path and tls.key_path and tls.ca_path
    ):
        problems.append("tls: cert_path, key_path and ca_path go together (all three or none)")
    if config.peer.pull_piece_bytes < 4096:
        problems.append("peer.pull_piece_bytes must be at least 4096")
    if not 0 <= config.peer.pin_port < 65536:
        problems.append("peer.pin_port must be in [0, 65535]")
    bad_ids = [t for t in config.events.topic_id_list() if "@" in t]
    if bad_ids:
        problems.append(
            f"events.topic_ids may not contain '@' (topics are kv@<id>@<model>): {bad_ids}"
        )
    ev = config.events
    if ev.curve_allowed_keys and not ev.curve_secret_key_file:
        problems.append("events.curve_allowed_keys needs events.curve_secret_key_file")
    if ev.curve_secret_key_file and not ev.curve_allowed_keys:
        problems.append(
            "events.curve_secret_key_file needs events.curve_allowed_keys (with CURVE on, "
            "only listed subscribers may connect)"
        )
    r = config.router
    if r.decision_deadline_s <= 0 or r.scrape_interval_s <= 0 or r.connect_timeout_s <= 0:
        problems.append("router: decision_deadline_s, scrape_interval_s, connect_timeout_s > 0")
    if r.block_size_tokens < 0 or r.backend_capacity <= 0 or r.max_inflight <= 0:
        problems.append(
            "router: need block_size_tokens >= 0, backend_capacity and max_inflight > 0"
        )
    if not r.priority_classes or r.default_priority not in r.priority_classes:
        problems.append("router: default_priority must be one of router.priority_classes")
    for tenant, klass in r.tenant_priority.items():
        if klass not in r.priority_classes:
            problems.append(f"router.tenant_priority.{tenant}: {klass!r} is not a class")
    if r.queue_max <= 0 or r.low_max_wait_s <= 0:
        problems.append("router: queue_max and low_max_wait_s must be > 0")
    if bool(r.prefill) != bool(r.decode):
        problems.append("router: prefill and decode go together (both lists, or neither)")
    if r.backends_from_indexer and not r.indexer:
        problems.append("router.backends_from_indexer needs router.indexer")
    if r.backends_refresh_s <= 0 or r.max_backends <= 0:
        problems.append("router: backends_refresh_s and max_backends must be > 0")
    if r.index == "local" and not r.indexer:
        problems.append('router.index = "local" needs router.indexer (its sources and fallback)')
    if r.local_index_refresh_s <= 0 or r.local_index_max_bytes <= 0:
        problems.append("router: local_index_refresh_s and local_index_max_bytes must be > 0")
    for node in [*r.prefill, *r.decode]:
        if node not in r.backends and not r.backends_from_indexer:
            problems.append(f"router: prefill/decode node {node!r} is not in router.backends")
    if set(r.prefill) & set(r.decode):
        problems.append("router: a node cannot be both prefill and decode")
    for node, url in r.backends.items():
        if not url.startswith(("http://", "https://", "unix:")):
            problems.append(f"router.backends.{node}: {url!r} is not http(s)://... or unix:/...")
    if problems:
        raise ConfigError("invalid config: " + "; ".join(problems))
    Authorizer.from_config(config.auth.principals, "auth.principals")  # its own checks


# Tenant names label metrics and Stats rows: Prometheus-safe, and never the label
# that sums the tenants not configured (kvstore.quotas.OTHER_TENANTS).
_TENANT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _quota_problems(q: QuotasConfig) -> list[str]:
    problems = []
    for name in ("default_dram_bytes", "default_disk_bytes", "default_gpu_bytes"):
        if getattr(q, name) < 0:
            problems.append(f"quotas.{name} must be >= 0")
    seen: dict[str, str] = {}
    for name, entry in q.tenants.items():
        if not _TENANT_NAME_RE.match(name):
            problems.append(
                f"quotas.tenants.{name}: a tenant name is 1-64 of A-Z a-z 0-9 _ . - "
                "(it labels metrics), starting with a letter or digit"
            )
        for field_name in ("dram_bytes", "disk_bytes", "gpu_bytes"):
            if getattr(entry, field_name) < 0:
                problems.append(f"quotas.tenants.{name}.{field_name} must be >= 0")
        if entry.tenant in seen:
            problems.append(
                f"quotas.tenants.{name} and quotas.tenants.{seen[entry.tenant]} cap the same tenant"
            )
        seen.setdefault(entry.tenant, name)
    return problems


def to_toml(config: Config) -> str:
    """Render a config as TOML (for --print-config)."""
    tree = msgspec.to_builtins(config)
    lines: list[str] = []
    sections = []
    for key, value in tree.items():
        if isinstance(value, dict):
            sections.append((key, value))
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    for name, section in sections:
        lines.append(f"\n[{name}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in section.items())
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table
        items = (
            f"{msgspec.json.encode(str(k)).decode()} = {_toml_value(v)}" for k, v in value.items()
        )
        return "{ " + ", ".join(items) + " }" if value else "{}"
    return msgspec.json.encode(str(value)).decode()


def reference_markdown() -> str:
    """The config reference table for docs/configuration.md, read from this module's source.

    Field docstrings (the string under each field) are not kept at run time,
    so they are read with ast; defaults come from the classes themselves.
    tests/unit/test_readme.py checks docs/configuration.md carries this exact table.
    """
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(inspect.getmodule(Config)))  # type: ignore[arg-type]
    docs: dict[tuple[str, str], str] = {}
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                nxt = body[i + 1] if i + 1 < len(body) else None
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                    text = " ".join(str(nxt.value.value).split())
                    docs[(cls.name, node.target.id)] = text.replace("|", "\\|")
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    defaults = Config()
    for name in defaults.__struct_fields__:
        value = getattr(defaults, name)
        if isinstance(value, msgspec.Struct):
            for field_name in value.__struct_fields__:
                doc = docs.get((type(value).__name__, field_name), "")
                default = _toml_value(getattr(value, field_name))
                rows.append(f"| `{name}.{field_name}` | `{default}` | {doc} |")
        else:
            rows.append(f"| `{name}` | `{_toml_value(value)}` | {docs.get(('Config', name), '')} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
