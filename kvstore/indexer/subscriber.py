"""Follows KV event streams (kvstore daemons, vLLM engines) into an index.

One thread owns every ZMQ socket (ZMQ sockets are not thread-safe): a SUB
socket and a connection monitor per source, a DEALER for replays, and an
inproc pair other threads use to add or remove sources.

Per source it tracks the next expected sequence number:

- ``seq == next``: apply.
- ``seq > next`` (a dropped batch, or a restarted indexer whose saved cursor
  is behind): replay ``[next, ...)`` from the publisher's ROUTER, apply what
  is missing. If the publisher no longer buffers ``next``, the source's
  entries are cleared and rebuilt from what it still has (a *resync*).
- ``seq < next``: the publisher restarted (its counter reset): clear the
  source's entries and start over from its sequence 0 (replayed if buffered).
- Malformed frames, payloads and unknown event types are counted and
  skipped; they never stop the thread.
- A source disconnected for longer than ``node_gone_s`` has its entries
  dropped; when it reconnects it is replayed from 0.

Sources with a ``snapshot_address`` (kvstore daemons) never fall back to
"what the replay buffer still has": whenever the index cannot be sure it
matches the daemon (first connection and every reconnection, a gap the
replay cannot fill, a sequence reset, a node-wide clear after seq 0, a
backend outage, and every ``snapshot_interval_s``), the subscriber asks the
daemon's ``Snapshot`` RPC for what it holds, replaces the node's entries in
the daemon's mediums with it, and applies the stream from the snapshot's
``next_seq`` on. Batches below it still queued from before are skipped
(``seq 0`` is always a new publisher's first batch, so it is never taken for
one of those). An idle source is checked every ``tail_check_s`` by asking its
replay buffer for anything past the last applied batch (a dropped tail).

Supervision: nothing a source sends and no backend error ends the thread.
Errors are counted (per source and in total), logged at most once per
``error_log_interval_s`` per kind, and retried with backoff. A backend
error (Redis unreachable) drops what is staged, marks the backend down
(``health()`` is then not ok) and every source for a rebuild; once the
backend answers again, every source is resynced. A thread that dies anyway
is restarted by ``restart_if_dead`` (the indexer calls it).

Sources own their mediums: a daemon source's events and clears touch its
CPU, DISK and its GPU tier (``KVSTORE_GPU``), an engine source's only the
engine's GPU cache (``GPU``); see ``backend.MEDIUMS``.

Index updates are staged per (model, node, medium) as ``hash -> present`` in
arrival order, so the net effect of a burst reaches the index as two
vectorized calls instead of one per event; staging is flushed before any
clear and at the end of every poll round, under the index lock.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc
import msgspec
import numpy as np
import zmq
import zmq.utils.monitor

from kvstore.auth import SECRET_METADATA_KEY
from kvstore.errors import ConfigError, InvalidRequest, KVStoreError
from kvstore.events.curve import (
    HANDSHAKE_FAILED,
    CurveClient,
    KeyPair,
    handshake_failure,
    secure_socket,
    z85_key,
)
from kvstore.events.wire import (
    END_SEQ,
    LeanBatch,
    LeanCleared,
    LeanEvent,
    LeanRemoved,
    LeanStored,
    PositionalEvent,
    block_hash_to_int,
    lean_event,
    parse_topic,
    positional_decoder,
)
from kvstore.indexer.backend import (
    DAEMON_MEDIUMS,
    ENGINE_MEDIUMS,
    IndexBackend,
    source_medium,
)
from kvstore.indexer.seedcheck import SeedChecker
from kvstore.tls import ClientCredentials

log = logging.getLogger(__name__)

KIND_DAEMON = "daemon"
KIND_ENGINE = "engine"
_MAX_MESSAGES_PER_SOURCE_TURN = 2_000
_POLL_MS = 100
# how many applied batches are remembered to tell a duplicate from a restart
_RECENT_BATCHES = 4_096
# one replay holds at most this much payload in memory at once
_MAX_REPLAY_BYTES = 256 << 20
_MAX_REPLAYS_PER_GAP = 8
# a snapshot holds at most this many hashes (8 bytes each) in memory
_MAX_SNAPSHOT_HASHES = 32 << 20
_SNAPSHOT_BACKOFF_S = (0.2, 30.0)  # first retry after, at most
_BACKEND_BACKOFF_S = (0.1, 5.0)
_MAX_LEARNED_MODELS = 4_096
# Batches below a snapshot's seq arriving this soon after it were queued
# before it (they are in it); later, a lower seq is a restarted publisher.
_STALE_WINDOW_S = 2.0
_MAX_SIZES_PER_MODEL = 8
# the daemon's StoreService tiers (kvstore.v1.Tier) -> index mediums
_TIER_MEDIUM = {1: "KVSTORE_GPU", 2: "CPU", 3: "DISK"}


class SourceSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An event stream to follow."""

    node: str
    """Node the stream's blocks live on (the daemon's node_id)."""
    endpoint: str
    """ZMQ PUB endpoint to connect to, e.g. tcp://10.0.0.5:5557."""
    replay_endpoint: str = ""
    """ZMQ ROUTER endpoint for replays; "" = gaps always resync."""
    kind: str = KIND_DAEMON
    """"daemon": a kvstore daemon (model from topic kv@<node>@<model>);
    "engine": a vLLM engine's own stream (its GPU cache; model below)."""
    model: str = ""
    """Model of an engine stream (vLLM's topic does not carry one)."""
    snapshot_address: str = ""
    """A daemon's gRPC host:port for StoreService.Snapshot; "" = no snapshots
    (a lost batch the replay buffer no longer has is then lost for good)."""
    engine_url: str = ""
    """The node's engine OpenAI server (http://host:port or unix:PATH), listed by
    ListNodes for routers that take their backends from the indexer; "" = none."""
    data_parallel_rank: int = -1
    """An engine stream of one data-parallel rank (vLLM publishes one stream per
    rank, each batch tagged with its rank; its ``/kv_event_sources`` lists them):
    its GPU entries are that rank's, not the node's (the node's DRAM and disk,
    shared by its ranks, come from the daemon). A batch tagged with another rank
    is rejected. -1: the node's only engine (GPU entries are the node's,
    whatever the batches' tag)."""
    curve_server_key: str = ""
    """The publisher's ZMQ CURVE public key (Z85, 40 characters; `kvstore keys curve`
    prints it): set, the stream and its replays are authenticated and encrypted, with
    the indexer's events_curve_key_file as client key. "" = plaintext (a private network
    only; vLLM's own engine publisher has no CURVE)."""

    def check(self) -> None:
        if not self.node or "@" in self.node:
            raise ConfigError(f"source node must be non-empty without '@'; got {self.node!r}")
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(
                f"source endpoint must be a ZMQ tcp/ipc address; got {self.endpoint!r}"
            )
        if self.kind not in (KIND_DAEMON, KIND_ENGINE):
            raise ConfigError(f"source kind must be 'daemon' or 'engine'; got {self.kind!r}")
        if self.kind == KIND_ENGINE and not self.model:
            raise ConfigError(f"engine source {self.endpoint} needs a model")
        if self.snapshot_address and self.kind != KIND_DAEMON:
            raise ConfigError("only a daemon source has a snapshot_address")
        addr = self.snapshot_address
        if addr and not addr.startswith("unix:") and ":" not in addr:
            raise ConfigError(f"snapshot_address must be host:port or unix:PATH; got {addr!r}")
        if not isinstance(self.data_parallel_rank, int) or self.data_parallel_rank < -1:
            raise ConfigError(
                f"data_parallel_rank must be an int >= 0 (or -1: none); got "
                f"{self.data_parallel_rank!r}"
            )
        if self.data_parallel_rank >= 0 and self.kind != KIND_ENGINE:
            raise ConfigError("only an engine source has a data_parallel_rank")
        url = self.engine_url
        if url and not (
            url.startswith(("http://", "https://")) or (url.startswith("unix:") and len(url) > 5)
        ):
            raise ConfigError(f"engine_url must be http(s)://host:port or unix:PATH; got {url!r}")
        if self.curve_server_key:
            z85_key(self.curve_server_key, f"curve_server_key of source {self.node}")

    @property
    def key(self) -> str:
        return f"{self.node}|{self.endpoint}"


