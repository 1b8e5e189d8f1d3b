"""Shared fixtures: real daemons as child processes on temp Unix sockets and port 0."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator

import pytest

from kvstore.namespace import NamespaceSpec
from kvstore.process import DaemonProcess


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


_REGIONS = "/dev/shm/kvstore-test-*"


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
