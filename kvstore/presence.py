"""The presence table: which blocks the daemon holds, in shared memory, for local
clients to probe read-only instead of calling Lookup (docs/presence.md).

    table = PresenceTable.create(path, capacity_blocks, files, region_id)   # the daemon
    table.put(salt, hashes, tiers) / table.remove(salt, hashes)             # its placement
    probe = PresenceProbe.open(path, region_id)                             # a client
    probe.lookup(salt, hashes) -> (prefix_blocks, {tier: blocks}) | None

One file beside the DRAM region (``<dram.path>.presence``, the region's mode and
group), written only by the daemon (``kvstore.placement`` through
``PresenceRecorder``). A fixed-size set-associative hash table of 64-bit words:
buckets of ``WAYS`` words (one 64-byte cache line), two buckets a key (the
emptier takes it: ``buckets_of``), a word = the mixed key of
(namespace, block hash) with its low 2 bits replaced by the block's fastest
tier (1 GPU, 2 DRAM, 3 DISK); 0 = empty. A 4 KiB header before it:

    word 0 MAGIC, 1 VERSION, 2 region_id (the daemon's; 0 = retired: the
    daemon stopped, or a later daemon on the same path found it left behind),
    3 buckets (a power of two), 4 WAYS, 5 generation (bumped by a rebuild),
    6 entries, 7 inserts refused (their bucket was full)

It is a hint, never an authority: a block missing from a full bucket only
misses a hit; a block removed after the probe makes the later PrepareLoad find
fewer blocks (the engine recomputes). Every word the daemon writes is one
aligned 8-byte store, so a reader sees a slot's old or new word, never a mix:
it can only ever report a block that was stored.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import mmap
import os
import secrets
import stat
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvstore.errors import ConfigError
from kvstore.files import FilePolicy, check_owned
from kvstore.namespace import Tier

if TYPE_CHECKING:
    from kvstore.namespace import Block, Namespace

log = logging.getLogger(__name__)

PATH_SUFFIX = ".presence"
MAGIC = int.from_bytes(b"KVPRES\x00\x01", "little")
VERSION = 1
WAYS = 8  # words per bucket: one 64-byte cache line
HEADER_BYTES = 4096  # the table starts page aligned
_MAGIC, _VERSION, _REGION, _BUCKETS, _WAYS, _GENERATION, _ENTRIES, _REFUSED = range(8)
# Sizing: the tiers' capacity counted in blocks of this size (the smallest slot
# a namespace is likely to use: a page; real KV blocks are 64 KiB .. a few MiB),
# times KEYS_PER_BLOCK, in whole buckets, a power of two, within these bounds
# (64 KiB .. 64 MiB of table: 1 GiB of DRAM -> 4 MiB). tmpfs backs only the
# pages written, and at a quarter full an 8-way bucket overflows ~never.
SIZING_BLOCK_BYTES = 4 * 1024
KEYS_PER_BLOCK = 2
MIN_BUCKETS = 1 << 10
MAX_BUCKETS = 1 << 20
# A probe of a long prefix looks at this many hashes first, then 4x more each
# round, stopping at the first miss: a request with no hit costs one small round.
FIRST_ROUND = 64
MAX_OPEN_ATTEMPTS = 8

_M64 = (1 << 64) - 1
_C1, _C2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53  # murmur3's fmix64
_LOW = np.uint64(3)
_TIER_OF_BITS = {int(Tier.GPU): Tier.GPU, int(Tier.DRAM): Tier.DRAM, int(Tier.DISK): Tier.DISK}


@functools.lru_cache(maxsize=4096)
def namespace_salt(namespace_id: str) -> int:
    """The 64-bit identity of a namespace mixed into its keys (bounded cache)."""
    return int.from_bytes(hashlib.blake2b(namespace_id.encode(), digest_size=8).digest(), "little")


def mix_keys(salt: int, hashes: np.ndarray) -> np.ndarray:
    """fmix64(hash ^ salt) for each hash, low 2 bits cleared (the tier's place);
    never 0 (an empty slot). numpy's uint64 arithmetic wraps, as fmix64 wants."""
    x = hashes.astype(np.uint64, copy=True)
    x ^= np.uint64(salt)
    x ^= x >> np.uint64(33)
    x *= np.uint64(_C1)
    x ^= x >> np.uint64(33)
    x *= np.uint64(_C2)
    x ^= x >> np.uint64(33)
    x &= ~_LOW
    x[x == 0] = np.uint64(4)
    return x


def mix_key(salt: int, block_hash: int) -> int:
    """mix_keys for one hash, in Python ints (a single key costs less so)."""
    x = (block_hash ^ salt) & _M64
    x ^= x >> 33
    x = (x * _C1) & _M64
    x ^= x >> 33
    x = (x * _C2) & _M64
    x ^= x >> 33
    return (x & ~3) or 4


def buckets_of(keys: np.ndarray, buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """A key's two buckets: from its top bits and from its low bits above the tier's."""
    top = (keys >> np.uint64(64 - (buckets.bit_length() - 1))).astype(np.intp)
    low = ((keys >> np.uint64(2)) & np.uint64(buckets - 1)).astype(np.intp)
    return top, low


def table_buckets(capacity_bytes: int) -> int:
    """Buckets for tiers of ``capacity_bytes`` together (see the sizing constants)."""
    keys = KEYS_PER_BLOCK * max(capacity_bytes, 0) // SIZING_BLOCK_BYTES
    buckets = MIN_BUCKETS
    while buckets * WAYS < keys and buckets < MAX_BUCKETS:
        buckets *= 2
    return buckets


def presence_path(dram_path: str) -> str:
    return dram_path + PATH_SUFFIX


class PresenceTable:
    """The daemon's side: the file, created anew at each start, and its writes."""

    def __init__(self, path: str, mapping: mmap.mmap, buckets: int) -> None:
        self.path = path
        self._mmap = mapping
        self.buckets = buckets
        self._shift = 64 - (buckets.bit_length() - 1)
        words = np.frombuffer(mapping, dtype=np.uint64)
        self.header = words[: HEADER_BYTES // 8]
        self.flat = words[HEADER_BYTES // 8 :]
        self.rows = self.flat.reshape(buckets, WAYS)
        self.refused = 0
        self._warned = False

    @classmethod
    def create(
        cls, path: str, capacity_bytes: int, files: FilePolicy, region_id: int
    ) -> PresenceTable:
        """A new, empty table at ``path`` for the daemon of ``region_id``. A file left
        there (a daemon killed before it could retire it) is retired first, so a
        client still mapping it stops probing, then replaced; one another user owns
        is refused (kvstore/files.py), as for the region."""
        buckets = table_buckets(capacity_bytes)
        nbytes = HEADER_BYTES + buckets * WAYS * 8
        for _ in range(MAX_OPEN_ATTEMPTS):
            if os.path.lexists(path):
                _retire_left_behind(path, files)
            try:
                fd = files.open(
                    path, os.O_RDWR | os.O_CREAT | os.O_EXCL, files.shared_mode, what="presence"
                )
            except FileExistsError:
                continue  # (files.open retries without O_EXCL only when we ask it to)
            except OSError as exc:
                raise ConfigError(f"presence table: cannot create {path}: {exc.strerror}") from None
            if os.fstat(fd).st_size:  # files.open fell back to an existing file: not ours
                os.close(fd)
                continue
            try:
                os.ftruncate(fd, nbytes)
                mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
            table = cls(path, mapping, buckets)
            h = table.header
            h[_BUCKETS], h[_WAYS], h[_VERSION] = buckets, WAYS, VERSION
            h[_GENERATION] = secrets.randbits(63) + 1
            h[_REGION] = region_id
            h[_MAGIC] = MAGIC  # last: a reader checks it first
            return table
        raise ConfigError(f"presence table: {path} keeps being replaced; another daemon?")

    # ------------------------------------------------------------ writes

    def put(self, salt: int, hashes: np.ndarray, tiers: np.ndarray | int) -> None:
        """Record distinct blocks of one namespace as present in ``tiers`` (or move
        ones already recorded there): one word each, written in place."""
        if not len(hashes):
            return
        keys = mix_keys(salt, hashes)
        words = keys | np.asarray(tiers, dtype=np.uint64)
        if words.shape != keys.shape:
            words = np.broadcast_to(words, keys.shape)
        b1, b2 = buckets_of(keys, self.buckets)
        rows = self.rows
        placed = np.zeros(len(keys), dtype=bool)
        for b in (b1, b2):
            match = (rows[b] ^ keys[:, None]) < np.uint64(4)
            at = np.flatnonzero(match.any(axis=1) & ~placed)
            if at.size:
                rows[b[at], match[at].argmax(axis=1)] = words[at]
                placed[at] = True
        rest = np.flatnonzero(~placed)
        added = 0
        # A new key goes to the emptier of its two buckets (two choices keep every
        # bucket under WAYS at loads one choice overflows at). Keys of one batch
        # aiming at one bucket take turns: one per bucket a round, so each round's
        # empty slot is still empty when written.
        while rest.size:
            free1 = (rows[b1[rest]] == 0).sum(axis=1)
            free2 = (rows[b2[rest]] == 0).sum(axis=1)
            target = np.where(free2 > free1, b2[rest], b1[rest])
            room = np.maximum(free1, free2) > 0
            self._refuse(int(rest.size - np.count_nonzero(room)))
            rest, target = rest[room], target[room]
            if not rest.size:
                break
            _, first = np.unique(target, return_index=True)
            take, into = rest[first], target[first]
            rows[into, (rows[into] == 0).argmax(axis=1)] = words[take]
            added += take.size
            rest = np.delete(rest, first)
        self.header[_ENTRIES] += added

    def _rows_of(self, key: int) -> tuple[int, int]:
        return (key >> self._shift) * WAYS, ((key >> 2) & (self.buckets - 1)) * WAYS

    def put_one(self, salt: int, block_hash: int, tier: int) -> None:
        key = mix_key(salt, block_hash)
        flat = self.flat
        base1, base2 = self._rows_of(key)
        row1 = flat[base1 : base1 + WAYS].tolist()
        row2 = flat[base2 : base2 + WAYS].tolist()
        for base, row in ((base1, row1), (base2, row2)):
            for i, word in enumerate(row):
                if word ^ key < 4:
                    flat[base + i] = key | tier
                    return
        base, row = (base2, row2) if row2.count(0) > row1.count(0) else (base1, row1)
        try:
            i = row.index(0)
        except ValueError:
            self._refuse(1)
            return
        flat[base + i] = key | tier
        self.header[_ENTRIES] += 1

    def remove_one(self, salt: int, block_hash: int) -> None:
        key = mix_key(salt, block_hash)
        flat = self.flat
        for base in self._rows_of(key):
            for i, word in enumerate(flat[base : base + WAYS].tolist()):
                if word ^ key < 4:
                    flat[base + i] = 0
                    self.header[_ENTRIES] -= 1
                    return

    def _refuse(self, n: int) -> None:
        if n <= 0:
            return
        self.refused += n
        self.header[_REFUSED] = self.refused
        if not self._warned:
            self._warned = True
            log.warning(
                "presence table %s: a bucket is full, %d block(s) not published (local "
                "lookups miss them; the table has %d buckets of %d)",
                self.path,
                n,
                self.buckets,
                WAYS,
            )

    def rebuild(self, namespaces: Iterable[Namespace]) -> None:
        """Empty the table and record every block of ``namespaces``; a new generation
        tells clients that mapped the old one to call until they map it again."""
        self.header[_GENERATION] = secrets.randbits(63) + 1
        self.flat[:] = 0
        self.header[_ENTRIES] = 0
        for ns in namespaces:
            blocks = list(ns.blocks.values())
            if blocks:
                self.put(
                    namespace_salt(ns.namespace_id),
                    block_hashes(blocks),
                    np.fromiter((int(b.tier) for b in blocks), np.uint64, len(blocks)),
                )

    def close(self, *, unlink: bool = True) -> None:
        """Retire the table (clients mapping it stop probing it) and remove the file."""
        self.header[_REGION] = 0
        self.header = self.flat = np.empty(0, dtype=np.uint64)
        self.rows = np.empty((0, WAYS), dtype=np.uint64)
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still alive: unmapped with the process
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _retire_left_behind(path: str, files: FilePolicy) -> None:
    """Mark the table a previous daemon left at ``path`` retired, then unlink it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as exc:
        if os.path.islink(path):
            raise ConfigError(
                f"presence: {path} is a symbolic link; refusing to follow it"
            ) from None
        raise ConfigError(f"presence: cannot open {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        check_owned(st, path, "presence")
        if st.st_size >= HEADER_BYTES:
            with mmap.mmap(fd, HEADER_BYTES, flags=mmap.MAP_SHARED) as m:
                header = np.frombuffer(m, dtype=np.uint64, count=8)
                if int(header[_MAGIC]) == MAGIC:
                    header[_REGION] = 0
                del header
    finally:
        os.close(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def block_hashes(blocks: Sequence[Block]) -> np.ndarray:
    return np.fromiter((b.block_hash for b in blocks), np.uint64, len(blocks))


class PresenceRecorder:
    """What ``kvstore.placement`` tells of every change to a namespace's blocks
    (``ns.blocks`` and the tier of each): the table follows. Placement stays the one
    owner of the index; this only mirrors it."""

    def __init__(self, table: PresenceTable) -> None:
        self.table = table

    def stored(self, ns: Namespace, blocks: Sequence[Block], tier: Tier) -> None:
        """Blocks entered the index, or moved to ``tier``, all of them there."""
        if len(blocks) == 1:
            self.table.put_one(namespace_salt(ns.namespace_id), blocks[0].block_hash, tier)
        elif blocks:
            self.table.put(namespace_salt(ns.namespace_id), block_hashes(blocks), int(tier))

    def moved(self, block: Block) -> None:
        """A block's fastest copy changed tier (a demotion, a promotion, a GPU move)."""
        self.table.put_one(
            namespace_salt(block.namespace.namespace_id), block.block_hash, int(block.tier)
        )

    def left(self, block: Block) -> None:
        """A block left the index (removed, evicted, doomed)."""
        self.table.remove_one(namespace_salt(block.namespace.namespace_id), block.block_hash)


class PresenceProbe:
    """A client's read-only mapping of the daemon's table."""

    def __init__(self, mapping: mmap.mmap, region_id: int) -> None:
        self._mmap = mapping
        words = np.frombuffer(mapping, dtype=np.uint64)
        self.header = words[: HEADER_BYTES // 8]
        buckets = int(self.header[_BUCKETS])
        self.rows = words[HEADER_BYTES // 8 :].reshape(buckets, WAYS)
        self.buckets = buckets
        self.region_id = region_id
        self.generation = int(self.header[_GENERATION])

    @classmethod
    def open(cls, path: str, region_id: int) -> PresenceProbe | None:
        """Map the table of the daemon of ``region_id``; None when there is none to
        trust (no file, not a regular file, a header that does not add up, another
        daemon's): the client then calls."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < HEADER_BYTES:
                return None
            mapping = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError:
            return None
        finally:
            os.close(fd)
        h = np.frombuffer(mapping, dtype=np.uint64, count=8)
        buckets = int(h[_BUCKETS])
        ok = (
            int(h[_MAGIC]) == MAGIC
            and int(h[_VERSION]) == VERSION
            and int(h[_WAYS]) == WAYS
            and buckets > 0
            and buckets & (buckets - 1) == 0
            and st.st_size == HEADER_BYTES + buckets * WAYS * 8
            and region_id != 0
            and int(h[_REGION]) == region_id
        )
        del h
        if not ok:
            mapping.close()
            return None
        return cls(mapping, region_id)

    @property
    def current(self) -> bool:
        """Whether the table is still the one this daemon keeps (not retired, not rebuilt)."""
        h = self.header
        return (
            len(h) > _GENERATION  # (closed: empty)
            and int(h[_REGION]) == self.region_id
            and int(h[_GENERATION]) == self.generation
        )

    def lookup(self, salt: int, hashes: np.ndarray) -> tuple[int, dict[Tier, int]] | None:
        """The longest present prefix of ``hashes`` and its blocks by fastest tier, as the
        daemon's Lookup answers; None when the table is no longer current."""
        if not self.current:
            return None
        rows = self.rows
        n = len(hashes)
        found = 0
        tiers: list[np.ndarray] = []
        size = FIRST_ROUND
        while found < n:
            part = hashes[found : found + size]
            keys = mix_keys(salt, part)
            b1, b2 = buckets_of(keys, self.buckets)
            got = np.concatenate((rows[b1], rows[b2]), axis=1)  # (n, 2 * WAYS)
            match = (got ^ keys[:, None]) < np.uint64(4)
            hit = match.any(axis=1)
            k = len(part) if hit.all() else int(hit.argmin())
            if k:
                words = got[np.arange(k), match[:k].argmax(axis=1)]
                tiers.append(words & _LOW)
            found += k
            if k < len(part):
                break
            size *= 4
        if not self.current:  # retired or rebuilt while we read: nothing to trust
            return None
        by_tier: dict[Tier, int] = {}
        if found:
            counts = np.bincount(np.concatenate(tiers).astype(np.intp), minlength=4)
            for bits, tier in _TIER_OF_BITS.items():
                if counts[bits]:
                    by_tier[tier] = int(counts[bits])
        return found, by_tier

    def close(self) -> None:
        self.header = np.empty(0, dtype=np.uint64)
        self.rows = np.empty((0, WAYS), dtype=np.uint64)
        try:
            self._mmap.close()
        except BufferError:
            pass
