"""One system's side of `kvstore-bench compare`, run as a subprocess.

    python kvstore_bench/compare_worker.py '<json params>'   -> one JSON line on stdout

Each system is measured by this same file, in its own interpreter (LMCache
and Mooncake live in their own virtual environments, see
kvstore_bench/setup_peers.sh), so they all get the same blocks, the same timing code
and a memcpy reference measured in the same process, just before them.
It needs only numpy and the system's own client; it must not import kvstore
unless it measures kvstore.

Measured per system and block size:
  store: one batch of n blocks from the caller's memory into the system, the
         system's batch API (pipelined for Redis); fresh keys every round.
  load:  the same n blocks back into the caller's buffer (a private,
         pre-faulted numpy array), bytes verified after the timed rounds.
  latency: one block stored / loaded, one call at a time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np


def percentiles(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples, dtype=np.float64)
    p10, p50, p90, p99 = np.percentile(a, [10, 50, 90, 99])
    return {"n": len(a), "median_s": p50, "p10_s": p10, "p90_s": p90, "p99_s": p99}


def make_blocks(n: int, block_bytes: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)


def memcpy_s(src: np.ndarray, dst: np.ndarray) -> float:
    """One copy of the whole batch (numpy.copyto -> memcpy): the fastest these
    bytes can move in this process, with no per-block overhead."""
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t0


class System:
    """store(keys, blocks) / load(keys, out) / remove(keys) for one system."""

    name = ""

    def store(self, keys: list[str], blocks: np.ndarray) -> None:
        raise NotImplementedError

    def load(self, keys: list[str], out: np.ndarray) -> None:
        raise NotImplementedError

    def remove(self, keys: list[str]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def settings(self) -> dict[str, Any]:
        return {}


class KVStoreSystem(System):
    name = "kvstore"

    def __init__(self, p: dict[str, Any]) -> None:
        import xxhash

        from kvstore.client import Client, NamespaceSpec
        from kvstore.presence import compiled_probes

        self._xxh = xxhash.xxh3_64_intdigest
        # The presence probes compiled before anything is timed, as an engine has
        # them (its connector starts the compile at construction). Left to start
        # at the first store, numba's cache load (~1 s of a thread holding the
        # interpreter lock) fell inside the timed rounds: 64 KiB one-block store
        # p99 5.6 ms and load p99 1.1 ms against 0.5 / 0.17 ms with the numpy
        # probes, alternated runs (2026-12-04).
        self._probes = "compiled" if compiled_probes(120.0) else "numpy"
        self.client = Client(p["address"])
        self.ns = self.client.declare_namespace(
            NamespaceSpec(
                model="compare",
                dtype="uint8",
                block_size_tokens=1,
                num_layers=1,
                num_kv_heads=1,
                head_dim=p["block_bytes"],
                tp_rank=0,
                tp_world_size=1,
                tenant="",
                block_bytes=p["block_bytes"],
            )
        )
        self._address = p["address"]

    def _hashes(self, keys: list[str]) -> np.ndarray:
        return np.array([self._xxh(k.encode()) for k in keys], dtype=np.uint64)

    def store(self, keys: list[str], blocks: np.ndarray) -> None:
        res = self.client.put(self.ns, self._hashes(keys), blocks)
        if res.stored + res.skipped != len(keys):
            raise RuntimeError(f"kvstore stored {res.stored}+{res.skipped} of {len(keys)}")

    def load(self, keys: list[str], out: np.ndarray) -> None:
        res = self.client.get(self.ns, self._hashes(keys), out=out)
        if res.found != len(keys):
            raise RuntimeError(f"kvstore found {res.found} of {len(keys)}")

    def remove(self, keys: list[str]) -> None:
        self.client.delete(self.ns, self._hashes(keys))

    def close(self) -> None:
        self.client.close()

    def settings(self) -> dict[str, Any]:
        channel = (
            "lean local channel (Unix socket)"
            if self.client.using_local_channel
            else "gRPC over unix socket"
        )
        return {
            "transport": f"{channel} + shared-memory region",
            "presence probes": self._probes,
            "address": self._address,
        }


class RedisSystem(System):
    name = "redis"

    def __init__(self, p: dict[str, Any]) -> None:
        import redis

        self.r = redis.Redis(unix_socket_path=p["unix_socket"])
        self.r.ping()
        self._sock = p["unix_socket"]

    def store(self, keys: list[str], blocks: np.ndarray) -> None:
        pipe = self.r.pipeline(transaction=False)
        for k, b in zip(keys, blocks, strict=True):
            pipe.set(k, memoryview(b))
        if not all(pipe.execute()):
            raise RuntimeError("redis SET failed")

    def load(self, keys: list[str], out: np.ndarray) -> None:
        pipe = self.r.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        for i, value in enumerate(pipe.execute()):
            if value is None:
                raise RuntimeError(f"redis: {keys[i]} missing")
            out[i] = np.frombuffer(value, dtype=np.uint8)

    def remove(self, keys: list[str]) -> None:
        self.r.delete(*keys)

    def settings(self) -> dict[str, Any]:
        return {
            "client": "redis-py, pipelined (transaction=False), unix socket",
            "socket": self._sock,
        }


class MooncakeSystem(System):
    name = "mooncake"

    def __init__(self, p: dict[str, Any]) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store_ = MooncakeDistributedStore()
        buf_bytes = p["n_blocks"] * p["block_bytes"] * 2 + (64 << 20)
        # This client holds no segment of its own (0): the data lives in the
        # holder process, as with a per-node store service.
        rc = self.store_.setup(
            "127.0.0.1", p["metadata_url"], 0, buf_bytes, "tcp", "", p["master_address"]
        )
        if rc != 0:
            raise RuntimeError(f"mooncake setup failed: {rc}")
        self._registered: set[int] = set()

    def _register(self, arr: np.ndarray) -> None:
        ptr = arr.ctypes.data
        if ptr not in self._registered:
            rc = self.store_.register_buffer(ptr, arr.nbytes)
            if rc != 0:
                raise RuntimeError(f"mooncake register_buffer: {rc}")
            self._registered.add(ptr)

    def store(self, keys: list[str], blocks: np.ndarray) -> None:
        self._register(blocks)
        base, bb = blocks.ctypes.data, blocks.shape[1]
        rcs = self.store_.batch_put_from(
            keys, [base + i * bb for i in range(len(keys))], [bb] * len(keys)
        )
        bad = [rc for rc in rcs if rc != 0]
        if bad:
            raise RuntimeError(f"mooncake batch_put_from: {len(bad)} failed, e.g. {bad[0]}")

    def load(self, keys: list[str], out: np.ndarray) -> None:
        self._register(out)
        base, bb = out.ctypes.data, out.shape[1]
        rcs = self.store_.batch_get_into(
            keys, [base + i * bb for i in range(len(keys))], [bb] * len(keys)
        )
        bad = [rc for rc in rcs if rc != bb]
        if bad:
            raise RuntimeError(f"mooncake batch_get_into: {len(bad)} short, e.g. {bad[0]}")

    def remove(self, keys: list[str]) -> None:
        self.store_.batch_remove(keys, True)

    def close(self) -> None:
        self.store_.close()

    def settings(self) -> dict[str, Any]:
        return {
            "client": "MooncakeDistributedStore batch_put_from/batch_get_into, registered buffers",
            "transport": "tcp on 127.0.0.1; data held by a separate holder process",
        }


def _mooncake_holder(p: dict[str, Any]) -> int:
    """Mount the segment that stores the data, then wait to be terminated."""
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup(
        "127.0.0.1", p["metadata_url"], p["segment_bytes"], 16 << 20, "tcp", "", p["master_address"]
    )
    print(json.dumps({"ready": rc == 0, "rc": rc}), flush=True)
    if rc != 0:
        return 1
    sys.stdin.read()  # the parent closes our stdin to stop us
    s.close()
    return 0


def make_system(p: dict[str, Any]) -> System:
    kind = p["system"]
    if kind == "kvstore":
        return KVStoreSystem(p)
    if kind == "redis":
        return RedisSystem(p)
    if kind == "mooncake":
        return MooncakeSystem(p)
    if kind.startswith("lmcache-"):
        from kvstore_bench import compare_lmcache  # only in the LMCache venv

        return compare_lmcache.make(p)
    raise ValueError(f"unknown system {kind!r}")


def measure(p: dict[str, Any]) -> dict[str, Any]:
    n, bb, repeats = p["n_blocks"], p["block_bytes"], p["repeats"]
    blocks = make_blocks(n, bb, p["seed"])
    out = np.zeros_like(blocks)
    out.fill(1)  # pre-fault
    system = make_system(p)
    result: dict[str, Any] = {"system": system.name, "block_bytes": bb, "n_blocks": n}
    try:
        memcpy, store, load = [], [], []
        for r in range(repeats):
            memcpy.append(memcpy_s(blocks, out))
            out.fill(0)
            keys = [f"r{r}-b{i}-{bb}" for i in range(n)]
            t0 = time.perf_counter()
            system.store(keys, blocks)
            store.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            system.load(keys, out)
            load.append(time.perf_counter() - t0)
            if not np.array_equal(out, blocks):
                raise RuntimeError(f"{system.name}: loaded bytes differ from stored bytes")
            system.remove(keys)
        one_store, one_load = [], []
        one = blocks[:1]
        one_out = out[:1]
        for i in range(p["latency_ops"]):
            k = [f"lat-{i}-{bb}"]
            t0 = time.perf_counter()
            system.store(k, one)
            one_store.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            system.load(k, one_out)
            one_load.append(time.perf_counter() - t0)
            system.remove(k)
        if not np.array_equal(one_out, one):
            raise RuntimeError(f"{system.name}: single-block load differs")
        result.update(
            memcpy=percentiles(memcpy),
            store=percentiles(store),
            load=percentiles(load),
            store_one=percentiles(one_store),
            load_one=percentiles(one_load),
            settings=system.settings(),
            verified=True,
            raw={
                "memcpy_s": memcpy,
                "store_s": store,
                "load_s": load,
                "store_one_s": one_store,
                "load_one_s": one_load,
            },
        )
    finally:
        system.close()
    return result


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(type(o))


def main(argv: list[str]) -> int:
    p = json.loads(argv[1])
    if p.get("role") == "mooncake-holder":
        return _mooncake_holder(p)
    try:
        res = measure(p)
    except Exception as exc:  # reported to the parent, which prints it per system
        res = {
            "system": p.get("system"),
            "block_bytes": p.get("block_bytes"),
            "error": f"{type(exc).__name__}: {exc}",
        }
    sys.stdout.write("RESULT " + json.dumps(res, default=_json_default) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    rc = main(sys.argv)
    sys.stdout.flush()
    # Some peers' native libraries crash in their exit handlers; our result is
    # already out, so leave without running them.
    os._exit(rc)
