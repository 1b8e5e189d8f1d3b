"""`kvstore-bench policy` and `kvstore-bench tiers` run end to end on small inputs."""

from __future__ import annotations

import re
import subprocess
import sys


def bench(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore_bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_policy_bench_compares_against_lru():
    proc = bench(
        "policy",
        "--agents",
        "6",
        "--turns",
        "4",
        "--seeds",
        "2",
        "--cache-fractions",
        "0.1,0.3",
        timeout_s=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [
        line.split()
        for line in proc.stdout.splitlines()
        if re.match(r"\s*0\.\d+\s+(lru|s3fifo)", line)
    ]
    assert [r[1] for r in rows] == ["lru", "s3fifo", "lru", "s3fifo"]
    assert all(r[4] == "1.000x" for r in rows if r[1] == "lru")  # the reference is itself


def test_policy_bench_refuses_unknown_policy():
    proc = bench("policy", "--policies", "lru,nosuch", timeout_s=60)
    assert proc.returncode == 2 and "nosuch" in proc.stderr


def test_tiers_bench_small(tmp_path):
    proc = bench(
        "tiers",
        "--dir",
        str(tmp_path),
        "--total-bytes",
        str(16 << 20),
        "--repeats",
        "1",
        "--context-tokens",
        "2048",
        "--eviction-blocks",
        "128",
        timeout_s=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for what in (
        "daemon -> disk write",
        "disk -> daemon read",
        "promotion of a 2048-token context",
        "demotion (disk write) per",
        "eviction cost",
        "read ratio per run: median",
        "read path: Client.get in 256 MiB loads",
        "load average (1 min)",
    ):
        assert what in out, out
    assert re.search(r"disk -> daemon read .* ratio \d+\.\d\dx", out)
