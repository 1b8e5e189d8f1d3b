"""The disk tier: committed blocks in one preallocated file, recovered after a crash.

Layout of the tier's directory:

    blocks.dat    the data file, ``capacity_bytes`` long, preallocated; slots are
                  byte offsets handed out by the DRAM tier's ``SlabAllocator``
                  (slots rounded up to 4 KiB for O_DIRECT, one slot size per slab)
    journal.log   a header, then COMMIT(slot, key, nbytes, checksum) and FREE(slot)
                  records, each framed by its length and its own xxh3-64
    lock          flock()ed while a daemon owns the directory

Durability: ``write`` returns only after the block's bytes and its COMMIT record
are on stable storage (``fdatasync`` of the data file, then of the journal).
Concurrent writes are group-committed: one pair of syncs covers every record
queued while the previous pair ran. Recovery replays the journal up to its first
torn record; every block whose ``write`` returned is in it.

Integrity: each block's xxh3-64 is kept with its record and checked on every
read. A torn, truncated or flipped block raises ``DataCorruption`` after the
tier has dropped it; its bytes are never handed out. A slot freed and reused is
not rewritten until its FREE record is durable, so a crash can never pair an old
record with new bytes.

I/O runs on a bounded thread pool, never on the event loop, with ``O_DIRECT``
where the filesystem takes it (unaligned buffers go through a per-thread
aligned bounce buffer) and buffered I/O otherwise (tmpfs, some overlays).
``read_many`` reads neighbouring slots with one ``preadv`` (up to 8 MiB, split
so every I/O thread gets work) and verifies each block in the I/O thread.

Primitives:
    DiskTier(path, capacity_bytes, ...)    opens or creates, recovers (ConfigError on a bad path)
    recover() -> [DiskEntry]               blocks found at start
    allocate(nbytes) -> slot | None        None: full for this size
    await write(slot, data, key, checksum) durable on return
    await read(slot, into)                 verified on return
    await read_many([(slot, into)]) -> [error | None]   batched, each verified
    free(slot)
    await close()
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
import xxhash

from kvstore.errors import (
    BackendError,
    CapacityExhausted,
    ConfigError,
    DataCorruption,
    InvalidRequest,
    KVStoreError,
    StateConflict,
)
from kvstore.files import FilePolicy
from kvstore.tiers.dram import SlabAllocator

log = logging.getLogger(__name__)

DATA_FILE = "blocks.dat"
JOURNAL_FILE = "journal.log"
LOCK_FILE = "lock"
_FILES = FilePolicy()  # disk files are the daemon's alone (0600), whatever the group

ALIGN_BYTES = 4096  # O_DIRECT alignment that every Linux block device accepts

_MAGIC = b"KVSDISK1"
_HEADER = struct.Struct("<8sQQQ")  # magic, capacity_bytes, slab_bytes, xxh3 of the rest
_FRAME = struct.Struct("<IQ")  # body length, xxh3-64 of body
_BODY = struct.Struct("<BQQQQH")  # kind, slot, nbytes, checksum, block_hash, len(namespace)
_COMMIT, _FREE = 1, 2
_MAX_BODY = _BODY.size + 0xFFFF
# Largest read of neighbouring slots in one preadv: big enough that a run of
# small blocks costs one syscall and one thread hop, small enough that a load
# of a few blocks still spreads over every I/O thread.
MAX_RUN_BYTES = 8 * 1024 * 1024
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def align_up(n: int, align: int = ALIGN_BYTES) -> int:
    return -(-n // align) * align


Key = tuple[str, int]
# Anything with the buffer protocol: bytes, memoryview, mmap, a contiguous numpy array.
Buffer = Any


def _skip(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """The buffers left after the first ``nbytes`` were filled (a short preadv)."""
    if nbytes == 0:
        return views
    out = []
    for v in views:
        if nbytes >= len(v):
            nbytes -= len(v)
            continue
        out.append(v[nbytes:] if nbytes else v)
        nbytes = 0
    return out


class DiskEntry(NamedTuple):
    namespace_id: str
    block_hash: int
    slot: int
    nbytes: int
    checksum: int


def checksum_of(data: Buffer) -> int:
    """xxh3-64 of a block's bytes (the checksum every tier and peer uses)."""
    return xxhash.xxh3_64_intdigest(data)


