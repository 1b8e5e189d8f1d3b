"""Helpers shared by the benchmarks: timing, medians and spread, the memcpy
reference every throughput is divided by, a progress bar, result folders.

Absolute figures on these machines move ~2x from minute to minute, so every
benchmark measures its reference (memcpy of the same bytes) in the same run
and reports ratios, medians and spread (p10..p90) rather than a best case.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import numpy as np


class Summary(msgspec.Struct, kw_only=True):
    """Medians and spread of repeated measurements (seconds)."""

    n: int
    median_s: float
    p10_s: float
    p90_s: float
    p99_s: float
    min_s: float

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: how noisy the measurement was."""
        return (self.p90_s - self.p10_s) / self.median_s if self.median_s else 0.0


def summarize(samples_s: Sequence[float]) -> Summary:
    if not samples_s:
        raise ValueError("no samples")
    a = np.asarray(samples_s, dtype=np.float64)
    p10, p50, p90, p99 = np.percentile(a, [10, 50, 90, 99])
    return Summary(
        n=len(a),
        median_s=float(p50),
        p10_s=float(p10),
        p90_s=float(p90),
        p99_s=float(p99),
        min_s=float(a.min()),
    )


def repeat(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Wall time of ``fn`` ``repeats`` times after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def memcpy_reference(nbytes: int, block_bytes: int, repeats: int = 5) -> Summary:
    """Time to copy ``nbytes`` in ``block_bytes`` pieces between two private
    buffers (numpy.copyto, one thread): the reference a store or load of the
    same bytes is compared with. Buffers are pre-faulted."""
    block_bytes = min(block_bytes, nbytes)
    n_blocks = max(1, nbytes // block_bytes)
    src = np.ones((n_blocks, block_bytes), dtype=np.uint8)
    dst = np.zeros_like(src)

    def copy() -> None:
        for i in range(n_blocks):
            np.copyto(dst[i], src[i])

    return summarize(repeat(copy, repeats))


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


class Progress:
    """A one-line progress bar on stderr (only on a terminal, or if forced),
    updated at most every 0.2 s so it costs nothing on hot loops."""

    def __init__(self, total: int, label: str, enabled: bool | None = None) -> None:
        self.total = max(1, total)
        self.label = label
        self.done = 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._start = time.monotonic()
        self._last = 0.0

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.2 and self.done < self.total):
            return
        self._last = now
        frac = min(1.0, self.done / self.total)
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        elapsed = now - self._start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        sys.stderr.write(
            f"\r{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.0f}s eta {eta:4.0f}s {note}"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def wait_collapsed(address: str, timeout_s: float = 300.0) -> int:
    """Once a daemon is done moving its DRAM region into 2 MiB pages (dram.huge_pages
    = auto, in the background after start; docs/tiers.md), or at the timeout: the
    bytes moved. Benches that time the region wait for it, so no figure mixes the
    two page sizes or races the collapse for the CPU."""
    from kvstore.client import Client
    from kvstore.v1 import store_pb2

    deadline = time.monotonic() + timeout_s
    with Client(address) as client:
        while True:
            dram = next(t for t in client.stats().tiers if t.tier == store_pb2.TIER_DRAM)
            if not dram.collapsing or time.monotonic() >= deadline:
                return int(dram.huge_page_bytes)
            time.sleep(0.1)


def results_dir(base: str, name: str) -> Path:
    """results/<name>-<UTC timestamp>/, created."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = Path(base) / f"{name}-{stamp}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, obj: object) -> None:
    path.write_bytes(msgspec.json.format(msgspec.json.encode(obj), indent=2))


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def needs_checkout(command: str) -> bool:
    """Make the checkout's ``tests`` package importable (the tiny Llama and its vLLM
    runner live in tests/integration/vllm_model.py); False, said on stdout, when
    this is no repository checkout."""
    root = str(repo_root())
    if root not in sys.path:
        sys.path.insert(0, root)  # a console script's path starts at its bin/, not here
    try:
        importlib.import_module("tests.integration.vllm_model")
    except ImportError:
        print(
            f"kvstore-bench {command} runs from a repository checkout "
            "(it uses tests/integration/vllm_model.py)"
        )
        return False
    return True


def env_python(venv: str) -> str | None:
    """The interpreter of a peer's virtual environment (see kvstore_bench/setup_peers.sh)."""
    override = os.environ.get(f"KVSTORE_BENCH_{venv.upper()}_PYTHON")
    if override:
        return override
    path = repo_root() / f".venv-{venv}" / "bin" / "python"
    return str(path) if path.exists() else None


class Figure(msgspec.Struct, kw_only=True):
    """One row of a summary table: a measured value, its reference from the same run,
    and the goal on their ratio (value / reference, or reference / time for times)."""

    figure: str
    value: float | None  # None: not measured (``note`` says why)
    unit: str
    reference: float | None = None
    reference_what: str = ""
    ratio: float | None = None
    goal: float | None = None  # the ratio is good at or above this
    note: str = ""


def write_figures(path: str | os.PathLike[str] | None, figures: Sequence[Figure]) -> None:
    """Append figures as JSON lines (the form scripts/gpu_check.sh collects)."""
    if not path:
        return
    with open(path, "ab") as f:
        for fig in figures:
            f.write(msgspec.json.encode(fig) + b"\n")
