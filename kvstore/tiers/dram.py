"""The DRAM tier: one shared-memory region carved into block slots.

The region is a file in /dev/shm (or hugetlbfs when it has room) mapped
MAP_SHARED by the daemon and by every local client, so block bytes move by
memcpy in the client, never through gRPC. It is sized once to the configured
capacity (a hard cap: nothing else is ever allocated for blocks) and
pre-faulted at start, since first touch of new memory runs at ~1 GB/s here,
then moved into 2 MiB pages in the background where the filesystem gave 4 KiB
ones (``Region.collapse_huge_pages``; docs/tiers.md, "Huge pages").

Slots come from a slab allocator: the region is cut into equal chunks; a chunk
serves one slot size (a namespace's block size rounded up to 64 bytes, so every
slot is cache-line aligned); a chunk whose slots are all free goes back to the
shared pool, so namespaces with different block sizes share the region.

A region may be cut into *ranges* (``partitions``): the shared range at
offset 0 in the file at ``path``, then one range per named partition, each
its own 0600 file ``<path>.tenant-<name>`` (a tenant's own memory, which a
client of that tenant alone is meant to map: docs/tenants.md). The daemon maps
the files at adjacent addresses, so it still sees one contiguous array and one
offset space: movers, NIXL registration and warm-restart views are unchanged.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvstore.errors import ConfigError
from kvstore.files import FilePolicy
from kvstore.memcopy import libc_mmap

log = logging.getLogger(__name__)

SLOT_ALIGN_BYTES = 64
PAGE_BYTES = 4096
HUGE_PAGE_BYTES = 2 * 1024 * 1024
HUGETLBFS_DIR = Path("/dev/hugepages")
MAX_OPEN_ATTEMPTS = 8
# Linux mmap flags the mmap module does not export (same value on x86_64 and aarch64).
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
# A partition's name becomes part of a file name.
PARTITION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
PARTITION_SUFFIX = ".tenant-"
# DRAM eviction orders are by slot size, and by range with tenant regions: the
# key of range p's order of a size is size + p * PART_KEY_STRIDE (sizes < 2**40).
PART_KEY_STRIDE = 1 << 40


def slot_bytes_for(block_bytes: int) -> int:
    """Slot stride for a block size: rounded up to a cache line."""
    return -(-block_bytes // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES


MEMORY_FILESYSTEMS = ("tmpfs", "hugetlbfs", "ramfs")


def _mount_of(path: str) -> tuple[str, str]:
    """(type, options) of the filesystem holding path: the longest mount point
    that contains it, the last mounted of equal ones (the one on top)."""
    real = os.path.realpath(path)
    best, found = "", ("", "")
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 4:
                    continue
                mount_point = fields[1].replace("\\040", " ")
                inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, found = mount_point, (fields[2], fields[3])
    except OSError:
        return "", ""
    return found


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding path (longest mount point that contains it)."""
    return _mount_of(path)[0]


SHMEM_POLICY_PATH = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


def page_bytes_of(path: str) -> int:
    """The page size a memory file at ``path`` is allocated in: 2 MiB on a tmpfs
    mounted with ``huge=always`` or ``huge=within_size`` (transparent huge pages,
    nothing reserved) and on hugetlbfs (its ``pagesize``), 4 KiB otherwise
    (/dev/shm as most systems mount it). Peer pulls ran 1.2-2.2x faster between
    regions on 2 MiB pages where we measured (docs/tiers.md, "Huge pages")."""
    fstype, options = _mount_of(path)
    try:
        # [force] / [deny] override every tmpfs mount's huge= (a testing knob).
        policy = re.search(r"\[(\w+)\]", SHMEM_POLICY_PATH.read_text())
    except OSError:
        policy = None
    return page_bytes_for(fstype, options, policy.group(1) if policy else "")


def page_bytes_for(fstype: str, options: str, shmem_policy: str = "") -> int:
    """page_bytes_of's answer for a mount's type and options (as /proc/self/mounts
    lists them) and the kernel's shmem_enabled policy."""
    opts = dict(o.partition("=")[::2] for o in options.split(",") if o)
    if fstype == "hugetlbfs":
        size = re.fullmatch(r"(\d+)([KMG])", opts.get("pagesize", ""))
        if size is None:
            return HUGE_PAGE_BYTES
        return int(size.group(1)) << {"K": 10, "M": 20, "G": 30}[size.group(2)]
    if fstype != "tmpfs" or shmem_policy == "deny":
        return PAGE_BYTES
    # huge=advise is no help here: the region's pages are allocated by
    # fallocate, outside any mapping that could advise them.
    huge = shmem_policy == "force" or opts.get("huge") in ("always", "within_size")
    return HUGE_PAGE_BYTES if huge else PAGE_BYTES


