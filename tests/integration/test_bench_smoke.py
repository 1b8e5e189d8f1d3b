"""CI smoke runs of `kvstore-bench agentic` and `compare`: real daemons, real
bytes, real outputs (report, JSON, plots), kept small for 2 cores."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HAVE_NIXL = (
    importlib.util.find_spec("nixl") is not None
    or importlib.util.find_spec("nixl_cu12") is not None
)


def _bench(*args: str, timeout_s: float, console: bool = False) -> subprocess.CompletedProcess[str]:
    """The bench as ``python -m`` from the checkout, or (``console``) as its installed
    console script with no PYTHONPATH: then the checkout is not on its path unless
    the bench puts it there (the router bench once failed so)."""
    if console:
        cmd = [str(Path(sys.executable).with_name("kvstore-bench"))]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    else:
        cmd, env = [sys.executable, "-m", "kvstore_bench"], None
    return subprocess.run(
        [*cmd, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _only_dir(results: Path) -> Path:
    dirs = [p for p in results.iterdir() if p.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


@pytest.mark.timeout(240)
def test_agentic_quick_replays_every_request_on_real_daemons(tmp_path: Path) -> None:
    results = tmp_path / "results"
    before = set(Path("/dev/shm").glob("kvsbench-*"))
    proc = _bench(
        "agentic",
        "--preset",
        "cybergym",
        "--quick",
        "--agents",
        "8",
        "--tasks",
        "2",
        "--turns",
        "3",
        "--nodes",
        "2",
        "--progress",
        "on",
        "--results",
        str(results),
        timeout_s=220,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = _only_dir(results)
    data = json.loads((out / "agentic.json").read_text())
    assert set(data["strategies"]) == {
        "random",
        "round-robin",
        "approximate",
        "precise-only",
        "cache+load",
        "approximate-gpu-only",
    }
    n_requests = data["trace"]["requests"]
    for name, s in data["strategies"].items():
        assert s["requests"] == n_requests, name
        assert s["verify_failures"] == 0, name
        if name == "approximate-gpu-only":  # no kvstore at all: nothing stored or loaded
            assert s["blocks_stored"] == s["blocks_loaded"] == 0
            assert s["token_shares"]["dram"] == s["token_shares"]["peer"] == 0
        else:
            assert s["blocks_stored"] > 0, name
        assert sum(s["token_shares"].values()) == pytest.approx(1.0), name
        assert 0.0 < s["cached_share"] <= data["trace"]["prefix_reuse_bound"] + 1e-9, name
        assert s["throughput_tokens_per_s"] > 0 and s["ttft_s"]["p50"] > 0, name
    # The turns reuse their predecessors: something was served from the daemons
    # (or peers) and verified byte for byte.
    assert sum(s["verified_blocks"] for s in data["strategies"].values()) > 0
    for name, s in data["strategies"].items():
        # Every recomputed token has a cause, and none of them is a bench bug.
        causes = s["recompute_causes"]
        assert sum(causes.values()) == s["tokens_recomputed"], name
        for bug in ("local_not_loaded", "never_stored"):
            assert causes[bug] == 0, (name, causes)
        peer = s["peer"]
        assert peer["failures"] == 0 and peer["corrupt_blocks"] == 0, (name, peer)
        assert s["blocks_pulled"] <= peer["fetched_blocks"], name
        if HAVE_NIXL:
            assert set(peer["transports"]) <= {"nixl"}, (name, peer)
    # Random and round-robin routing send most turns of an agent to another node
    # than its last one (seeded: the same every run): the chosen node's daemon
    # pulls the prefix from the peer daemon, and those tokens are served.
    for name in ("random", "round-robin"):
        s = data["strategies"][name]
        assert s["peer"]["fetched_blocks"] > 0 and s["blocks_pulled"] > 0, name
        assert s["token_shares"]["peer"] > 0, name
    report = (out / "report.md").read_text()
    assert "Measured" in report and "Modelled" in report and "| cache+load |" in report
    for png in ("hit_rate.png", "tier_shares.png", "ttft_cdf.png"):
        assert (out / png).stat().st_size > 1000
    assert "cache+load" in proc.stderr  # per-strategy progress lines
    assert set(Path("/dev/shm").glob("kvsbench-*")) <= before, "daemon regions left behind"


@pytest.mark.redis
@pytest.mark.timeout(240)
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_compare_quick_kvstore_and_redis_same_blocks(tmp_path: Path) -> None:
    results = tmp_path / "results"
    before = set(Path("/dev/shm").glob("kvsbench-*"))
    proc = _bench(
        "compare",
        "--systems",
        "kvstore,redis",
        "--block-sizes",
        "65536",
        "--total-bytes",
        str(8 << 20),
        "--repeats",
        "2",
        "--latency-ops",
        "5",
        "--results",
        str(results),
        timeout_s=220,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((_only_dir(results) / "compare.json").read_text())
    rows = {r["system"]: r for r in data["results"]}
    assert set(rows) == {"kvstore", "redis"}
    for name, r in rows.items():
        assert "error" not in r, r
        assert r["verified"] is True, name
        assert r["n_blocks"] == 128
        assert r["load"]["median_s"] > 0 and r["memcpy"]["median_s"] > 0
    # what was measured: the client's default channel, probes compiled before timing
    assert rows["kvstore"]["settings"]["transport"].startswith("lean local channel")
    assert rows["kvstore"]["settings"]["presence probes"] == "compiled"
    entry = data["summary"]["65536"]
    assert entry["best_peer_load"] == "redis"
    assert entry["kvstore_load_over_best_peer"] > 0
    assert "kvstore vs the best peer" in proc.stdout
    assert set(Path("/dev/shm").glob("kvsbench-*")) <= before, "daemon region left behind"


def test_compare_rejects_unknown_system(tmp_path: Path) -> None:
    proc = _bench(
        "compare", "--systems", "kvstore,nosuch", "--results", str(tmp_path), timeout_s=60
    )
    assert proc.returncode == 2
    assert "nosuch" in proc.stderr


@pytest.mark.timeout(240)
@pytest.mark.skipif(not HAVE_NIXL, reason="NIXL (nixl-cu12) not installed")
def test_p2p_quick_pulls_between_two_daemons_and_leaves_nothing(tmp_path: Path) -> None:
    results = tmp_path / "results"
    regions = Path(tempfile.mkdtemp(prefix="kvstore-test-p2p-", dir="/dev/shm"))
    try:
        proc = _bench(
            "p2p", "--quick", "--region-dir", str(regions), "--results", str(results), timeout_s=220
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert not list(regions.iterdir()), "region files left behind"
    finally:
        shutil.rmtree(regions, ignore_errors=True)
    for kib in (2048, 64):
        assert f"block {kib} KiB x" in proc.stdout
    # which pages the regions got, and the first byte's two bare references
    assert "regions on 4 KiB pages" in proc.stdout or "regions on 2048 KiB pages" in proc.stdout
    assert "back to back," in proc.stdout and "after a 2 ms idle gap" in proc.stdout
    report = json.loads((_only_dir(results) / "p2p.json").read_text())
    assert report["results"][0]["region_page_bytes"] in (4096, 2 << 20)

    bad = _bench("p2p", "--region-dir", str(tmp_path / "nope"), timeout_s=60)
    assert bad.returncode == 2
    assert "--region-dir" in bad.stderr and "not a directory" in bad.stderr


def test_cli_names_missing_subcommand_modules() -> None:
    proc = _bench("--help", timeout_s=60)
    assert proc.returncode == 0
    for name in ("local", "tiers", "policy", "indexer", "p2p", "vllm", "agentic", "compare"):
        assert name in proc.stdout


@pytest.mark.timeout(240)
def test_router_bench_decision_cost_reports_cold_and_resent(tmp_path: Path) -> None:
    results = tmp_path / "results"
    proc = _bench(
        "router",
        "--engine",
        "off",
        "--replay",
        "off",
        "--samples",
        "4",
        "--context-tokens",
        "40000",
        "--new-tokens",
        "1000",
        "--progress",
        "on",
        "--results",
        str(results),
        timeout_s=220,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = _only_dir(results)
    data = json.loads((out / "router.json").read_text())
    d = data["decision"]
    assert d["request_blocks"] == 40000 // 16
    # the re-sent turn reused every block of the previous context
    assert d["reused_blocks_mean"] == (40000 - 1000) // 16
    assert d["resent_s"]["p50"] > 0 and d["cold_s"]["p50"] > 0
    # the local index's compiled walk, timed against the numpy walk: same answers
    assert d["walk_native"] and d["walks_differ"] == 0
    assert d["walk_compiled_s"]["p50"] > 0 and d["walk_numpy_s"]["p50"] > 0
    assert "Decision cost" in (out / "report.md").read_text()
    assert (out / "decision_cdf.png").stat().st_size > 1000


@pytest.mark.timeout(240)
def test_router_bench_proxy_against_the_stand_in_engine(tmp_path: Path) -> None:
    results = tmp_path / "results"
    proc = _bench(
        "router",
        *("--decision", "off", "--replay", "off", "--engine", "stub", "--requests", "3"),
        *("--progress", "off", "--results", str(results)),
        timeout_s=220,
        console=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-1000:]
    out = _only_dir(results)
    p = json.loads((out / "router.json").read_text())["proxy"]
    assert p["engine"] == "stub" and p["direct_first_s"]["p50"] > 0
    hop = p["variants"]["the hop alone (round-robin: no decision), uvloop"]
    assert hop["first_s"]["p50"] > 0
    assert "stand-in SSE engine" in (out / "report.md").read_text()


def _marked_pids(mark: str, word: str = "") -> list[int]:
    """Processes whose environment carries ``mark`` (the bench and what it started)
    and, with ``word``, whose command line contains it."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if mark.encode() in (proc / "environ").read_bytes() and (
                word.encode() in (proc / "cmdline").read_bytes()
            ):
                pids.append(int(proc.name))
        except OSError:
            continue  # gone, or not ours to read
    return pids


