"""S3-FIFO: a scan-resistant order over a tier's blocks.

Three FIFO queues (Yang et al., "FIFO queues are all you need for cache
eviction", SOSP 2023):

    small  new blocks land here (about a tenth of the tier)
    main   blocks that were hit while in small, or that came back from ghost
    ghost  keys (no bytes) recently evicted from small, about main's length

A block read once and never again (a one-shot scan, a context that is not
re-sent) leaves from ``small`` without disturbing ``main``, where the long
shared prefixes and re-sent agent contexts live. Hits only bump a 2-bit
counter, so a hit costs a dict lookup, not a list relink.

Low-priority copies (``insert_cold``: a block pulled from a peer, say) wait in a
fourth FIFO, ``cold``, ahead of all three: they go first, oldest first, and
leave it by ``promote`` (into main: they were reused) or by eviction.

Each queue is an insertion-ordered dict, so every primitive is O(1) and
``victims()`` does O(1) amortised work per key it yields.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Iterator

_FREQ_MAX = 3


class S3FIFOPolicy:
    """Coldest first by S3-FIFO. ``small_ratio`` is small's share of resident keys."""

    def __init__(self, small_ratio: float = 0.1, ghost_min: int = 1024) -> None:
        assert 0.0 < small_ratio < 1.0
        self._small_ratio = small_ratio
        self._ghost_min = ghost_min
        self._small: dict[Hashable, None] = {}
        self._main: dict[Hashable, None] = {}
        self._ghost: dict[Hashable, None] = {}
        self._freq: dict[Hashable, int] = {}
        # Low-priority copies, FIFO, outside small/main/freq (docs/eviction.md).
        self._cold: dict[Hashable, None] = {}
        # Keys a victims() walk has handed out and the manager has not removed
        # yet, with the queue they came from: they go back to its head when the
        # walk ends, so a skipped (pinned) key stays resident.
        self._held: list[tuple[Hashable, dict[Hashable, None]]] = []

    def insert_many(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self.insert(key)

    def insert(self, key: Hashable) -> None:
        self._restore()
        self._cold.pop(key, None)
        if key in self._freq:
            self.touch(key)
            return
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None  # evicted too early last time: it was worth keeping
        else:
            self._small[key] = None

    def touch(self, key: Hashable) -> None:
        freq = self._freq.get(key)
        if freq is not None and freq < _FREQ_MAX:
            self._freq[key] = freq + 1

    def touch_many(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self.touch(key)

    def remove(self, key: Hashable) -> None:
        self._restore()
        self._cold.pop(key, None)
        if self._freq.pop(key, None) is None:
            return
        if key in self._small:
            del self._small[key]
            # Left from small unread: remember it, so a quick return goes to main.
            self._ghost[key] = None
            limit = max(self._ghost_min, len(self._main))
            while len(self._ghost) > limit:
                del self._ghost[next(iter(self._ghost))]
        else:
            self._main.pop(key, None)

    def insert_cold(self, key: Hashable) -> None:
        self._restore()
        if self._freq.pop(key, None) is not None:
            # Out of small/main without a ghost entry: it did not leave the tier.
            self._small.pop(key, None)
            self._main.pop(key, None)
        self._cold.pop(key, None)
        self._cold[key] = None

    def insert_cold_many(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self.insert_cold(key)

    def promote(self, key: Hashable) -> None:
        self._restore()
        if key in self._cold:
            del self._cold[key]
            self._freq[key] = 0
            self._main[key] = None  # reused since it came: worth keeping

    def cold_len(self) -> int:
        return len(self._cold)

    def cold_keys(self) -> Iterator[Hashable]:
        return iter(self._cold)

    def victims(self) -> Iterator[Hashable]:
        self._restore()
        # The cold FIFO is only read (a key the manager skips stays where it is);
        # then small/main by S3-FIFO.
        return itertools.chain(self._cold, self._walk())

    def coldest(self) -> Iterator[Hashable]:
        """About the order the next walks would evict in, without moving anything:
        unhit keys of small, unhit keys of main, then the hit ones (which a walk
        would first move to main or give another round)."""
        self._restore()
        freq = self._freq
        yield from self._cold
        yield from (k for k in self._small if not freq[k])
        yield from (k for k in self._main if not freq[k])
        yield from (k for k in self._small if freq[k])
        yield from (k for k in self._main if freq[k])

    def _walk(self) -> Iterator[Hashable]:
        # Every step either yields a key (taking it out of its queue), moves a
        # hit key from small to main, or lowers a main key's counter: at most
        # 1 + 1 + 3 steps per key.
        budget = 5 * len(self._freq) + 1
        while budget > 0 and (self._small or self._main):
            budget -= 1
            resident = len(self._freq)
            if self._small and (len(self._small) >= self._small_ratio * resident or not self._main):
                queue = self._small
                key = next(iter(queue))
                del queue[key]
                if self._freq[key] > 0:
                    self._freq[key] = 0
                    self._main[key] = None
                    continue
            else:
                queue = self._main
                key = next(iter(queue))
                del queue[key]
                if self._freq[key] > 0:
                    self._freq[key] -= 1
                    queue[key] = None
                    continue
            self._held.append((key, queue))
            yield key

    def _restore(self) -> None:
        """Put keys a walk handed out, and that are still resident, back in their queue.

        They go to the tail: a key the manager skipped is pinned, i.e. being
        read right now, and a dict cannot take a key back at its head in O(1).
        """
        if not self._held:
            return
        held, self._held = self._held, []
        for key, queue in held:
            if key in self._freq:
                queue[key] = None

    def __len__(self) -> int:
        return len(self._freq) + len(self._cold)

    def __contains__(self, key: object) -> bool:
        return key in self._freq or key in self._cold
