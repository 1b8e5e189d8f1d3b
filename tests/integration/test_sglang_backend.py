"""kvstore as SGLang HiCache's storage backend, driven by SGLang 0.5.23's own classes.

SGLang's pins (torch 2.14.1 CUDA, transformers 5.19) clash with vLLM's, so it
lives in .venv-sglang (scripts/setup_sglang_venv.sh, run by install.sh --full)
and these tests drive a worker there (tests/integration/sglang_worker.py) line
by line: real host pools (MHATokenToKVPoolHost, MLATokenToKVPoolHost), the
backend built by SGLang's StorageBackendFactory from a ``dynamic`` extra
config, against real daemons on temp Unix sockets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvstore_connectors.sglang.keys import key_to_block_hash, page_hashes

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
WORKER = Path(__file__).with_name("sglang_worker.py")

pytestmark = pytest.mark.skipif(
    not SGLANG_PYTHON.exists(),
    reason="no .venv-sglang: run bash scripts/setup_sglang_venv.sh",
)

PS = 4  # page size (tokens)


class Worker:
    """An SGLang-side process; ``call`` sends one command and returns its answer."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
        self.proc = subprocess.Popen(
            [str(SGLANG_PYTHON), str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(ROOT),
        )

    def call(self, op: str, **args: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"the SGLang worker died: {err[-3000:]}")
        reply = json.loads(line)
        assert reply["ok"], reply.get("trace") or reply
        self.warnings: list[str] = reply["warnings"]
        return reply["out"]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def _worker_process():
    w = Worker()  # SGLang's import takes ~10-30 s here: one process for the module
    yield w
    w.close()


@pytest.fixture
def worker(_worker_process):
    _worker_process.call("reset")
    return _worker_process


def _keys(seed: int, pages: int) -> list[str]:
    """SGLang page keys of a random token sequence (its chained SHA-256 scheme)."""
    tokens = [(seed * 7919 + i * 104729) % 50_000 for i in range(pages * PS)]
    return page_hashes(tokens, None, PS)


# (MLA, --hicache-mem-layout, bytes inline over gRPC instead of the shared region)
LAYOUTS = [
    (False, "layer_first", False),
    (False, "page_first", False),
    (False, "page_first_direct", False),
    (True, "layer_first", False),
    (True, "page_first", False),
    (True, "page_first_direct", False),
    (False, "layer_first", True),
    (True, "page_first", True),
]


@pytest.mark.parametrize(("mla", "layout", "inline"), LAYOUTS)
def test_pages_round_trip_bit_exact_between_two_engines(daemon, worker, mla, layout, inline):
    common = dict(mla=mla, layout=layout, page_size=PS, address=daemon.address)
    if inline:  # what a daemon on another host gets: no region mapped
        common["extra"] = {"kvstore_map_region": False}
    made = worker.call("make", name="a", **common)
    assert "HiCacheStorage" in made["bases"]  # SGLang's factory checked the subclass
    assert made["namespace"]["block_size_tokens"] == PS
    worker.call("make", name="b", **common)
    keys = _keys(1, 5)
    src_pages = [1, 2, 3, 4, 5]
    digests = worker.call("fill", name="a", pages=src_pages, seed=11)
    assert len(set(digests)) == 5
    assert worker.call("set_v1", name="a", keys=keys, pages=src_pages) == [True] * 5
    # Engine b loads them into other host pages, zero-copy from the region.
    dst_pages = [9, 7, 12, 3, 10]
    assert worker.call("get_v1", name="b", keys=keys, pages=dst_pages) == [True] * 5
    assert worker.call("digests", name="b", pages=dst_pages) == digests
    # SGLang's tensor path (no interface_v1) reads the same bytes back as flat pages.
    assert worker.call("get_flat", name="b", keys=keys) == digests
    # ...and what it stores, the zero-copy path loads.
    keys2 = _keys(2, 2)
    assert worker.call("set_flat", name="a", keys=keys2, pages=[6, 7]) is True
    worker.call("zero", name="b", pages=[1, 2])
    assert worker.call("get_v1", name="b", keys=keys2, pages=[1, 2]) == [True, True]
    assert worker.call("digests", name="b", pages=[1, 2]) == worker.call(
        "digests", name="a", pages=[6, 7]
    )
    assert worker.warnings == []


def test_keys_are_sglangs_own_page_hashes(daemon, worker):
    """SGLang's native page hashing (compiled at first use) names pages as
    kvstore_connectors.sglang.keys does; a chain resumed from a prior hash continues it."""
    tokens = [(i * 7919) % 50_000 for i in range(6 * PS + 3)]
    theirs = worker.call("sglang_keys", tokens=tokens, page_size=PS)
    assert theirs == page_hashes(tokens, None, PS)
    resumed = worker.call("sglang_keys", tokens=tokens[2 * PS :], prior=theirs[1], page_size=PS)
    assert resumed == theirs[2:]
    worker.call(
        "make", name="a", mla=False, layout="page_first", page_size=PS, address=daemon.address
    )
    digests = worker.call("fill", name="a", pages=[1, 2, 3], seed=12)
    assert worker.call("set_v1", name="a", keys=theirs[:3], pages=[1, 2, 3]) == [True] * 3
    assert worker.call("exists", name="a", keys=theirs) == 3
    assert worker.call("get_v1", name="a", keys=theirs[:3], pages=[4, 5, 6]) == [True] * 3
    assert worker.call("digests", name="a", pages=[4, 5, 6]) == digests


def test_batch_exists_counts_leading_pages_present(daemon, worker):
    worker.call(
        "make", name="a", mla=False, layout="page_first", page_size=PS, address=daemon.address
    )
    keys = _keys(3, 6)
    worker.call("fill", name="a", pages=[1, 2, 3, 4, 5, 6], seed=3)
    assert worker.call("set_v1", name="a", keys=keys[:3], pages=[1, 2, 3]) == [True] * 3
    assert worker.call("set_v1", name="a", keys=keys[4:], pages=[5, 6]) == [True] * 2
    assert worker.call("exists", name="a", keys=keys) == 3  # page 3 missing: 4 and 5 don't count
    assert worker.call("exists", name="a", keys=keys[4:]) == 2
    assert worker.call("exists", name="a", keys=keys[3:]) == 0
    assert worker.call("exists_one", name="a", keys=keys) == [True, True, True, False, True, True]
    # A load stops at the first missing page too: nothing past it is written.
    worker.call("zero", name="a", pages=[10, 11, 12, 13])
    got = worker.call("get_v1", name="a", keys=keys[2:6], pages=[10, 11, 12, 13])
    assert got == [True, False, False, False]
    zero = worker.call("digests", name="a", pages=[14])[0]
    assert worker.call("digests", name="a", pages=[11, 12]) == [zero, zero]
    # More than SGLang's 128-page batch still answers the whole prefix.
    many = _keys(4, 130)
    assert worker.call("exists", name="a", keys=many) == 0


def test_identities_that_differ_never_share_and_equal_ones_do(daemon, worker):
    base = dict(mla=False, layout="page_first", page_size=PS, address=daemon.address)
    worker.call("make", name="tp0", tp_rank=0, tp_size=2, **base)
    worker.call("make", name="tp1", tp_rank=1, tp_size=2, **base)
    worker.call("make", name="other_model", tp_rank=0, tp_size=2, model="other", **base)
    worker.call(
        "make", name="other_layout", tp_rank=0, tp_size=2, **{**base, "layout": "layer_first"}
    )
    worker.call(
        "make", name="tenant_b", tp_rank=0, tp_size=2, extra={"kvstore_tenant": "b"}, **base
    )
    worker.call("make", name="twin", tp_rank=0, tp_size=2, **base)
    keys = _keys(5, 3)
    digests = worker.call("fill", name="tp0", pages=[1, 2, 3], seed=5)
    assert worker.call("set_v1", name="tp0", keys=keys, pages=[1, 2, 3]) == [True] * 3
    for other in ("tp1", "other_model", "other_layout", "tenant_b"):
        assert worker.call("exists", name=other, keys=keys) == 0, other
        assert worker.call("get_v1", name=other, keys=keys, pages=[4, 5, 6]) == [False] * 3
    assert worker.call("exists", name="twin", keys=keys) == 3
    assert worker.call("get_v1", name="twin", keys=keys, pages=[4, 5, 6]) == [True] * 3
    assert worker.call("digests", name="twin", pages=[4, 5, 6]) == digests
    # clear() drops this identity's pages (the twin's too: they are the same ones), only those.
    worker.call("set_v1", name="tp1", keys=keys, pages=[1, 2, 3])
    worker.call("clear", name="tp0")
    assert worker.call("exists", name="twin", keys=keys) == 0
    assert worker.call("exists", name="tp1", keys=keys) == 3


def test_mla_ranks_share_one_copy(daemon, worker):
    """MLA KV is replicated over TP ranks (SGLang's file backend shares one file too)."""
    base = dict(mla=True, layout="page_first", page_size=PS, address=daemon.address)
    worker.call("make", name="r0", tp_rank=0, tp_size=2, **base)
    worker.call("make", name="r1", tp_rank=1, tp_size=2, **base)
    keys = _keys(6, 2)
    digests = worker.call("fill", name="r0", pages=[1, 2], seed=6)
    worker.call("set_v1", name="r0", keys=keys, pages=[1, 2])
    assert worker.call("get_v1", name="r1", keys=keys, pages=[3, 4]) == [True, True]
    assert worker.call("digests", name="r1", pages=[3, 4]) == digests


def test_daemon_killed_gives_misses_one_warning_no_exception(daemon_factory, worker):
    daemon = daemon_factory("dying", tcp=False)
    worker.call(
        "make", name="a", mla=False, layout="page_first", page_size=PS, address=daemon.address
    )
    keys = _keys(7, 4)
    worker.call("fill", name="a", pages=[1, 2, 3, 4], seed=7)
    assert worker.call("set_v1", name="a", keys=keys[:2], pages=[1, 2]) == [True, True]
    assert worker.call("exists", name="a", keys=keys) == 2
    daemon.kill()
    t0 = time.monotonic()
    for _ in range(10):
        assert worker.call("exists", name="a", keys=keys) == 0
        assert worker.call("get_v1", name="a", keys=keys[:2], pages=[5, 6]) == [False, False]
        assert worker.call("set_v1", name="a", keys=keys[2:], pages=[3, 4]) == [False, False]
        assert worker.call("get_flat", name="a", keys=keys[:1]) == [None]
    assert time.monotonic() - t0 < 10.0
    unusable = [m for m in worker.warnings if "unusable" in m]
    assert len(unusable) == 1, worker.warnings
    daemon.start()  # back (empty): the backend reconnects on its own
    deadline = time.monotonic() + 15
    while worker.call("set_v1", name="a", keys=keys[2:], pages=[3, 4]) != [True, True]:
        assert time.monotonic() < deadline, "never reconnected"
        time.sleep(0.2)
    assert worker.call("exists", name="a", keys=keys[2:]) == 2
    assert any("reconnected" in m for m in worker.warnings)


def test_pages_stored_through_sglang_appear_in_kv_events(daemon_factory, worker):
    from kvstore.events.wire import BlockStored, full_decoder
    from kvstore_bench.ports import free_port
    from tests.integration._events import EventTap

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    daemon = daemon_factory(
        settings={
            "events.enabled": True,
            "events.publish_address": endpoint,
            "events.replay_address": "",
            "events.topic_ids": "10.0.0.9:30000",
        }
    )
    tap = EventTap(daemon.address, endpoint, b"kv@10.0.0.9:30000@")
    try:
        worker.call(
            "make", name="a", mla=False, layout="page_first", page_size=PS, address=daemon.address
        )
        keys = _keys(8, 5)
        worker.call("fill", name="a", pages=[1, 2, 3, 4, 5], seed=8)
        assert worker.call("set_v1", name="a", keys=keys[:2], pages=[1, 2]) == [True, True]
        # SGLang's backup thread passes the keys before the batch (hicache_storage_pass_prefix_keys)
        ok = worker.call(
            "set_v1_prefix", name="a", keys=keys[2:], pages=[3, 4, 5], prefix_keys=keys[:2]
        )
        assert ok == [True] * 3
        expected = [key_to_block_hash(k) for k in keys]
        dec = full_decoder()
        stored: list[BlockStored] = []

        def all_in() -> bool:
            stored.clear()
            for topic, _, payload in tap.frames:
                if topic.endswith(b"@tiny-model"):
                    stored.extend(
                        e for e in dec.decode(payload).events if isinstance(e, BlockStored)
                    )
            return {int(h) for e in stored for h in e.block_hashes} >= set(expected)

        tap.collect(all_in)
    finally:
        tap.close()
    chains = [[int(h) for h in e.block_hashes] for e in stored]
    assert chains == [expected[:2], expected[2:]]
    assert stored[0].parent_block_hash is None
    assert int(stored[1].parent_block_hash) == expected[1]  # the chain continues
    assert all(e.block_size == PS for e in stored)
    # The hash is the 64 bits SGLang's own events carry (hash_str_to_int64, signed).
    signed = [
        int(k[:16], 16) - (1 << 64) if int(k[:16], 16) >= 1 << 63 else int(k[:16], 16) for k in keys
    ]
    assert [h % (1 << 64) for h in signed] == expected


def test_v2_pool_transfers_keep_each_pool_apart_and_apply_hit_policies(daemon, worker):
    """Hybrid models (SWA, DSA indexer...): extra host pools through SGLang's v2 API."""
    worker.call(
        "make", name="a", mla=False, layout="page_first", page_size=PS, address=daemon.address
    )
    worker.call(
        "make", name="b", mla=False, layout="page_first", page_size=PS, address=daemon.address
    )
    for eng in ("a", "b"):
        worker.call("add_pool", name=eng, pool="swa", layout="layer_first", heads=1)
        worker.call("add_pool", name=eng, pool="indexer", mla=True, layout="page_first")
    keys = _keys(9, 4)
    kv = worker.call("fill", name="a", pages=[1, 2, 3, 4], seed=9)
    swa = worker.call("fill", name="a", pages=[1, 2, 3, 4], seed=10, pool="swa")
    idx = worker.call("fill", name="a", pages=[1, 2], seed=11, pool="indexer")
    assert len(set(kv + swa + idx)) == 10  # every pool's pages differ
    stored = worker.call(
        "set_v2",
        name="a",
        transfers=[
            {"pool": "kv", "keys": keys, "pages": [1, 2, 3, 4]},
            {"pool": "swa", "keys": keys[1:3], "pages": [2, 3]},  # a window: pages 1 and 2
            {"pool": "indexer", "keys": keys[:2], "pages": [1, 2]},
        ],
    )
    assert stored == {"kv": [True] * 4, "swa": [True] * 2, "indexer": [True] * 2}
    # The same key names a different page in each pool: no pool sees another's.
    assert worker.call("exists", name="b", keys=keys) == 4
    trailing = {"pool": "swa", "keys": keys[:2], "policy": "trailing_pages"}
    got = worker.call("exists_v2", name="b", keys=keys, transfers=[trailing])
    assert got == {"kv_hit_pages": 3, "extra": {"kv": 4, "swa": 3}}  # pages 1, 2 end at 3
    every = {"pool": "indexer", "keys": keys, "policy": "all_pages"}
    got = worker.call("exists_v2", name="b", keys=keys, transfers=[trailing, every])
    # swa can restore a prefix of 3 only, indexer one of 1 or 2: no length suits both
    assert got == {"kv_hit_pages": 0, "extra": {"kv": 4, "swa": 3, "indexer": 2}}
    loaded = worker.call(
        "get_v2",
        name="b",
        transfers=[
            {"pool": "swa", "keys": keys[1:3], "pages": [5, 6]},
            {"pool": "indexer", "keys": keys[:3], "pages": [7, 8, 9]},
        ],
    )
    assert loaded == {"swa": [True, True], "indexer": [True, True, False]}
    assert worker.call("digests", name="b", pages=[5, 6], pool="swa") == swa[1:3]
    assert worker.call("digests", name="b", pages=[7, 8], pool="indexer") == idx


def test_pages_beyond_dram_come_back_from_disk_checksummed(daemon_factory, worker, tmp_path):
    """Pages evicted to the disk tier load back exactly (their xxh3 checked on the way)."""
    (tmp_path / "disk").mkdir()
    daemon = daemon_factory(
        dram_bytes=1 << 20,
        chunk_bytes=256 << 10,
        settings={
            "disk.path": str(tmp_path / "disk"),
            "disk.capacity_bytes": 16 << 20,
            "disk.slab_bytes": 256 << 10,
            "disk.demote_free_fraction": 1.0,  # every page written behind to disk
        },
    )
    geometry = dict(mla=False, layout="page_first", page_size=PS, heads=8, dim=64, layers=4)
    worker.call("make", name="a", address=daemon.address, pages=100, **geometry)
    worker.call("make", name="b", address=daemon.address, pages=100, **geometry)
    keys = _keys(13, 96)  # 96 x 32 KiB: three times the DRAM tier
    pages = list(range(1, 97))
    digests = worker.call("fill", name="a", pages=pages, seed=13)
    from kvstore.client import Client

    def wait_on_disk(c: Client, n: int) -> None:
        deadline = time.monotonic() + 15
        while next((t.blocks for t in c.stats().tiers if t.tier == 3), 0) < n:  # 3: disk
            assert time.monotonic() < deadline, "pages never reached the disk tier"
            time.sleep(0.02)

    with Client(daemon.address) as c:
        for s in range(0, 96, 8):
            batch = dict(keys=keys[s : s + 8], pages=pages[s : s + 8])
            assert worker.call("set_v1", name="a", **batch) == [True] * 8
            wait_on_disk(c, s + 8)  # written behind before DRAM needs the room
    assert worker.call("exists", name="b", keys=keys) == 96
    for s in range(0, 96, 8):
        got = worker.call("get_v1", name="b", keys=keys[s : s + 8], pages=pages[s : s + 8])
        assert got == [True] * 8, s
    assert worker.call("digests", name="b", pages=pages) == digests
    assert worker.call("stats", name="b")["checksum_failures"] == 0


def test_storage_threads_calling_at_once_get_right_answers(daemon, worker):
    worker.call(
        "make", name="a", mla=False, layout="page_first", page_size=PS, address=daemon.address
    )
    pages = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
    digests = worker.call("fill", name="a", pages=[p for ps in pages for p in ps], seed=16)
    keys = [_keys(20 + t, 3) for t in range(4)]
    assert worker.call("threads", name="a", keys=keys, pages=pages, rounds=10) == [True] * 4
    assert worker.call("digests", name="a", pages=[p for ps in pages for p in ps]) == digests
    assert worker.warnings == []


def test_host_indices_outside_the_pool_are_refused_not_written(daemon, worker):
    worker.call(
        "make", name="a", mla=False, layout="page_first", page_size=PS, address=daemon.address
    )
    keys = _keys(14, 2)
    digests = worker.call("fill", name="a", pages=[1, 2], seed=14)
    assert worker.call("set_v1", name="a", keys=keys, pages=[1, 2]) == [True, True]
    # pages 40 and 4000 lie past the pool's 17 pages: a miss, an error logged, nothing written
    assert worker.call("get_v1", name="a", keys=keys, pages=[1, 4000]) == [False, False]
    assert worker.call("set_v1", name="a", keys=_keys(15, 2), pages=[2, 40]) == [False, False]
    assert worker.call("digests", name="a", pages=[1, 2]) == digests


def test_mamba_states_go_through_the_pools_own_copies(daemon, worker):
    """A Mamba host pool's page is no view of host memory (its get_data_page
    concatenates conv and temporal states): the backend copies through the pool.
    Mamba state is TP-sharded even in an MLA model: ranks do not share it."""
    for name, rank in (("a", 0), ("b", 0), ("c", 1)):
        worker.call(
            "make", name=name, mla=True, layout="page_first", page_size=PS,
            tp_rank=rank, tp_size=2, address=daemon.address,
        )  # fmt: skip
        worker.call("add_pool", name=name, pool="mamba", kind="mamba")
    keys = _keys(30, 3)
    states = worker.call("fill", name="a", pages=[1, 2, 3], seed=30, pool="mamba")
    assert len(set(states)) == 3
    t = {"pool": "mamba", "keys": keys, "pages": [1, 2, 3]}
    assert worker.call("set_v2", name="a", transfers=[t]) == {"mamba": [True] * 3}
    t_other = {"pool": "mamba", "keys": keys, "pages": [4, 5, 6]}
    assert worker.call("get_v2", name="b", transfers=[t_other]) == {"mamba": [True] * 3}
    assert worker.call("digests", name="b", pages=[4, 5, 6], pool="mamba") == states
    assert worker.call("get_v2", name="c", transfers=[t_other]) == {"mamba": [False] * 3}


def test_bad_extra_config_is_refused_clearly(daemon, worker):
    with pytest.raises(AssertionError, match="kvstore_adress"):
        worker.call(
            "make",
            name="bad",
            mla=False,
            layout="page_first",
            page_size=PS,
            address=daemon.address,
            extra={"kvstore_adress": "x"},
        )


def test_bench_quick_compares_kvstore_with_sglangs_file_backend(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore_bench.cli",
            "sglang",
            "--quick",
            "--results",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (report,) = tmp_path.glob("sglang-*/sglang.json")
    data = json.loads(report.read_text())
    for name in ("kvstore_set", "kvstore_get", "file_set", "file_get"):
        assert data[name]["pages_per_s"] > 0 and data[name]["gb_per_s"] > 0
        assert len(data["data"]["seconds"][name]) == 3
    assert data["ratio_set"] > 0 and data["ratio_get"] > 0
    assert "load" in out.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-x", "-q"]))