class SubscriberStats(msgspec.Struct):
    batches: int = 0
    events: int = 0
    hashes_stored: int = 0
    hashes_removed: int = 0
    clears: int = 0
    malformed: int = 0
    unknown_events: int = 0
    gaps: int = 0
    replays: int = 0
    replayed_batches: int = 0
    resyncs: int = 0
    restarts: int = 0
    nodes_gone: int = 0
    snapshots: int = 0
    snapshot_failures: int = 0
    stale_skipped: int = 0
    rank_mismatches: int = 0
    tail_checks: int = 0
    handshake_failures: int = 0
    errors: int = 0
    backend_errors: int = 0
    backend_outages: int = 0
    thread_restarts: int = 0


class SourceStatus(msgspec.Struct, frozen=True):
    """How fresh one source's entries are (for ListNodes, metrics, ``kvstore status``)."""

    key: str
    node: str
    kind: str
    connected: bool
    next_seq: int
    last_event_age_s: float
    """Seconds since the last applied batch; -1 = none yet."""
    since_snapshot_s: float
    """Seconds since the index last matched a snapshot of this source; -1 = never."""
    errors: int
    snapshots: int
    handshake_error: str = ""
    """Why the last handshake with the publisher failed ("" = none since it last succeeded)."""


class _Source:
    def __init__(self, spec: SourceSpec, sub: Any = None, mon: Any = None) -> None:
        self.spec = spec
        # None only for apply_batch's out-of-band sources
        self.sub: zmq.Socket = sub
        self.mon: zmq.Socket = mon
        self.next: int | None = None
        self.cursor: int | None = None
        self.down_since: float | None = time.monotonic()
        self.dropped = False
        self.models: set[str] = set()
        self.recent: dict[int, int] = {}  # seq -> hash(payload) of recent batches
        # snapshots (sources with a snapshot_address)
        self.snapshot_due = bool(spec.snapshot_address)
        self.snapshot_seq: int | None = None  # set until a batch >= it is applied
        self.snapshot_at = 0.0
        self.retry_at = 0.0
        self.backoff_s = _SNAPSHOT_BACKOFF_S[0]
        self.channel: grpc.Channel | None = None
        self.channel_generation = 0  # of the TLS credentials the channel was made with
        # staleness and health (monotonic seconds)
        self.last_event_at: float | None = None
        self.matched_at: float | None = None
        self.last_seen_at = time.monotonic()
        self.tail_checked_at = time.monotonic()
        self.errors = 0
        self.snapshots = 0
        self.handshake_error = ""

    @property
    def daemon(self) -> bool:
        return self.spec.kind == KIND_DAEMON

    @property
    def rank(self) -> int | None:
        """The DP rank whose GPU entries this source's are; None = the node's."""
        r = self.spec.data_parallel_rank
        return r if r >= 0 and self.spec.kind == KIND_ENGINE else None

    @property
    def mediums(self) -> list[str]:
        # An engine reports only its GPU cache and a daemon only its own tiers:
        # a clear from one never touches the other's entries.
        return list(DAEMON_MEDIUMS if self.daemon else ENGINE_MEDIUMS)


_KNOWN_TAGS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


class _Decoders:
    def __init__(self) -> None:
        self.batch = msgspec.msgpack.Decoder(LeanBatch)
        self.positional = positional_decoder()
        # the per-event fallback re-encodes each event: msgspec.convert cannot
        # fill the views' Raw fields (token_ids), decoding bytes can
        self.encoder = msgspec.msgpack.Encoder()
        self.event = msgspec.msgpack.Decoder(LeanEvent)
        self.positional_event = msgspec.msgpack.Decoder(PositionalEvent)