@pytest.mark.timeout(120)
def test_sigterm_stops_the_bench_and_everything_it_started(tmp_path: Path) -> None:
    """SIGTERM used to kill the bench without unwinding: its daemons and indexer
    were orphaned. Now it exits 143 and leaves no process and no region behind."""
    import os
    import signal
    import time
    import uuid

    mark = f"KVSTORE_BENCH_TEST_MARK={uuid.uuid4().hex}"
    key, value = mark.split("=")
    before = set(Path("/dev/shm").glob("kvsbench-*"))
    bench = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvstore_bench",
            "agentic",
            "--quick",
            "--agents",
            "40",
            "--nodes",
            "2",
        ]
        + ["--results", str(tmp_path / "results")],
        cwd=ROOT,
        env={**os.environ, key: value},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while len(_marked_pids(mark, "serve")) < 2:  # both daemons
            assert bench.poll() is None, f"the bench exited early ({bench.returncode})"
            assert time.monotonic() < deadline, "the bench's daemons did not start"
            time.sleep(0.1)
        started = set(_marked_pids(mark)) - {bench.pid}
        assert len(started) >= 2
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while set(_marked_pids(mark)) & started and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not set(_marked_pids(mark)) & started, "processes the bench started outlived it"
        assert set(Path("/dev/shm").glob("kvsbench-*")) <= before, "regions left behind"
    finally:
        if bench.poll() is None:
            bench.kill()
        for pid in _marked_pids(mark):
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
