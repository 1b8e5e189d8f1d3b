"""The daemon moves its DRAM region into 2 MiB pages (dram.huge_pages = "auto"):
what Stats, metrics and `kvstore status` report is what the kernel maps the
daemon's region with (/proc/<pid>/smaps), and the blocks' bytes never change."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.tiers.dram import HUGE_PAGE_BYTES, pmd_mapped_bytes
from kvstore.v1 import store_pb2
from tests.conftest import kernel_collapses_shmem, make_spec


def _dram(c: Client) -> store_pb2.TierStats:
    return next(t for t in c.stats().tiers if t.tier == store_pb2.TIER_DRAM)


def _collapsed(c: Client, timeout_s: float = 60.0) -> int:
    """huge_page_bytes once the daemon is done collapsing."""
    deadline = time.monotonic() + timeout_s
    while (dram := _dram(c)).collapsing:
        assert time.monotonic() < deadline, "the collapse did not end"
        time.sleep(0.05)
    return int(dram.huge_page_bytes)


@pytest.mark.timeout(120)
def test_the_region_is_collapsed_and_every_report_says_what_the_kernel_maps(
    daemon_factory,
) -> None:  # type: ignore[no-untyped-def]
    region_bytes = 128 << 20
    d = daemon_factory("node-a", metrics=True, dram_bytes=region_bytes)
    assert d.info["region_page_bytes"] == 4096  # /dev/shm as this machine mounts it
    block = 256 << 10
    hashes = list(range(1, 65))
    data = np.random.default_rng(3).integers(0, 256, (len(hashes), block), dtype=np.uint8)
    with Client(d.address) as c:
        ns = c.declare_namespace(make_spec(block))
        assert c.put(ns, hashes, data).stored == len(hashes)  # while it collapses
        huge = _collapsed(c)
        assert huge == pmd_mapped_bytes(d.pid, d.info["region_path"])
        if kernel_collapses_shmem():
            # All of it, but for a few 2 MiB pages the put kept busy past the retries
            assert huge >= region_bytes - 4 * HUGE_PAGE_BYTES
        got = c.get(ns, hashes)
        assert got.found == len(hashes)
        np.testing.assert_array_equal(got.data, data)
    body = urllib.request.urlopen(f"http://{d.metrics_address}/metrics", timeout=5).read().decode()
    gauge = re.search(r'^kvstore_tier_huge_page_bytes\{tier="dram"\} (\S+)$', body, re.M)
    assert gauge is not None and float(gauge.group(1)) == huge
    status = subprocess.run(
        [sys.executable, "-m", "kvstore", "status", "--address", d.address],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    if huge:
        assert f"in 2 MiB pages={huge >> 20} MiB" in status


def test_huge_pages_off_keeps_4_kib_pages(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("node-b", dram_bytes=64 << 20, settings={"dram.huge_pages": "off"})
    with Client(d.address) as c:
        time.sleep(0.5)  # what a collapse would have done by now
        dram = _dram(c)
        assert dram.huge_page_bytes == 0 and not dram.collapsing
    assert pmd_mapped_bytes(d.pid, d.info["region_path"]) == 0
