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

import msgspec
import numpy as np
import zmq
import zmq.utils.monitor

from kvstore.errors import ConfigError, InvalidRequest
from kvstore.events.wire import (
    END_SEQ,
    LeanBatch,
    LeanCleared,
    LeanEvent,
    LeanRemoved,
    LeanStored,
    block_hash_to_int,
    parse_topic,
)
from kvstore.indexer.backend import MEDIUMS, IndexBackend, medium_index

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

    @property
    def mediums(self) -> list[str] | None:
        # An engine publishes only its GPU cache; clearing it must leave the
        # node daemon's DRAM/disk entries alone.
        return ["GPU"] if self.spec.kind == KIND_ENGINE else None


_KNOWN_TAGS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


class _Decoders:
    def __init__(self) -> None:
        self.batch = msgspec.msgpack.Decoder(LeanBatch)


class Subscriber:
    """Applies every source's events to ``index`` (under ``lock``)."""

    def __init__(
        self,
        index: IndexBackend,
        lock: threading.Lock,
        *,
        replay_timeout_s: float = 2.0,
        node_gone_s: float = 30.0,
        context: zmq.Context | None = None,
    ) -> None:
        self._index = index
        self._lock = lock
        self._replay_timeout_s = replay_timeout_s
        self._node_gone_s = node_gone_s
        self._ctx = context or zmq.Context.instance()
        self.stats = SubscriberStats()
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
        self._staged: dict[tuple[str, str, str], list[tuple[bool, list[Any]]]] = {}
        self._dirty: set[_Source] = set()
        self._dec = _Decoders()
        self._thread = threading.Thread(target=self._run, name="kv-indexer-sub", daemon=True)

    # --- control (any thread) ------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def add_source(self, spec: SourceSpec) -> None:
        spec.check()
        self._command("add", spec)

    def remove_source(self, key: str, drop_entries: bool = True) -> None:
        self._command("remove", (key, drop_entries))

    def sources(self) -> list[SourceSpec]:
        return [s.spec for s in list(self._sources.values())]

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
        elif self._thread.ident is None:  # never started: the thread would close it
            self._wake_rx.close(linger=0)
        with self._wake_lock:
            self._wake_tx.close(linger=0)

    # --- the thread -----------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        try:
            while not self._stop.is_set():
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
                self._flush()
                self._check_gone()
        except Exception:
            log.exception("KV event subscriber thread failed")
            raise
        finally:
            for src in list(self._sources.values()):
                self._close_source(src)
            self._wake_rx.close(linger=0)

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
        mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sub.connect(spec.endpoint)
        src = _Source(spec, sub, mon)
        src.cursor = self._index.load_cursor(spec.key)
        self._sources[spec.key] = src
        self._by_socket[sub] = src
        self._by_monitor[mon] = src
        poller.register(sub, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        log.info("following KV events of %s at %s", spec.node, spec.endpoint)

    def _remove(self, poller: zmq.Poller, src: _Source, drop: bool) -> None:
        self._flush()
        poller.unregister(src.sub)
        poller.unregister(src.mon)
        self._close_source(src)
        del self._sources[src.spec.key]
        if drop:
            self._clear_source(src)
            with self._lock:
                self._index.forget_cursor(src.spec.key)  # a comeback starts afresh
            # the node id stays only while another stream still feeds it
            if not any(s.spec.node == src.spec.node for s in self._sources.values()):
                with self._lock:
                    self._index.drop_node(src.spec.node)

    def _close_source(self, src: _Source) -> None:
        self._by_socket.pop(src.sub, None)
        self._by_monitor.pop(src.mon, None)
        try:
            src.sub.disable_monitor()
        except zmq.ZMQError:
            pass
        src.mon.close(linger=0)
        src.sub.close(linger=0)

    def _on_monitor(self, src: _Source) -> None:
        while src.mon.poll(0):
            try:
                ev = zmq.utils.monitor.recv_monitor_message(src.mon)
            except zmq.ZMQError:
                return
            if ev["event"] == zmq.EVENT_DISCONNECTED:
                src.down_since = time.monotonic()
            elif ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                src.down_since = None
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

    # --- messages ---------------------------------------------------------------------

    def _drain(self, src: _Source) -> None:
        for _ in range(_MAX_MESSAGES_PER_SOURCE_TURN):
            try:
                frames = src.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_frames(src, frames)

    def _on_frames(self, src: _Source, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.malformed += 1
            return
        topic, seq_b, payload = frames
        seq = int.from_bytes(seq_b, "big")
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

    @staticmethod
    def _resume_seq(src: _Source) -> int:
        return 0 if src.cursor is None else src.cursor + 1

    def _done(self, src: _Source, seq: int, payload: bytes) -> None:
        src.next = seq + 1
        src.cursor = seq
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
        out: list[tuple[int, bytes, bytes]] = []
        got_bytes = 0
        try:
            sock.connect(src.spec.replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + self._replay_timeout_s
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not sock.poll(left_ms):
                    log.warning("replay from %s timed out", src.spec.replay_endpoint)
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

    def _apply(self, src: _Source, topic: bytes, payload: bytes) -> None:
        spec = src.spec
        if spec.kind == KIND_ENGINE:
            model: str | None = spec.model
        else:
            parsed = parse_topic(topic)
            if parsed is None:
                self.stats.malformed += 1
                return
            model = parsed[1] or None  # kv@<node>@ = every model of the node
        events = self._decode(payload)
        if events is None:
            return
        self.stats.batches += 1
        node = spec.node
        for ev in events:
            self.stats.events += 1
            if isinstance(ev, LeanCleared):
                self._flush()
                self.stats.clears += 1
                with self._lock:
                    self._index.clear(node, model, src.mediums)
                continue
            if model is None:
                self.stats.malformed += 1  # block events need a model
                continue
            try:
                medium = MEDIUMS[medium_index(ev.medium)]
            except InvalidRequest:
                self.stats.unknown_events += 1
                continue
            src.models.add(model)
            present = isinstance(ev, LeanStored)
            # runs of (present, hashes) in arrival order; hashes stay as
            # decoded, bytes-form or signed ones are folded at flush
            runs = self._staged.get((model, node, medium))
            if runs is None:
                self._staged[(model, node, medium)] = [(present, list(ev.block_hashes))]
            elif runs[-1][0] == present:
                runs[-1][1].extend(ev.block_hashes)
            else:
                runs.append((present, list(ev.block_hashes)))
            if present:
                self.stats.hashes_stored += len(ev.block_hashes)
            else:
                self.stats.hashes_removed += len(ev.block_hashes)

    def _decode(self, payload: bytes) -> Sequence[LeanStored | LeanRemoved | LeanCleared] | None:
        try:
            return self._dec.batch.decode(payload).events
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        # One bad event must not cost the whole batch: decode event by event.
        try:
            raw = msgspec.msgpack.decode(payload)
        except msgspec.DecodeError:
            self.stats.malformed += 1
            return None
        if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
            self.stats.malformed += 1
            return None
        out: list[LeanStored | LeanRemoved | LeanCleared] = []
        for item in raw[1]:
            try:
                out.append(msgspec.convert(item, LeanEvent))
            except msgspec.ValidationError:
                known = isinstance(item, dict) and item.get("type") in _KNOWN_TAGS
                if known:
                    self.stats.malformed += 1
                else:
                    self.stats.unknown_events += 1
        return out

    def _flush(self) -> None:
        staged, self._staged = self._staged, {}
        dirty, self._dirty = self._dirty, set()
        if not staged and not dirty:
            return
        with self._lock:
            for (model, node, medium), runs in staged.items():
                if len(runs) == 1:
                    present, hashes = runs[0]
                    keys = self._hash_array(hashes)
                    if keys is None:
                        continue
                    if present:
                        self._index.add(model, node, medium, keys)
                    else:
                        self._index.remove(model, node, medium, keys)
                    continue
                # stores and removals interleave: the last word on each hash wins
                ops: dict[int | bytes, bool] = {}
                for present, hashes in runs:
                    ops.update(dict.fromkeys(hashes, present))
                keys = self._hash_array(list(ops))
                if keys is None:
                    continue
                mask = np.fromiter(ops.values(), dtype=bool, count=len(ops))
                self._index.add(model, node, medium, keys[mask])
                self._index.remove(model, node, medium, keys[~mask])
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
        """Drop what this source told the index (engines: their model's GPU tier)."""
        self._flush()
        model = src.spec.model if src.spec.kind == KIND_ENGINE else None
        with self._lock:
            self._index.clear(src.spec.node, model, src.mediums)
