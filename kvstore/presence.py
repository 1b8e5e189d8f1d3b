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

then the key words, the locations and the checksums (``buckets * WAYS`` words each).

Beside each key word, at the same index of two more arrays of the same shape:
its **location** (a DRAM block's slot: ``offset // 64 << 24 | stamp``, the
stamp a 24-bit count of location writes; 0 = no DRAM copy to read) and its
**checksum** (0 = none). They let a local client read a DRAM block's bytes
with no call and no pin (``locate``, then ``intact`` after the copy: a direct
load, docs/presence.md "Direct loads"). The rule that makes that safe: the
daemon changes a block's key word (removed: 0; moved: its tier bits) or its
location in the same event-loop step that frees its DRAM slot, before anyone
can be handed that slot, and writes a location before the key word that
publishes it. So a reader that finds the key word and the location it copied
by unchanged after its copy read bytes that were that block's all along.

As a lookup it is a hint, never an authority: a block missing from a full
bucket only misses a hit; a block removed after the probe makes the later
PrepareLoad find fewer blocks (the engine recomputes). Every word the daemon
writes is one aligned 8-byte store, so a reader sees a slot's old or new word,
never a mix: it can only ever report a block that was stored.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import mmap
import os
import secrets
import stat
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvstore.errors import ConfigError
from kvstore.files import FilePolicy, check_owned
from kvstore.namespace import Tier
from kvstore.native import CompiledKernel

if TYPE_CHECKING:
    from kvstore.namespace import Block, Namespace

log = logging.getLogger(__name__)

PATH_SUFFIX = ".presence"
MAGIC = int.from_bytes(b"KVPRES\x00\x01", "little")
VERSION = 2  # 2: locations and checksums beside the keys (direct loads)
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
# locate reads more per hash than a lookup: numpy is faster from ~10 hashes here
LOCATE_PYTHON_PROBES = 8
# a commit of this many blocks or fewer is written in Python ints (put_few)
PYTHON_PUTS = 16
MAX_OPEN_ATTEMPTS = 8

_M64 = (1 << 64) - 1
_C1, _C2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53  # murmur3's fmix64
_LOW = np.uint64(3)
_DRAM_BITS = np.uint64(int(Tier.DRAM))
_TIER_OF_BITS = {int(Tier.GPU): Tier.GPU, int(Tier.DRAM): Tier.DRAM, int(Tier.DISK): Tier.DISK}
_KEYS_AT = HEADER_BYTES // 8  # the key words' first index in the file's words


def _build_probe() -> object:
    from kvstore import _presence_kernel  # numba compiles it here (or loads its cache)

    return _presence_kernel.probe


# The probes compiled (kvstore._presence_kernel): a lookup, presence check or locate
# of any length in one call, ~2-5 us where numpy's ~30 calls cost 30-100 us.
_NATIVE = CompiledKernel(
    _build_probe,
    name="the presence table's probe",
    off_env="KVSTORE_NATIVE_PROBE",
    fallback="the presence table is probed in numpy",
    log=log,
)
_LOOKUP, _PRESENT, _LOCATE = 0, 1, 2  # its modes (kvstore._presence_kernel)


def _build_writer() -> object:
    # numba compiles it here (or loads its cache); apart from the probe, which is
    # all a client compiles (cold: ~0.8 s of CPU for the probe, ~2.7 s with these)
    from kvstore import _presence_write_kernel

    return _presence_write_kernel


# The daemon's writes compiled (kvstore._presence_write_kernel: put, remove): a commit's or a
# delete's blocks in one call. A 64-block commit wrote the table in ~25 numpy
# calls and a 64-block delete in 64 Python loops, about half of the daemon's
# time for a store step of 64 blocks (py-spy, 2026-12-05).
_WRITER = CompiledKernel(
    _build_writer,
    name="the presence table's writes",
    off_env="KVSTORE_NATIVE_PRESENCE_WRITE",
    fallback="the daemon writes the presence table in numpy and Python ints",
    log=log,
)
# Compiled from two blocks: a put and a remove of 2 / 8 / 16 blocks took 6.2 / 7.0 /
# 7.8 us compiled, 7.0 / 26.5 / 51.5 us in Python ints (put_few, remove_one); one
# block is written in Python ints (the kernel call's own cost is ~3 us). The same
# for batched removals and checksums (from this many blocks).
KERNEL_MIN_BLOCKS = 2
_NO_OFFSETS = np.empty(0, dtype=np.int64)
_NO_CHECKSUMS = np.empty(0, dtype=np.uint64)