class Subscriber:
    """Applies every source's events to ``index`` (under ``lock``)."""

    def __init__(
        self,
        index: IndexBackend,
        lock: threading.Lock,
        *,
        replay_timeout_s: float = 2.0,
        node_gone_s: float = 30.0,
        snapshot_timeout_s: float = 30.0,
        snapshot_interval_s: float = 600.0,
        tail_check_s: float = 5.0,
        error_log_interval_s: float = 10.0,
        backend_ping_s: float = 1.0,
        cluster_secret: str = "",
        snapshot_credentials: ClientCredentials | None = None,
        hash_algo: str = "sha256",
        hash_seed: str | None = None,
        context: zmq.Context | None = None,
        curve_keys: KeyPair | None = None,
    ) -> None:
        self._index = index
        self._lock = lock
        self._replay_timeout_s = replay_timeout_s
        self._node_gone_s = node_gone_s
        self._snapshot_timeout_s = snapshot_timeout_s
        self._snapshot_interval_s = snapshot_interval_s
        self._tail_check_s = tail_check_s
        self._error_log_interval_s = error_log_interval_s
        self._backend_ping_s = backend_ping_s
        self._metadata = ((SECRET_METADATA_KEY, cluster_secret),) if cluster_secret else None
        self._snapshot_credentials = snapshot_credentials  # mutual TLS to daemons, if set
        self._ctx = context or zmq.Context.instance()
        self._curve_keys = curve_keys  # our CURVE client key pair, for sources that name a key
        self.stats = SubscriberStats()
        self._specs: dict[str, SourceSpec] = {}  # what should be followed (any thread)
        self._specs_lock = threading.Lock()
        self._sources: dict[str, _Source] = {}
        self._offline: dict[str, _Source] = {}
        self._by_socket: dict[zmq.Socket, _Source] = {}
        self._by_monitor: dict[zmq.Socket, _Source] = {}
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=10_000)
        self._wake_addr = f"inproc://kv-indexer-wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._stop = threading.Event()
        # (model, node, medium, DP rank or None) -> runs of (present, hashes)
        self._staged: dict[tuple[str, str, str, int | None], list[tuple[bool, list[Any]]]] = {}
        self._dirty: set[_Source] = set()
        self._dec = _Decoders()
        self._logged_at: dict[str, tuple[float, int]] = {}  # kind -> (last log, suppressed)
        # the backend: down from its first error until a ping answers again
        self.backend_down_since: float | None = None
        self._backend_retry_at = 0.0
        self._backend_backoff_s = _BACKEND_BACKOFF_S[0]
        self._backend_pinged_at = time.monotonic()
        self.last_error = ""
        self.heartbeat_at = time.monotonic()
        # model -> block sizes its sources publish (from events and snapshots)
        self._block_sizes: dict[str, set[int]] = {}
        self.seeds = SeedChecker(hash_algo, hash_seed)
        self._thread = self._new_thread()

    def _new_thread(self) -> threading.Thread:
        return threading.Thread(target=self._run, name="kv-indexer-sub", daemon=True)

    # --- control (any thread) ------------------------------------------------------

    def start(self) -> None:
        self.heartbeat_at = time.monotonic()
        self._thread.start()

    def restart_if_dead(self) -> bool:
        """Start a new ingestion thread if the running one died; True if it did."""
        if self._stop.is_set() or self._thread.ident is None or self._thread.is_alive():
            return False
        self.stats.thread_restarts += 1
        log.error("KV event subscriber thread had died; restarting it")
        self._thread = self._new_thread()
        self.start()
        return True

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def health(self, stall_s: float | None = None) -> tuple[bool, str]:
        """(ok, why not): the thread runs, turns, and the backend answers."""
        if not self._thread.is_alive():
            return False, "the ingestion thread is not running"
        # one turn may wait on a snapshot and a replay; longer than that is a stall
        limit = stall_s or (self._snapshot_timeout_s + self._replay_timeout_s + 5.0)
        age = time.monotonic() - self.heartbeat_at
        if age > limit:
            return False, f"the ingestion thread has not turned for {age:.1f}s"
        if self.backend_down_since is not None:
            return False, f"the index backend is unreachable: {self.last_error}"
        return True, ""

    def check_curve(self, spec: SourceSpec) -> None:
        """A source with a CURVE server key needs this subscriber's client key pair."""
        if spec.curve_server_key and self._curve_keys is None:
            raise ConfigError(
                f"source {spec.node} at {spec.endpoint} names a curve_server_key, but this "
                "indexer has no CURVE key of its own (indexer.events_curve_key_file)"
            )

    def _curve(self, spec: SourceSpec) -> CurveClient | None:
        if not spec.curve_server_key:
            return None
        assert self._curve_keys is not None  # check_curve ran in add_source
        return CurveClient(self._curve_keys, spec.curve_server_key.encode())

    def add_source(self, spec: SourceSpec) -> None:
        spec.check()
        self.check_curve(spec)
        with self._specs_lock:
            self._specs[spec.key] = spec
        self._command("add", spec)

    def remove_source(self, key: str, drop_entries: bool = True) -> None:
        with self._specs_lock:
            self._specs.pop(key, None)
        self._command("remove", (key, drop_entries))

    def sources(self) -> list[SourceSpec]:
        with self._specs_lock:
            return list(self._specs.values())

    def source_status(self) -> list[SourceStatus]:
        now = time.monotonic()
        out = []
        for src in list(self._sources.values()):
            out.append(
                SourceStatus(
                    key=src.spec.key,
                    node=src.spec.node,
                    kind=src.spec.kind,
                    connected=src.down_since is None,
                    next_seq=src.next or 0,
                    last_event_age_s=-1.0 if src.last_event_at is None else now - src.last_event_at,
                    since_snapshot_s=-1.0 if src.matched_at is None else now - src.matched_at,
                    errors=src.errors,
                    snapshots=src.snapshots,
                    handshake_error=src.handshake_error,
                )
            )
        return out

    def block_sizes(self, model: str) -> list[int]:
        """Block sizes the sources publish for ``model`` (empty: none learned yet)."""
        return sorted(self._block_sizes.get(model, ()))

    def learned_models(self) -> dict[str, list[int]]:
        return {m: sorted(s) for m, s in list(self._block_sizes.items())}

    def apply_batch(self, spec: SourceSpec, topic: bytes, payload: bytes) -> None:
        """Apply one batch received out of band (no sequence checks), then flush.

        For embedding and benchmarks; never call it while the thread runs.
        """
        assert not self._thread.is_alive(), "apply_batch while the subscriber thread runs"
        src = self._offline.get(spec.key)
        if src is None:
            src = self._offline[spec.key] = _Source(spec)
        self._apply(src, topic, payload)

    def flush(self) -> None:
        """Push staged updates to the index (see ``apply_batch``)."""
        assert not self._thread.is_alive(), "flush while the subscriber thread runs"
        self._flush()

    def _command(self, op: str, arg: Any) -> None:
        self._commands.put((op, arg), timeout=1.0)
        self._wake()

    def _wake(self) -> None:
        # best effort: the thread also polls every _POLL_MS
        with self._wake_lock:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._wake()
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._wake_rx.close(linger=0)
        with self._wake_lock:
            self._wake_tx.close(linger=0)

    # --- the thread -----------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        # a restarted thread follows everything its predecessor followed
        for spec in self.sources():
            self._add(poller, spec)
        try:
            while not self._stop.is_set():
                try:
                    self._turn(poller)
                except KVStoreError as e:  # the backend failed outside a guarded write
                    self._backend_failed(e)
                except Exception as e:
                    self.stats.errors += 1
                    self._log_error("turn", f"KV event subscriber turn failed: {e!r}", exc=True)
                    self._stop.wait(0.1)  # a persistent fault must not spin
                self.heartbeat_at = time.monotonic()
        finally:
            for src in list(self._sources.values()):
                self._close_source(src)
            self._sources.clear()
            self._by_socket.clear()
            self._by_monitor.clear()

    def _turn(self, poller: zmq.Poller) -> None:
        self._run_commands(poller)
        ready = dict(poller.poll(_POLL_MS))
        if self._wake_rx in ready:
            while self._wake_rx.poll(0):
                self._wake_rx.recv()
        for sock in ready:
            if sock in self._by_monitor:
                self._on_monitor(self._by_monitor[sock])
        for sock in ready:
            src = self._by_socket.get(sock)
            if src is not None:
                self._drain(src)
        self._guarded(self._flush)
        self._check_gone()
        self._maintain()

    def _log_error(self, kind: str, msg: str, exc: bool = False) -> None:
        """Log ``msg`` at most once per error_log_interval_s per kind, with a count."""
        now = time.monotonic()
        last, suppressed = self._logged_at.get(kind, (-1e18, 0))
        if now - last < self._error_log_interval_s:
            self._logged_at[kind] = (last, suppressed + 1)
            return
        if len(self._logged_at) > 1024:
            self._logged_at.clear()  # bounded: kinds are few in practice
        self._logged_at[kind] = (now, 0)
        more = f" (and {suppressed} more like it since the last report)" if suppressed else ""
        log.error("%s%s", msg, more, exc_info=exc)

    # --- the backend -----------------------------------------------------------------

    def _guarded(self, fn: Any, *args: Any) -> bool:
        """Run an index update; on a backend error mark the backend down. True if it ran."""
        if self.backend_down_since is not None:
            return False
        try:
            fn(*args)
            return True
        except KVStoreError as e:
            self._backend_failed(e)
            return False

    def _backend_failed(self, e: Exception) -> None:
        self.stats.backend_errors += 1
        self.last_error = str(e)
        if self.backend_down_since is None:
            self.stats.backend_outages += 1
            self.backend_down_since = time.monotonic()
            self._backend_backoff_s = _BACKEND_BACKOFF_S[0]
            self._backend_retry_at = time.monotonic() + self._backend_backoff_s
        self._log_error("backend", f"index backend failed; ingestion paused: {e}")
        # what was staged is lost with the failed write; every source is rebuilt
        self._staged.clear()
        self._dirty.clear()
        for src in self._sources.values():
            self._mark_rebuild(src)

    def _mark_rebuild(self, src: _Source) -> None:
        if src.spec.snapshot_address:
            src.snapshot_due = True
            src.retry_at = 0.0
        else:
            src.next = None  # replay everything the publisher still has
            src.cursor = None
            src.recent.clear()

    def _check_backend(self) -> None:
        now = time.monotonic()
        if self.backend_down_since is None:
            if now - self._backend_pinged_at < self._backend_ping_s:
                return
            self._backend_pinged_at = now
        elif now < self._backend_retry_at:
            return
        try:
            with self._lock:
                lost = self._index.ping()
        except KVStoreError as e:
            if self.backend_down_since is None:
                self._backend_failed(e)
            else:
                self.last_error = str(e)
                self._backend_backoff_s = min(self._backend_backoff_s * 2, _BACKEND_BACKOFF_S[1])
                self._backend_retry_at = now + self._backend_backoff_s
            return
        if self.backend_down_since is not None:
            log.warning(
                "index backend answers again after %.1fs; resyncing every source",
                now - self.backend_down_since,
            )
            self.backend_down_since = None
            lost = True
        if lost:
            for src in self._sources.values():
                self._mark_rebuild(src)
                if not src.spec.snapshot_address:
                    self._clear_source(src)
                    if src.down_since is None:
                        self._catch_up(src)

    # --- maintenance ----------------------------------------------------------------

    def _maintain(self) -> None:
        self._check_backend()
        if self.backend_down_since is not None:
            return
        now = time.monotonic()
        for src in list(self._sources.values()):
            if not src.spec.snapshot_address or src.down_since is not None:
                continue
            periodic = (
                self._snapshot_interval_s > 0
                and src.matched_at is not None
                and now - src.matched_at >= self._snapshot_interval_s
            )
            if (src.snapshot_due or periodic) and now >= src.retry_at:
                self._snapshot(src)
            elif (
                src.spec.replay_endpoint
                and src.next is not None
                and now - src.last_seen_at >= self._tail_check_s
                and now - src.tail_checked_at >= self._tail_check_s
            ):
                self._tail_check(src)

    def _tail_check(self, src: _Source) -> None:
        """An idle source: is it the publisher we followed, and did its tail get lost?

        Asks the replay buffer from the last batch applied (``next - 1``): the
        publisher must still have that very batch (same payload, where we saw
        it), then whatever follows is a tail we missed. No batch there means
        it restarted with a shorter history (its first batches may have been
        lost on the way, so the live stream never showed the reset); a later
        first batch means the buffer moved past it. Either way: a snapshot.
        """
        src.tail_checked_at = time.monotonic()
        self.stats.tail_checks += 1
        assert src.next is not None
        if src.next == 0:
            return
        probe = src.next - 1
        batches = self._replay(src, probe)
        first = batches[0] if batches else None
        known = src.recent.get(probe)
        if first is None or first[0] != probe or (known is not None and known != hash(first[2])):
            log.info("KV event source %s: publisher changed under us; resyncing", src.spec.key)
            self.stats.restarts += 1
            src.snapshot_due = True
            src.retry_at = 0.0
            return
        src.recent[probe] = hash(first[2])
        for seq, topic, payload in batches[1:]:
            if seq != src.next:
                src.snapshot_due = True
                return
            self._apply_one(src, seq, topic, payload)

    # --- snapshots -------------------------------------------------------------------

    def _stub(self, src: _Source) -> Any:
        from kvstore.v1 import store_pb2_grpc  # grpc stubs only where snapshots are used

        credentials, generation = (
            self._snapshot_credentials.current()
            if self._snapshot_credentials is not None
            else (None, 0)
        )
        if src.channel is not None and generation != src.channel_generation:
            # renewed certificate files: the next snapshot connects with them (this
            # thread is the channel's only user, and no call is in flight on it now)
            src.channel.close()
            src.channel = None
        if src.channel is None:
            options = [("grpc.max_receive_message_length", 64 << 20)]
            src.channel_generation = generation
            if credentials is not None:
                src.channel = grpc.secure_channel(
                    src.spec.snapshot_address, credentials, options=options
                )
            else:
                src.channel = grpc.insecure_channel(src.spec.snapshot_address, options=options)
        return store_pb2_grpc.StoreServiceStub(src.channel)

    def _fetch_snapshot(self, src: _Source) -> tuple[int, dict[tuple[str, str], list[bytes]]]:
        from kvstore.v1 import store_pb2

        groups: dict[tuple[str, str], list[bytes]] = {}
        total = 0
        next_seq: int | None = None
        done = False
        stream = self._stub(src).Snapshot(
            store_pb2.SnapshotRequest(), timeout=self._snapshot_timeout_s, metadata=self._metadata
        )
        for chunk in stream:
            if done:
                raise InvalidRequest("snapshot went on after its last message")
            if next_seq is None:
                next_seq = chunk.next_seq
            elif chunk.next_seq != next_seq:
                raise InvalidRequest("snapshot messages disagree on next_seq")
            if chunk.done:
                done = True
                continue
            if chunk.block_size_tokens:
                self._learn(chunk.model, chunk.block_size_tokens)
            if not chunk.block_hashes:
                continue
            medium = _TIER_MEDIUM.get(chunk.tier)
            if medium is None or len(chunk.block_hashes) % 8:
                raise InvalidRequest(f"snapshot chunk with tier {chunk.tier} is malformed")
            total += len(chunk.block_hashes) // 8
            if total > _MAX_SNAPSHOT_HASHES:
                raise InvalidRequest(f"snapshot exceeds {_MAX_SNAPSHOT_HASHES} hashes")
            groups.setdefault((chunk.model, medium), []).append(chunk.block_hashes)
        if not done or next_seq is None:
            raise InvalidRequest("snapshot stream ended before its last message")
        return next_seq, groups

    def _snapshot(self, src: _Source) -> bool:
        """Replace the node's daemon entries with what the daemon holds; True if done."""
        now = time.monotonic()
        try:
            next_seq, groups = self._fetch_snapshot(src)
        except (grpc.RpcError, KVStoreError) as e:
            self.stats.snapshot_failures += 1
            src.errors += 1
            src.snapshot_due = True
            src.retry_at = now + src.backoff_s
            src.backoff_s = min(src.backoff_s * 2, _SNAPSHOT_BACKOFF_S[1])
            detail = e.details() if isinstance(e, grpc.RpcError) else str(e)  # type: ignore[attr-defined]
            self._log_error(
                f"snapshot:{src.spec.key}",
                f"snapshot of {src.spec.node} from {src.spec.snapshot_address} failed "
                f"(retry in {src.backoff_s:.1f}s): {detail}",
            )
            return False
        # staged updates are older than the snapshot: it supersedes them
        mine = set(src.mediums)
        self._staged = {
            k: v for k, v in self._staged.items() if k[1] != src.spec.node or k[2] not in mine
        }
        node = src.spec.node

        def replace() -> None:
            with self._lock:
                self._index.clear(node, None, src.mediums)
                for (model, medium), parts in groups.items():
                    keys = np.frombuffer(b"".join(parts), dtype="<u8").astype(np.uint64)
                    self._index.add(model, node, medium, keys)
                    src.models.add(model)

        if not self._guarded(replace):
            return False
        self.stats.snapshots += 1
        src.snapshots += 1
        src.snapshot_due = False
        src.backoff_s = _SNAPSHOT_BACKOFF_S[0]
        src.matched_at = src.last_event_at = time.monotonic()
        src.snapshot_seq = next_seq
        src.snapshot_at = time.monotonic()
        src.next = next_seq
        src.cursor = next_seq - 1 if next_seq else None
        src.recent.clear()
        src.dropped = False
        src.tail_checked_at = time.monotonic()
        log.info(
            "%s rebuilt from its snapshot: %d hashes, stream from seq %d",
            src.spec.key,
            sum(len(b) for parts in groups.values() for b in parts) // 8,
            next_seq,
        )
        return True

    def _learn(self, model: str, block_size: int) -> None:
        sizes = self._block_sizes.get(model)
        if sizes is None:
            if len(self._block_sizes) >= _MAX_LEARNED_MODELS:
                return
            sizes = self._block_sizes[model] = set()
        if block_size not in sizes and len(sizes) < _MAX_SIZES_PER_MODEL:
            sizes.add(block_size)
            if len(sizes) > 1:
                log.warning(
                    "model %r is published with block sizes %s: a Score with token ids must "
                    "say which (block_size_tokens)",
                    model,
                    sorted(sizes),
                )

    # --- sources ---------------------------------------------------------------------

    def _run_commands(self, poller: zmq.Poller) -> None:
        while True:
            try:
                op, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                spec: SourceSpec = arg
                old = self._sources.get(spec.key)
                if old is not None and old.spec == spec:
                    continue
                if old is not None:
                    self._remove(poller, old, drop=True)
                self._add(poller, spec)
            elif op == "remove":
                key, drop = arg
                src = self._sources.get(key)
                if src is not None:
                    self._remove(poller, src, drop)

    def _add(self, poller: zmq.Poller, spec: SourceSpec) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        secure_socket(sub, self._curve(spec))
        mon = sub.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
        )
        sub.connect(spec.endpoint)
        src = _Source(spec, sub, mon)
        self._sources[spec.key] = src
        self._by_socket[sub] = src
        self._by_monitor[mon] = src
        poller.register(sub, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        try:
            src.cursor = self._index.load_cursor(spec.key)
        except KVStoreError as e:
            self._backend_failed(e)
        log.info("following KV events of %s at %s", spec.node, spec.endpoint)

    def _remove(self, poller: zmq.Poller, src: _Source, drop: bool) -> None:
        self._guarded(self._flush)
        poller.unregister(src.sub)
        poller.unregister(src.mon)
        self._close_source(src)
        del self._sources[src.spec.key]
        if drop:
            self._clear_source(src)

            def forget() -> None:
                with self._lock:
                    self._index.forget_cursor(src.spec.key)  # a comeback starts afresh
                    # the node id stays only while another stream still feeds it
                    if not any(s.spec.node == src.spec.node for s in self._sources.values()):
                        self._index.drop_node(src.spec.node)

            self._guarded(forget)

    def _close_source(self, src: _Source) -> None:
        self._by_socket.pop(src.sub, None)
        self._by_monitor.pop(src.mon, None)
        try:
            src.sub.disable_monitor()
        except zmq.ZMQError:
            pass
        src.mon.close(linger=0)
        src.sub.close(linger=0)
        if src.channel is not None:
            src.channel.close()
            src.channel = None

    def _on_monitor(self, src: _Source) -> None:
        while src.mon.poll(0):
            try:
                ev = zmq.utils.monitor.recv_monitor_message(src.mon)
            except zmq.ZMQError:
                return
            if ev["event"] & HANDSHAKE_FAILED:
                # a CURVE mismatch would otherwise look like a silent publisher
                src.handshake_error = handshake_failure(ev, bool(src.spec.curve_server_key))
                src.errors += 1
                self.stats.handshake_failures += 1
                self._log_error(
                    f"handshake:{src.spec.key}",
                    f"KV event source {src.spec.node} at {src.spec.endpoint}: handshake "
                    f"failed: {src.handshake_error}",
                )
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                src.down_since = time.monotonic()
            elif ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                src.handshake_error = ""
                src.down_since = None
                src.last_seen_at = time.monotonic()
                if src.spec.snapshot_address:
                    # whatever happened while we were apart, the daemon knows
                    src.snapshot_due = True
                    src.retry_at = 0.0
                    if self.backend_down_since is None and not self._snapshot(src):
                        self._catch_up(src)  # meanwhile, what the replay buffer has
                else:
                    self._catch_up(src)

    def _catch_up(self, src: _Source) -> None:
        """On (re)connect, replay what the publisher sent while we were away.

        Without this an idle publisher's history stays invisible until its
        next batch reveals the gap. The replay starts one batch back, at the
        last one applied: if the publisher no longer has that exact batch, it
        restarted (or dropped it from its buffer) while we were away, so the
        source is cleared and rebuilt from everything it still has.
        """
        if not src.spec.replay_endpoint:
            return
        start = src.next if src.next is not None else self._resume_seq(src)
        probe = max(start - 1, 0)
        batches = self._replay(src, probe)
        if start > 0:
            first = batches[0] if batches else None
            known = src.recent.get(probe)
            same = (
                first is not None
                and first[0] == probe
                and (known is None or known == hash(first[2]))
            )
            if not same:
                self._resync(src, start)
                src.next = 0
                start = 0
                if first is None or first[0] != 0:
                    batches = self._replay(src, 0)
        if batches:
            if batches[0][0] > start:
                self._resync(src, start)
            self._apply_replayed(src, batches, start)

    def _check_gone(self) -> None:
        now = time.monotonic()
        for src in list(self._sources.values()):
            if src.down_since is None or src.dropped or src.next is None:
                continue
            if now - src.down_since >= self._node_gone_s:
                log.warning("KV event source %s gone; dropping its entries", src.spec.key)
                self.stats.nodes_gone += 1
                self._clear_source(src)
                src.dropped = True
                src.next = 0  # when it comes back, replay it from the start
                src.matched_at = None
                if src.spec.snapshot_address:
                    src.snapshot_due = True

    # --- messages ---------------------------------------------------------------------

    def _drain(self, src: _Source) -> None:
        for _ in range(_MAX_MESSAGES_PER_SOURCE_TURN):
            try:
                frames = src.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            src.last_seen_at = time.monotonic()
            if self.backend_down_since is not None:
                continue  # nowhere to apply it; the rebuild after the outage covers it
            try:
                self._on_frames(src, frames)
            except KVStoreError as e:
                self._backend_failed(e)
            except Exception as e:
                src.errors += 1
                self.stats.errors += 1
                self._log_error(
                    f"frames:{src.spec.key}", f"batch from {src.spec.key} failed: {e!r}", exc=True
                )

    def _on_frames(self, src: _Source, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.malformed += 1
            return
        topic, seq_b, payload = frames
        seq = int.from_bytes(seq_b, "big")
        if src.spec.snapshot_address:
            self._on_snapshot_source_frames(src, seq, topic, payload)
            return
        self._on_plain_frames(src, seq, topic, payload)

    def _on_plain_frames(self, src: _Source, seq: int, topic: bytes, payload: bytes) -> None:
        """A source without snapshots: replay what is missing, else rebuild from the buffer."""
        src.dropped = False
        if src.next is None:
            # First batch since this indexer started: resume after the saved
            # cursor, or catch up on everything the publisher still buffers.
            src.next = self._resume_seq(src)
        if seq < src.next and src.recent.get(seq) == hash(payload):
            return  # already applied (a replay and the live stream overlap)
        if seq < src.next:
            # the counter went back: the publisher restarted and its old
            # blocks are gone with it
            log.info(
                "KV event source %s restarted (seq %d, expected %d)", src.spec.key, seq, src.next
            )
            self.stats.restarts += 1
            self._clear_source(src)
            src.next = 0
        if seq > src.next:
            self.stats.gaps += 1
            resyncs = self.stats.resyncs
            for _ in range(_MAX_REPLAYS_PER_GAP):  # a cut-short replay continues
                before = src.next
                self._recover(src, src.next)
                if seq < src.next or src.next == before:
                    break
            if seq < src.next:
                return  # the replay covered this batch
            if seq > src.next and self.stats.resyncs == resyncs:
                self._resync(src, src.next)  # [next, seq) could not be had: start over here
        self._apply(src, topic, payload)
        self._done(src, seq, payload)

    def _on_snapshot_source_frames(
        self, src: _Source, seq: int, topic: bytes, payload: bytes
    ) -> None:
        """A daemon source: the index is rebuilt from a snapshot whenever it may be wrong."""
        for _ in range(3):  # a snapshot, then at most a replay, then this batch
            if src.snapshot_due or src.next is None:
                if time.monotonic() >= src.retry_at and self._snapshot(src):
                    continue
                # No snapshot to be had now (retried with backoff): follow the
                # stream as a source without snapshots does, rather than show
                # nothing; the snapshot replaces it all once it comes.
                self._on_plain_frames(src, seq, topic, payload)
                return
            if seq < src.next:
                if src.recent.get(seq) == hash(payload):
                    return  # already applied (a replay and the live stream overlap)
                if (
                    src.snapshot_seq is not None
                    and 0 < seq < src.snapshot_seq
                    and time.monotonic() - src.snapshot_at < _STALE_WINDOW_S
                ):
                    self.stats.stale_skipped += 1  # sent before the snapshot: in it
                    return
                # the counter went back (seq 0 is a new publisher's first batch)
                log.info(
                    "KV event source %s restarted (seq %d, expected %d)",
                    src.spec.key,
                    seq,
                    src.next,
                )
                self.stats.restarts += 1
                src.snapshot_due = True
                src.retry_at = 0.0
                continue
            if seq > src.next:
                self.stats.gaps += 1
                self._fill_gap(src, seq)
                if seq > src.next:
                    src.snapshot_due = True  # the replay buffer no longer has it
                    src.retry_at = 0.0
                    continue
                if seq < src.next:
                    return  # the replay covered this batch
            self._apply_one(src, seq, topic, payload)
            return

    def _fill_gap(self, src: _Source, seq: int) -> None:
        """Replay ``[next, seq)`` contiguously; stops at the first hole."""
        if not src.spec.replay_endpoint:
            return
        for _ in range(_MAX_REPLAYS_PER_GAP):
            assert src.next is not None
            start = src.next
            batches = self._replay(src, start)
            if not batches or batches[0][0] != start:
                return
            for bseq, topic, payload in batches:
                if bseq != src.next:
                    return
                self._apply_one(src, bseq, topic, payload)
                if src.snapshot_due:
                    return
            self.stats.replayed_batches += len(batches)
            if seq < src.next or src.next == start:
                return

    def _apply_one(self, src: _Source, seq: int, topic: bytes, payload: bytes) -> None:
        cleared_node = self._apply(src, topic, payload)
        self._done(src, seq, payload)
        if src.snapshot_seq is not None and seq >= src.snapshot_seq:
            src.snapshot_seq = None  # the live stream has passed the snapshot
        if cleared_node and seq > 0:
            # a node-wide clear past a publisher's first batch means it dropped
            # events (its queue overflowed), not that it holds nothing
            src.snapshot_due = True
            src.retry_at = 0.0

    @staticmethod
    def _resume_seq(src: _Source) -> int:
        return 0 if src.cursor is None else src.cursor + 1

    def _done(self, src: _Source, seq: int, payload: bytes) -> None:
        src.next = seq + 1
        src.cursor = seq
        src.last_event_at = time.monotonic()
        src.recent[seq] = hash(payload)
        if len(src.recent) > _RECENT_BATCHES:
            del src.recent[next(iter(src.recent))]
        self._dirty.add(src)

    def _resync(self, src: _Source, start: int) -> None:
        self.stats.resyncs += 1
        log.warning("KV event source %s: batches from %d are gone; resyncing", src.spec.key, start)
        self._clear_source(src)

    def _apply_replayed(
        self, src: _Source, batches: list[tuple[int, bytes, bytes]], start: int
    ) -> None:
        for seq, topic, payload in batches:
            if seq >= start:
                self._apply(src, topic, payload)
                self._done(src, seq, payload)
                start = seq + 1
        self.stats.replayed_batches += len(batches)

    def _recover(self, src: _Source, start: int) -> None:
        """Replay ``[start, ...)``; resync if the publisher lost part of it."""
        batches = self._replay(src, start) if src.spec.replay_endpoint else []
        if not batches or batches[0][0] != start:
            self._resync(src, start)
        self._apply_replayed(src, batches, start)

    def _replay(self, src: _Source, start: int) -> list[tuple[int, bytes, bytes]]:
        self.stats.replays += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        # A DEALER's send waits for a peer; one whose handshake fails (a CURVE
        # mismatch) never comes, and this thread must not wait for it unbounded.
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(self._replay_timeout_s * 1000)))
        secure_socket(sock, self._curve(src.spec))
        out: list[tuple[int, bytes, bytes]] = []
        got_bytes = 0
        try:
            sock.connect(src.spec.replay_endpoint)
            try:
                sock.send_multipart((b"", start.to_bytes(8, "big")))
            except zmq.Again:
                self._log_error(
                    f"replay:{src.spec.key}",
                    f"replay from {src.spec.replay_endpoint}: no connection within "
                    f"{self._replay_timeout_s:.1f}s (see the handshake errors)",
                )
                return out
            deadline = time.monotonic() + self._replay_timeout_s
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not sock.poll(left_ms):
                    self._log_error(
                        f"replay:{src.spec.key}",
                        f"replay from {src.spec.replay_endpoint} timed out",
                    )
                    return out
                frames = sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self.stats.malformed += 1
                    continue
                _, topic, seq_b, payload = frames
                if seq_b == END_SEQ:
                    return out
                out.append((int.from_bytes(seq_b, "big"), topic, payload))
                got_bytes += len(payload)
                if got_bytes > _MAX_REPLAY_BYTES:
                    # bounded memory: apply this much; the next live batch
                    # shows the rest as a gap and asks again from there
                    log.warning(
                        "replay from %s cut at %d bytes", src.spec.replay_endpoint, got_bytes
                    )
                    return out
        finally:
            sock.close(linger=0)

    def _apply(self, src: _Source, topic: bytes, payload: bytes) -> bool:
        """Stage one batch's events; True if it held a node-wide clear."""
        spec = src.spec
        if spec.kind == KIND_ENGINE:
            model: str | None = spec.model
        else:
            parsed = parse_topic(topic)
            if parsed is None:
                self.stats.malformed += 1
                return False
            model = parsed[1] or None  # kv@<node>@ = every model of the node
        decoded = self._decode(payload)
        if decoded is None:
            return False
        events, tagged_rank = decoded
        rank = src.rank
        if rank is not None and tagged_rank is not None and tagged_rank != rank:
            # another rank's stream at this endpoint: its blocks are not this rank's
            self.stats.rank_mismatches += 1
            self._log_error(
                f"rank:{spec.key}",
                f"engine source {spec.key} is configured as DP rank {rank} but sent a "
                f"batch of rank {tagged_rank}; batch dropped",
            )
            return False
        self.stats.batches += 1
        node = spec.node
        cleared_node = False
        for ev in events:
            self.stats.events += 1
            if isinstance(ev, LeanCleared):
                self._flush()
                self.stats.clears += 1
                with self._lock:
                    self._index.clear(node, model, src.mediums, rank)
                cleared_node = cleared_node or model is None
                continue
            if model is None:
                self.stats.malformed += 1  # block events need a model
                continue
            try:
                medium = source_medium(ev.medium, src.daemon)
            except InvalidRequest:
                self.stats.unknown_events += 1
                continue
            if not isinstance(ev.block_hashes, list):
                self.stats.malformed += 1
                continue
            src.models.add(model)
            present = isinstance(ev, LeanStored)
            if present and ev.block_size:  # type: ignore[union-attr]
                self._learn(model, ev.block_size)  # type: ignore[union-attr]
                if ev.parent_block_hash is None and ev.block_hashes and ev.token_ids:  # type: ignore[union-attr]
                    self.seeds.offer(
                        model,
                        ev.block_hashes[0],
                        ev.block_size,  # type: ignore[union-attr]
                        ev.token_ids,  # type: ignore[union-attr]
                        ev.extra_keys,  # type: ignore[union-attr]
                        ev.lora_name,  # type: ignore[union-attr]
                        ev.lookahead_token_ids,  # type: ignore[union-attr]
                    )
            # runs of (present, hashes) in arrival order; hashes stay as
            # decoded, bytes-form or signed ones are folded at flush
            runs = self._staged.get((model, node, medium, rank))
            if runs is None:
                self._staged[(model, node, medium, rank)] = [(present, list(ev.block_hashes))]
            elif runs[-1][0] == present:
                runs[-1][1].extend(ev.block_hashes)
            else:
                runs.append((present, list(ev.block_hashes)))
            if present:
                self.stats.hashes_stored += len(ev.block_hashes)
            else:
                self.stats.hashes_removed += len(ev.block_hashes)
        return cleared_node

    def _decode(
        self, payload: bytes
    ) -> tuple[Sequence[LeanStored | LeanRemoved | LeanCleared], int | None] | None:
        """(events, the batch's data_parallel_rank tag), or None: malformed."""
        # Any failure of any kind is one malformed batch, never the thread's
        # end: msgspec raises RecursionError on deeply nested arrays, and
        # whatever else a hostile payload provokes is caught the same way.
        try:
            batch = self._dec.batch.decode(payload)
            return batch.events, batch.data_parallel_rank
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        except Exception:
            self.stats.malformed += 1
            return None
        # Engines before vLLM 0.26 send positional events (kvstore.events.wire).
        try:
            pos = self._dec.positional.decode(payload)
            return [lean_event(ev) for ev in pos.events], pos.data_parallel_rank
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        except Exception:
            self.stats.malformed += 1
            return None
        # One bad event must not cost the whole batch: decode event by event.
        try:
            raw = msgspec.msgpack.decode(payload)
        except Exception:
            self.stats.malformed += 1
            return None
        if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
            self.stats.malformed += 1
            return None
        tag = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
        out: list[LeanStored | LeanRemoved | LeanCleared] = []
        for item in raw[1]:
            try:
                data = self._dec.encoder.encode(item)
                if isinstance(item, list):
                    out.append(lean_event(self._dec.positional_event.decode(data)))
                else:
                    out.append(self._dec.event.decode(data))
            except msgspec.ValidationError:
                if isinstance(item, dict):
                    known = item.get("type") in _KNOWN_TAGS
                else:
                    known = isinstance(item, list) and bool(item) and item[0] in _KNOWN_TAGS
                if known:
                    self.stats.malformed += 1
                else:
                    self.stats.unknown_events += 1
            except Exception:
                self.stats.malformed += 1
        return out, tag

    def _flush(self) -> None:
        staged, self._staged = self._staged, {}
        dirty, self._dirty = self._dirty, set()
        if not staged and not dirty:
            return
        with self._lock:
            for (model, node, medium, rank), runs in staged.items():
                if len(runs) == 1:
                    present, hashes = runs[0]
                    keys = self._hash_array(hashes)
                    if keys is None:
                        continue
                    if present:
                        self._index.add(model, node, medium, keys, rank)
                    else:
                        self._index.remove(model, node, medium, keys, rank)
                    continue
                # stores and removals interleave: the last word on each hash wins
                ops: dict[int | bytes, bool] = {}
                for present, hashes in runs:
                    for h in hashes:
                        if isinstance(h, (int, bytes)):
                            ops[h] = present
                keys = self._hash_array(list(ops))
                if keys is None:
                    continue
                mask = np.fromiter(ops.values(), dtype=bool, count=len(ops))
                self._index.add(model, node, medium, keys[mask], rank)
                self._index.remove(model, node, medium, keys[~mask], rank)
            for src in dirty:
                if src.cursor is not None:
                    self._index.save_cursor(src.spec.key, src.cursor)

    def _hash_array(self, hashes: list[Any]) -> np.ndarray | None:
        """Event hashes as uint64; digests (bytes) and signed int64 are folded."""
        try:
            return np.fromiter(hashes, dtype=np.uint64, count=len(hashes))
        except (OverflowError, TypeError, ValueError):
            pass
        try:
            return np.fromiter(
                (block_hash_to_int(h) for h in hashes), dtype=np.uint64, count=len(hashes)
            )
        except (TypeError, ValueError, OverflowError):
            self.stats.malformed += 1
            return None

    def _clear_source(self, src: _Source) -> None:
        """Drop what this source told the index (engines: their model's GPU cache)."""
        if not self._guarded(self._flush):
            return
        model = src.spec.model if src.spec.kind == KIND_ENGINE else None

        def clear() -> None:
            with self._lock:
                self._index.clear(src.spec.node, model, src.mediums, src.rank)

        self._guarded(clear)
