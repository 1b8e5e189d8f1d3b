"""Per-tenant quotas in-process (docs/tenants.md): caps per tier, own-block eviction,
usage kept by every transition, names (never salts) in the report, config checks."""

from __future__ import annotations

import asyncio
import collections
import time

import pytest

from kvstore.config import load_config
from kvstore.errors import CapacityExhausted, ConfigError
from kvstore.manager import STORE_ALLOCATED, STORE_NO_ROOM, BlockManager
from kvstore.quotas import OTHER_TENANTS
from kvstore.tiers import Tier
from kvstore.tiers.disk import align_up
from kvstore.tiers.dram import Region
from tests.conftest import make_spec
from tests.managers import managers
from tests.sinks import RecordingSink

SALT_A = "salt-of-tenant-a-7f3e"
SALT_B = "salt-of-tenant-b-91c2"
QUOTA_A = {"quotas.tenants.alpha.tenant": SALT_A, "quotas.tenants.alpha.dram_bytes": "16KiB"}


@pytest.fixture
def make_manager(tmp_path):
    with managers(tmp_path) as make_one:

        def make(settings, capacity="1MiB", chunk="256KiB"):
            sizes = (f"dram.capacity_bytes={capacity}", f"dram.chunk_bytes={chunk}")
            return make_one(*sizes, *(f"{k}={v}" for k, v in settings.items()))

        yield make


def store(m, ns, hashes):
    plan = m.prepare_store(ns.namespace_id, hashes)
    if plan.lease_id:
        m.commit_store(plan.lease_id)
    return plan


def held(m, ns, hashes):
    return [h for h in hashes if h in ns.blocks]


def check_accounts(m):
    """Every account's bytes are exactly its tenant's slots, tier by tier."""
    p = m.placement
    want: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0])
    for block in p.dram.owner.values():
        want[block.namespace.tenant][Tier.DRAM] += block.namespace.slot_bytes
    if p.gpu is not None:
        for block in p.gpu.owner.values():
            want[block.namespace.tenant][Tier.GPU] += block.namespace.slot_bytes
    for ns in m.namespaces.values():
        for block in ns.blocks.values():
            if block.disk_slot >= 0:
                want[ns.tenant][Tier.DISK] += align_up(ns.block_bytes)
    for tenant, account in p.accounts.items():
        assert account.used_bytes == want.get(tenant, [0, 0, 0, 0]), tenant


def test_a_tenant_at_its_dram_cap_evicts_only_its_own_blocks(make_manager):
    m = make_manager(QUOTA_A)
    a = m.declare_namespace(make_spec(4096, tenant=SALT_A))
    a2 = m.declare_namespace(make_spec(4096, tenant=SALT_A, model="other-model"))
    b = m.declare_namespace(make_spec(4096, tenant=SALT_B))
    store(m, b, range(100, 110))
    store(m, a, [1, 2])
    store(m, a2, [3, 4])  # the cap is the tenant's, across its namespaces
    store(m, b, range(110, 120))  # B's blocks are the hottest now; A's the coldest of A's
    plan = store(m, a, [5, 6])
    assert list(plan.statuses) == [STORE_ALLOCATED] * 2
    assert m.placement.accounts[SALT_A].used_bytes[Tier.DRAM] == 16 << 10
    assert held(m, a, [1, 2, 5, 6]) == [5, 6] and held(m, a2, [3, 4]) == [3, 4]
    assert held(m, b, range(100, 120)) == list(range(100, 120))  # none of B's went
    # One request larger than the cap: its own pending blocks are not victims.
    plan = store(m, a, [7, 8, 9, 10, 11, 12])
    assert list(plan.statuses) == [STORE_ALLOCATED] * 4 + [STORE_NO_ROOM] * 2
    assert held(m, b, range(100, 120)) == list(range(100, 120))
    check_accounts(m)


