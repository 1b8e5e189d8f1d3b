"""``settle_heap``: the router's start-up heap leaves the cyclic collector's reach."""

from __future__ import annotations

import gc
import weakref

from kvstore.router.proxy import settle_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_settle_heap_collects_garbage_then_freezes_the_rest():
    gc.unfreeze()
    try:
        live = _Node()
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # an unreachable cycle: only the collector frees it
        dead = weakref.ref(a)
        del a, b
        settle_heap()
        assert dead() is None  # collected first, not frozen with the rest
        assert gc.get_freeze_count() > 0
        assert all(o is not live for o in gc.get_objects())  # live ones: frozen
    finally:
        gc.unfreeze()
