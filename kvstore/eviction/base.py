"""Eviction policies: which unpinned block to move out of a full tier first.

A policy only orders keys; it never frees memory, never sees pins and never
touches metrics. The manager asks for ``victims()`` (coldest first), skips the
keys it may not move (pinned, leased, mid-store) and stops once it has room, so
a policy must tolerate a partially consumed iterator and keys being removed
while the manager walks it (the manager collects victims before removing).

Primitives:
    insert(key)   a block became resident in the tier
    insert_many(keys)  insert() of each, in order (a commit's blocks)
    touch(key)    the block was hit (lookup/load)
    touch_many(keys)  touch() of each, in order (a load's blocks)
    remove(key)   the block left the tier (evicted, deleted, demoted)
    victims()     keys, coldest first (the walk of an eviction: may reorder the policy)
    coldest()     keys, about coldest first, without changing anything (for a
                  reader that evicts nothing, like the disk demoter)

Low-priority copies (docs/eviction.md, "Admission of pulled copies"):
    insert_cold(key)  the block enters (or moves to) a FIFO of low-priority copies
                      ahead of the policy's own order: first to go, oldest first;
                      touch() does not move it (the placement decides promotion)
    insert_cold_many(keys)  insert_cold() of each, in order (a pull's blocks)
    promote(key)      a low-priority copy becomes a normal block (as if just hit)
    cold_len()        how many low-priority copies are resident
    cold_keys()       the low-priority copies, oldest first (read only)
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from typing import Protocol


class EvictionPolicy(Protocol):
    def insert(self, key: Hashable) -> None: ...

    def insert_many(self, keys: Iterable[Hashable]) -> None:
        """insert() of each key, in order."""

    def touch(self, key: Hashable) -> None: ...

    def touch_many(self, keys: Iterable[Hashable]) -> None:
        """touch() of each key, in order."""

    def remove(self, key: Hashable) -> None: ...

    def insert_cold(self, key: Hashable) -> None: ...

    def insert_cold_many(self, keys: Iterable[Hashable]) -> None:
        """insert_cold() of each key, in order."""

    def promote(self, key: Hashable) -> None: ...

    def cold_len(self) -> int: ...

    def cold_keys(self) -> Iterator[Hashable]: ...

    def victims(self) -> Iterator[Hashable]: ...

    def coldest(self) -> Iterator[Hashable]: ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...
