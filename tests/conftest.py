"""Shared fixtures: real daemons as child processes on temp Unix sockets and port 0."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator

import pytest

from kvstore.namespace import NamespaceSpec
from kvstore.process import DaemonProcess
from kvstore.tiers.dram import SHMEM_POLICY_PATH


def kernel_collapses_shmem() -> bool:
    """Whether this kernel moves shared memory into 2 MiB pages on request
    (MADV_COLLAPSE: Linux 6.1+, unless shmem_enabled says deny): what a region
    collapsed by its daemon is expected to reach here (docs/tiers.md)."""
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    try:
        deny = "[deny]" in SHMEM_POLICY_PATH.read_text()
    except OSError:
        deny = False
    return (major, minor) >= (6, 1) and not deny


def make_spec(
    block_bytes: int = 4096, *, model: str = "tiny", tenant: str = "", **kw: object
) -> NamespaceSpec:
    fields: dict[str, object] = dict(
        model=model,
        dtype="float16",
        block_size_tokens=16,
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        block_bytes=block_bytes,
        tenant=tenant,
    )
    fields.update(kw)
    return NamespaceSpec(**fields)  # type: ignore[arg-type]


@pytest.fixture
def daemon_factory(tmp_path) -> Iterator[Callable[..., DaemonProcess]]:
    started: list[DaemonProcess] = []

    def start(name: str = "kvstored", **kw: object) -> DaemonProcess:
        d = DaemonProcess(tmp_path / name, name=name, **kw)  # type: ignore[arg-type]
        d.start()
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()
        d.remove_region()


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:
    return daemon_factory()


# Regions of this run only (DaemonProcess names them after KVSTORE_TEST_RUN):
# another test run on the same machine keeps its regions.
os.environ.setdefault("KVSTORE_TEST_RUN", f"r{os.getpid()}")
_REGIONS = f"/dev/shm/kvstore-test-{os.environ['KVSTORE_TEST_RUN']}-*"


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config._kvstore_regions_before = set(glob.glob(_REGIONS))  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A safety net: region files (and manifests) this session created and left behind."""
    before = getattr(session.config, "_kvstore_regions_before", set())
    for path in set(glob.glob(_REGIONS)) - before:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


# Under CI=true a skipped test is a failure, except where CUDA is what is missing:
# a missing tool must not pass for a green run. Reasons that name CUDA (the `gpu`
# marker's tests) may skip.
_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
_CUDA_WORDS = ("cuda", "gpu")


def _skip_allowed(reason: str, item: pytest.Item | None) -> bool:
    if item is not None and item.get_closest_marker("gpu") is not None:
        return True
    return any(word in reason.lower() for word in _CUDA_WORDS)


def _skip_reason(longrepr: object) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if _CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report.longrepr)
        if not _skip_allowed(reason, item):
            report.outcome = "failed"
            report.longrepr = f"skipped under CI=true (only CUDA tests may skip): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if _CI and report.skipped:
        reason = _skip_reason(report.longrepr)
        path = str(getattr(collector, "path", ""))
        if not _skip_allowed(reason, None) and "/tests/gpu/" not in path:
            report.outcome = "failed"
            report.longrepr = f"module skipped under CI=true (only CUDA tests may skip): {reason}"
