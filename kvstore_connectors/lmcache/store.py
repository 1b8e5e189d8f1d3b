"""The LMCache connectors' link to the daemon: chunks in, chunks out, misses on failure.

    store = ChunkStore(address, meta_bytes=m)
    store.put([Chunk(spec, block_hash, meta, payload), ...])     -> PutReport(stored, ok)
    store.prefix([(spec, block_hash), ...])                        -> leading chunks present
    store.get([(spec, block_hash), ...], make, drop)               -> made objects, a prefix

Bytes go through the daemon's shared region when this process can map it (a
local daemon: PrepareStore, write the slots, CommitStore; PrepareLoad, read,
Release), else inline over gRPC (a remote daemon). Every call goes through
``kvstore_connectors.vllm.session.DaemonSession``: the daemon gone, slow or refusing
means a miss (or nothing stored) and one warning per outage, never an
exception, and the link comes back by itself.

LMCache calls in from its event-loop thread, its executor threads and the
engine's thread at once; the session is not thread-safe, so one lock
serialises the calls (each is one or two RPCs plus a copy).

Keys of one call normally share one namespace; runs of equal namespaces are
sent as one RPC each, and prefix calls stop at the first run not wholly present.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from kvstore import errors
from kvstore.client import Client, Namespace
from kvstore.namespace import NamespaceSpec
from kvstore_connectors.lmcache.blocks import read_block, write_block
from kvstore_connectors.vllm.session import DaemonSession

log = logging.getLogger(__name__)
T = TypeVar("T")
ChunkKey = tuple[NamespaceSpec, int]
MAX_NAMESPACES = 4096  # declared namespaces remembered per connection


@dataclass(frozen=True, slots=True)
class Chunk:
    spec: NamespaceSpec
    block_hash: int
    meta: bytes  # LMCache's RemoteMetadata of the chunk
    payload: np.ndarray  # uint8, the MemoryObj's bytes (a view, not a copy)


@dataclass(frozen=True, slots=True)
class PutReport:
    stored: int  # chunks new in the daemon (already-present ones are not counted)
    ok: bool  # False: some chunks were not stored (daemon down, full, refused)


def _delete(client: Client, ns: Namespace, hashes: list[int]) -> tuple[int, int]:
    # This client's own loads release their pins in the background: a block
    # still pinned by them is "busy" and would not go.
    client.flush_releases()
    return client.delete(ns, hashes)


def _runs(items: Sequence[T], spec_of: Callable[[T], NamespaceSpec]) -> list[list[T]]:
    return [list(g) for _, g in itertools.groupby(items, key=spec_of)]


@dataclass(slots=True)
class _Made(Generic[T]):
    """Objects made in one attempt: dropped again if the attempt fails."""

    items: list[T]
    drop: Callable[[T], None]

    def drop_all(self) -> None:
        self.keep(0)

    def keep(self, n: int) -> None:
        """Drop all but the first ``n``."""
        items, self.items = self.items[n:], self.items[:n]
        for item in items:
            self.drop(item)


class ChunkStore:
    def __init__(
        self,
        address: str,
        *,
        meta_bytes: int,
        timeout_s: float = 5.0,
        retry_initial_s: float = 1.0,
        retry_max_s: float = 30.0,
        map_region: bool = True,
    ) -> None:
        self.address = address
        self.meta_bytes = meta_bytes
        self._session = DaemonSession(
            address,
            timeout_s=timeout_s,
            retry_initial_s=retry_initial_s,
            retry_max_s=retry_max_s,
            map_region=map_region,
        )
        self._lock = threading.Lock()
        self._refusals_seen: set[tuple[str, str]] = set()
        self._declared: dict[NamespaceSpec, Namespace] = {}
        self._declared_for = -1  # the session generation _declared belongs to

    @property
    def failures(self) -> int:
        return self._session.failures

    def close(self) -> None:
        with self._lock:
            self._session.close()

    # ------------------------------------------------------------ calls

    def _call(
        self, what: str, spec: NamespaceSpec, fn: Callable[[Client, Namespace], T]
    ) -> T | None:
        """``fn(client, namespace)`` through the session (so None on any failure),
        plus a warning the first time the daemon refuses a kind of call for a
        reason: the session logs refusals at debug level only, and one such as
        "TCP needs the cluster secret" must not be silent."""

        def watched(client: Client) -> T:
            try:
                return fn(client, self._namespace(client, spec))
            except (
                errors.PermissionDenied,
                errors.InvalidRequest,
                errors.CapacityExhausted,
            ) as exc:
                reason = (what, type(exc).__name__)
                if reason not in self._refusals_seen and len(self._refusals_seen) < 64:
                    self._refusals_seen.add(reason)
                    log.warning("kvstore: the daemon refused an LMCache %s: %s", what, exc)
                raise

        return self._session.call(what, watched)

    def _namespace(self, client: Client, spec: NamespaceSpec) -> Namespace:
        """``spec`` declared on the daemon ``client`` talks to (once per connection)."""
        if self._declared_for != self._session.generation or len(self._declared) > MAX_NAMESPACES:
            self._declared.clear()
            self._declared_for = self._session.generation
        ns = self._declared.get(spec)
        if ns is None:
            ns = self._declared[spec] = client.declare_namespace(spec)
        return ns

    def prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` the daemon holds (0 while it is down)."""
        found = 0
        for run in _runs(keys, lambda k: k[0]):
            hashes = [h for _, h in run]
            with self._lock:
                n = self._call(
                    "lookup", run[0][0], lambda c, ns, h=hashes: c.lookup(ns, h).prefix_blocks
                )
            found += n or 0
            if n != len(run):
                break
        return found

    def put(self, chunks: Sequence[Chunk]) -> PutReport:
        """Store ``chunks`` (already-present ones are skipped, not rewritten)."""
        stored, ok = 0, True
        for run in _runs(chunks, lambda c: c.spec):
            with self._lock:
                n = self._call("store", run[0].spec, lambda c, ns, r=run: self._put(c, ns, r))
            stored += n or 0
            ok = ok and n is not None
        return PutReport(stored, ok)

    def get(
        self,
        keys: Sequence[ChunkKey],
        make: Callable[[bytes, np.ndarray], T | None],
        drop: Callable[[T], None],
    ) -> list[T]:
        """``make(meta, payload)`` for the longest present prefix of ``keys``.

        ``make`` copies the payload out (it is a view of a slot that is reused
        once the call returns) or returns None to stop there; the objects of an
        attempt that fails part-way are given to ``drop``.
        """
        out: list[T] = []
        for run in _runs(keys, lambda k: k[0]):
            hashes = [h for _, h in run]
            with self._lock:
                got = self._call(
                    "load", run[0][0], lambda c, ns, h=hashes: self._get(c, ns, h, make, drop)
                )
            got = got or []
            out.extend(got)
            if len(got) != len(run):
                break
        return out

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        deleted = 0
        for run in _runs(keys, lambda k: k[0]):
            hashes = [h for _, h in run]
            with self._lock:
                n = self._call("delete", run[0][0], lambda c, ns, h=hashes: _delete(c, ns, h))
            deleted += n[0] if n else 0
        return deleted

    # ------------------------------------------------------------ data path

    def _put(self, client: Client, ns: Namespace, run: list[Chunk]) -> int:
        hashes = [c.block_hash for c in run]
        if not client.mapped:
            rows = np.zeros((len(run), ns.block_bytes), dtype=np.uint8)
            for row, c in zip(rows, run, strict=True):
                write_block(row, c.meta, c.payload)
            return client.put(ns, hashes, rows).stored
        handle = client.prepare_store(ns, hashes)
        idx = handle.allocated
        if not len(idx):
            return 0
        try:
            for i in idx:
                if client.expired(handle):
                    raise errors.LeaseExpired("the store lease ran out while copying chunks")
                c = run[int(i)]
                write_block(client.view(int(handle.offsets[i]), ns.block_bytes), c.meta, c.payload)
        except BaseException:
            client.release(handle, wait=False)  # the slots go back, nothing is committed
            raise
        if not self._session.region_is_current():
            # The daemon restarted under us: the bytes went into a file it no
            # longer serves. Commit nothing.
            client.release(handle, wait=False)
            return 0
        client.commit_store(handle)
        return len(idx)

    def _get(
        self,
        client: Client,
        ns: Namespace,
        hashes: list[int],
        make: Callable[[bytes, np.ndarray], T | None],
        drop: Callable[[T], None],
    ) -> list[T]:
        made = _Made[T]([], drop)
        try:
            if not client.mapped:
                result = client.get(ns, hashes)
                self._make_all(result.data, made, make)
                return made.items
            # A direct load where the daemon's presence table shows the chunks in
            # DRAM (no call, no lease), else pinned: either way only the chunks
            # ``intact`` vouches for after the copy are kept.
            handle = client.prepare_load(ns, hashes, pin=False)
            try:
                rows = (
                    client.view(int(off), ns.block_bytes) for off in handle.offsets[: handle.found]
                )
                self._make_all(rows, made, make)
                if not self._session.region_is_current():
                    made.drop_all()
                else:
                    # Slots read after the lease ran out (or, read directly, left by
                    # their chunk meanwhile) may hold other bytes.
                    made.keep(client.intact(handle))
            finally:
                client.release(handle, wait=False)
            return made.items
        except BaseException:
            made.drop_all()
            raise

    def _make_all(
        self,
        rows: Iterable[np.ndarray],
        made: _Made[T],
        make: Callable[[bytes, np.ndarray], T | None],
    ) -> None:
        for row in rows:
            try:
                meta, payload = read_block(row, self.meta_bytes)
            except errors.DataCorruption as exc:
                log.warning("kvstore: dropped an unreadable LMCache chunk: %s", exc)
                return
            obj = make(meta, payload)
            if obj is None:
                return
            made.items.append(obj)