def test_a_capped_tenant_with_every_block_pinned_gets_the_full_tier_answer(make_manager):
    m = make_manager(QUOTA_A)
    a = m.declare_namespace(make_spec(4096, tenant=SALT_A))
    b = m.declare_namespace(make_spec(4096, tenant=SALT_B))
    store(m, a, [1, 2, 3, 4])
    store(m, b, [100])
    load = m.prepare_load(a.namespace_id, [1, 2, 3, 4])
    with pytest.raises(CapacityExhausted, match="tenant 'alpha' is at its DRAM quota") as e:
        m.prepare_store(a.namespace_id, [5])
    assert SALT_A not in str(e.value)
    assert held(m, b, [100]) == [100]  # the tier has room, but not for A
    store(m, b, [101])  # B is not capped
    m.release([load.lease_id])
    assert list(store(m, a, [5]).statuses) == [STORE_ALLOCATED]  # its own coldest went
    assert held(m, a, [1, 2, 3, 4, 5]) == [2, 3, 4, 5]
    check_accounts(m)


def test_default_cap_holds_each_unlisted_tenant_on_its_own(make_manager):
    m = make_manager({"quotas.default_dram_bytes": "8KiB"})
    t1 = m.declare_namespace(make_spec(4096, tenant="t1"))
    t2 = m.declare_namespace(make_spec(4096, tenant="t2"))
    store(m, t1, [1, 2])
    store(m, t2, [4, 5])
    store(m, t1, [3])
    store(m, t2, [6])
    assert held(m, t1, [1, 2, 3]) == [2, 3] and held(m, t2, [4, 5, 6]) == [5, 6]
    (row,) = m.stats().tenants
    assert (row.label, row.tenants, row.namespaces) == (OTHER_TENANTS, 2, 2)
    assert row.used_bytes[Tier.DRAM] == 16 << 10 and row.quota_bytes[Tier.DRAM] == 8 << 10


def test_report_names_configured_tenants_never_salts_and_accounts_go(make_manager):
    m = make_manager(QUOTA_A)
    rows = m.stats().tenants
    assert [r.label for r in rows] == ["alpha"]  # known before it declares anything
    a = m.declare_namespace(make_spec(4096, tenant=SALT_A))
    b = m.declare_namespace(make_spec(4096, tenant=SALT_B))
    store(m, a, [1, 2])
    store(m, b, [3])
    rows = {r.label: r for r in m.stats().tenants}
    assert set(rows) == {"alpha", OTHER_TENANTS}
    assert rows["alpha"].used_bytes[Tier.DRAM] == 8 << 10
    assert rows[OTHER_TENANTS].used_bytes[Tier.DRAM] == 4 << 10
    assert SALT_A not in repr(rows) and SALT_B not in repr(rows)
    m.delete(a.namespace_id, [1])
    check_accounts(m)
    m.clear(b.namespace_id)  # empties B's namespace: dropped, its account with it
    assert SALT_B not in m.placement.accounts
    assert [r.label for r in m.stats().tenants] == ["alpha"]


def test_a_cleared_namespace_with_pinned_blocks_keeps_its_bytes_counted(make_manager):
    m = make_manager(QUOTA_A)
    a = m.declare_namespace(make_spec(4096, tenant=SALT_A))
    store(m, a, [1, 2])
    load = m.prepare_load(a.namespace_id, [1])
    m.clear(a.namespace_id)  # [1] is doomed (pinned), the namespace is dropped
    assert a.namespace_id not in m.namespaces
    account = m.placement.accounts[SALT_A]
    assert account.namespaces == 0 and account.used_bytes[Tier.DRAM] == 4 << 10
    again = m.declare_namespace(make_spec(4096, tenant=SALT_A))  # same tenant, new object
    assert m.placement.accounts[SALT_A] is account and account.namespaces == 1
    m.release([load.lease_id])  # the doomed block's slot goes: off the same account
    assert account.used_bytes[Tier.DRAM] == 0 and account.namespaces == 1
    check_accounts(m)
    m.clear(again.namespace_id)
    assert SALT_A not in m.placement.accounts
    assert [(r.label, r.namespaces) for r in m.stats().tenants] == [("alpha", 0)]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {
                "quotas.tenants.a.tenant": "x",
                "quotas.tenants.b.tenant": "x",
            },
            "quotas.tenants.b and quotas.tenants.a cap the same tenant",
        ),
        ({"quotas.tenants._other.tenant": "x"}, "quotas.tenants._other: a tenant name"),
        ({"quotas.tenants.a.dram_bytes": "1KiB"}, "tenant"),  # tenant is required
        ({"quotas.tenants.a.tenant": "x", "quotas.tenants.a.gpu_bytes": -1}, "gpu_bytes"),
        ({"quotas.default_disk_bytes": -5}, "quotas.default_disk_bytes"),
    ],
)
def test_bad_quota_config_is_refused_precisely(settings, message):
    with pytest.raises(ConfigError, match=message):
        load_config(environ={}, assignments=[f"{k}={v}" for k, v in settings.items()])


