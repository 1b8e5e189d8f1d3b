"""Per-tenant quotas on a real daemon (docs/tenants.md): two tenants fill one daemon,
the capped one stays within its caps in DRAM and on disk, the other's blocks all
survive with their bytes; Stats, /metrics and `kvstore status` name the tenant by
its configured name and never show a cache_salt."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import numpy as np
import pytest

from kvstore.client import Client
from kvstore.errors import CapacityExhausted
from tests.conftest import make_spec

BLOCK = 64 << 10
SALT_A = "a-secret-salt-3b9d"  # capped, configured as "alpha"
SALT_B = "b-secret-salt-c471"  # not configured: summed under "_other"
MiB = 1 << 20


def blocks_for(hashes):
    return np.stack(
        [np.random.default_rng(int(h)).integers(0, 256, BLOCK, dtype=np.uint8) for h in hashes]
    )


def tenant_rows(client):
    return {r.tenant: r for r in client.stats().tenants}


def test_two_tenants_fill_one_daemon_and_the_quota_holds(daemon_factory, tmp_path):
    (tmp_path / "disk").mkdir()
    d = daemon_factory(
        dram_bytes=4 * MiB,  # 64 blocks
        chunk_bytes=1 * MiB,
        metrics=True,
        settings={
            "disk.path": str(tmp_path / "disk"),
            # DRAM and disk hold 128 blocks; the two tenants store 136: without the
            # cap, B's (the coldest) would go.
            "disk.capacity_bytes": 4 * MiB,
            "disk.slab_bytes": 1 * MiB,
            "quotas.tenants.alpha.tenant": SALT_A,
            "quotas.tenants.alpha.dram_bytes": "1MiB",  # 16 blocks
            "quotas.tenants.alpha.disk_bytes": "2MiB",  # 32 blocks
        },
    )
    with Client(d.address) as c:
        a = c.declare_namespace(make_spec(BLOCK, tenant=SALT_A))
        b = c.declare_namespace(make_spec(BLOCK, tenant=SALT_B))
        b_hashes = list(range(10_000, 10_040))
        for i in range(0, 40, 8):
            assert c.put(b, b_hashes[i : i + 8], blocks_for(b_hashes[i : i + 8])).stored == 8
        # A stores three times its DRAM cap, in batches as an engine would.
        a_hashes = list(range(1, 97))
        for i in range(0, 96, 8):
            assert c.put(a, a_hashes[i : i + 8], blocks_for(a_hashes[i : i + 8])).stored == 8
            rows = tenant_rows(c)
            assert rows["alpha"].dram_bytes <= 1 * MiB
            assert rows["alpha"].disk_bytes <= 2 * MiB
        # The other tenant's blocks all survived, with their bytes.
        got = c.get(b, b_hashes)
        assert got.found == 40
        np.testing.assert_array_equal(got.data, blocks_for(b_hashes))
        # A's newest blocks are there (DRAM and disk), within its caps.
        newest = a_hashes[-8:]
        got = c.get(a, newest)
        assert got.found == 8
        np.testing.assert_array_equal(got.data, blocks_for(newest))
        present = c.lookup(a, a_hashes[::-1])  # newest first: how many of A's are held
        assert present.prefix_blocks <= 16 + 32
        rows = tenant_rows(c)
        alpha, other = rows["alpha"], rows["_other"]
        assert (alpha.dram_quota_bytes, alpha.disk_quota_bytes) == (1 * MiB, 2 * MiB)
        assert alpha.dram_bytes <= 1 * MiB and alpha.disk_bytes <= 2 * MiB
        assert alpha.namespaces == 1 and other.tenants == 1
        assert other.dram_bytes + other.disk_bytes >= 40 * BLOCK
        assert SALT_A not in str(c.stats()) and SALT_B not in str(c.stats())

    page = urllib.request.urlopen(f"http://{d.metrics_address}/metrics", timeout=5).read().decode()
    assert 'kvstore_tenant_quota_bytes{tenant="alpha",tier="dram"} 1.048576e+06' in page
    assert 'kvstore_tenant_quota_bytes{tenant="alpha",tier="disk"} 2.097152e+06' in page
    assert 'kvstore_tenant_bytes{tenant="alpha",tier="dram"}' in page
    assert 'kvstore_tenant_bytes{tenant="_other",tier="disk"}' in page
    assert SALT_A not in page and SALT_B not in page

    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "status", "--address", d.address],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "tenant alpha: namespaces=1" in out and "/ 1.0 MiB" in out
    assert "tenant _other (1 tenants)" in out
    assert SALT_A not in out and SALT_B not in out


def test_a_capped_tenant_with_its_blocks_pinned_is_refused_not_served_by_others(daemon_factory):
    d = daemon_factory(
        dram_bytes=4 * MiB,
        chunk_bytes=1 * MiB,
        settings={
            "quotas.tenants.alpha.tenant": SALT_A,
            "quotas.tenants.alpha.dram_bytes": "512KiB",  # 8 blocks
        },
    )
    with Client(d.address) as c:
        a = c.declare_namespace(make_spec(BLOCK, tenant=SALT_A))
        b = c.declare_namespace(make_spec(BLOCK, tenant=SALT_B))
        assert c.put(b, range(100, 108), blocks_for(range(100, 108))).stored == 8
        assert c.put(a, range(8), blocks_for(range(8))).stored == 8
        # Pin all of A's blocks (a load lease), then A stores once more.
        plan = c.prepare_load(a, list(range(8)))
        assert plan.found == 8
        try:
            with pytest.raises(CapacityExhausted, match="'alpha' is at its DRAM quota") as e:
                c.put(a, [8], blocks_for([8]))
            assert SALT_A not in str(e.value)
        finally:
            c.release(plan)
        assert c.lookup(b, list(range(100, 108))).prefix_blocks == 8
        assert c.put(a, [8], blocks_for([8])).stored == 1  # unpinned: its own coldest goes
        assert c.lookup(a, [0]).prefix_blocks == 0
        assert c.lookup(b, list(range(100, 108))).prefix_blocks == 8
