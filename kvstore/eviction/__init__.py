"""Eviction policies by name (config ``dram.eviction_policy``)."""

from __future__ import annotations

from collections.abc import Callable

from kvstore.errors import ConfigError
from kvstore.eviction.base import EvictionPolicy
from kvstore.eviction.lru import LRUPolicy


def _lru(cold_share: float = 0.0) -> EvictionPolicy:
    return LRUPolicy(cold_share=cold_share)


def _s3fifo(cold_share: float = 0.0) -> EvictionPolicy:
    from kvstore.eviction.s3fifo import S3FIFOPolicy

    return S3FIFOPolicy(cold_share=cold_share)


POLICIES: dict[str, Callable[..., EvictionPolicy]] = {"lru": _lru, "s3fifo": _s3fifo}


def make_policy(name: str, *, cold_share: float = 0.0) -> EvictionPolicy:
    """``cold_share``: the share of a policy's keys its low-priority copies may hold
    before they go first (base.py)."""
    try:
        return POLICIES[name](cold_share=cold_share)
    except KeyError:
        raise ConfigError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