# madvise(2) advice (Linux 6.1+; the mmap module of Python 3.11 does not name it).
MADV_COLLAPSE = 25
# Bytes collapsed per madvise call: what a close waits for at most (~25-75 ms here,
# more when the machine is busy: the thread runs at the lowest priority).
COLLAPSE_CHUNK_BYTES = 16 * 1024 * 1024
# Passes over chunks whose pages were busy (a copy in flight), 0.1 s apart.
COLLAPSE_RETRIES = 3


def collapse_range(address: int, nbytes: int) -> int:
    """Ask the kernel to move [address, address+nbytes) of a shared-memory mapping
    into 2 MiB pages now (MADV_COLLAPSE; the huge= mount option need not allow
    it). The bytes do not change. Returns 0 or the errno: EINVAL where the
    kernel cannot (before Linux 6.1, shmem_enabled=deny, a mapping whose
    addresses and file offsets are not both 2 MiB aligned), EAGAIN / ENOMEM
    where some page could not be moved now (others may have been)."""
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    if fn(address, nbytes, MADV_COLLAPSE) == 0:
        return 0
    return ctypes.get_errno() or errno.EINVAL


def collapse_all(address: int, nbytes: int, stop: threading.Event | None = None) -> tuple[int, int]:
    """collapse_range over [address, address+nbytes) (2 MiB-aligned, whole 2 MiB
    pages only), COLLAPSE_CHUNK_BYTES per call, until done or ``stop`` is set.
    Returns (bytes of the chunks collapsed whole, the first errno met: EINVAL
    ends it at once, since the kernel collapses nothing here; EAGAIN / ENOMEM /
    EBUSY leave that chunk's busy pages as they were and go on)."""
    end = nbytes - nbytes % HUGE_PAGE_BYTES
    done, first = 0, 0
    for lo in range(0, end, COLLAPSE_CHUNK_BYTES):
        if stop is not None and stop.is_set():
            break
        n = min(COLLAPSE_CHUNK_BYTES, end - lo)
        err = collapse_range(address + lo, n)
        if err == 0:
            done += n
            continue
        first = first or err
        if err == errno.EINVAL:
            break
    return done, first


def pmd_mapped_bytes(pid: int | str, path: str) -> int:
    """Bytes of ``path``'s mappings in process ``pid`` mapped with 2 MiB page
    entries, as the kernel reports them (/proc/<pid>/smaps: ShmemPmdMapped,
    FilePmdMapped; hugetlbfs: Private_/Shared_Hugetlb)."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                inside = line.rstrip("\n").endswith(" " + path)
            elif inside and head in (
                "ShmemPmdMapped:",
                "FilePmdMapped:",
                "Shared_Hugetlb:",
                "Private_Hugetlb:",
            ):
                total += int(line.split()[1]) * 1024
    return total


def _free_huge_pages_bytes() -> int:
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return 0
    fields = dict(line.split(":", 1) for line in meminfo.splitlines() if ":" in line)
    try:
        free = int(fields["HugePages_Free"].split()[0])
        size_kib = int(fields["Hugepagesize"].split()[0])
    except (KeyError, ValueError):
        return 0
    return free * size_kib * 1024


@dataclass(frozen=True, slots=True)
class RegionRange:
    """One file of a region: bytes [offset, offset + nbytes) of the daemon's array."""

    name: str  # "" = the shared range (the file at dram.path)
    path: str
    offset: int
    nbytes: int
    reused: bool  # the file existed and is trusted (a warm restart may adopt it)