BLOCK = 16 * 1024


def tiered_manager(tmp_path, *, gpu=False, extra=(), **quota):
    """A manager over a real region and a real disk tier (and a host-mode GPU pool)."""
    (tmp_path / "disk").mkdir(exist_ok=True)
    settings = {
        "dram.capacity_bytes": "256KiB",  # 16 blocks
        "dram.chunk_bytes": "64KiB",
        "dram.path": str(tmp_path / "region"),
        "disk.path": str(tmp_path / "disk"),
        "disk.capacity_bytes": "1MiB",  # 64 blocks
        "disk.slab_bytes": "64KiB",
        "disk.io_threads": 2,
        "disk.demote_free_fraction": 1.0,  # write-behind: every block goes to disk
        "quotas.tenants.alpha.tenant": SALT_A,
        **{f"quotas.tenants.alpha.{k}": v for k, v in quota.items()},
    }
    if gpu:
        settings |= {
            "gpu.device": "cpu",
            "gpu.capacity_bytes": "128KiB",  # 8 blocks
            "gpu.chunk_bytes": "64KiB",
            "gpu.demote_free_fraction": 0,
        }
    assignments = [f"{k}={v}" for k, v in settings.items()] + list(extra)
    config = load_config(environ={}, assignments=assignments)
    region = Region(config.dram.path, config.dram.capacity_bytes, prefault=False, huge_pages="off")
    return BlockManager(config, region, RecordingSink()), region


async def settled(m, timeout_s=20.0):
    """Every dirty block written down (A's too: it drops its own copies for room).
    Not DiskLayer.drain: with write-behind that waits for all of DRAM to be clean,
    which A's DRAM share beyond its disk cap never is."""
    deadline = time.monotonic() + timeout_s
    while m.disk.dirty and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    assert not m.disk.dirty


async def test_disk_cap_drops_only_the_tenants_own_disk_copies(tmp_path):
    m, region = tiered_manager(tmp_path, disk_bytes="64KiB")  # 4 of A's blocks on disk
    try:
        a = m.declare_namespace(make_spec(BLOCK, tenant=SALT_A))
        b = m.declare_namespace(make_spec(BLOCK, tenant=SALT_B))
        for i in range(0, 24, 4):  # more than DRAM holds, each tenant
            store(m, a, range(i, i + 4))
            store(m, b, range(100 + i, 104 + i))
            await settled(m)
        check_accounts(m)
        account = m.placement.accounts[SALT_A]
        assert account.used_bytes[Tier.DISK] <= 64 << 10
        on_disk_a = [h for h, blk in a.blocks.items() if blk.disk_slot >= 0]
        assert 0 < len(on_disk_a) <= 4
        # B is not capped: all its 24 blocks are still in the store (disk has room).
        assert held(m, b, range(100, 124)) == list(range(100, 124))
        assert m.lookup(b.namespace_id, list(range(100, 124))).prefix_blocks == 24
        rows = {r.label: r for r in m.stats().tenants}
        assert rows["alpha"].used_bytes[Tier.DISK] == account.used_bytes[Tier.DISK]
        assert rows["alpha"].quota_bytes[Tier.DISK] == 64 << 10
    finally:
        await m.close()
        region.close(unlink=True)


