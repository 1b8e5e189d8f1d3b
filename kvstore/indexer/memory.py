"""In-memory index: one open-addressing hash table of numpy arrays per model.

Why not ``dict[int, set[tuple[str, str]]]``: 12,000 lookups in a Python dict
with millions of int keys cost ~6.5 ms here (a pointer chase per key) before
any set work, and every replica costs a tuple. Here a table is three arrays:
``keys`` (uint64), ``state`` (empty / full / deleted) and ``bits`` (slot x
medium x word uint64: one bit per node id). Lookups, inserts and removals are
vectorized over a whole batch: each probe round is a few numpy passes over
the keys still unresolved, and linear probing at load <= 0.7 needs few rounds.

Slot of a key: multiply by a random odd constant chosen per process, keep the
top bits (Fibonacci hashing). Block hashes are SHA-256 output, but a client
could grind token sequences whose hashes collide on low bits; a secret
multiplier makes that useless.

Not thread-safe: the indexer applies events and answers scores under one lock.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np

from kvstore.errors import ConfigError, InvalidRequest
from kvstore.indexer import walk
from kvstore.indexer.backend import (
    MEDIUMS,
    RANK_MARK,
    NodeScore,
    counted_scores,
    fold_ranks,
    group_ranks,
    medium_index,
    prefix_scores,
    rank_member,
    split_member,
)

_EMPTY, _FULL, _DELETED = 0, 1, 2
_MAX_LOAD = 0.7
_MIN_CAPACITY = 1 << 10
_M = len(MEDIUMS)


class _Table:
    """Hash -> (medium x node) bitset for one model."""

    def __init__(self, capacity: int, words: int, multiplier: np.uint64) -> None:
        self._mult = multiplier
        self._alloc(capacity, words)

    def _alloc(self, capacity: int, words: int) -> None:
        self.capacity = capacity
        self._shift = np.uint64(64 - (capacity.bit_length() - 1))
        self._mask = capacity - 1
        self.keys = np.zeros(capacity, dtype=np.uint64)
        self.state = np.zeros(capacity, dtype=np.uint8)
        self.bits = np.zeros((capacity, _M, words), dtype=np.uint64)
        self.used = 0
        self.deleted = 0

    @property
    def words(self) -> int:
        return int(self.bits.shape[2])

    def _home(self, keys: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return ((keys * self._mult) >> self._shift).astype(np.int64)

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Slot of each key, -1 where absent."""
        out = np.full(keys.size, -1, dtype=np.int64)
        if self.used == 0 or keys.size == 0:
            return out
        idx = np.arange(keys.size)
        slot = self._home(keys)
        k = keys
        for _ in range(self.capacity):  # bounded: a table always has empty slots
            st = self.state[slot]
            hit = (st == _FULL) & (self.keys[slot] == k)
            out[idx[hit]] = slot[hit]
            more = ~hit & (st != _EMPTY)
            if not more.any():
                break
            idx, slot, k = idx[more], (slot[more] + 1) & self._mask, k[more]
        return out

    def _insert_absent(self, keys: np.ndarray) -> np.ndarray:
        """Insert distinct keys known to be absent; returns their slots."""
        out = np.empty(keys.size, dtype=np.int64)
        idx = np.arange(keys.size)
        slot = self._home(keys)
        for _ in range(self.capacity + keys.size):
            if idx.size == 0:
                break
            free = np.flatnonzero(self.state[slot] != _FULL)
            placed = np.zeros(idx.size, dtype=bool)
            if free.size:
                # several keys may reach the same free slot this round: first wins
                _, first = np.unique(slot[free], return_index=True)
                win = free[first]
                s = slot[win]
                self.deleted -= int(np.count_nonzero(self.state[s] == _DELETED))
                self.state[s] = _FULL
                self.keys[s] = keys[idx[win]]
                out[idx[win]] = s
                placed[win] = True
            keep = ~placed
            idx, slot = idx[keep], (slot[keep] + 1) & self._mask
        self.used += keys.size
        return out

    def reserve(self, extra: int, words: int, force: bool = False) -> bool:
        """Make room for ``extra`` more keys and ``words`` node words; True if rehashed."""
        words = max(words, self.words)
        fits = self.used + self.deleted + extra <= _MAX_LOAD * self.capacity
        if fits and words == self.words and not force:
            return False
        live = self.state == _FULL
        keys, bits = self.keys[live], self.bits[live]
        # after a rehash the load is <= half the limit, so rehashes amortize;
        # the capacity follows the live keys down as well as up
        cap = _MIN_CAPACITY
        while self.used + extra > _MAX_LOAD * cap * 0.5:
            cap *= 2
        self._alloc(cap, words)
        if keys.size:
            slots = self._insert_absent(keys)
            self.bits[slots, :, : bits.shape[2]] = bits
        return True

    def set_bits(self, keys: np.ndarray, m: int, word: int, bit: np.uint64) -> None:
        slots = self.find(keys)
        absent = slots < 0
        if absent.any():
            new, where = np.unique(keys[absent], return_inverse=True)
            if self.reserve(new.size, self.words):
                slots = self.find(keys)  # the rehash moved every key
            slots[absent] = self._insert_absent(new)[where]
        self.bits[slots, m, word] |= bit

    def clear_bits(self, keys: np.ndarray, m: int, word: int, bit: np.uint64) -> None:
        slots = self.find(keys)
        slots = slots[slots >= 0]
        if slots.size == 0:
            return
        self.bits[slots, m, word] &= ~bit
        self._reap(np.unique(slots))

    def clear_node(self, word: int, bit: np.uint64, mediums: list[int]) -> None:
        full = np.flatnonzero(self.state == _FULL)
        if full.size == 0:
            return
        for m in mediums:
            self.bits[full, m, word] &= ~bit
        self._reap(full)

    def _reap(self, slots: np.ndarray) -> None:
        """Mark slots whose bitsets became empty as deleted."""
        empty = slots[~self.bits[slots].any(axis=(1, 2))]
        if empty.size:
            self.state[empty] = _DELETED
            self.used -= empty.size
            self.deleted += empty.size
        # shrink once mostly empty (a quarter of the post-rehash load): the
        # O(capacity) rehash is paid for by the removals that led here
        if self.capacity > _MIN_CAPACITY and self.used < _MAX_LOAD * self.capacity / 8:
            self.reserve(0, self.words, force=True)

    def walk(
        self, hashes: np.ndarray, alive: np.ndarray, pairs: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The compiled prefix walk (``walk.available()``): per node id, prefix
        blocks and of them GPU and DISK-only ones."""
        ids = alive.shape[0] * 64
        prefix = np.zeros(ids, dtype=np.int64)
        gpu, disk = np.zeros(ids, dtype=np.int64), np.zeros(ids, dtype=np.int64)
        walk.walk(
            self.keys,
            self.state,
            self.bits.reshape(self.capacity, -1),
            self.words,
            self._mult,
            self._shift,
            np.int64(self._mask),
            hashes,
            alive,
            pairs,
            prefix,
            gpu,
            disk,
        )
        return prefix, gpu, disk

    def rows(self, keys: np.ndarray) -> np.ndarray:
        slots = self.find(keys)
        rows = self.bits[np.maximum(slots, 0)]
        rows[slots < 0] = 0
        return rows


class MemoryIndex:
    """``IndexBackend`` in process memory."""

    def __init__(
        self, initial_capacity: int = 1 << 16, max_nodes: int = 4096, native: bool | None = None
    ) -> None:
        """``native``: the Score's prefix walk compiled (``kvstore.indexer.walk``),
        else in numpy; same answers. None: compiled once its background compile
        is done, where numba is installed; True: waits for the compile."""
        cap = _MIN_CAPACITY
        while cap < initial_capacity:
            cap *= 2
        self._initial_capacity = cap
        self._max_nodes = max_nodes
        self._mult = np.uint64(secrets.randbits(64) | 1)
        self._tables: dict[str, _Table] = {}
        self._node_bit: dict[str, int] = {}
        self._bit_node: dict[int, str] = {}
        self._free_bits: list[int] = []
        self._words = 1
        self._cursors: dict[str, int] = {}
        # node -> rank -> its rank member (see backend.rank_member)
        self._ranks: dict[str, dict[int, str]] = {}
        self._native = native
        if native is None:
            walk.start()
        elif native and not walk.available():
            raise ConfigError(
                "the compiled Score walk is unavailable (numba missing, KVSTORE_NATIVE_WALK=0, "
                "or its compile failed: see the log)"
            )

    @property
    def native(self) -> bool:
        """Whether a Score now walks compiled (see ``__init__``)."""
        return walk.ready() if self._native is None else self._native

    # --- nodes -------------------------------------------------------------------

    def _bit(self, node: str) -> int:
        bit = self._node_bit.get(node)
        if bit is not None:
            return bit
        base, rank = split_member(node)
        if rank is not None:
            self._bit(base)  # first: a node has an id whenever one of its ranks has
        if self._free_bits:
            bit = self._free_bits.pop()
        else:
            bit = len(self._node_bit)
            if bit >= self._max_nodes:
                raise InvalidRequest(f"index holds {self._max_nodes} nodes already (max_nodes)")
        self._node_bit[node] = bit
        self._bit_node[bit] = node
        self._words = max(self._words, bit // 64 + 1)
        if rank is not None:
            self._ranks.setdefault(base, {})[rank] = node
        return bit

    def _release(self, member: str) -> None:
        bit = self._node_bit.pop(member, None)
        if bit is not None:
            del self._bit_node[bit]
            self._free_bits.append(bit)

    def nodes(self) -> list[str]:
        return sorted(n for n in self._node_bit if RANK_MARK not in n)

    def models(self) -> list[str]:
        return sorted(self._tables)

    def block_count(self, model: str) -> int:
        """Distinct blocks indexed for ``model`` (constant time, unlike stats())."""
        t = self._tables.get(model)
        return 0 if t is None else t.used

    def _table(self, model: str) -> _Table:
        t = self._tables.get(model)
        if t is None:
            t = self._tables[model] = _Table(self._initial_capacity, self._words, self._mult)
        return t

    # --- events ------------------------------------------------------------------

    def add(
        self,
        model: str,
        node: str,
        medium: str | None,
        hashes: np.ndarray,
        rank: int | None = None,
    ) -> None:
        if hashes.size == 0:
            return
        m = medium_index(medium)
        bit = self._bit(rank_member(node, rank))
        t = self._table(model)
        if t.words < self._words:
            t.reserve(0, self._words)
        t.set_bits(hashes, m, bit // 64, np.uint64(1 << (bit % 64)))

    def remove(
        self,
        model: str,
        node: str,
        medium: str | None,
        hashes: np.ndarray,
        rank: int | None = None,
    ) -> None:
        m = medium_index(medium)
        bit = self._node_bit.get(rank_member(node, rank))
        t = self._tables.get(model)
        if bit is None or t is None or hashes.size == 0 or bit // 64 >= t.words:
            return
        t.clear_bits(hashes, m, bit // 64, np.uint64(1 << (bit % 64)))

    def clear(
        self,
        node: str,
        model: str | None,
        mediums: Sequence[str] | None = None,
        rank: int | None = None,
    ) -> None:
        bit = self._node_bit.get(rank_member(node, rank))
        if bit is None:
            return
        ms = list(range(_M)) if mediums is None else sorted({medium_index(m) for m in mediums})
        tables = self._tables.values() if model is None else [self._tables.get(model)]
        for t in tables:
            if t is not None and bit // 64 < t.words:
                t.clear_node(bit // 64, np.uint64(1 << (bit % 64)), ms)

    def drop_node(self, node: str) -> None:
        for rank, member in self._ranks.pop(node, {}).items():
            self.clear(node, None, rank=rank)
            self._release(member)
        self.clear(node, None)
        self._release(node)

    # --- queries -----------------------------------------------------------------

    def score(
        self, model: str, hashes: np.ndarray, nodes: Sequence[str] | None = None
    ) -> list[NodeScore]:
        t = self._tables.get(model)
        if t is None or hashes.size == 0:
            return []
        alive = np.zeros(t.words, dtype=np.uint64)
        wanted = self._node_bit if nodes is None else nodes
        pairs: list[tuple[int, int]] = []  # (node bit, rank member bit) to fold
        for name in wanted:
            bit = self._node_bit.get(name)
            if bit is None or bit // 64 >= t.words or RANK_MARK in name:
                continue  # rank members come with their node
            alive[bit // 64] |= np.uint64(1 << (bit % 64))
            for member in self._ranks.get(name, {}).values():
                rb = self._node_bit[member]
                if rb // 64 < t.words:
                    alive[rb // 64] |= np.uint64(1 << (rb % 64))
                    pairs.append((bit, rb))
        if not alive.any():
            return []
        if self.native:
            hashes = np.ascontiguousarray(hashes, dtype=np.uint64)
            pair_ids = np.array(pairs, dtype=np.int64).reshape(-1, 2)
            prefix, gpu, disk = t.walk(hashes, alive, pair_ids)
            return group_ranks(counted_scores(prefix, gpu, disk, self._bit_node))
        # Look up in growing chunks and stop once no candidate still has the
        # prefix: a miss on block 0 costs one small probe, a 1M-token request
        # nobody holds costs nothing more.
        parts: list[np.ndarray] = []
        running = alive.copy()
        start, chunk = 0, 256
        while start < hashes.size:
            rows = t.rows(hashes[start : start + chunk])
            fold_ranks(rows, pairs)
            parts.append(rows)
            held = np.bitwise_or.reduce(rows, axis=1) & running
            running = np.bitwise_and.reduce(held, axis=0)
            if not running.any():
                break
            start += chunk
            chunk *= 4
        return group_ranks(prefix_scores(np.concatenate(parts), alive, self._bit_node))

    def stats(self) -> dict[str, int]:
        entries = sum(t.used for t in self._tables.values())
        nbytes = sum(t.keys.nbytes + t.state.nbytes + t.bits.nbytes for t in self._tables.values())
        replicas = 0
        for t in self._tables.values():
            full = t.state == _FULL
            if full.any():
                b = t.bits[full]
                replicas += int(np.unpackbits(b.view(np.uint8)).sum(dtype=np.int64))
        return {
            "models": len(self._tables),
            "nodes": len(self._node_bit) - sum(len(r) for r in self._ranks.values()),
            "blocks": entries,
            "replicas": replicas,
            "bytes": nbytes,
        }

    def memory_bytes(self) -> int:
        """Bytes the tables hold (cheap: no pass over the entries, unlike ``stats``)."""
        return sum(t.keys.nbytes + t.state.nbytes + t.bits.nbytes for t in self._tables.values())

    def ping(self) -> bool:
        return False  # process memory is never unreachable and never lost alone

    def reset(self) -> None:
        """Forget everything (a mirror about to be reloaded from its durable copy)."""
        self._tables.clear()
        self._node_bit.clear()
        self._bit_node.clear()
        self._free_bits.clear()
        self._ranks.clear()
        self._words = 1

    def load_cursor(self, source: str) -> int | None:
        return self._cursors.get(source)

    def save_cursor(self, source: str, seq: int) -> None:
        self._cursors[source] = seq

    def forget_cursor(self, source: str) -> None:
        self._cursors.pop(source, None)

    def close(self) -> None:
        self._tables.clear()
