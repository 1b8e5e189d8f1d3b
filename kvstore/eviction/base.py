"""Eviction policies: which unpinned block to move out of a full tier first.

A policy only orders keys; it never frees memory, never sees pins and never
touches metrics. The manager asks for ``victims()`` (coldest first), skips the
keys it may not move (pinned, leased, mid-store) and stops once it has room, so
a policy must tolerate a partially consumed iterator and keys being removed
while the manager walks it (the manager collects victims before removing).

Primitives:
    insert(key)   a block became resident in the tier
    touch(key)    the block was hit (lookup/load)
    remove(key)   the block left the tier (evicted, deleted, demoted)
    victims()     keys, coldest first (the walk of an eviction: may reorder the policy)
    coldest()     keys, about coldest first, without changing anything (for a
                  reader that evicts nothing, like the disk demoter)
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Protocol


class EvictionPolicy(Protocol):
    def insert(self, key: Hashable) -> None: ...

    def touch(self, key: Hashable) -> None: ...

    def remove(self, key: Hashable) -> None: ...

    def victims(self) -> Iterator[Hashable]: ...

    def coldest(self) -> Iterator[Hashable]: ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...