def compile_probes() -> None:
    """Start compiling the probes now, in the background (once per process; the
    first ``PresenceProbe.open`` starts it otherwise). An engine calls this at its
    start: numba's import and cache load (~1 s of a thread that mostly holds the
    interpreter lock) then overlap the engine's own start, not its first requests."""
    _NATIVE.start()


def compiled_probes(timeout_s: float | None = None) -> bool:
    """Whether probes run compiled, once the compile started by the first
    ``PresenceProbe.open`` is done (started here if not; waits up to ``timeout_s``,
    None: until done): numba importable, KVSTORE_NATIVE_PROBE not 0, compiled."""
    return _NATIVE.available(timeout_s)


# A location word: the slot's offset in units of LOC_UNIT_BYTES (every DRAM slot
# starts on a cache line: kvstore.tiers.dram.SLOT_ALIGN_BYTES) above a 24-bit
# stamp. The stamp makes a block that comes back to the same slot (evicted,
# stored again) a new location: a copy that spanned the two does not pass.
LOC_UNIT_BYTES = 64
LOC_STAMP_BITS = 24
_STAMP_MASK = (1 << LOC_STAMP_BITS) - 1
MAX_LOC_OFFSET_BYTES = LOC_UNIT_BYTES << (64 - LOC_STAMP_BITS)
_UNIT_SHIFT_INT = LOC_UNIT_BYTES.bit_length() - 1  # offset // 64
_UNIT_SHIFT = np.uint64(_UNIT_SHIFT_INT)
_STAMP_SHIFT = np.uint64(LOC_STAMP_BITS)


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


def table_bytes(buckets: int) -> int:
    """The file's size: the header, then keys, locations and checksums."""
    return HEADER_BYTES + 3 * buckets * WAYS * 8


def _arrays(mapping: mmap.mmap, buckets: int) -> tuple[np.ndarray, ...]:
    """(header, keys, locations, checksums) over a table's mapping: flat uint64 arrays."""
    words = np.frombuffer(mapping, dtype=np.uint64)
    n, h = buckets * WAYS, HEADER_BYTES // 8
    return words[:h], words[h : h + n], words[h + n : h + 2 * n], words[h + 2 * n : h + 3 * n]


