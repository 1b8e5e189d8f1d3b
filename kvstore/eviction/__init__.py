"""Eviction policies by name (config ``dram.eviction_policy``)."""

from __future__ import annotations

from collections.abc import Callable

from kvstore.errors import ConfigError
from kvstore.eviction.base import EvictionPolicy
from kvstore.eviction.lru import LRUPolicy


def _s3fifo() -> EvictionPolicy:
    from kvstore.eviction.s3fifo import S3FIFOPolicy

    return S3FIFOPolicy()


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy, "s3fifo": _s3fifo}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ConfigError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
