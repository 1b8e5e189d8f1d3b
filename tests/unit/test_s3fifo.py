"""S3-FIFO against the eviction-policy contract, and the scan resistance it is chosen for."""

from __future__ import annotations

import itertools

import pytest

from kvstore.eviction.lru import LRUPolicy
from kvstore.eviction.s3fifo import S3FIFOPolicy

POLICIES = [LRUPolicy, S3FIFOPolicy]


class Cache:
    """What the manager does with a policy: admit on miss, evict coldest unpinned."""

    def __init__(self, policy, capacity: int) -> None:
        self.policy, self.capacity = policy, capacity
        self.resident: set = set()
        self.pinned: set = set()
        self.hits = self.misses = 0

    def access(self, key) -> bool:
        if key in self.resident:
            self.hits += 1
            self.policy.touch(key)
            return True
        self.misses += 1
        if len(self.resident) >= self.capacity:
            need = len(self.resident) - self.capacity + 1
            chosen = []
            for victim in self.policy.victims():
                if victim in self.pinned:
                    continue
                chosen.append(victim)
                if len(chosen) == need:
                    break
            for victim in chosen:
                self.policy.remove(victim)
                self.resident.discard(victim)
        self.policy.insert(key)
        self.resident.add(key)
        return False


@pytest.mark.parametrize("cls", POLICIES)
def test_full_walk_yields_every_key_once(cls):
    policy = cls()
    keys = [("ns", i) for i in range(50)]
    for k in keys:
        policy.insert(k)
    for k in keys[::3]:
        policy.touch(k)
    walked = list(policy.victims())
    assert sorted(walked) == keys
    assert len(policy) == 50
    assert all(k in policy for k in keys)
    # A walk that removed nothing leaves every key resident and walkable again.
    assert sorted(policy.victims()) == keys


@pytest.mark.parametrize("cls", POLICIES)
def test_untouched_keys_leave_in_insertion_order(cls):
    policy = cls()
    for i in range(20):
        policy.insert(i)
    it = policy.victims()
    assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("cls", POLICIES)
def test_pinned_keys_are_skipped_and_stay(cls):
    cache = Cache(cls(), capacity=10)
    for i in range(10):
        cache.access(i)
    cache.pinned = {0, 1, 2}
    for i in range(10, 30):
        cache.access(i)
    assert {0, 1, 2} <= cache.resident
    assert len(cache.resident) == 10 == len(cache.policy)
    assert set(cache.policy.victims()) == cache.resident


@pytest.mark.parametrize("cls", POLICIES)
def test_remove_and_reinsert(cls):
    policy = cls()
    policy.insert("a")
    policy.insert("b")
    policy.remove("a")
    policy.remove("missing")  # a no-op, not an error
    assert "a" not in policy and len(policy) == 1
    policy.insert("a")
    policy.insert("a")  # twice = a hit, not a duplicate
    assert len(policy) == 2
    assert sorted(policy.victims()) == ["a", "b"]


def test_one_shot_scan_does_not_flush_the_hot_set():
    hot = [("hot", i) for i in range(60)]
    results = {}
    for cls in POLICIES:
        cache = Cache(cls(), capacity=100)
        for _ in range(3):
            for k in hot:
                cache.access(k)
        for i in range(1000):  # a scan ten times the cache
            cache.access(("scan", i))
        results[cls.__name__] = sum(k in cache.resident for k in hot)
    assert results["S3FIFOPolicy"] == len(hot)
    assert results["LRUPolicy"] == 0


def test_quick_return_from_ghost_goes_to_main():
    cache = Cache(S3FIFOPolicy(), capacity=20)
    cache.access("x")
    for i in range(25):  # "x" leaves small unread: into ghost
        cache.access(i)
    assert "x" not in cache.resident
    cache.access("x")  # back from ghost: straight into main
    for i in range(100, 200):
        cache.access(i)  # new one-shot keys churn through small only
    assert "x" in cache.resident


def test_ghost_is_bounded():
    policy = S3FIFOPolicy(ghost_min=16)
    for i in range(1000):
        policy.insert(i)
        policy.remove(i)
    assert len(policy._ghost) <= 16
    assert len(policy) == 0


def test_abandoned_walk_loses_no_key():
    policy = S3FIFOPolicy()
    for i in range(100):
        policy.insert(i)
    for i in range(0, 100, 2):
        policy.touch(i)
    for _ in range(5):
        it = policy.victims()
        next(it)
        next(it)
        del it  # the manager found room and stopped early
    policy.insert(1000)  # the next operation restores the walk's held keys
    assert sorted(policy.victims()) == [*range(100), 1000]


def test_coldest_is_read_only_and_puts_unhit_keys_first():
    def build():
        p = S3FIFOPolicy(small_ratio=0.5, ghost_min=4)
        for k in range(10):
            p.insert(k)
        for k in (1, 3):
            p.touch(k)
        return p

    p, q = build(), build()
    order = list(p.coldest())
    assert sorted(order) == list(range(10))
    assert order.index(0) < order.index(1) and order.index(2) < order.index(3)  # hit keys later
    assert list(p.coldest()) == order  # reading twice sees the same order: nothing moved
    # And an eviction walk afterwards is exactly that of a policy never read.
    assert list(itertools.islice(p.victims(), 6)) == list(itertools.islice(q.victims(), 6))
