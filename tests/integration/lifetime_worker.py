"""One client process of the lifetime property test (test_lifetime_property.py).

    python -m tests.integration.lifetime_worker ADDRESS SEED DURATION_S BLOCK_BYTES [--stall]

Runs a random mix of put / get / get(tier=gpu) / manual loads with short lease TTLs /
delete / clear against one daemon, with random call deadlines, for DURATION_S, and
prints one JSON object: counts per operation, every wrong byte it saw, every
unexpected error. Payloads derive from (namespace, hash), so any process can verify
any block with no shared table.

What counts as wrong: a block reported as found whose bytes are not its hash's,
when the lease it was read under was still valid (a get, or a manual load whose
release succeeded). A manual load whose release failed (its lease expired during
the copy) is "unconfirmed" and not checked: the client learnt its copy may be
invalid. ``--stall`` adds writers that sleep past their store lease's TTL before
writing (issue 19 bug 4b: their bytes must land nowhere another client reads).
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections import Counter
from typing import Any

import numpy as np

from kvstore.client import Client
from kvstore.errors import KVStoreError, LeaseNotFound
from tests.conftest import make_spec

HASHES = 48  # per namespace: small enough that clients collide on the same blocks
NAMESPACES = ("life-a", "life-b")
# Statuses a client may see under these faults; anything else fails the test. A
# LeaseNotFound (or a subclass, raised by the daemon or by the client's own lease
# clock) says the lease ran out: expected with these TTLs, and what the client must learn.
EXPECTED_CODES = {"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "NOT_FOUND", "CANCELLED"}


def payload(ns_index: int, h: int, block_bytes: int) -> np.ndarray:
    rng = np.random.default_rng((ns_index << 32) | h)
    return rng.integers(0, 256, block_bytes, dtype=np.uint8)


class Worker:
    def __init__(self, address: str, seed: int, block_bytes: int, stall: bool) -> None:
        self.rng = random.Random(seed)
        self.block_bytes = block_bytes
        self.stall = stall
        self.client = Client(address, timeout_s=5.0)
        self.namespaces = [
            self.client.declare_namespace(make_spec(block_bytes, model=name)) for name in NAMESPACES
        ]
        self.cache: dict[tuple[int, int], np.ndarray] = {}
        self.ops: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.wrong: list[dict[str, Any]] = []
        self.unexpected: list[str] = []
        self.unconfirmed = 0
        self.checked_blocks = 0

    def data(self, ns_index: int, h: int) -> np.ndarray:
        key = (ns_index, h)
        block = self.cache.get(key)
        if block is None:
            block = self.cache[key] = payload(ns_index, h, self.block_bytes)
        return block

    def rows(self, ns_index: int, hashes: list[int]) -> np.ndarray:
        return np.stack([self.data(ns_index, h) for h in hashes])

    def verify(self, op: str, ns_index: int, hashes: list[int], got: Any, found: int) -> None:
        for i in range(found):
            self.checked_blocks += 1
            if not np.array_equal(np.asarray(got[i]), self.data(ns_index, hashes[i])):
                self.wrong.append({"op": op, "ns": ns_index, "hash": hashes[i], "index": i})

    def run(self, duration_s: float) -> dict[str, Any]:
        ops = [
            (self.put, 5),
            (self.put_gpu, 4),
            (self.get, 5),
            (self.get_gpu, 4),
            (self.manual_load, 4),
            (self.delete, 2),
            (self.clear, 0.2),
        ]
        if self.stall:
            ops += [(self.stalled_put, 1), (self.stalled_load, 1)]
        funcs, weights = zip(*ops, strict=True)
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline:
            op = self.rng.choices(funcs, weights)[0]
            ns_index = self.rng.randrange(len(self.namespaces))
            start = self.rng.randrange(HASHES)
            hashes = list(range(start, min(HASHES, start + self.rng.randint(1, 8))))
            # Call deadlines: mostly ample, sometimes shorter than a tier move.
            self.client.timeout_s = self.rng.choice([5.0, 5.0, 5.0, 0.3, 0.05, 0.01])
            self.ops[op.__name__] += 1
            try:
                op(ns_index, hashes)
            except KVStoreError as exc:
                code = getattr(exc, "status_code", None)
                name = code.name if code is not None else type(exc).__name__
                self.errors[name] += 1
                if name not in EXPECTED_CODES and not isinstance(exc, LeaseNotFound):
                    self.unexpected.append(f"{op.__name__}: {exc}")
        self.client.timeout_s = 5.0
        self.client.flush_releases()
        self.client.close()
        return {
            "ops": dict(self.ops),
            "errors": dict(self.errors),
            "wrong": self.wrong[:50],
            "wrong_count": len(self.wrong),
            "unexpected": self.unexpected[:50],
            "unconfirmed": self.unconfirmed,
            "checked_blocks": self.checked_blocks,
        }

    # ------------------------------------------------------------ operations

    def put(self, ns_index: int, hashes: list[int], tier: str = "dram") -> None:
        self.client.put(self.namespaces[ns_index], hashes, self.rows(ns_index, hashes), tier=tier)

    def put_gpu(self, ns_index: int, hashes: list[int]) -> None:
        self.put(ns_index, hashes, "gpu")

    def get(self, ns_index: int, hashes: list[int], tier: str = "dram") -> None:
        got = self.client.get(self.namespaces[ns_index], hashes, tier=tier)
        self.verify(f"get:{tier}", ns_index, hashes, got.data, got.found)

    def get_gpu(self, ns_index: int, hashes: list[int]) -> None:
        self.get(ns_index, hashes, "gpu")

    def manual_load(self, ns_index: int, hashes: list[int], *, stall_s: float = 0.0) -> None:
        """PrepareLoad with a short TTL, copy, Release: checked only if the release
        proves the lease outlived the copy."""
        c = self.client
        tier = self.rng.choice(["dram", "gpu"])
        ttl_s = self.rng.choice([0.05, 0.2, 1.0])
        handle = c.prepare_load(self.namespaces[ns_index], hashes, lease_ttl_s=ttl_s, tier=tier)
        if not handle.found:
            return
        if stall_s:
            time.sleep(stall_s)  # a stalled reader: its lease runs out before the copy
        space = c.gpu_pool() if handle.tier == "gpu" else c.region
        got = [np.array(space[int(o) : int(o) + self.block_bytes]) for o in handle.offsets]
        c.timeout_s = 5.0
        try:
            c.release(handle)
        except KVStoreError:
            self.unconfirmed += 1  # expired during the copy: the client knows
            return
        self.verify(f"manual:{tier}", ns_index, hashes, got, handle.found)

    def delete(self, ns_index: int, hashes: list[int]) -> None:
        self.client.delete(self.namespaces[ns_index], hashes)

    def clear(self, ns_index: int, hashes: list[int]) -> None:
        self.client.clear(self.namespaces[ns_index])

    def stalled_put(self, ns_index: int, hashes: list[int]) -> None:
        """A writer whose store lease expires before it writes (issue 19 bug 4b)."""
        c = self.client
        c.timeout_s = 5.0
        ns = self.namespaces[ns_index]
        tier = self.rng.choice(["dram", "gpu"])
        handle = c.prepare_store(ns, hashes, lease_ttl_s=0.05, tier=tier)
        idx = handle.allocated
        if not len(idx):
            return
        # Past the TTL and several reaper passes (leases.reap_interval_s = 0.05), well
        # inside the quarantine that bug 4's fix keeps expired slots in (2 s).
        time.sleep(0.5)
        space = c.gpu_pool() if handle.tier == "gpu" else c.region
        for i in idx:
            off = int(handle.offsets[i])
            space[off : off + self.block_bytes] = self.data(ns_index, hashes[i])
        c.commit_store(handle)  # fails: the lease is gone

    def stalled_load(self, ns_index: int, hashes: list[int]) -> None:
        self.manual_load(ns_index, hashes, stall_s=0.5)


def main() -> None:
    address, seed, duration_s, block_bytes = sys.argv[1:5]
    stall = "--stall" in sys.argv[5:]
    worker = Worker(address, int(seed), int(block_bytes), stall)
    print(json.dumps(worker.run(float(duration_s))), flush=True)


if __name__ == "__main__":
    main()