def reserve_addresses(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """``nbytes`` of addresses, huge-page aligned, with no memory behind them
    (MAP_NORESERVE): the array to map files over with map_file_at. Closing the
    returned mmap (refused while a view is exported) unmaps all of it."""
    reservation = mmap.mmap(
        -1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    )
    probe = ctypes.c_char.from_buffer(reservation)
    start = ctypes.addressof(probe)
    del probe  # a live export would make the reservation impossible to close
    skip = -start % HUGE_PAGE_BYTES
    return reservation, np.frombuffer(reservation, dtype=np.uint8, count=nbytes, offset=skip)


def map_file_at(array: np.ndarray, offset: int, fd: int, nbytes: int, *, populate: bool) -> None:
    """Map the first ``nbytes`` of ``fd`` MAP_SHARED over ``array[offset:offset+nbytes]``
    (an array from reserve_addresses); OSError if the kernel refuses."""
    if offset < 0 or offset + nbytes > len(array) or offset % PAGE_BYTES:
        raise ValueError(f"range [{offset}, {offset + nbytes}) does not fit the reservation")
    want = array.ctypes.data + offset
    got = libc_mmap()(
        want,
        nbytes,
        mmap.PROT_READ | mmap.PROT_WRITE,
        mmap.MAP_SHARED | _MAP_FIXED | (mmap.MAP_POPULATE if populate else 0),
        fd,
        0,
    )
    if got != want:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class Region:
    """A shared-memory file of fixed size, mapped MAP_SHARED and locked by one daemon.

    The file is flock()ed for the daemon's life, so a second daemon with the
    same path stops at start instead of serving the first one's bytes. An
    existing file is reused (a warm restart may then adopt its blocks,
    ``reused``) only when this user owns it and nobody else could have mapped
    it; one with wider permissions is replaced by a new, empty file, and one
    another user owns is refused (see kvstore/files.py).
    """

    def __init__(
        self,
        path: str,
        capacity_bytes: int,
        *,
        prefault: bool,
        huge_pages: str,
        files: FilePolicy | None = None,
        partitions: Sequence[tuple[str, int]] = (),
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.path = self._choose_path(path, capacity_bytes, huge_pages)
        self.files = files or FilePolicy()
        parent = Path(self.path).parent
        if not parent.is_dir():
            raise ConfigError(f"dram.path: directory {parent} does not exist")
        layout = self._layout(partitions)
        # New at every start (warm restarts included), never 0: clients compare it
        # with the one in each PrepareStore/PrepareLoad answer (see kvstore/client.py).
        self.region_id = secrets.randbits(63) + 1
        # Held open (and locked) until close(): each lock is the claim on its path.
        self._fds: list[int] = []
        self.ranges: list[RegionRange] = []
        try:
            for name, file_path, offset, nbytes in layout:
                # The shared file keeps its mode (a configured group's clients map
                # it); a partition's file is the daemon's alone: its clients get
                # the descriptor, never the path.
                mode = self.files.private_mode if name else self.files.shared_mode
                fd, reused = self._open_locked(file_path, mode)
                self._fds.append(fd)
                self._size(fd, file_path, nbytes, prefault)
                self.ranges.append(RegionRange(name, file_path, offset, nbytes, reused))
            self.reused = all(r.reused for r in self.ranges)
            populate = mmap.MAP_POPULATE if prefault else 0
            # At 2 MiB-aligned addresses, one range or several: a file's pages can
            # then be collapsed into 2 MiB pages (collapse_huge_pages).
            self._mmap, self.array = self._map_adjacent(populate)
        except BaseException:
            for fd in self._fds:
                os.close(fd)
            self._fds = []
            raise
        self.base_address = self.array.ctypes.data
        self.page_bytes = page_bytes_of(self.path)
        # Collapsed into 2 MiB pages once pre-faulted: pages not yet allocated
        # cannot be (the kernel refuses an empty range).
        self._huge_pages = huge_pages if prefault else "off"
        self._collapsed_bytes = 0
        self._collapse_stop = threading.Event()
        self._collapser: threading.Thread | None = None
        # Run first thing in close(), while the bytes are still mapped (the
        # manager writes its warm-restart manifest there); one that sets
        # keep_on_close keeps the file for the next daemon.
        self.close_hooks: list[Callable[[], None]] = []
        self.keep_on_close = False

    def _layout(self, partitions: Sequence[tuple[str, int]]) -> list[tuple[str, str, int, int]]:
        """(name, path, offset, bytes) of each range: the shared one first."""
        taken = sum(nbytes for _, nbytes in partitions)
        shared = self.capacity_bytes - taken
        align = HUGE_PAGE_BYTES if self.path.startswith(str(HUGETLBFS_DIR) + "/") else PAGE_BYTES
        if shared <= 0:
            raise ConfigError(
                f"dram: the tenant regions take {taken} of dram.capacity_bytes="
                f"{self.capacity_bytes}; the shared range needs some"
            )
        layout = [("", self.path, 0, shared)]
        offset = shared
        seen: set[str] = set()
        for name, nbytes in partitions:
            if not PARTITION_NAME.fullmatch(name) or name in seen:
                raise ConfigError(f"dram: bad or repeated tenant region name {name!r}")
            seen.add(name)
            if nbytes <= 0 or nbytes % align:
                raise ConfigError(
                    f"dram: tenant region {name!r} of {nbytes} bytes is not a positive "
                    f"multiple of {align}"
                )
            layout.append((name, self.path + PARTITION_SUFFIX + name, offset, nbytes))
            offset += nbytes
        if shared % align:
            raise ConfigError(
                f"dram: the shared range ({shared} bytes) is not a multiple of {align}"
            )
        return layout

    def _size(self, fd: int, path: str, nbytes: int, prefault: bool) -> None:
        os.ftruncate(fd, nbytes)
        if prefault:
            # Allocate the tmpfs pages now (and fail now, not mid-store, if
            # /dev/shm is too small); MAP_POPULATE then maps them all.
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                raise ConfigError(
                    f"dram.path: cannot reserve {nbytes} bytes in {path}: "
                    f"{exc.strerror} (is the filesystem large enough?)"
                ) from None

    def _map_adjacent(self, populate: int) -> tuple[mmap.mmap, np.ndarray]:
        """Map every range's file at adjacent addresses: one array over all of them.

        An anonymous reservation (no memory behind it, MAP_NORESERVE) holds the
        addresses; each file is mapped over its part with MAP_FIXED. The
        reservation is a Python mmap, so its close() (refused while a view is
        exported, as for a single file) unmaps the files too. Aligned to huge
        pages, which hugetlbfs files need and tmpfs does not mind.
        """
        reservation, array = reserve_addresses(self.capacity_bytes)
        try:
            for rng, fd in zip(self.ranges, self._fds, strict=True):
                try:
                    map_file_at(array, rng.offset, fd, rng.nbytes, populate=bool(populate))
                except OSError as exc:
                    raise ConfigError(
                        f"dram.path: cannot map {rng.path} at its place in the region: "
                        f"{exc.strerror}"
                    ) from None
        except BaseException:
            del array
            reservation.close()
            raise
        return reservation, array

    def range_of(self, name: str) -> RegionRange:
        """The range of a named partition ("" = the shared range); KeyError if none."""
        for rng in self.ranges:
            if rng.name == name:
                return rng
        raise KeyError(name)

    def fd_of(self, name: str) -> int:
        """The open descriptor of a range's file (what a client of it is handed)."""
        return self._fds[self.ranges.index(self.range_of(name))]

    def _open_locked(self, path: str, mode: int) -> tuple[int, bool]:
        """The file's fd, flock()ed, and whether the file existed (and is trusted)."""
        # Bounded: each retry means another process unlinked the path meanwhile.
        for _ in range(MAX_OPEN_ATTEMPTS):
            existed = os.path.lexists(path)
            try:
                fd = self.files.open(
                    path, os.O_RDWR | os.O_CREAT, mode, what="dram.path", check_mode=False
                )
            except FileNotFoundError:
                if existed:
                    continue  # unlinked between our look and our open
                raise ConfigError(f"dram.path: cannot open {path}: not found") from None
            except OSError as exc:
                raise ConfigError(f"dram.path: cannot open {path}: {exc.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise ConfigError(
                    f"dram.path: {path} is locked by another running daemon; give each "
                    "daemon on a node its own node_id (the default region is "
                    "/dev/shm/kvstore-<node_id>.dram) or its own dram.path"
                ) from None
            st = os.fstat(fd)
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                # A stopping daemon unlinks its region while holding the lock: we
                # locked a file that is no longer the one at the path.
                os.close(fd)
                continue
            if not self.files.trusted(st, mode):
                log.warning(
                    "dram.path %s had mode %04o (others could map it): its contents are "
                    "not trusted; starting with a new, empty region",
                    path,
                    stat.S_IMODE(st.st_mode),
                )
                os.unlink(path)
                os.close(fd)
                continue
            # Exactly our mode and group (a file_group set since the last run widens
            # a private region to the group; nothing else could have mapped it).
            self.files.apply(fd, mode)
            # An empty file (just created, or created and never sized) holds nothing to adopt.
            return fd, st.st_size > 0
        raise ConfigError(f"dram.path: {path} keeps being replaced; is another daemon starting?")

    @staticmethod
    def _choose_path(path: str, capacity_bytes: int, huge_pages: str) -> str:
        if huge_pages == "off":
            return path
        has_room = (
            HUGETLBFS_DIR.is_dir()
            and capacity_bytes % HUGE_PAGE_BYTES == 0
            and _free_huge_pages_bytes() >= capacity_bytes
        )
        if has_room:
            return str(HUGETLBFS_DIR / Path(path).name)
        if huge_pages == "on":
            raise ConfigError(
                f"dram.huge_pages=on but hugetlbfs at {HUGETLBFS_DIR} has no room for "
                f"{capacity_bytes} bytes (see /proc/meminfo HugePages_Free)"
            )
        return path

    def warn_if_not_memory(self) -> None:
        """A region on a disk filesystem works, but every store is written back to
        disk; one on 4 KiB pages works, but copies and peer pulls run slower."""
        fs = filesystem_type(self.path)
        if fs not in MEMORY_FILESYSTEMS:
            log.warning(
                "dram.path %s is on a %s filesystem, not tmpfs or hugetlbfs: the DRAM tier "
                "will be written back to disk; put it under /dev/shm",
                self.path,
                fs or "unknown",
            )
        elif self.page_bytes == PAGE_BYTES and self._huge_pages == "off":
            log.info(
                "dram.path %s is on 4 KiB pages (dram.huge_pages = off); on 2 MiB pages "
                'peer pulls ran 1.2-2.2x faster where measured (docs/tiers.md, "Huge pages")',
                self.path,
            )

    @property
    def huge_page_bytes(self) -> int:
        """Bytes of the region in pages of 2 MiB or more: all of it on hugetlbfs or
        a huge= tmpfs, else what collapse_huge_pages has moved so far."""
        if self.page_bytes >= HUGE_PAGE_BYTES:
            return self.capacity_bytes
        return self._collapsed_bytes

    def collapse_huge_pages(self) -> bool:
        """Move the region's 4 KiB pages into 2 MiB pages, in the background
        (MADV_COLLAPSE, a thread at the lowest CPU priority, COLLAPSE_CHUNK_BYTES
        at a time, in offset order; close() stops it between chunks). Peer pulls
        ran 1.2-2.2x faster between regions on 2 MiB pages (docs/tiers.md). Only
        with dram.huge_pages = "auto" and a region on 4 KiB pages; False if
        not started."""
        if self._huge_pages != "auto" or self.page_bytes >= HUGE_PAGE_BYTES:
            return False
        if self._collapser is not None or not self._fds:
            return False
        self._collapser = threading.Thread(target=self._collapse, name="dram-collapse", daemon=True)
        self._collapser.start()
        return True

    def _collapse(self) -> None:
        try:
            self._collapse_all()
        except Exception:  # the region serves on 4 KiB pages: never a reason to stop
            log.exception("dram region: collapsing into 2 MiB pages failed")

    def _collapse_all(self) -> None:
        try:
            # This thread only: it yields the CPU to everything else the node runs.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
        started = time.monotonic()
        refused = ""
        busy: list[tuple[int, int]] = []  # chunks with pages in use: tried again
        for rng in self.ranges:
            # A file's 2 MiB pages sit at 2 MiB file offsets: only a range at a
            # 2 MiB-aligned place in the region has addresses that match them.
            if rng.offset % HUGE_PAGE_BYTES:
                continue
            address = self.base_address + rng.offset
            for lo in range(0, rng.nbytes, COLLAPSE_CHUNK_BYTES):  # counted as it goes
                n = min(COLLAPSE_CHUNK_BYTES, rng.nbytes - lo)
                done, err = collapse_all(address + lo, n, self._collapse_stop)
                self._collapsed_bytes += done
                if err == errno.EINVAL:
                    refused = os.strerror(err)  # this kernel (or policy) collapses nothing
                    break
                if err:
                    busy.append((address + lo, n))
        for _ in range(COLLAPSE_RETRIES):
            if not busy or self._collapse_stop.wait(0.1):
                break
            again = []
            for address, n in busy:
                done, err = collapse_all(address, n, self._collapse_stop)
                self._collapsed_bytes += done
                if err and err != errno.EINVAL:
                    again.append((address, n))
            busy = again
        if self._collapse_stop.is_set():
            return
        # The kernel's own count, now that nothing moves: a chunk it refused in
        # part (EAGAIN) may still have had some of its pages collapsed.
        self._collapsed_bytes = sum(pmd_mapped_bytes(os.getpid(), rng.path) for rng in self.ranges)
        log.info(
            "dram region: %d of %d MiB in 2 MiB pages, collapsed in %.1f s%s",
            self._collapsed_bytes >> 20,
            self.capacity_bytes >> 20,
            time.monotonic() - started,
            f" (the kernel refused: {refused})" if refused else "",
        )

    @property
    def collapsing(self) -> bool:
        """True while collapse_huge_pages' thread runs."""
        return self._collapser is not None and self._collapser.is_alive()

    def _stop_collapse(self) -> None:
        self._collapse_stop.set()
        if self._collapser is not None:
            self._collapser.join(timeout=10.0)  # one chunk's work at most

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.array[offset : offset + nbytes]

    def close(self, *, unlink: bool) -> None:
        self._stop_collapse()  # before anything is unmapped
        hooks, self.close_hooks = self.close_hooks, []
        for hook in hooks:
            try:
                hook()
            except Exception:
                log.exception("region close hook failed")
        # Views handed out (self.array) keep the mmap alive; drop ours first.
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self._mmap.close()
        except BufferError:
            # Someone still holds a view; the mapping dies with the process.
            pass
        if unlink and not self.keep_on_close:
            for rng in self.ranges:
                try:
                    os.unlink(rng.path)
                except FileNotFoundError:
                    pass
        # Unlinked (or kept) while still locked; closing the fds drops the locks.
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)


@dataclass(slots=True)
class _SizeClass:
    slot_bytes: int
    slots_per_chunk: int
    # chunk index -> free slot offsets in that chunk (a stack)
    free_by_chunk: dict[int, list[int]] = field(default_factory=dict)
    used_by_chunk: dict[int, int] = field(default_factory=dict)
    # chunks that still have a free slot
    partial: set[int] = field(default_factory=set)


class SlabAllocator:
    """Slots of several sizes over one region, chunk by chunk.

    Pure bookkeeping: it never touches the bytes. O(1) alloc and free, except
    when a chunk is taken or returned (O(slots per chunk)).
    """

    def __init__(self, capacity_bytes: int, chunk_bytes: int) -> None:
        assert chunk_bytes > 0 and capacity_bytes >= chunk_bytes
        self.chunk_bytes = chunk_bytes
        self.num_chunks = capacity_bytes // chunk_bytes
        self.capacity_bytes = self.num_chunks * chunk_bytes
        # Lowest chunk first: keeps the used part of the region compact.
        self._free_chunks = list(range(self.num_chunks - 1, -1, -1))
        self._classes: dict[int, _SizeClass] = {}
        self._chunk_class: dict[int, int] = {}
        self.used_bytes = 0

    def alloc(self, slot_bytes: int, part: int = 0) -> int | None:
        """A free slot's offset, or None when neither a slot nor a chunk is free.

        ``part``: the range to take it from; one allocator has only range 0
        (PartitionedAllocator has more)."""
        cls = self._classes.get(slot_bytes)
        if cls is None:
            if slot_bytes > self.chunk_bytes:
                raise ValueError(f"slot of {slot_bytes} bytes exceeds chunk of {self.chunk_bytes}")
            cls = self._classes[slot_bytes] = _SizeClass(slot_bytes, self.chunk_bytes // slot_bytes)
        if not cls.partial:
            if not self._free_chunks:
                return None
            chunk = self._free_chunks.pop()
            base = chunk * self.chunk_bytes
            cls.free_by_chunk[chunk] = [
                base + i * slot_bytes for i in range(cls.slots_per_chunk - 1, -1, -1)
            ]
            cls.used_by_chunk[chunk] = 0
            cls.partial.add(chunk)
            self._chunk_class[chunk] = slot_bytes
        chunk = next(iter(cls.partial))
        free = cls.free_by_chunk[chunk]
        offset = free.pop()
        cls.used_by_chunk[chunk] += 1
        if not free:
            cls.partial.discard(chunk)
        self.used_bytes += slot_bytes
        return offset

    def alloc_many(self, slot_bytes: int, n: int, part: int = 0) -> list[int]:
        """The offsets ``n`` alloc() calls would give, in that order, fewer when
        neither slots nor chunks are left: a request's slots taken a chunk's free
        list slice at a time instead of one call per slot (the store's hot path).
        ``part`` as for alloc()."""
        out: list[int] = []
        while len(out) < n:
            cls = self._classes.get(slot_bytes)
            if cls is not None and not cls.partial and self._free_chunks:
                # Whole free chunks, as many as the rest fills (what alloc() does
                # one slot at a time: pop a chunk, hand out its slots lowest
                # first). Large slots have few per chunk (2 MiB in 4 MiB: 32
                # chunks for 64 blocks), so this is most of their cost per step.
                self._take_chunks(cls, n - len(out), out)
                continue
            if cls is None or not cls.partial:
                offset = self.alloc(slot_bytes)  # makes the class, or takes a chunk
                if offset is None:
                    break
                out.append(offset)
                continue
            chunk = next(iter(cls.partial))  # what alloc() would take from
            free = cls.free_by_chunk[chunk]
            take = min(n - len(out), len(free))
            start = len(free) - take
            out += reversed(free[start:])  # alloc() pops from the end
            del free[start:]
            cls.used_by_chunk[chunk] += take
            if not free:
                cls.partial.discard(chunk)
            self.used_bytes += slot_bytes * take
        return out

    def _take_chunks(self, cls: _SizeClass, n: int, out: list[int]) -> None:
        """Up to ``n`` slots of ``cls`` from whole free chunks, appended to ``out`` in
        alloc()'s order; the last chunk, if not used up, is left partial (as alloc()
        leaves it). Needs ``cls.partial`` empty and a free chunk."""
        per, slot_bytes, free_chunks = cls.slots_per_chunk, cls.slot_bytes, self._free_chunks
        taken = 0
        while taken < n and free_chunks:
            chunk = free_chunks.pop()
            base = chunk * self.chunk_bytes
            take = min(per, n - taken)
            out += range(base, base + take * slot_bytes, slot_bytes)
            # the rest of the chunk, a stack popped from its end (lowest first)
            cls.free_by_chunk[chunk] = list(
                range(base + (per - 1) * slot_bytes, base + (take - 1) * slot_bytes, -slot_bytes)
            )
            cls.used_by_chunk[chunk] = take
            self._chunk_class[chunk] = slot_bytes
            # Added and, used up, discarded, as alloc() does: the set's history
            # (so its iteration order, which picks the next partial chunk) stays
            # the one per-slot allocs would leave.
            cls.partial.add(chunk)
            if take == per:
                cls.partial.discard(chunk)
            taken += take
        self.used_bytes += slot_bytes * taken

    def free(self, offset: int) -> None:
        chunk = offset // self.chunk_bytes
        slot_bytes = self._chunk_class[chunk]
        cls = self._classes[slot_bytes]
        assert (offset - chunk * self.chunk_bytes) % slot_bytes == 0, "misaligned free"
        cls.free_by_chunk[chunk].append(offset)
        cls.used_by_chunk[chunk] -= 1
        self.used_bytes -= slot_bytes
        if cls.used_by_chunk[chunk] == 0:
            # The whole chunk is free: give it back so another size may use it.
            del cls.free_by_chunk[chunk], cls.used_by_chunk[chunk], self._chunk_class[chunk]
            cls.partial.discard(chunk)
            self._free_chunks.append(chunk)
        else:
            cls.partial.add(chunk)

    def rebuild(self, slots: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """Mark ``(offset, slot_bytes)`` slots used, on an empty allocator (after a restart).

        Returns the pairs that cannot be slots here (outside the region,
        misaligned, another size than their chunk's, or a duplicate); they stay
        free. One pass, O(slots + chunks touched x slots per chunk).
        """
        assert self.used_bytes == 0, "rebuild needs an empty allocator"
        rejected: list[tuple[int, int]] = []
        taken: dict[int, set[int]] = {}
        sizes: dict[int, int] = {}
        for offset, slot_bytes in slots:
            chunk, rel = divmod(offset, self.chunk_bytes)
            ok = (
                0 < slot_bytes <= self.chunk_bytes
                and 0 <= chunk < self.num_chunks
                and rel % slot_bytes == 0
                and rel + slot_bytes <= self.chunk_bytes
                and sizes.get(chunk, slot_bytes) == slot_bytes
                and offset not in taken.get(chunk, ())
            )
            if not ok:
                rejected.append((offset, slot_bytes))
                continue
            sizes[chunk] = slot_bytes
            taken.setdefault(chunk, set()).add(offset)
        for chunk, used in taken.items():
            slot_bytes = sizes[chunk]
            cls = self._classes.get(slot_bytes)
            if cls is None:
                cls = self._classes[slot_bytes] = _SizeClass(
                    slot_bytes, self.chunk_bytes // slot_bytes
                )
            base = chunk * self.chunk_bytes
            free = [
                base + i * slot_bytes
                for i in range(cls.slots_per_chunk - 1, -1, -1)
                if base + i * slot_bytes not in used
            ]
            cls.free_by_chunk[chunk] = free
            cls.used_by_chunk[chunk] = len(used)
            if free:
                cls.partial.add(chunk)
            self._chunk_class[chunk] = slot_bytes
            self.used_bytes += slot_bytes * len(used)
        self._free_chunks = [c for c in self._free_chunks if c not in taken]
        return rejected

    def slot_bytes_at(self, offset: int) -> int:
        return self._chunk_class[offset // self.chunk_bytes]

    def part_of(self, offset: int) -> int:
        return 0

    def chunks_of(self, slot_bytes: int, part: int = 0) -> list[int]:
        cls = self._classes.get(slot_bytes)
        return list(cls.used_by_chunk) if cls else []

    def chunk_slots(self, chunk: int) -> range:
        """Every slot offset of a chunk that is in use by some size class."""
        slot_bytes = self._chunk_class[chunk]
        base = chunk * self.chunk_bytes
        return range(base, base + (self.chunk_bytes // slot_bytes) * slot_bytes, slot_bytes)

    def size_classes(self, part: int = 0) -> list[int]:
        return [s for s, c in self._classes.items() if c.used_by_chunk]

    @property
    def free_chunks(self) -> int:
        return len(self._free_chunks)

    def can_alloc_without_eviction(self, slot_bytes: int, part: int = 0) -> bool:
        cls = self._classes.get(slot_bytes)
        return bool(self._free_chunks) or bool(cls and cls.partial)


class PartitionedAllocator(SlabAllocator):
    """One SlabAllocator per range of a partitioned region, in one offset space.

    Range 0 is the shared one; range i > 0 holds only the blocks of the tenant
    it belongs to (the placement says which: ``TenantAccount.dram_part``), so a
    slot is always in its tenant's file. Chunk indexes are global (a range
    starts on a chunk boundary). Only a daemon with tenant regions uses it: the
    one-range daemon keeps the plain SlabAllocator and its hot path.
    """

    def __init__(self, ranges: Sequence[tuple[int, int]], chunk_bytes: int) -> None:
        offset = 0
        for start, nbytes in ranges:
            if start != offset or nbytes % chunk_bytes or nbytes < chunk_bytes:
                raise ConfigError(
                    f"dram: region range at {start} of {nbytes} bytes is not whole chunks "
                    f"of dram.chunk_bytes={chunk_bytes} right after the previous one"
                )
            offset += nbytes
        self.parts = [SlabAllocator(nbytes, chunk_bytes) for _, nbytes in ranges]
        self.bases = [start for start, _ in ranges]
        self._first_chunk = [start // chunk_bytes for start in self.bases]
        self.chunk_bytes = chunk_bytes
        self.num_chunks = offset // chunk_bytes
        self.capacity_bytes = offset

    @property
    def used_bytes(self) -> int:  # type: ignore[override]
        return sum(p.used_bytes for p in self.parts)

    def part_of(self, offset: int) -> int:
        return bisect.bisect_right(self.bases, offset) - 1

    def alloc(self, slot_bytes: int, part: int = 0) -> int | None:
        offset = self.parts[part].alloc(slot_bytes)
        return None if offset is None else offset + self.bases[part]

    def alloc_many(self, slot_bytes: int, n: int, part: int = 0) -> list[int]:
        base = self.bases[part]
        return [offset + base for offset in self.parts[part].alloc_many(slot_bytes, n)]

    def free(self, offset: int) -> None:
        part = self.part_of(offset)
        self.parts[part].free(offset - self.bases[part])

    def rebuild(self, slots: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        by_part: list[list[tuple[int, int]]] = [[] for _ in self.parts]
        rejected: list[tuple[int, int]] = []
        for offset, slot_bytes in slots:
            if 0 <= offset < self.capacity_bytes:
                part = self.part_of(offset)
                by_part[part].append((offset - self.bases[part], slot_bytes))
            else:
                rejected.append((offset, slot_bytes))
        for part, pairs in enumerate(by_part):
            base = self.bases[part]
            rejected += [(o + base, s) for o, s in self.parts[part].rebuild(pairs)]
        return rejected

    def slot_bytes_at(self, offset: int) -> int:
        part = self.part_of(offset)
        return self.parts[part].slot_bytes_at(offset - self.bases[part])

    def chunks_of(self, slot_bytes: int, part: int = 0) -> list[int]:
        first = self._first_chunk[part]
        return [first + c for c in self.parts[part].chunks_of(slot_bytes)]

    def chunk_slots(self, chunk: int) -> range:
        part = bisect.bisect_right(self._first_chunk, chunk) - 1
        local = self.parts[part].chunk_slots(chunk - self._first_chunk[part])
        base = self.bases[part]
        return range(local.start + base, local.stop + base, local.step)

    def size_classes(self, part: int = 0) -> list[int]:
        return self.parts[part].size_classes()

    @property
    def free_chunks(self) -> int:
        return sum(p.free_chunks for p in self.parts)

    def can_alloc_without_eviction(self, slot_bytes: int, part: int = 0) -> bool:
        return self.parts[part].can_alloc_without_eviction(slot_bytes)
