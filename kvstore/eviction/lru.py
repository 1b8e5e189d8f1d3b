"""Least-recently-used order over a tier's blocks."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator


class LRUPolicy:
    """Coldest = least recently inserted or touched, after the low-priority copies
    (insert_cold, oldest first). O(1) per operation."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()
        self._cold: dict[Hashable, None] = {}  # low-priority copies, FIFO

    def insert(self, key: Hashable) -> None:
        self._cold.pop(key, None)
        self._order[key] = None
        self._order.move_to_end(key)

    def insert_many(self, keys: Iterable[Hashable]) -> None:
        cold, order = self._cold, self._order
        to_end = order.move_to_end
        for key in keys:
            if cold:
                cold.pop(key, None)
            order[key] = None
            to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def touch_many(self, keys: Iterable[Hashable]) -> None:
        order = self._order
        to_end = order.move_to_end
        for key in keys:
            if key in order:
                to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)
        self._cold.pop(key, None)

    def insert_cold(self, key: Hashable) -> None:
        self._order.pop(key, None)
        self._cold.pop(key, None)
        self._cold[key] = None

    def insert_cold_many(self, keys: Iterable[Hashable]) -> None:
        cold = self._cold
        order_pop, cold_pop = self._order.pop, cold.pop
        for key in keys:
            order_pop(key, None)
            cold_pop(key, None)
            cold[key] = None

    def promote(self, key: Hashable) -> None:
        if key in self._cold:
            del self._cold[key]
            self._order[key] = None  # the hot end: it was just hit

    def cold_len(self) -> int:
        return len(self._cold)

    def cold_keys(self) -> Iterator[Hashable]:
        return iter(self._cold)

    def victims(self) -> Iterator[Hashable]:
        # No snapshot (O(n) per call): the manager collects victims before it
        # removes any, as the interface requires.
        return itertools.chain(self._cold, self._order)

    def coldest(self) -> Iterator[Hashable]:
        return self.victims()  # victims() changes nothing here either

    def __len__(self) -> int:
        return len(self._order) + len(self._cold)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._cold
