"""`kvstore-bench gpu --quick` runs end to end (host mode here; CUDA where present)."""

from __future__ import annotations

import glob
import subprocess
import sys

import pytest

pytest.importorskip("torch")


def test_bench_gpu_quick_prints_every_figure():
    before = set(glob.glob("/dev/shm/kvstore-bench-gpu-*"))
    out = subprocess.run(
        [sys.executable, "-m", "kvstore_bench", "gpu", "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for line in ("promotion DRAM -> GPU", "demotion  GPU -> DRAM", "demotion to make room"):
        assert line in out.stdout
    assert "ratio" in out.stdout and "torch copy" in out.stdout
    assert set(glob.glob("/dev/shm/kvstore-bench-gpu-*")) == before  # nothing left behind
