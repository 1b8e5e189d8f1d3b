"""Least-recently-used order over a tier's blocks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator


class LRUPolicy:
    """Coldest = least recently inserted or touched. O(1) per operation."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[Hashable]:
        # No snapshot (O(n) per call): the manager collects victims before it
        # removes any, as the interface requires.
        return iter(self._order)

    def coldest(self) -> Iterator[Hashable]:
        return iter(self._order)  # victims() changes nothing here either

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