async def test_gpu_cap_moves_only_the_tenants_own_blocks_down(tmp_path):
    pytest.importorskip("torch")
    m, region = tiered_manager(tmp_path, gpu=True, gpu_bytes="32KiB")  # 2 of A's blocks
    try:
        a = m.declare_namespace(make_spec(BLOCK, tenant=SALT_A))
        b = m.declare_namespace(make_spec(BLOCK, tenant=SALT_B))
        m.commit_store(m.prepare_store(b.namespace_id, [100, 101, 102], tier=Tier.GPU).lease_id)
        for h in range(1, 5):
            plan = m.prepare_store(a.namespace_id, [h], tier=Tier.GPU)
            assert list(plan.statuses) == [STORE_ALLOCATED]
            m.commit_store(plan.lease_id)
        assert [a.blocks[h].tier for h in range(1, 5)] == [Tier.DRAM] * 2 + [Tier.GPU] * 2
        assert [b.blocks[h].tier for h in (100, 101, 102)] == [Tier.GPU] * 3
        check_accounts(m)
        # Its GPU blocks pinned: the pool has room, but not for A.
        load = await m.prepare_load_async(a.namespace_id, [3, 4], tier=Tier.GPU)
        with pytest.raises(CapacityExhausted, match="at its GPU quota"):
            m.prepare_store(a.namespace_id, [5], tier=Tier.GPU)
        m.release([load.lease_id])
        check_accounts(m)
    finally:
        await m.close()
        region.close(unlink=True)


def test_warm_restart_restores_each_tenants_usage(tmp_path):
    settings = [
        "dram.capacity_bytes=1MiB",
        "dram.chunk_bytes=256KiB",
        f"dram.path={tmp_path}/region",
        *(f"{k}={v}" for k, v in QUOTA_A.items()),
    ]
    config = load_config(environ={}, assignments=settings)

    def open_manager():
        region = Region(
            config.dram.path, config.dram.capacity_bytes, prefault=False, huge_pages="off"
        )
        return BlockManager(config, region, RecordingSink()), region

    m, region = open_manager()
    store(m, m.declare_namespace(make_spec(4096, tenant=SALT_A)), [1, 2, 3])
    store(m, m.declare_namespace(make_spec(4096, tenant=SALT_B)), [4])
    region.close(unlink=False)  # the drain: the manifest is written beside the region
    m, region = open_manager()
    try:
        assert m.placement.accounts[SALT_A].used_bytes[Tier.DRAM] == 12 << 10
        assert m.placement.accounts[SALT_A].namespaces == 1
        check_accounts(m)
        a = m.declare_namespace(make_spec(4096, tenant=SALT_A))
        store(m, a, [5, 6])  # the cap holds across the restart: its own coldest went
        assert held(m, a, [1, 2, 3, 5, 6]) == [2, 3, 5, 6]
        check_accounts(m)
    finally:
        region.close(unlink=True)


async def test_usage_matches_the_slots_through_random_operations(tmp_path):
    """Seeded random stores, loads, deletes and clears of three tenants (two capped
    in DRAM and on disk) over DRAM + disk: after every step each account equals its
    tenant's slots and no capped tenant is past a cap."""
    import random

    m, region = tiered_manager(
        tmp_path,
        dram_bytes="64KiB",
        disk_bytes="128KiB",
        extra=["quotas.tenants.beta.tenant=b", "quotas.tenants.beta.dram_bytes=96KiB"],
    )
    rng = random.Random(1234)
    try:
        spaces = [
            m.declare_namespace(make_spec(BLOCK, tenant=t, model=model))
            for t in (SALT_A, "b", "c")
            for model in ("m1", "m2")
        ]
        caps = {SALT_A: (64 << 10, 128 << 10), "b": (96 << 10, 0)}
        for _ in range(150):
            ns = rng.choice(spaces)
            if ns.namespace_id not in m.namespaces:
                ns = m.declare_namespace(ns.spec)
                spaces = [s if s.spec != ns.spec else ns for s in spaces]
            op = rng.random()
            hashes = rng.sample(range(64), rng.randint(1, 6))
            if op < 0.6:
                store(m, ns, hashes)
            elif op < 0.8:
                plan = await m.prepare_load_async(ns.namespace_id, hashes)
                if plan.lease_id:
                    m.release([plan.lease_id])
            elif op < 0.95:
                m.delete(ns.namespace_id, [h for h in hashes if h in ns.blocks])
            else:
                m.clear(ns.namespace_id)
            await settled(m)
            check_accounts(m)
            for tenant, (dram_cap, disk_cap) in caps.items():
                account = m.placement.accounts.get(tenant)
                if account is not None:
                    assert account.used_bytes[Tier.DRAM] <= dram_cap
                    assert not disk_cap or account.used_bytes[Tier.DISK] <= disk_cap
        assert m.placement.pinned_blocks == 0
    finally:
        await m.close()
        region.close(unlink=True)