class PresenceTable:
    """The daemon's side: the file, created anew at each start, and its writes."""

    def __init__(self, path: str, mapping: mmap.mmap, buckets: int) -> None:
        self.path = path
        self._mmap = mapping
        self.buckets = buckets
        self._shift = 64 - (buckets.bit_length() - 1)
        self.header, self.flat, self.locs, self.sums = _arrays(mapping, buckets)
        self.rows = self.flat.reshape(buckets, WAYS)
        n = buckets * WAYS
        # One word at a time from Python ints (one aligned 8-byte store each).
        self._view = memoryview(mapping).cast("Q")
        h = HEADER_BYTES // 8
        self._words = self._view[h : h + n]
        self._loc_words = self._view[h + n : h + 2 * n]
        self._sum_words = self._view[h + 2 * n : h + 3 * n]
        self._stamp = 0  # location writes so far (the low bits of each location)
        # the compiled writes' first arguments (as the probe's: PresenceProbe): the
        # file's words, the key words' first index and count, the buckets' shift and mask
        self._geometry = (
            np.frombuffer(mapping, dtype=np.uint64),
            _KEYS_AT,
            n,
            np.uint64(self._shift),
            np.uint64(buckets - 1),
        )
        self._state = np.zeros(2, dtype=np.int64)  # the kernel's stamp and refusals
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
        nbytes = table_bytes(buckets)
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
            # numpy and Python ints write until it is compiled (numba's import and
            # cache load: ~0.4 s of a thread's CPU, ~110 MiB resident)
            _WRITER.start()
            h = table.header
            h[_BUCKETS], h[_WAYS], h[_VERSION] = buckets, WAYS, VERSION
            h[_GENERATION] = secrets.randbits(63) + 1
            h[_REGION] = region_id
            h[_MAGIC] = MAGIC  # last: a reader checks it first
            return table
        raise ConfigError(f"presence table: {path} keeps being replaced; another daemon?")

    # ------------------------------------------------------------ writes

    def locations(self, offsets: np.ndarray) -> np.ndarray:
        """Location words for DRAM slots at byte ``offsets`` (-1: none, 0), each with
        the next stamp. (A commit's hot path: as few numpy calls as it takes.)"""
        offsets = np.asarray(offsets, dtype=np.int64)
        n = len(offsets)
        start = self._stamp + 1
        stamps = np.arange(start, start + n, dtype=np.uint64)
        if start + n > _STAMP_MASK:
            stamps &= np.uint64(_STAMP_MASK)
        self._stamp = (self._stamp + n) & _STAMP_MASK
        none = offsets < 0
        any_none = bool(none.any())
        locs = (offsets.astype(np.uint64) >> _UNIT_SHIFT) << _STAMP_SHIFT
        locs |= stamps
        if any_none:
            locs[none] = 0
        return locs

    def location(self, offset: int) -> int:
        """location() for one slot, in Python ints."""
        if offset < 0:
            return 0
        assert offset % LOC_UNIT_BYTES == 0 and offset < MAX_LOC_OFFSET_BYTES, offset
        self._stamp = (self._stamp + 1) & _STAMP_MASK
        return (offset // LOC_UNIT_BYTES) << LOC_STAMP_BITS | self._stamp

    def put(
        self,
        salt: int,
        hashes: np.ndarray,
        tiers: np.ndarray | int,
        *,
        new: bool = False,
        offsets: np.ndarray | None = None,
        checksums: np.ndarray | None = None,
    ) -> None:
        """Record distinct blocks of one namespace as present in ``tiers`` (or move
        ones already recorded there): one word each, written in place. ``new``: the
        caller knows none is recorded (they just entered the index), so no look for
        them is made. ``offsets``: each block's DRAM slot (-1: none; None: none has
        one), published as its location; ``checksums`` beside them (None: 0)."""
        if not len(hashes):
            return
        if _WRITER.ready() and isinstance(tiers, int):
            self._put_compiled(salt, hashes, tiers, new, offsets, checksums)
            return
        keys = mix_keys(salt, hashes)
        words = keys | np.asarray(tiers, dtype=np.uint64)
        n = len(keys)
        locs = self.locations(offsets) if offsets is not None else np.zeros(n, np.uint64)
        sums = (
            np.asarray(checksums, dtype=np.uint64)
            if checksums is not None
            else np.zeros(n, np.uint64)
        )
        if new and self._put_new(keys, words, locs, sums):
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
                        self._put_one(int(keys[i]), int(words[i]) & 3, int(locs[i]), int(sums[i]))
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
                self._write(target * WAYS + slot, words[rest], locs[rest], sums[rest])
                self.header[_ENTRIES] += rest.size
                break
            at = target[first] * WAYS + slot[first]
            chosen = rest[first]
            self._write(at, words[chosen], locs[chosen], sums[chosen])
            self.header[_ENTRIES] += first.size
            rest = np.delete(rest, first)

    def _put_compiled(
        self,
        salt: int,
        hashes: np.ndarray,
        tier: int,
        new: bool,
        offsets: np.ndarray | None,
        checksums: np.ndarray | None,
    ) -> None:
        """put() in one call of the compiled kernel (the same entries, in order)."""
        state = self._state
        state[0] = self._stamp
        added = _WRITER.kernel.put(
            *self._geometry,
            np.uint64(salt),
            np.ascontiguousarray(hashes, dtype=np.uint64),
            np.uint64(tier),
            _writable(offsets, np.int64) if offsets is not None else _NO_OFFSETS,
            _writable(checksums, np.uint64) if checksums is not None else _NO_CHECKSUMS,
            int(new),
            _UNIT_SHIFT_INT,
            LOC_STAMP_BITS,
            state,
        )
        self._stamp = int(state[0])
        if added:
            self.header[_ENTRIES] += added
        self._refuse(int(state[1]))

    def _write(self, at: np.ndarray, words: np.ndarray, locs: np.ndarray, sums: np.ndarray) -> None:
        """Entries at flat indexes ``at``: location and checksum first, the key word
        last (a reader that finds the key finds its location already there)."""
        self.locs[at] = locs
        self.sums[at] = sums
        self.flat[at] = words

    def _put_new(
        self, keys: np.ndarray, words: np.ndarray, locs: np.ndarray, sums: np.ndarray
    ) -> bool:
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
        way = np.where(use2, z2.argmax(axis=1), z1.argmax(axis=1))
        self._write(target * WAYS + way, words, locs, sums)
        self.header[_ENTRIES] += len(keys)
        return True

    def _rows_of(self, key: int) -> tuple[int, int]:
        return (key >> self._shift) * WAYS, ((key >> 2) & (self.buckets - 1)) * WAYS

    def put_one(
        self, salt: int, block_hash: int, tier: int, *, offset: int = -1, checksum: int = 0
    ) -> None:
        """put() for one block, in Python ints: ``offset`` its DRAM slot (-1: none)."""
        self._put_one(mix_key(salt, block_hash), tier, self.location(offset), checksum)

    def put_few(
        self,
        salt: int,
        hashes: Sequence[int],
        tier: int,
        *,
        new: bool = False,
        offsets: Sequence[int] | None = None,
        checksums: Sequence[int] | None = None,
    ) -> None:
        """put() for up to ``PYTHON_PUTS`` blocks, in Python ints: a commit of a few
        blocks (the connector's decode steps: one per request) runs right after
        the engine's forward, when each of put's ~25 numpy calls costs 3-10 us."""
        added = refused = 0
        for i, block_hash in enumerate(hashes):
            key = mix_key(salt, block_hash)
            at, fresh = self._entry_for(key, new)
            if at < 0:
                refused += 1
                continue
            loc = self.location(offsets[i]) if offsets is not None else 0
            self._write_one(at, key | tier, loc, checksums[i] if checksums is not None else 0)
            added += fresh
        if added:
            self.header[_ENTRIES] += added
        self._refuse(refused)

    def _put_one(self, key: int, tier: int, loc: int, checksum: int) -> None:
        at, fresh = self._entry_for(key, False)
        if at < 0:
            self._refuse(1)
            return
        self._write_one(at, key | tier, loc, checksum)
        if fresh:
            self.header[_ENTRIES] += 1

    def _entry_for(self, key: int, new: bool) -> tuple[int, bool]:
        """(the flat index for ``key``, whether that entry is a new one): its own
        entry if recorded (``new``: the caller knows it is not, no look), else a
        free way in the emptier of its buckets; (-1, False) when both are full."""
        words = self._words
        base1, base2 = self._rows_of(key)
        row1 = words[base1 : base1 + WAYS].tolist()
        row2 = words[base2 : base2 + WAYS].tolist()
        if not new:
            for base, row in ((base1, row1), (base2, row2)):
                for i, word in enumerate(row):
                    if word ^ key < 4:
                        return base + i, False
        base, row = (base2, row2) if row2.count(0) > row1.count(0) else (base1, row1)
        try:
            return base + row.index(0), True
        except ValueError:
            return -1, False

    def _write_one(self, at: int, word: int, loc: int, checksum: int) -> None:
        self._loc_words[at] = loc  # before the key word, as _write
        self._sum_words[at] = checksum
        self._words[at] = word

    def set_checksum(self, salt: int, block_hash: int, checksum: int) -> None:
        """The checksum beside a recorded block (nothing when it is not recorded)."""
        key = mix_key(salt, block_hash)
        for base in self._rows_of(key):
            for i, word in enumerate(self._words[base : base + WAYS].tolist()):
                if word ^ key < 4:
                    self._sum_words[base + i] = checksum
                    return

    def remove_one(self, salt: int, block_hash: int) -> None:
        key = mix_key(salt, block_hash)
        words = self._words
        for base in self._rows_of(key):
            for i, word in enumerate(words[base : base + WAYS].tolist()):
                if word ^ key < 4:
                    words[base + i] = 0  # the key first: a reader stops finding it
                    self._loc_words[base + i] = 0
                    self._sum_words[base + i] = 0
                    self.header[_ENTRIES] -= 1
                    return

    def set_checksums(self, salt: int, hashes: Sequence[int], checksums: Sequence[int]) -> None:
        """set_checksum for each of ``hashes`` (of one namespace), compiled in one call
        where the kernel is ready."""
        if _WRITER.ready():
            _WRITER.kernel.set_checksums(
                *self._geometry,
                np.uint64(salt),
                np.fromiter(hashes, np.uint64, len(hashes)),
                np.fromiter(checksums, np.uint64, len(checksums)),
            )
            return
        for block_hash, checksum in zip(hashes, checksums, strict=True):
            self.set_checksum(salt, block_hash, checksum)

    def remove(self, salt: int, hashes: Sequence[int]) -> None:
        """remove_one for each of ``hashes`` (of one namespace), compiled in one call
        where the kernel is ready."""
        if _WRITER.ready():
            removed = _WRITER.kernel.remove(
                *self._geometry,
                np.uint64(salt),
                np.fromiter(hashes, np.uint64, len(hashes)),
            )
            if removed:
                self.header[_ENTRIES] -= removed
            return
        for block_hash in hashes:
            self.remove_one(salt, block_hash)

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
        self.locs[:] = 0
        self.sums[:] = 0
        self.header[_ENTRIES] = 0
        for ns in namespaces:
            blocks = list(ns.blocks.values())
            if blocks:
                tiers, offsets, checksums = entry_fields(blocks)
                self.put(
                    namespace_salt(ns.namespace_id),
                    block_hashes(blocks),
                    tiers,
                    new=True,  # the table was just emptied
                    offsets=offsets,
                    checksums=checksums,
                )

    def close(self, *, unlink: bool = True) -> None:
        """Retire the table (clients mapping it stop probing it) and remove the file.
        Once: a second close does nothing."""
        if not len(self.header):
            return
        self.header[_REGION] = 0
        self.header = self.flat = self.locs = self.sums = np.empty(0, dtype=np.uint64)
        self.rows = np.empty((0, WAYS), dtype=np.uint64)
        try:
            for view in (self._words, self._loc_words, self._sum_words):
                view.release()
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


def _writable(values: np.ndarray, dtype: type) -> np.ndarray:
    """``values`` as a C-contiguous writable array of ``dtype`` (the kernel's types)."""
    arr: np.ndarray = np.ascontiguousarray(values, dtype=dtype)
    return arr if arr.flags.writeable else arr.copy()


def block_hashes(blocks: Sequence[Block]) -> np.ndarray:
    return np.fromiter((b.block_hash for b in blocks), np.uint64, len(blocks))


def entry_fields(blocks: Sequence[Block]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each block's fastest tier, DRAM slot where that tier is DRAM (-1 elsewhere: a
    GPU or disk block has no bytes a client reads directly) and checksum."""
    n = len(blocks)
    tiers = np.fromiter((int(b.tier) for b in blocks), np.uint64, n)
    offsets = np.fromiter((b.offset if b.gpu_offset < 0 else -1 for b in blocks), np.int64, n)
    checksums = np.fromiter((b.checksum for b in blocks), np.uint64, n)
    return tiers, offsets, checksums


class PresenceRecorder:
    """What ``kvstore.placement`` tells of every change to a namespace's blocks
    (``ns.blocks`` and the tier of each): the table follows. Placement stays the one
    owner of the index; this only mirrors it."""

    def __init__(self, table: PresenceTable) -> None:
        self.table = table
        self._batches = 0  # open batch() blocks
        self._leaving: dict[int, list[int]] = {}  # salt -> hashes that left, not written yet

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Blocks that leave inside are taken out of the table together at its end
        (one compiled call per namespace: a delete's, or a prepare's evictions).
        Nothing else sees the table in between: the daemon's loop runs the whole
        block, and every other write here writes the pending removals first, so
        the table goes through the same states in the same order; a slot a
        removal freed is handed out only in the reply sent after it."""
        self._batches += 1
        try:
            yield
        finally:
            self._batches -= 1
            if not self._batches:
                self._write_leaving()

    def _write_leaving(self) -> None:
        leaving, self._leaving = self._leaving, {}
        for salt, hashes in leaving.items():
            if len(hashes) < KERNEL_MIN_BLOCKS:
                for block_hash in hashes:
                    self.table.remove_one(salt, block_hash)
            else:
                self.table.remove(salt, hashes)

    def stored(self, ns: Namespace, blocks: Sequence[Block], tier: Tier, *, new: bool) -> None:
        """Blocks entered the index (``new``), or moved to ``tier``, all of them there."""
        if self._leaving:
            self._write_leaving()
        if len(blocks) == 1:
            self.moved(blocks[0])
        elif blocks:
            salt = namespace_salt(ns.namespace_id)
            if tier is not Tier.DRAM:  # no bytes a client reads directly: no location
                self.table.put(salt, block_hashes(blocks), int(tier), new=new)
                return
            if len(blocks) <= PYTHON_PUTS and not _WRITER.ready():
                self.table.put_few(
                    salt,
                    [b.block_hash for b in blocks],
                    int(tier),
                    new=new,
                    offsets=[b.offset for b in blocks],
                    checksums=[b.checksum for b in blocks],
                )
                return
            # a commit's hot path: list comprehensions (a generator per field cost
            # ~3x as much here, ~20 us for 64 blocks)
            n = len(blocks)
            self.table.put(
                salt,
                np.fromiter([b.block_hash for b in blocks], np.uint64, n),
                int(tier),
                new=new,
                offsets=np.fromiter([b.offset for b in blocks], np.int64, n),
                checksums=np.fromiter([b.checksum for b in blocks], np.uint64, n),
            )

    def moved(self, block: Block) -> None:
        """A block's fastest copy changed tier (a demotion, a promotion, a GPU move),
        or its DRAM slot changed: a new location."""
        if self._leaving:
            self._write_leaving()
        self.table.put_one(
            namespace_salt(block.namespace.namespace_id),
            block.block_hash,
            int(block.tier),
            offset=block.offset if block.gpu_offset < 0 else -1,
            checksum=block.checksum,
        )

    def checksummed(self, block: Block) -> None:
        """A block's checksum became known (a demotion's write, a peer's pull)."""
        if self._leaving:
            self._write_leaving()
        self.table.set_checksum(
            namespace_salt(block.namespace.namespace_id), block.block_hash, block.checksum
        )

    def checksummed_many(self, blocks: Sequence[Block]) -> None:
        """``checksummed`` for each of ``blocks`` (a pin's or a pull's: one namespace,
        usually), in one compiled call per namespace where the kernel is ready."""
        if len(blocks) < KERNEL_MIN_BLOCKS or not _WRITER.ready():
            for block in blocks:
                self.checksummed(block)
            return
        if self._leaving:
            self._write_leaving()
        by_ns: dict[str, list[Block]] = {}
        for block in blocks:
            by_ns.setdefault(block.namespace.namespace_id, []).append(block)
        for ns_id, group in by_ns.items():
            self.table.set_checksums(
                namespace_salt(ns_id),
                [b.block_hash for b in group],
                [b.checksum for b in group],
            )

    def left(self, block: Block) -> None:
        """A block left the index (removed, evicted, doomed); inside ``batch()``, at
        its end."""
        salt = namespace_salt(block.namespace.namespace_id)
        if self._batches and _WRITER.ready():
            self._leaving.setdefault(salt, []).append(block.block_hash)
        else:
            self.table.remove_one(salt, block.block_hash)


class PresenceProbe:
    """A client's read-only mapping of the daemon's table."""

    def __init__(self, mapping: mmap.mmap, region_id: int) -> None:
        self._mmap = mapping
        buckets = int(np.frombuffer(mapping, dtype=np.uint64, count=8)[_BUCKETS])
        self.header, self.flat, self.locs, self.sums = _arrays(mapping, buckets)
        self.rows = self.flat.reshape(buckets, WAYS)
        self.buckets = buckets
        self._shift_int = 64 - (buckets.bit_length() - 1)
        # the compiled probe's arguments: the whole file's words, the key words'
        # count, a key's two buckets (buckets_of)
        self._table = np.frombuffer(mapping, dtype=np.uint64)
        self._n_words = buckets * WAYS
        self._shift = np.uint64(self._shift_int)
        self._mask = np.uint64(buckets - 1)
        n, h = buckets * WAYS, HEADER_BYTES // 8
        self._view = memoryview(mapping).cast("Q")
        # the table, one word at a time
        self._words = self._view[h : h + n]
        self._loc_words = self._view[h + n : h + 2 * n]
        self._sum_words = self._view[h + 2 * n : h + 3 * n]
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
            and st.st_size == table_bytes(buckets)
            and region_id != 0
            and int(h[_REGION]) == region_id
        )
        del h
        if not ok:
            mapping.close()
            return None
        _NATIVE.start()  # numpy probes until it is compiled (kvstore.native)
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
        if _NATIVE.ready():
            out = np.zeros((1, 4), dtype=np.uint64)
            found = self._compiled(salt, hashes, _LOOKUP, out)
            counts = out[0].tolist()
        else:
            counts = [0, 0, 0, 0]
            # The first hashes in Python ints (a numpy call costs ~1-2 us here: a
            # short lookup, or one that misses early, is done before numpy starts).
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
        if _NATIVE.ready():
            out = np.zeros((1, len(hashes)), dtype=np.uint64)
            self._compiled(salt, hashes, _PRESENT, out)
            found = out[0].astype(bool)
        elif len(hashes) <= PYTHON_PROBES:
            # A decode step's few new blocks: Python ints (each numpy call costs
            # ~2 µs warm, 10-20 µs right after a forward has evicted the caches).
            find = self._find
            found = np.array([find(mix_key(salt, h)) >= 0 for h in hashes.tolist()], dtype=bool)
        else:
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

    def _compiled(
        self, salt: int, hashes: Sequence[int] | np.ndarray, mode: int, out: np.ndarray
    ) -> int:
        """The compiled probe (kvstore._presence_kernel) in ``mode``, answering into ``out``."""
        return int(
            _NATIVE.kernel(
                self._table,
                _KEYS_AT,
                self._n_words,
                self._shift,
                self._mask,
                np.uint64(salt),
                np.ascontiguousarray(hashes, dtype=np.uint64),
                mode,
                out,
            )
        )

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

    # ------------------------------------------------------------ direct loads

    def locate(self, salt: int, hashes: Sequence[int] | np.ndarray) -> Located | None:
        """Where the longest prefix of ``hashes`` held in DRAM lies, from the table
        alone: the slots a client may copy from without a call, then check with
        ``intact``. None when the table is no longer current."""
        if not self.current:
            return None
        n = len(hashes)
        if _NATIVE.ready():
            out = np.empty((4, n), dtype=np.uint64)
            got = self._compiled(salt, hashes, _LOCATE, out)
            found = got >> 1
            located = Located(
                out[0, :found].view(np.intp),
                out[1, :found],
                out[2, :found],
                out[3, :found],
                bool(got & 1),
                self,
            )
        elif n <= LOCATE_PYTHON_PROBES:
            located = self._locate_few(salt, hashes)
        else:
            located = self._locate_many(salt, np.asarray(hashes, np.uint64))
        return located if self.current else None

    def _find(self, key: int) -> int:
        """The flat index of the entry holding ``key`` (any tier), or -1."""
        words = self._words
        for base in ((key >> self._shift_int) * WAYS, ((key >> 2) & (self.buckets - 1)) * WAYS):
            for i, word in enumerate(words[base : base + WAYS].tolist()):
                if word ^ key < 4:
                    return base + i
        return -1

    def _locate_few(self, salt: int, hashes: Sequence[int] | np.ndarray) -> Located:
        words, locs, sums = self._words, self._loc_words, self._sum_words
        at: list[int] = []
        keys: list[int] = []
        where: list[int] = []
        checks: list[int] = []
        elsewhere = False
        for h in hashes:
            key = mix_key(salt, int(h))
            a = self._find(key)
            if a < 0:
                break  # not held: the prefix ends here
            word, loc = words[a], locs[a]
            if word ^ key >= 4:
                # it left since _find read its way, and another block took the
                # way: word and location are that block's (intact would pass them)
                elsewhere = True
                break
            if word & 3 != int(Tier.DRAM) or not loc:
                elsewhere = True  # held, but not where a client can read it
                break
            at.append(a)
            keys.append(word)
            where.append(loc)
            checks.append(sums[a])
        u64 = np.uint64
        return Located(
            np.array(at, np.intp),
            np.array(keys, u64),
            np.array(where, u64),
            np.array(checks, u64),
            elsewhere,
            self,
        )

    def _locate_many(self, salt: int, hashes: np.ndarray) -> Located:
        keys = mix_keys(salt, hashes)
        n = len(keys)
        b1, b2 = buckets_of(keys, self.buckets)
        # word ^ key < 4 where a way holds the key: its way in each bucket, if any
        # (numpy calls cost ~1-2 us each here: as few as it takes)
        got = self.rows.take(b1, axis=0)
        np.bitwise_xor(got, keys[:, None], out=got)
        way = got.argmin(axis=1)
        at = b1 * WAYS + way
        held = got.ravel().take(np.arange(0, n * WAYS, WAYS) + way) < 4
        if not held.all():
            second = np.nonzero(~held)[0]
            got = self.rows.take(b2.take(second), axis=0)
            np.bitwise_xor(got, keys.take(second)[:, None], out=got)
            way = got.argmin(axis=1)
            at[second] = b2.take(second) * WAYS + way
            held[second] = got.ravel().take(np.arange(0, second.size * WAYS, WAYS) + way) < 4
        words = self.flat.take(at)
        locs = self.locs.take(at)
        # read again: a block that left since the reads above may have had its way
        # taken by another block, whose word and location intact would pass
        still = (words ^ keys) < 4
        readable = held & still & ((words & _LOW) == _DRAM_BITS) & (locs != 0)
        if readable.all():
            return Located(at, words, locs, self.sums.take(at), False, self)
        k = int(readable.argmin())
        return Located(at[:k], words[:k], locs[:k], self.sums.take(at[:k]), bool(held[k]), self)

    def intact(self, located: Located) -> int:
        """How many leading blocks of ``located`` are still where it found them, with
        nothing else ever there in between: read after the copy, so a block the
        daemon let go of (removed, moved, its slot freed) since ``locate`` fails
        here, and no copy of it counts. 0 when the table is no longer current (a
        warm restart's daemon may hand out these slots again)."""
        n = len(located.at)
        if not n:
            return 0
        if n <= PYTHON_PROBES:
            words, locs = self._words, self._loc_words
            ok = n
            for i, (a, w, loc) in enumerate(
                zip(
                    located.at.tolist(),
                    located.words.tolist(),
                    located.locs.tolist(),
                    strict=True,
                )
            ):
                if words[a] != w or locs[a] != loc:
                    ok = i
                    break
        else:
            same = (self.flat[located.at] == located.words) & (
                self.locs[located.at] == located.locs
            )
            bad = np.flatnonzero(~same)
            ok = int(bad[0]) if bad.size else n
        # The header last: retired or rebuilt after the words were read (a new
        # daemon on a warm-restarted region) counts for nothing.
        return ok if self.current else 0

    def close(self) -> None:
        self.header = self.flat = self.locs = self.sums = np.empty(0, dtype=np.uint64)
        self._table = self.header
        self.rows = np.empty((0, WAYS), dtype=np.uint64)
        try:
            for view in (self._words, self._loc_words, self._sum_words):
                view.release()
            self._view.release()
            self._mmap.close()
        except BufferError:
            pass  # another thread is probing it: unmapped when its views go


class Located(NamedTuple):
    """Where PresenceProbe.locate found a prefix: for each block, the flat index of
    its entry, the key word and location seen there (what ``intact`` compares
    after the copy) and its checksum (0: none). ``elsewhere``: the block after
    the prefix is held, in a tier a client cannot read directly (disk, the GPU
    pool): the daemon must move it first, so a call would find more."""

    at: np.ndarray
    words: np.ndarray
    locs: np.ndarray
    checksums: np.ndarray
    elsewhere: bool
    probe: PresenceProbe

    @property
    def found(self) -> int:
        return len(self.at)

    def offsets(self) -> np.ndarray:
        """Each block's byte offset in the DRAM region."""
        return (self.locs >> np.uint64(LOC_STAMP_BITS)) * np.uint64(LOC_UNIT_BYTES)
