"""ZMQ publisher of vLLM-format KV events: the daemon's ``EventSink``.

The manager calls the sink on its event loop; a call only builds one event
Struct and puts it on a bounded queue (never blocks, never touches a socket).
One sender thread owns both sockets, because ZMQ sockets are not
thread-safe:

- PUB: frames ``(topic, seq u64 BE, payload)``, topic ``kv@<node>@<model>``
  (``kv@<node>@`` for a clear of every model); ``<node>`` is each of
  ``topic_ids`` (default the node id): llm-d names an engine by its topic, so
  each engine served from this daemon can get the events under its own
  ``address:port``. Consecutive events of one topic
  are sent as one ``KVEventBatch``; ``seq`` counts batches from 0 per process,
  so a subscriber sees a restart as a sequence reset.
- ROUTER (optional): a client sends ``(b"", start_seq u64 BE)``; the thread
  resends every buffered batch with seq >= start as ``(b"", topic, seq,
  payload)``, then ``(b"", b"", END_SEQ, b"")``. The replay buffer keeps the
  last ``replay_buffer_batches`` batches.

Snapshots (``mark``): the daemon's Snapshot RPC walks what it holds and, in
the same event-loop step, queues a marker; the sender thread resolves the
marker with the sequence number of the first batch sent after it. Every
event queued before the walk is in a batch below that number, every later
one at or above it, so "snapshot + the stream from that number on" is exact.

A new publisher first sends ``AllBlocksCleared`` on ``kv@<node>@`` (seq 0):
whatever a consumer still credits to this node from an earlier process is
gone. If the queue overflows, events are dropped (counted) and the next thing sent
is an ``AllBlocksCleared`` for every model of this node: consumers drop the
node's entries instead of trusting an index with holes in it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import msgspec
import numpy as np
import zmq
import zmq.utils.monitor

from kvstore import audit
from kvstore.errors import ConfigError, Unavailable
from kvstore.events.curve import (
    HANDSHAKE_FAILED,
    CurveServer,
    KeyPair,
    ZapAllowList,
    handshake_failure,
    load_keypair,
    public_key,
    require_curve,
    secure_socket,
    split_list,
)
from kvstore.events.sink import NamespaceRef
from kvstore.events.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    make_topic,
)

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.02  # how long the sender sleeps on an empty queue (replay latency bound)
_MAX_REPLAY_REQUESTS_PER_TURN = 16
# the topics slot of a snapshot marker on the queue (events carry a tuple of topics)
_MARK = None
_MAX_TOPIC_IDS = 64  # engines one daemon's events may name (each event is sent once per id)


def _hash_list(block_hashes: Sequence[int] | np.ndarray) -> list[int]:
    if isinstance(block_hashes, np.ndarray):
        return block_hashes.astype(np.uint64, copy=False).tolist()
    return [int(h) for h in block_hashes]


class ZmqEventPublisher:
    """An ``EventSink`` publishing vLLM ``KVEventBatch``es over ZMQ PUB + replay ROUTER.

    Endpoints are bound; ``tcp://127.0.0.1:0`` picks a free port, readable from
    ``.endpoint`` / ``.replay_endpoint`` once constructed.
    """

    def __init__(
        self,
        node_id: str,
        endpoint: str = "tcp://127.0.0.1:5557",
        replay_endpoint: str | None = "tcp://127.0.0.1:5558",
        *,
        max_queue_events: int = 100_000,
        replay_buffer_batches: int = 10_000,
        max_batch_events: int = 1_024,
        hwm: int = 100_000,
        data_parallel_rank: int | None = None,
        close_timeout_s: float = 2.0,
        announce_start: bool = True,
        context: zmq.Context | None = None,
        topic_ids: Sequence[str] = (),
        curve_keys: KeyPair | None = None,
        curve_allowed: Sequence[bytes] = (),
    ) -> None:
        # the ids the topics name: llm-d takes an engine's pod id from the topic
        self.topic_ids = tuple(topic_ids) or (node_id,)
        for tid in (node_id, *self.topic_ids):
            if not tid or "@" in tid:
                raise ConfigError(
                    f"events node/topic id must be non-empty without '@'; got {tid!r}"
                )
        if len(self.topic_ids) > _MAX_TOPIC_IDS or len(set(self.topic_ids)) != len(self.topic_ids):
            raise ConfigError(
                f"events.topic_ids must be distinct and at most {_MAX_TOPIC_IDS}; got {list(self.topic_ids)}"
            )
        for name, value in (
            ("max_queue_events", max_queue_events),
            ("replay_buffer_batches", replay_buffer_batches),
            ("max_batch_events", max_batch_events),
        ):
            if value <= 0:
                raise ConfigError(f"events.{name} must be > 0; got {value}")
        self.node_id = node_id
        self._rank = data_parallel_rank
        self._max_batch_events = max_batch_events
        self._close_timeout_s = close_timeout_s
        # (the topics an event goes to, the event): one entry per event, however many ids
        self._queue: queue.Queue[tuple[tuple[bytes, ...] | None, Any]] = queue.Queue(
            maxsize=max_queue_events
        )
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=replay_buffer_batches)
        self._topics: dict[str, tuple[bytes, ...]] = {}
        self._overflowed = False
        self._stopping = threading.Event()
        self.dropped_events = 0
        self.published_batches = 0
        self.published_events = 0
        self.replay_requests = 0

        curve: CurveServer | None = None
        self._zap: ZapAllowList | None = None
        self._own_ctx: zmq.Context | None = None
        if curve_keys is not None:
            require_curve("events.curve_secret_key_file")
            if not curve_allowed:
                raise ConfigError(
                    "events.curve_allowed_keys is empty: with CURVE on, only listed "
                    "subscriber keys may connect, so nobody could"
                )
            curve = CurveServer(curve_keys)
            # ZAP handlers are per context: ours must not judge another publisher's peers
            self._own_ctx = zmq.Context()
            self._zap = ZapAllowList(self._own_ctx, curve_allowed, f"KV events of {node_id}")
        self._ctx = self._own_ctx or context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        # handshake failures of CURVE sockets, audited by the sender thread
        self._monitors: list[tuple[zmq.Socket, str]] = []
        try:
            self._pub.set_hwm(hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            secure_socket(self._pub, curve)
            self.endpoint = self._bind(self._pub, endpoint)
            self.replay_endpoint: str | None = None
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # a full replay is one message per buffered batch: past the
                # default HWM (1000) a ROUTER drops the rest silently
                self._replay.set_hwm(replay_buffer_batches + 16)
                secure_socket(self._replay, curve)
                self.replay_endpoint = self._bind(self._replay, replay_endpoint)
            if curve is not None:
                self._monitors.append(
                    (self._pub.get_monitor_socket(HANDSHAKE_FAILED), self.endpoint)
                )
                if self._replay is not None and self.replay_endpoint:
                    mon = self._replay.get_monitor_socket(HANDSHAKE_FAILED)
                    self._monitors.append((mon, self.replay_endpoint))
        except (zmq.ZMQError, ConfigError):
            self._close_sockets()
            self._stop_curve()
            raise
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{node_id}", daemon=True)
        if announce_start:
            # seq 0 of every publisher lifetime: consumers (ours, llm-d's) drop
            # whatever they still credit to this node from its previous life
            self.all_cleared(None)
        self._thread.start()

    @classmethod
    def from_config(cls, node_id: str, cfg: Any) -> ZmqEventPublisher:
        """From the daemon's ``[events]`` section (kvstore.config.EventsConfig)."""
        return cls(
            node_id,
            cfg.publish_address,
            cfg.replay_address or None,
            max_queue_events=cfg.queue_batches,
            replay_buffer_batches=cfg.buffer_batches,
            max_batch_events=cfg.max_events_per_batch,
            topic_ids=cfg.topic_id_list(),
            curve_keys=(
                load_keypair(cfg.curve_secret_key_file, "events.curve_secret_key_file")
                if cfg.curve_secret_key_file
                else None
            ),
            curve_allowed=[
                public_key(k, "events.curve_allowed_keys")
                for k in split_list(cfg.curve_allowed_keys)
            ],
        )

    @staticmethod
    def _bind(sock: zmq.Socket, endpoint: str) -> str:
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            raise ConfigError(f"cannot bind KV events socket {endpoint!r}: {e}") from e
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    # --- EventSink -------------------------------------------------------------

    def blocks_stored(
        self,
        ns: NamespaceRef,
        block_hashes: Sequence[int],
        medium: str,
        parent_block_hash: int | None,
        token_ids: Sequence[int] | None,
    ) -> None:
        hashes = _hash_list(block_hashes)
        if not hashes:
            return
        ev = BlockStored(
            block_hashes=hashes,  # type: ignore[arg-type]
            parent_block_hash=None if parent_block_hash is None else int(parent_block_hash),
            token_ids=[] if token_ids is None else _hash_list(token_ids),
            block_size=ns.block_size_tokens,
            lora_id=None,
            medium=medium,
            lora_name=None,
        )
        self._put(ns.model, ev)

    def blocks_removed(self, ns: NamespaceRef, block_hashes: Sequence[int], medium: str) -> None:
        hashes = _hash_list(block_hashes)
        if hashes:
            self._put(ns.model, BlockRemoved(block_hashes=hashes, medium=medium))  # type: ignore[arg-type]

    def all_cleared(self, ns: NamespaceRef | None) -> None:
        self._put("" if ns is None else ns.model, AllBlocksCleared())

    def mark(self) -> Future[int]:
        """A future of the seq of the first batch sent after everything queued so far.

        Fails (``Unavailable``) if the queue is full, if events are dropped
        before the marker is sent (the stream then has a hole the snapshot
        would paper over), or if the publisher closes first.
        """
        fut: Future[int] = Future()
        if self._stopping.is_set():
            fut.set_exception(Unavailable("the KV event publisher is closing"))
            return fut
        try:
            self._queue.put_nowait((_MARK, fut))
        except queue.Full:
            fut.set_exception(Unavailable("the KV event queue is full; retry the snapshot"))
        return fut

    def _put(self, model: str, ev: Any) -> None:
        if self._stopping.is_set():
            return
        topics = self._topics.get(model)
        if topics is None:
            topics = self._topics[model] = tuple(
                make_topic(tid, model).encode() for tid in self.topic_ids
            )
        try:
            self._queue.put_nowait((topics, ev))
        except queue.Full:
            # Losing an event silently would leave holes in every index;
            # the sender turns this into a node-wide clear (see module doc).
            self.dropped_events += 1
            self._overflowed = True

    # --- lifecycle ---------------------------------------------------------------

    def close(self) -> None:
        """Send what is queued (bounded by close_timeout_s), then close the sockets."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._thread.join(timeout=self._close_timeout_s + 1.0)
        if self._thread.is_alive():
            # the thread owns the sockets and closes them when it ends
            log.warning("KV events sender did not stop within %.1fs", self._close_timeout_s)
            return
        self._stop_curve()

    def _close_sockets(self) -> None:
        if self._monitors:
            for sock in (self._pub, self._replay):
                if sock is not None:
                    with contextlib.suppress(zmq.ZMQError):
                        sock.disable_monitor()
        for mon, _ in self._monitors:
            mon.close(linger=0)
        self._monitors = []
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _stop_curve(self) -> None:
        """After the sockets are closed: the ZAP handler, then our own context."""
        if self._zap is not None:
            self._zap.stop()
            self._zap = None
        if self._own_ctx is not None:
            self._own_ctx.term()
            self._own_ctx = None

    @property
    def curve_denied(self) -> int:
        """Subscribers the ZAP handler refused (their keys are not allowed)."""
        return self._zap.denied if self._zap is not None else 0

    @property
    def queued_events(self) -> int:
        return self._queue.qsize()

    # --- sender thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            while True:  # markers nobody will resolve now
                try:
                    topic, item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if topic is _MARK and not item.done():
                    item.set_exception(Unavailable("the KV event publisher closed"))
            self._close_sockets()

    def _loop(self) -> None:
        enc = msgspec.msgpack.Encoder()
        seq = 0
        deadline: float | None = None
        while True:
            if self._stopping.is_set():
                if deadline is None:
                    deadline = time.monotonic() + self._close_timeout_s
                if self._queue.empty() or time.monotonic() > deadline:
                    break
            items = self._drain()
            if self._overflowed:
                self._overflowed = False
                clear_topics = tuple(make_topic(t, "").encode() for t in self.topic_ids)
                items.insert(0, (clear_topics, AllBlocksCleared()))
                for topic, item in items:
                    # events after a marker may be among the dropped ones
                    if topic is _MARK:
                        item.set_exception(Unavailable("KV events were dropped; retry"))
                items = [it for it in items if it[0] is not _MARK]
            try:
                seq = self._send(enc, seq, items)
                self._serve_replay()
                self._audit_handshakes()
            except zmq.ZMQError as e:
                if self._stopping.is_set():
                    break
                log.error("KV events sender: %s", e)
                time.sleep(0.1)  # a broken socket must not spin the thread

    def _drain(self) -> list[tuple[tuple[bytes, ...] | None, Any]]:
        items: list[tuple[tuple[bytes, ...] | None, Any]] = []
        try:
            items.append(self._queue.get(timeout=_IDLE_WAIT_S))
            while len(items) < self._max_batch_events:
                items.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        return items

    def _send(
        self,
        enc: msgspec.msgpack.Encoder,
        seq: int,
        items: list[tuple[tuple[bytes, ...] | None, Any]],
    ) -> int:
        i = 0
        while i < len(items):
            topics = items[i][0]
            if topics is _MARK:
                items[i][1].set_result(seq)
                i += 1
                continue
            j = i
            while j < len(items) and items[j][0] == topics:
                j += 1
            events = [ev for _, ev in items[i:j]]
            # the same batch under each topic id (one payload: same ts, same events)
            payload = enc.encode(
                KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank)
            )
            assert topics is not None
            for topic in topics:
                self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), copy=False)
                self._buffer.append((seq, topic, payload))
                self.published_batches += 1
                seq += 1
            self.published_events += j - i
            i = j
        return seq

    def _serve_replay(self) -> None:
        sock = self._replay
        if sock is None:
            return
        for _ in range(_MAX_REPLAY_REQUESTS_PER_TURN):
            if not sock.poll(0):
                return
            frames = sock.recv_multipart()
            # ROUTER prepends the peer identity; REQ/DEALER peers send ("", seq).
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("malformed KV events replay request (%d frames)", len(frames))
                if frames:
                    sock.send_multipart((frames[0], b"", b"", END_SEQ, b""))
                continue
            ident, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            self.replay_requests += 1
            for seq, topic, payload in list(self._buffer):
                if seq >= start:
                    sock.send_multipart((ident, b"", topic, seq.to_bytes(8, "big"), payload))
            sock.send_multipart((ident, b"", b"", END_SEQ, b""))

    def _audit_handshakes(self) -> None:
        """A connection without CURVE or with the wrong server key: audited (ZAP
        refusals of a key are audited by the ZAP handler itself)."""
        for mon, endpoint in self._monitors:
            while mon.poll(0):
                ev = zmq.utils.monitor.recv_monitor_message(mon)
                if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    continue
                # the monitor names our endpoint, not the peer's address; rate
                # limited per cause (no CURVE and a wrong server key are two problems)
                cause = handshake_failure(ev)
                audit.denied(
                    f"a peer of {endpoint}",
                    f"KV events of {self.node_id}: {cause}",
                    audit.EVENTS_HANDSHAKE_FAILED,
                    key=f"{endpoint}|{cause}",
                )

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
