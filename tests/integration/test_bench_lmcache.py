"""`kvstore-bench compare` over LMCache engines: the same chunks through a real
LMCacheEngine with its CPU tier only and with kvstore behind it (.venv-lmcache)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration._lmcache import ROOT, lmcache_python


@pytest.mark.timeout(300)
def test_compare_quick_lmcache_local_vs_lmcache_with_kvstore(tmp_path: Path) -> None:
    lmcache_python()  # skips (fails under CI) without .venv-lmcache
    results = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable, "-m", "kvstore_bench.cli", "compare",
            "--systems", "lmcache-local,lmcache-kvstore",
            "--block-sizes", "65536", "--total-bytes", str(8 << 20),
            "--repeats", "2", "--latency-ops", "3", "--results", str(results),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out,) = results.glob("compare-*")
    data = json.loads((out / "compare.json").read_text())
    rows = {r["system"]: r for r in data["results"]}
    assert set(rows) == {"lmcache-local", "lmcache-kvstore"}
    for name, r in rows.items():
        assert "error" not in r, r
        assert r["verified"] is True, name  # every chunk retrieved bit-exactly
    ratio = data["summary"]["65536"]["lmcache_kvstore_over"]["lmcache-local"]
    assert ratio["load"] > 0 and ratio["store"] > 0
    assert "LMCache + kvstore vs lmcache-local" in proc.stdout