def _header_bytes(capacity_bytes: int, slab_bytes: int) -> bytes:
    head = struct.pack("<8sQQ", _MAGIC, capacity_bytes, slab_bytes)
    return _HEADER.pack(_MAGIC, capacity_bytes, slab_bytes, xxhash.xxh3_64_intdigest(head))


def _record(kind: int, slot: int, nbytes: int = 0, checksum: int = 0, key: Key = ("", 0)) -> bytes:
    ns = key[0].encode()
    body = _BODY.pack(kind, slot, nbytes, checksum, key[1], len(ns)) + ns
    return _FRAME.pack(len(body), xxhash.xxh3_64_intdigest(body)) + body


def _address(buf: memoryview) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if len(buf) else 0


class DiskTier:
    """Blocks on local disk with slot addressing, checksums and a journal."""

    def __init__(
        self,
        path: str,
        capacity_bytes: int,
        *,
        slab_bytes: int = 64 * 1024 * 1024,
        io_threads: int = 4,
        direct_io: bool = True,
        journal_compact_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        if capacity_bytes < slab_bytes:
            raise ConfigError(
                f"disk tier at {path}: capacity_bytes ({capacity_bytes}) must be at least "
                f"slab_bytes ({slab_bytes})"
            )
        if slab_bytes <= 0 or slab_bytes % ALIGN_BYTES:
            raise ConfigError(f"disk tier at {path}: slab_bytes must be a multiple of 4096")
        self.path = path
        self.slab_bytes = slab_bytes
        self.capacity_bytes = capacity_bytes // slab_bytes * slab_bytes
        self._alloc = SlabAllocator(self.capacity_bytes, slab_bytes)
        self._entries: dict[int, DiskEntry] = {}  # committed, by slot
        self._writing: set[int] = set()  # allocated slots whose write has not returned
        # Writes whose COMMIT record is queued or durable but whose writer has not
        # resumed yet: a compaction must keep their records (they are acknowledged
        # the moment the writer resumes, with no further journal append).
        self._committing: dict[int, tuple[DiskEntry, asyncio.Future[None]]] = {}
        self._journal_compact_bytes = journal_compact_bytes
        self._io = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="kvstore-disk-io")
        # fsyncs get their own thread so they never queue behind block reads.
        self._sync = ThreadPoolExecutor(1, thread_name_prefix="kvstore-disk-sync")
        self._io_slots: asyncio.Semaphore | None = None
        self._io_threads = max(1, io_threads)
        self._local = threading.local()
        # Group commit: (record, future, freed slot or -1), appended on the loop thread.
        self._pending: list[tuple[bytes, asyncio.Future[None], int]] = []
        self._wake: asyncio.Event | None = None
        self._committer: asyncio.Task[None] | None = None
        self._unsynced_free: dict[int, asyncio.Future[None]] = {}
        self._closed = False
        self._lock_fd = -1
        self._data_fd = -1
        self._journal_fd = -1
        self._journal_bytes = 0
        self.direct_io = False
        # Called in the I/O thread before each block write ("write") or read run
        # ("read"): tests force the timing of in-flight disk I/O with it.
        self.io_hook: Callable[[str], None] | None = None
        self._open(direct_io)

    # ---------------------------------------------------------------- opening

    def _open(self, want_direct: bool) -> None:
        path = self.path
        if not os.path.exists(path):
            raise ConfigError(f"disk tier path {path} does not exist")
        if not os.path.isdir(path):
            raise ConfigError(f"disk tier path {path} is not a directory")
        try:
            self._lock_fd = _FILES.open(
                os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600, what="disk tier"
            )
        except OSError as exc:
            raise ConfigError(f"disk tier path {path} is not writable: {exc.strerror}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise ConfigError(f"disk tier path {path} is in use by another process") from None
        try:
            self._open_files(want_direct)
            self._replay()
        except BaseException:
            self._close_fds()
            raise

    def _open_files(self, want_direct: bool) -> None:
        data_path = os.path.join(self.path, DATA_FILE)
        journal_path = os.path.join(self.path, JOURNAL_FILE)
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        # Private (tenants' KV bytes and hashes), never through a symlink, ours only.
        try:
            self._data_fd = _FILES.open(data_path, flags, 0o600, what="disk tier")
            self._journal_fd = _FILES.open(journal_path, flags, 0o600, what="disk tier")
        except OSError as exc:
            raise ConfigError(
                f"disk tier path {self.path} is not writable: {exc.strerror}"
            ) from None
        if want_direct and hasattr(os, "O_DIRECT"):
            self.direct_io = self._try_direct(data_path, flags)

    def _try_direct(self, data_path: str, flags: int) -> bool:
        """Reopen the data file with O_DIRECT if this filesystem takes it."""
        try:
            fd = os.open(data_path, flags | os.O_DIRECT)
        except OSError:
            return False  # tmpfs and others refuse O_DIRECT at open
        probe = mmap.mmap(-1, ALIGN_BYTES)
        try:
            if os.fstat(fd).st_size >= ALIGN_BYTES:
                os.preadv(fd, [probe], 0)
        except OSError:
            os.close(fd)
            return False
        finally:
            probe.close()
        os.close(self._data_fd)
        self._data_fd = fd
        return True

    def _preallocate(self) -> None:
        size = os.fstat(self._data_fd).st_size
        if size >= self.capacity_bytes:
            return
        try:
            os.posix_fallocate(self._data_fd, size, self.capacity_bytes - size)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._data_fd, size)  # give back what a failed fallocate took
            if exc.errno == errno.ENOSPC:
                raise ConfigError(
                    f"disk tier path {self.path}: no space for {self.capacity_bytes} bytes"
                ) from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise ConfigError(f"disk tier path {self.path}: {exc.strerror}") from None
            os.ftruncate(self._data_fd, self.capacity_bytes)  # sparse: ENOSPC comes at write

    def _replay(self) -> None:
        with open(os.path.join(self.path, JOURNAL_FILE), "rb") as f:
            blob = f.read()
        header = _header_bytes(self.capacity_bytes, self.slab_bytes)
        live: dict[int, DiskEntry] = {}
        if blob[: _HEADER.size] == header:
            pos = _HEADER.size
            while pos + _FRAME.size <= len(blob):
                length, digest = _FRAME.unpack_from(blob, pos)
                body = blob[pos + _FRAME.size : pos + _FRAME.size + length]
                if not _BODY.size <= length <= _MAX_BODY or len(body) != length:
                    break  # torn tail: the crash came mid-append
                if xxhash.xxh3_64_intdigest(body) != digest:
                    break
                kind, slot, nbytes, checksum, block_hash, ns_len = _BODY.unpack_from(body)
                if kind == _COMMIT and _BODY.size + ns_len == length:
                    ns = body[_BODY.size :].decode(errors="replace")
                    live.pop(slot, None)  # keep replay order: latest record last
                    live[slot] = DiskEntry(ns, block_hash, slot, nbytes, checksum)
                elif kind == _FREE:
                    live.pop(slot, None)
                else:
                    break
                pos += _FRAME.size + length
            if pos < len(blob):
                log.warning(
                    "disk tier %s: journal torn at byte %d, %d bytes ignored",
                    self.path,
                    pos,
                    len(blob) - pos,
                )
        elif blob:
            log.warning(
                "disk tier %s: journal of another layout (capacity or slab size "
                "changed); starting empty",
                self.path,
            )
        data_size = os.fstat(self._data_fd).st_size
        by_key: dict[Key, DiskEntry] = {}
        for entry in live.values():
            if entry.slot + entry.nbytes > data_size:
                log.warning(
                    "disk tier %s: block at %d lies past the end of %s (truncated); dropped",
                    self.path,
                    entry.slot,
                    DATA_FILE,
                )
                continue
            by_key[(entry.namespace_id, entry.block_hash)] = entry  # a later copy wins
        kept = list(by_key.values())
        rejected = set(self._alloc.rebuild((e.slot, align_up(e.nbytes)) for e in kept))
        self._entries = {e.slot: e for e in kept if (e.slot, align_up(e.nbytes)) not in rejected}
        if rejected:
            log.warning(
                "disk tier %s: %d journal records name impossible slots; dropped",
                self.path,
                len(rejected),
            )
        self._preallocate()
        # Start from a compact journal: no torn tail for appends to follow.
        self._rewrite_journal(list(self._entries.values()))

    def recover(self) -> list[DiskEntry]:
        """The blocks this tier held when it was opened (and still holds)."""
        return list(self._entries.values())

    # ------------------------------------------------------------- allocation

    @property
    def max_block_bytes(self) -> int:
        return self.slab_bytes

    @property
    def used_bytes(self) -> int:
        return self._alloc.used_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, slot: int) -> DiskEntry | None:
        return self._entries.get(slot)

    def _slot_size(self, nbytes: int) -> int:
        if nbytes <= 0 or nbytes > self.slab_bytes:
            raise InvalidRequest(
                f"block of {nbytes} bytes: must be 1..{self.slab_bytes} (the slab size)"
            )
        return align_up(nbytes)

    def can_allocate(self, nbytes: int) -> bool:
        return self._alloc.can_alloc_without_eviction(self._slot_size(nbytes))

    def allocate(self, nbytes: int) -> int | None:
        """Reserve a slot for a block of ``nbytes``; None when the tier is full for that size."""
        self._check_open()
        slot = self._alloc.alloc(self._slot_size(nbytes))
        if slot is not None:
            self._writing.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back: a committed block is forgotten (durably, group-committed)."""
        self._check_open()
        if slot in self._writing:
            raise StateConflict(f"disk slot {slot} is being written")
        entry = self._entries.pop(slot, None)
        if entry is None:
            raise StateConflict(f"disk slot {slot} holds no block")
        self._alloc.free(slot)
        fut = self._queue(_record(_FREE, slot), slot)
        self._unsynced_free[slot] = fut

    def _release_unwritten(self, slot: int) -> None:
        self._writing.discard(slot)
        self._alloc.free(slot)

    def abandon(self, slot: int) -> None:
        """Give back a slot that was allocated but never written."""
        if slot not in self._writing:
            raise StateConflict(f"disk slot {slot} is not an unwritten allocation")
        self._release_unwritten(slot)

    # ------------------------------------------------------------------ I/O

    async def write(self, slot: int, data: Buffer, key: Key, checksum: int | None = None) -> int:
        """Store ``data`` in an allocated slot; durable when this returns. Returns the checksum.

        ``checksum`` (of the bytes the caller meant to store) is verified against
        what is written: a source that changed underneath raises DataCorruption.
        On any error the slot is given back.
        """
        self._check_open()
        if slot not in self._writing:
            raise StateConflict(f"disk slot {slot} was not allocated for writing")
        buf = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
        commit: asyncio.Future[None] | None = None
        try:
            if len(buf) > self._slot_bytes(slot):
                raise InvalidRequest(f"{len(buf)} bytes do not fit disk slot {slot}")
            prior = self._unsynced_free.get(slot)
            if prior is not None and prior.done() and prior.exception() is not None:
                # Its FREE record never became durable (the journal's filesystem
                # was full): append it again; the write fails if that fails too.
                prior = self._unsynced_free[slot] = self._queue(_record(_FREE, slot), slot)
            if prior is not None:
                # The slot's FREE record must be durable before new bytes land in
                # it, or a crash could pair the old COMMIT with the new bytes.
                await asyncio.shield(prior)
            async with self._io_sem():
                digest = await self._run(self._io, self._pwrite_block, slot, buf, checksum)
            entry = DiskEntry(key[0], key[1], slot, len(buf), digest)
            commit = self._queue(_record(_COMMIT, slot, len(buf), digest, key), -1)
            self._committing[slot] = (entry, commit)
            await asyncio.shield(commit)
        except BaseException:
            self._committing.pop(slot, None)
            self._release_unwritten(slot)
            if commit is not None and not (commit.done() and commit.exception() is not None):
                # Cancelled while the COMMIT may still become durable: revoke it
                # before the slot can be reused.
                self._unsynced_free[slot] = self._queue(_record(_FREE, slot), slot)
            raise
        self._writing.discard(slot)
        self._entries[slot] = entry
        del self._committing[slot]
        return digest

    async def read(self, slot: int, into: Buffer) -> None:
        """Fill ``into`` with the block at ``slot``, verified against its checksum.

        A block that fails verification (or was truncated away) is dropped from
        the tier before DataCorruption is raised: the caller must not free it.
        """
        (error,) = await self.read_many([(slot, into)])
        if error is not None:
            raise error

    async def read_many(self, reads: Sequence[tuple[int, Buffer]]) -> list[KVStoreError | None]:
        """Fill each buffer with the block at its slot; one result per read, None = verified.

        Runs of neighbouring slots are read with one ``preadv`` each, the runs
        spread over the I/O threads; every block is checked against its checksum
        in the I/O thread that read it. A block that fails (DataCorruption) is
        dropped from the tier: the caller must not free it. An I/O error fails
        the blocks of its run (BackendError); the others are unaffected.
        Returns only when no thread writes into any buffer any more.
        """
        self._check_open()
        results: list[KVStoreError | None] = [None] * len(reads)
        items: list[tuple[int, DiskEntry, memoryview]] = []
        for i, (slot, into) in enumerate(reads):
            entry = self._entries.get(slot)
            if entry is None:
                results[i] = StateConflict(f"disk slot {slot} holds no block")
                continue
            out = memoryview(into).cast("B")
            if len(out) != entry.nbytes:
                results[i] = InvalidRequest(
                    f"read of {entry.nbytes} bytes into a {len(out)}-byte buffer"
                )
                continue
            items.append((i, entry, out))
        if not items:
            return results
        runs = self._runs(items)
        loop = asyncio.get_running_loop()

        async def read_run(run: list[tuple[int, DiskEntry, memoryview]]) -> list[bool]:
            async with self._io_sem():
                job = loop.run_in_executor(
                    self._io, self._pread_run, [e for _, e, _ in run], [o for _, _, o in run]
                )
                try:
                    return await asyncio.shield(job)
                except asyncio.CancelledError:
                    # The thread may still be filling the buffers: they must not
                    # be handed back (and reused) before it is done.
                    while not job.done():
                        with contextlib.suppress(asyncio.CancelledError):
                            await asyncio.wait([job])
                    raise

        outcomes = await asyncio.gather(*(read_run(run) for run in runs), return_exceptions=True)
        for run, outcome in zip(runs, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, KVStoreError):
                    raise outcome  # cancelled, or a bug: not a per-block result
                for i, _, _ in run:
                    results[i] = outcome
                continue
            for (i, entry, _), ok in zip(run, outcome, strict=True):
                if ok:
                    continue
                if self._entries.get(entry.slot) is entry:
                    self.free(entry.slot)
                results[i] = DataCorruption(
                    f"disk block {entry.block_hash:#x} of {entry.namespace_id} at slot "
                    f"{entry.slot} failed its checksum; dropped"
                )
        return results

    def _runs(
        self, items: list[tuple[int, DiskEntry, memoryview]]
    ) -> list[list[tuple[int, DiskEntry, memoryview]]]:
        """Group reads by neighbouring slots into runs that one preadv can fill."""
        total = sum(e.nbytes for _, e, _ in items)
        # At least one run per I/O thread when there is that much to read.
        limit = min(MAX_RUN_BYTES, max(ALIGN_BYTES, total // self._io_threads))
        runs: list[list[tuple[int, DiskEntry, memoryview]]] = []
        run_end = -1
        run_bytes = 0
        for item in sorted(items, key=lambda it: it[1].slot):
            _, entry, out = item
            joinable = (not self.direct_io) or (
                entry.nbytes % ALIGN_BYTES == 0 and _address(out) % ALIGN_BYTES == 0
            )
            if (
                joinable
                and runs
                and entry.slot == run_end
                and run_bytes + entry.nbytes <= limit
                and len(runs[-1]) < _IOV_MAX
            ):
                runs[-1].append(item)
                run_bytes += entry.nbytes
            else:
                runs.append([item])
                run_bytes = entry.nbytes
            # An unjoinable read (bounce buffer) stands alone.
            run_end = entry.slot + entry.nbytes if joinable else -1
        return runs

    def _pwrite_block(self, slot: int, buf: memoryview, expected: int | None) -> int:
        if self.io_hook is not None:
            self.io_hook("write")
        digest = checksum_of(buf)
        if expected is not None and digest != expected:
            raise DataCorruption(f"source of disk slot {slot} changed before it was written")
        nbytes = len(buf)
        span = align_up(nbytes, ALIGN_BYTES)
        if not self.direct_io or (_address(buf) % ALIGN_BYTES == 0 and nbytes == span):
            src = buf
        else:
            bounce = self._bounce(span)
            bounce[:nbytes] = buf
            bounce[nbytes:span] = b"\0" * (span - nbytes)
            src = bounce[:span]
        try:
            done = 0
            while done < len(src):
                done += os.pwrite(self._data_fd, src[done:], slot + done)
        except OSError as exc:
            raise self._os_error(exc, "write") from None
        return digest

    def _pread_block(self, entry: DiskEntry, out: memoryview) -> bool:
        nbytes = entry.nbytes
        span = align_up(nbytes, ALIGN_BYTES)
        direct_ok = _address(out) % ALIGN_BYTES == 0 and nbytes == span
        dst = out if not self.direct_io or direct_ok else self._bounce(span)[:span]
        try:
            done = 0
            while done < len(dst):
                n = os.preadv(self._data_fd, [dst[done:]], entry.slot + done)
                if n == 0:
                    return False  # the file was truncated under us
                done += n
        except OSError as exc:
            raise self._os_error(exc, "read") from None
        if checksum_of(dst[:nbytes]) != entry.checksum:
            return False
        if dst is not out:
            out[:] = dst[:nbytes]
        return True

    def _pread_run(self, entries: list[DiskEntry], outs: list[memoryview]) -> list[bool]:
        """Read neighbouring blocks with preadv and verify each: ok per block."""
        if self.io_hook is not None:
            self.io_hook("read")
        if len(entries) == 1:
            return [self._pread_block(entries[0], outs[0])]
        total = sum(len(o) for o in outs)
        start = entries[0].slot
        done = 0
        try:
            while done < total:
                n = os.preadv(self._data_fd, _skip(outs, done), start + done)
                if n == 0:
                    break  # the file was truncated under us: the rest fails below
                done += n
        except OSError as exc:
            raise self._os_error(exc, "read") from None
        oks = []
        end = 0
        for entry, out in zip(entries, outs, strict=True):
            end += len(out)
            oks.append(end <= done and checksum_of(out) == entry.checksum)
        return oks

    def _bounce(self, nbytes: int) -> memoryview:
        buf: mmap.mmap | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            if buf is not None:
                buf.close()
            buf = mmap.mmap(-1, nbytes)  # anonymous maps are page aligned
            self._local.buf = buf
        return memoryview(buf)

    def _os_error(self, exc: OSError, what: str) -> Exception:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return CapacityExhausted(f"disk tier {self.path}: {what} failed: no space left")
        return BackendError(f"disk tier {self.path}: {what} failed: {exc.strerror}")

    def _slot_bytes(self, slot: int) -> int:
        return self._alloc.slot_bytes_at(slot)

    # ---------------------------------------------------------- group commit

    def _queue(self, record: bytes, freed_slot: int) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._pending.append((record, fut, freed_slot))
        if self._wake is None:
            self._wake = asyncio.Event()
        self._wake.set()
        if self._committer is None or self._committer.done():
            self._committer = loop.create_task(self._commit_loop(), name="kvstore-disk-commit")
        return fut

    async def _commit_loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                batch, self._pending = self._pending, []
                syncs_data = any(rec[_FRAME.size] == _COMMIT for rec, _, _ in batch)
                try:
                    await self._run(self._sync, self._append, [r for r, _, _ in batch], syncs_data)
                except Exception as exc:
                    error = (
                        exc
                        if isinstance(exc, CapacityExhausted | BackendError)
                        else (BackendError(f"disk tier {self.path}: journal append failed: {exc}"))
                    )
                    for _, fut, _ in batch:
                        if not fut.done():
                            fut.set_exception(error)
                            fut.exception()  # a FREE's future may have no waiter
                    continue
                for _, fut, slot in batch:
                    if not fut.done():
                        fut.set_result(None)
                    if slot >= 0 and self._unsynced_free.get(slot) is fut:
                        del self._unsynced_free[slot]
                if not self._pending and self._journal_bytes > self._compact_threshold():
                    live = self._live_entries()
                    with contextlib.suppress(Exception):
                        await self._run(self._sync, self._rewrite_journal, live)
            if self._closed:
                return

    def _live_entries(self) -> list[DiskEntry]:
        """What a compacted journal must hold: every committed block, including the
        writes whose COMMIT is durable but whose writer has not resumed (with nothing
        pending, every queued COMMIT has been appended; a failed one is dropped)."""
        live = dict(self._entries)
        for slot, (entry, commit) in self._committing.items():
            if commit.done() and not commit.cancelled() and commit.exception() is None:
                live[slot] = entry
        return list(live.values())

    def _append(self, records: list[bytes], sync_data: bool) -> None:
        blob = b"".join(records)
        try:
            if sync_data:
                os.fdatasync(self._data_fd)
            done = 0
            while done < len(blob):
                done += os.pwrite(self._journal_fd, blob[done:], self._journal_bytes + done)
            os.fdatasync(self._journal_fd)
        except OSError as exc:
            # Cut a partial append off so a later append cannot resurrect it.
            with contextlib.suppress(OSError):
                os.ftruncate(self._journal_fd, self._journal_bytes)
            raise self._os_error(exc, "journal append") from None
        self._journal_bytes += len(blob)

    def _compact_threshold(self) -> int:
        live_bytes = len(self._entries) * (_FRAME.size + _BODY.size + 32)
        return max(self._journal_compact_bytes, 4 * live_bytes)

    def _rewrite_journal(self, live: Iterable[DiskEntry]) -> None:
        """Write a journal holding exactly ``live`` and swap it in atomically."""
        blob = _header_bytes(self.capacity_bytes, self.slab_bytes) + b"".join(
            _record(_COMMIT, e.slot, e.nbytes, e.checksum, (e.namespace_id, e.block_hash))
            for e in live
        )
        final = os.path.join(self.path, JOURNAL_FILE)
        tmp = final + ".tmp"
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # a crash's leftover; never written through (O_EXCL)
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
            try:
                done = 0
                while done < len(blob):
                    done += os.write(fd, blob[done:])
                os.fdatasync(fd)
            except BaseException:
                os.close(fd)
                raise
            # The data the records name must be durable before the records are.
            os.fdatasync(self._data_fd)
            os.replace(tmp, final)
            dir_fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CapacityExhausted(
                    f"disk tier {self.path}: no space for its journal"
                ) from None
            raise ConfigError(f"disk tier path {self.path}: journal: {exc.strerror}") from None
        old = self._journal_fd
        self._journal_fd = fd
        self._journal_bytes = len(blob)
        os.close(old)

    # ------------------------------------------------------------- plumbing

    def _io_sem(self) -> asyncio.Semaphore:
        # Bounds the executor's queue: at most 2 operations waiting per thread.
        if self._io_slots is None:
            self._io_slots = asyncio.Semaphore(2 * self._io_threads)
        return self._io_slots

    @staticmethod
    async def _run(pool: ThreadPoolExecutor, fn, *args):  # type: ignore[no-untyped-def]
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def _check_open(self) -> None:
        if self._closed:
            raise StateConflict(f"disk tier {self.path} is closed")

    async def flush(self) -> None:
        """Wait until every queued journal record is durable."""
        if self._pending:
            await asyncio.gather(*(fut for _, fut, _ in self._pending), return_exceptions=True)

    async def close(self) -> None:
        if self._closed:
            return
        await self.flush()
        self._closed = True
        if self._wake is not None:
            self._wake.set()
        if self._committer is not None:
            with contextlib.suppress(Exception):
                await self._committer
        self._io.shutdown(wait=True)
        self._sync.shutdown(wait=True)
        self._close_fds()

    def close_sync(self) -> None:
        """Close without a loop (tests, error paths); pending records are abandoned."""
        self._closed = True
        self._io.shutdown(wait=True)
        self._sync.shutdown(wait=True)
        self._close_fds()

    def _close_fds(self) -> None:
        for name in ("_data_fd", "_journal_fd", "_lock_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, -1)
