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
PYTHON_PROBES = 16  # hashes probed in Python ints before numpy takes over
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
    """fmix64(hash ^ salt) for each hash, low 2 bits cleared (the tier's place), bit 2
    set (never 0: an empty slot). numpy's uint64 arithmetic wraps, as fmix64 wants."""
    x = np.bitwise_xor(hashes, np.uint64(salt), dtype=np.uint64)
    x ^= x >> np.uint64(33)
    x *= np.uint64(_C1)
    x ^= x >> np.uint64(33)
    x *= np.uint64(_C2)
    x ^= x >> np.uint64(33)
    x &= ~_LOW
    x |= np.uint64(4)  # bit 2 always set: never 0 (61 bits of identity are plenty)
    return x


def mix_key(salt: int, block_hash: int) -> int:
    """mix_keys for one hash, in Python ints (a single key costs less so)."""
    x = (block_hash ^ salt) & _M64
    x ^= x >> 33
    x = (x * _C1) & _M64
    x ^= x >> 33
    x = (x * _C2) & _M64
    x ^= x >> 33
    return (x & ~3) | 4


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
        # One word at a time from Python ints (one aligned 8-byte store each).
        self._view = memoryview(mapping).cast("Q")
        self._words = self._view[HEADER_BYTES // 8 :]
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

    def put(
        self, salt: int, hashes: np.ndarray, tiers: np.ndarray | int, *, new: bool = False
    ) -> None:
        """Record distinct blocks of one namespace as present in ``tiers`` (or move
        ones already recorded there): one word each, written in place. ``new``: the
        caller knows none is recorded (they just entered the index), so no look for
        them is made."""
        if not len(hashes):
            return
        keys = mix_keys(salt, hashes)
        words = keys | np.asarray(tiers, dtype=np.uint64)
        if new and self._put_new(keys, words):
            return
        rest = np.arange(len(keys))
        first_round = not new
        # Rounds: a new key goes to the emptier of its two buckets (two choices keep
        # buckets under WAYS); keys of a batch aiming at one bucket take turns, one
        # per bucket a round, so each round's empty slot is still empty when written.
        while rest.size:
            k = keys[rest]
            b1, b2 = buckets_of(k, self.buckets)
            r1, r2 = np.take(self.rows, b1, axis=0), np.take(self.rows, b2, axis=0)
            if first_round:
                first_round = False
                # word ^ key < 4 where the identity matches (PresenceProbe._rounds)
                known = ((r1 ^ k[:, None]).min(axis=1) < 4) | ((r2 ^ k[:, None]).min(axis=1) < 4)
                if known.any():  # moves (a promotion's batch): word by word
                    for i in rest[known].tolist():
                        self.put_one(salt, int(hashes[i]), int(words[i]) & 3)
                    rest, k, b1, b2 = rest[~known], k[~known], b1[~known], b2[~known]
                    r1, r2 = r1[~known], r2[~known]
                    if not rest.size:
                        break
            free1, free2 = (r1 == 0).sum(axis=1), (r2 == 0).sum(axis=1)
            room = np.maximum(free1, free2) > 0
            if not room.all():
                self._refuse(int(room.size - np.count_nonzero(room)))
                rest, b1, b2, r1, r2 = rest[room], b1[room], b2[room], r1[room], r2[room]
                free1, free2 = free1[room], free2[room]
            use2 = free2 > free1
            target = np.where(use2, b2, b1)
            slot = np.where(use2, (r2 == 0).argmax(axis=1), (r1 == 0).argmax(axis=1))
            _, first = np.unique(target, return_index=True)
            if first.size == rest.size:
                self.rows[target, slot] = words[rest]
                self.header[_ENTRIES] += rest.size
                break
            self.rows[target[first], slot[first]] = words[rest[first]]
            self.header[_ENTRIES] += first.size
            rest = np.delete(rest, first)

    def _put_new(self, keys: np.ndarray, words: np.ndarray) -> bool:
        """The common case of a commit in few numpy calls: every key has room and no
        two aim at one bucket. False (nothing written) otherwise: put's rounds then."""
        b1, b2 = buckets_of(keys, self.buckets)
        z1 = np.take(self.rows, b1, axis=0) == 0
        z2 = np.take(self.rows, b2, axis=0) == 0
        free1, free2 = z1.sum(axis=1), z2.sum(axis=1)
        use2 = free2 > free1  # the emptier bucket
        target = np.where(use2, b2, b1)
        ordered = np.sort(target)
        if not (free1 | free2).all() or (ordered[1:] == ordered[:-1]).any():
            return False
        self.rows[target, np.where(use2, z2.argmax(axis=1), z1.argmax(axis=1))] = words
        self.header[_ENTRIES] += len(keys)
        return True

    def _rows_of(self, key: int) -> tuple[int, int]:
        return (key >> self._shift) * WAYS, ((key >> 2) & (self.buckets - 1)) * WAYS

    def put_one(self, salt: int, block_hash: int, tier: int) -> None:
        key = mix_key(salt, block_hash)
        words = self._words
        base1, base2 = self._rows_of(key)
        row1 = words[base1 : base1 + WAYS].tolist()
        row2 = words[base2 : base2 + WAYS].tolist()
        for base, row in ((base1, row1), (base2, row2)):
            for i, word in enumerate(row):
                if word ^ key < 4:
                    words[base + i] = key | tier
                    return
        base, row = (base2, row2) if row2.count(0) > row1.count(0) else (base1, row1)
        try:
            i = row.index(0)
        except ValueError:
            self._refuse(1)
            return
        words[base + i] = key | tier
        self.header[_ENTRIES] += 1

    def remove_one(self, salt: int, block_hash: int) -> None:
        key = mix_key(salt, block_hash)
        words = self._words
        for base in self._rows_of(key):
            for i, word in enumerate(words[base : base + WAYS].tolist()):
                if word ^ key < 4:
                    words[base + i] = 0
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
                    new=True,  # the table was just emptied
                )

    def close(self, *, unlink: bool = True) -> None:
        """Retire the table (clients mapping it stop probing it) and remove the file."""
        self.header[_REGION] = 0
        self.header = self.flat = np.empty(0, dtype=np.uint64)
        self.rows = np.empty((0, WAYS), dtype=np.uint64)
        try:
            self._words.release()
            self._view.release()
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

    def stored(self, ns: Namespace, blocks: Sequence[Block], tier: Tier, *, new: bool) -> None:
        """Blocks entered the index (``new``), or moved to ``tier``, all of them there."""
        if len(blocks) == 1:
            self.table.put_one(namespace_salt(ns.namespace_id), blocks[0].block_hash, tier)
        elif blocks:
            salt = namespace_salt(ns.namespace_id)
            self.table.put(salt, block_hashes(blocks), int(tier), new=new)

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
        self._shift_int = 64 - (buckets.bit_length() - 1)
        self._view = memoryview(mapping).cast("Q")
        self._words = self._view[HEADER_BYTES // 8 :]  # the table, one word at a time
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

    def lookup(
        self, salt: int, hashes: Sequence[int] | np.ndarray
    ) -> tuple[int, dict[Tier, int]] | None:
        """The longest present prefix of ``hashes`` and its blocks by fastest tier, as the
        daemon's Lookup answers; None when the table is no longer current."""
        if not self.current:
            return None
        n = len(hashes)
        counts = [0, 0, 0, 0]
        # The first hashes in Python ints (a numpy call costs ~1-2 us here: a short
        # lookup, or one that misses early, is done before numpy would start).
        found = self._scan(salt, hashes, min(n, PYTHON_PROBES), counts)
        if found == PYTHON_PROBES and n > found:
            found += self._rounds(salt, np.asarray(hashes[found:], np.uint64), counts)
        if not self.current:  # retired or rebuilt while we read: nothing to trust
            return None
        by_tier = {tier: counts[bits] for bits, tier in _TIER_OF_BITS.items() if counts[bits]}
        return found, by_tier

    def present(self, salt: int, hashes: np.ndarray) -> np.ndarray | None:
        """Which of ``hashes`` the table holds, in any tier (a bool per hash, not a
        prefix); None when the table is no longer current."""
        if not self.current:
            return None
        keys = mix_keys(salt, np.asarray(hashes, dtype=np.uint64))
        b1, b2 = buckets_of(keys, self.buckets)
        found = np.zeros(len(keys), dtype=bool)
        for b in (b1, b2):
            # word ^ key < 4 where a slot holds this key (its tier in the low bits)
            got = np.take(self.rows, b, axis=0)
            np.bitwise_xor(got, keys[:, None], out=got)
            found |= got.min(axis=1) < 4
        if not self.current:  # retired or rebuilt while we read
            return None
        return found

    def _scan(
        self, salt: int, hashes: Sequence[int] | np.ndarray, n: int, counts: list[int]
    ) -> int:
        words, shift, mask = self._words, self._shift_int, self.buckets - 1
        for i in range(n):
            key = mix_key(salt, int(hashes[i]))
            for base in ((key >> shift) * WAYS, ((key >> 2) & mask) * WAYS):
                row = words[base : base + WAYS].tolist()
                # `in` runs in C: one look per tier, DRAM (the usual one) first
                if key | 2 in row:
                    counts[2] += 1
                elif key | 3 in row:
                    counts[3] += 1
                elif key | 1 in row:
                    counts[1] += 1
                else:
                    continue
                break
            else:
                return i
        return n

    def _rounds(self, salt: int, hashes: np.ndarray, counts: list[int]) -> int:
        """numpy, over rounds of FIRST_ROUND, then 4x more hashes, to the first miss."""
        rows, n, found, size = self.rows, len(hashes), 0, FIRST_ROUND
        while found < n:
            part = hashes[found : found + size]
            keys = mix_keys(salt, part)
            b1, b2 = buckets_of(keys, self.buckets)
            # word ^ key is the word's tier (< 4) where the identity matches, >= 4
            # elsewhere (an empty slot gives the key): a row's minimum says both.
            got = np.take(rows, b1, axis=0)
            np.bitwise_xor(got, keys[:, None], out=got)
            tiers = got.min(axis=1)
            second = np.flatnonzero(tiers >= 4)  # the second bucket, for those only
            if second.size:
                got = np.take(rows, b2[second], axis=0)
                np.bitwise_xor(got, keys[second, None], out=got)
                tiers[second] = got.min(axis=1)
            miss = np.flatnonzero(tiers >= 4)
            k = int(miss[0]) if miss.size else len(part)
            if k:
                for bits, c in enumerate(np.bincount(tiers[:k].astype(np.intp), minlength=4)):
                    counts[bits] += int(c)
            found += k
            if k < len(part):
                break
            size *= 4
        return found

    def close(self) -> None:
        self.header = np.empty(0, dtype=np.uint64)
        self.rows = np.empty((0, WAYS), dtype=np.uint64)
        try:
            self._words.release()
            self._view.release()
            self._mmap.close()
        except BufferError:
            pass  # another thread is probing it: unmapped when its views go
