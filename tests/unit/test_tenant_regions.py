"""Tenant regions: a DRAM region cut into files, one per tenant, mapped side by side.

Real files under a temp dir, real mmaps: what a client handed one file's
descriptor can see is read back through a mapping of its own.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat

import numpy as np
import pytest

from kvstore.errors import ConfigError
from kvstore.manager import STORE_ALLOCATED
from kvstore.tiers import Tier
from kvstore.tiers.dram import HUGE_PAGE_BYTES, PARTITION_SUFFIX, Region

KiB = 1024
MiB = 1024 * KiB
PARTS = [("alpha", 2 * MiB), ("beta", 2 * MiB)]


def _region(path, **kw) -> Region:
    kw.setdefault("prefault", False)
    return Region(str(path), 8 * MiB, huge_pages="off", partitions=PARTS, **kw)


def _read_file(path) -> np.ndarray:
    with open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8)


def test_layout_is_one_contiguous_array_over_one_file_per_range(tmp_path):
    r = _region(tmp_path / "r", prefault=True)
    try:
        assert [(g.name, g.offset, g.nbytes) for g in r.ranges] == [
            ("", 0, 4 * MiB),
            ("alpha", 4 * MiB, 2 * MiB),
            ("beta", 6 * MiB, 2 * MiB),
        ]
        assert r.range_of("beta").path == str(tmp_path / "r") + PARTITION_SUFFIX + "beta"
        assert len(r.array) == 8 * MiB and r.base_address % HUGE_PAGE_BYTES == 0
        for g in r.ranges:
            assert os.path.getsize(g.path) == g.nbytes
        # Bytes written through the daemon's one array land in the range's own file.
        r.array[:] = 0
        r.array[0:16] = 1
        r.array[4 * MiB : 4 * MiB + 16] = 2
        r.array[8 * MiB - 16 :] = 3
        shared, alpha, beta = (_read_file(g.path) for g in r.ranges)
        assert (shared[:16] == 1).all() and (alpha[:16] == 2).all() and (beta[-16:] == 3).all()
        # ...and nowhere else: no range's file holds another's bytes.
        assert set(np.unique(shared)) == {0, 1}
        assert set(np.unique(alpha)) == {0, 2}
        assert set(np.unique(beta)) == {0, 3}
    finally:
        r.close(unlink=True)


def test_a_handed_descriptor_maps_its_range_only(tmp_path):
    r = _region(tmp_path / "r")
    try:
        r.array[:] = 7
        r.array[6 * MiB : 8 * MiB] = 9  # beta's range
        # What a client of alpha gets: alpha's descriptor (a dup, as SCM_RIGHTS gives).
        fd = os.dup(r.fd_of("alpha"))
        try:
            assert os.fstat(fd).st_size == 2 * MiB
            with mmap.mmap(fd, 0, flags=mmap.MAP_SHARED) as m:
                seen = np.frombuffer(m, dtype=np.uint8)
                assert (seen == 7).all()  # not one byte of beta's
                seen[:4] = 5  # the client's writes reach the daemon's view
                assert list(r.array[4 * MiB : 4 * MiB + 4]) == [5] * 4
                del seen
        finally:
            os.close(fd)
    finally:
        r.close(unlink=True)


def test_tenant_files_are_the_daemons_alone(tmp_path):
    r = _region(tmp_path / "r")
    try:
        shared, alpha, beta = r.ranges
        assert stat.S_IMODE(os.stat(alpha.path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(beta.path).st_mode) == 0o600
        assert os.stat(alpha.path).st_uid == os.getuid()
        assert stat.S_IMODE(os.stat(shared.path).st_mode) == 0o600  # no group configured
    finally:
        r.close(unlink=True)


def test_a_tenant_file_locked_by_another_daemon_is_refused(tmp_path):
    beta_path = str(tmp_path / "r") + PARTITION_SUFFIX + "beta"
    fd = os.open(beta_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ConfigError, match="locked by another running daemon"):
            _region(tmp_path / "r")
        # Nothing half-made is left locked: once free, the region opens.
        fcntl.flock(fd, fcntl.LOCK_UN)
        _region(tmp_path / "r").close(unlink=True)
    finally:
        os.close(fd)


def test_a_planted_tenant_file_is_not_trusted(tmp_path):
    beta_path = str(tmp_path / "r") + PARTITION_SUFFIX + "beta"
    with open(beta_path, "wb") as f:
        f.write(b"\x01" * (2 * MiB))
    os.chmod(beta_path, 0o666)  # others could have mapped and written it
    r = _region(tmp_path / "r")
    try:
        assert not r.range_of("beta").reused and not r.reused
        assert (r.array[6 * MiB : 8 * MiB] == 0).all()  # a new, empty file
        assert stat.S_IMODE(os.stat(beta_path).st_mode) == 0o600
    finally:
        r.close(unlink=True)


def test_kept_files_are_reused_with_their_bytes(tmp_path):
    r = _region(tmp_path / "r")
    r.array[4 * MiB] = 42
    r.array[6 * MiB] = 43
    r.keep_on_close = True
    paths = [g.path for g in r.ranges]
    r.close(unlink=True)
    assert all(os.path.exists(p) for p in paths)
    again = _region(tmp_path / "r")
    try:
        assert again.reused and all(g.reused for g in again.ranges)
        assert again.array[4 * MiB] == 42 and again.array[6 * MiB] == 43
    finally:
        again.close(unlink=True)
    assert not any(os.path.exists(p) for p in paths)


def test_close_with_a_view_still_held_keeps_the_mapping(tmp_path):
    r = _region(tmp_path / "r")
    view = r.view(6 * MiB, 16)
    view[:] = 4
    r.close(unlink=True)
    assert (view == 4).all()  # still mapped: the reservation could not be closed


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ([("alpha", 8 * MiB)], "the shared range needs some"),
        ([("alpha", 3000)], "not a positive multiple of 4096"),
        ([("alpha", MiB), ("alpha", MiB)], "bad or repeated"),
        ([("../x", MiB)], "bad or repeated"),
    ],
)
def test_bad_layouts_are_refused_before_any_file_is_made(tmp_path, parts, message):
    with pytest.raises(ConfigError, match=message):
        Region(str(tmp_path / "r"), 8 * MiB, prefault=False, huge_pages="off", partitions=parts)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------- the daemon's slots in the ranges

SALT_A = "salt-of-tenant-a-7f3e"
SALT_B = "salt-of-tenant-b-91c2"
REGIONS = {
    "dram.tenant_regions": "true",
    "quotas.tenants.alpha.tenant": SALT_A,
    "quotas.tenants.alpha.dram_bytes": "256KiB",  # one chunk
}


@pytest.fixture
def make_manager(tmp_path):
    from kvstore.config import load_config
    from kvstore.manager import BlockManager
    from kvstore.quotas import tenant_regions
    from tests.sinks import RecordingSink

    made = []

    def make(settings=REGIONS, name="r"):
        assignments = [
            "dram.capacity_bytes=1MiB",
            "dram.chunk_bytes=256KiB",
            f"dram.path={tmp_path}/{name}",
        ] + [f"{k}={v}" for k, v in settings.items()]
        config = load_config(environ={}, assignments=assignments)
        region = Region(
            config.dram.path,
            config.dram.capacity_bytes,
            prefault=False,
            huge_pages="off",
            partitions=[(r.name, r.nbytes) for r in tenant_regions(config)],
        )
        made.append(region)
        return BlockManager(config, region, RecordingSink())

    yield make
    for r in made:
        r.close(unlink=True)


def _store(m, ns, hashes, fill=None):
    plan = m.prepare_store(ns.namespace_id, hashes)
    if fill is not None:
        for off in plan.offsets:
            if off >= 0:
                m.region.array[off : off + ns.block_bytes] = fill
    if plan.lease_id:
        m.commit_store(plan.lease_id)
    return plan


def _in_alpha(m, ns):
    alpha = m.region.range_of("alpha")
    return {alpha.offset <= b.offset < alpha.offset + alpha.nbytes for b in ns.blocks.values()}


def test_a_tenants_blocks_live_in_its_own_file_only(make_manager):
    from tests.conftest import make_spec

    m = make_manager()
    a = m.declare_namespace(make_spec(4096, tenant=SALT_A))
    b = m.declare_namespace(make_spec(4096, tenant=SALT_B))
    _store(m, a, range(10), fill=0xAA)
    _store(m, b, range(10), fill=0xBB)
    assert _in_alpha(m, a) == {True} and _in_alpha(m, b) == {False}
    alpha = _read_file(m.region.range_of("alpha").path)
    shared = _read_file(m.region.range_of("").path)
    assert (alpha == 0xAA).sum() == 10 * 4096 and not (alpha == 0xBB).any()
    assert (shared == 0xBB).sum() == 10 * 4096 and not (shared == 0xAA).any()


def test_neither_side_evicts_the_others_blocks_to_make_room(make_manager):
    from tests.conftest import make_spec

    m = make_manager()
    a = m.declare_namespace(make_spec(4096, tenant=SALT_A))
    b = m.declare_namespace(make_spec(4096, tenant=SALT_B))
    _store(m, a, range(64))  # alpha's one chunk, full
    _store(m, b, range(1000, 1000 + 3 * 64))  # the shared three chunks, full
    assert len(a.blocks) == 64 and len(b.blocks) == 192
    # The shared tenant keeps storing: its own coldest go (LRU), none of alpha's,
    # though alpha's are the coldest blocks of the whole tier.
    _store(m, b, range(2000, 2010))
    assert len(a.blocks) == 64 and 1000 not in b.blocks and 2009 in b.blocks
    # Alpha past its range: its own coldest go, none of the shared ones.
    _store(m, a, range(100, 110))
    assert len(b.blocks) == 192 and 0 not in a.blocks and 109 in a.blocks
    assert _in_alpha(m, a) == {True} and _in_alpha(m, b) == {False}
    assert m.placement.accounts[SALT_A].used_bytes[Tier.DRAM] == 256 << 10


def test_another_block_size_takes_a_chunk_of_the_tenants_own_range(make_manager):
    from tests.conftest import make_spec

    m = make_manager()
    a = m.declare_namespace(make_spec(4096, tenant=SALT_A))
    a_big = m.declare_namespace(make_spec(8192, tenant=SALT_A, model="big"))
    b = m.declare_namespace(make_spec(8192, tenant=SALT_B))
    _store(m, a, range(64))
    _store(m, b, range(1000, 1010))
    # Alpha's chunk is all 4 KiB slots: the 8 KiB store steals that chunk (its
    # own blocks), not a chunk of the shared range, which has free room.
    plan = _store(m, a_big, [1])
    assert list(plan.statuses) == [STORE_ALLOCATED] and len(a.blocks) == 0
    assert _in_alpha(m, a_big) == {True} and len(b.blocks) == 10


def test_warm_restart_puts_every_block_back_in_its_tenants_file(make_manager):
    from tests.conftest import make_spec

    m = make_manager()
    a = m.declare_namespace(make_spec(4096, tenant=SALT_A))
    b = m.declare_namespace(make_spec(4096, tenant=SALT_B))
    _store(m, a, range(5), fill=0xAA)
    _store(m, b, range(5), fill=0xBB)
    m.region.close(unlink=True)  # the drain: writes the manifest, keeps the files
    m2 = make_manager()
    a2 = m2.namespaces[a.namespace_id]
    b2 = m2.namespaces[b.namespace_id]
    assert sorted(a2.blocks) == list(range(5)) and sorted(b2.blocks) == list(range(5))
    assert _in_alpha(m2, a2) == {True} and _in_alpha(m2, b2) == {False}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"dram.capacity_bytes": "1000KiB"}, "in whole chunks"),
        ({"quotas.tenants.alpha.dram_bytes": "1MiB"}, "needs at least one chunk"),
    ],
)
def test_tenant_regions_that_cannot_fit_are_refused(settings, message):
    from kvstore.config import load_config
    from kvstore.quotas import tenant_regions

    assignments = ["dram.capacity_bytes=1MiB", "dram.chunk_bytes=256KiB"]
    assignments += [f"{k}={v}" for k, v in {**REGIONS, **settings}.items()]
    with pytest.raises(ConfigError, match=message):
        tenant_regions(load_config(environ={}, assignments=assignments))


def test_a_partial_chunk_cap_gets_its_range_in_whole_chunks():
    from kvstore.config import load_config
    from kvstore.quotas import tenant_regions

    assignments = ["dram.capacity_bytes=1MiB", "dram.chunk_bytes=256KiB"]
    assignments += [
        f"{k}={v}" for k, v in {**REGIONS, "quotas.tenants.alpha.dram_bytes": "300KiB"}.items()
    ]
    assignments += ["quotas.tenants.nocap.tenant=x"]  # no DRAM cap: shares range 0
    (only,) = tenant_regions(load_config(environ={}, assignments=assignments))
    assert (only.name, only.tenant, only.nbytes) == ("alpha", SALT_A, 512 << 10)


def test_partitioned_allocator_keeps_each_range_to_itself():
    from kvstore.tiers.dram import PartitionedAllocator

    chunk = 64 * KiB
    a = PartitionedAllocator([(0, 2 * chunk), (2 * chunk, chunk)], chunk)
    assert (a.capacity_bytes, a.num_chunks) == (3 * chunk, 3)
    own = [a.alloc(4096, 1) for _ in range(16)]
    assert all(2 * chunk <= o < 3 * chunk for o in own) and a.alloc(4096, 1) is None
    assert a.alloc(4096, 0) == 0  # the shared range still has room
    assert a.size_classes(1) == [4096] and a.chunks_of(4096, 1) == [2]
    assert list(a.chunk_slots(2)) == sorted(own)
    a.free(own[0])
    assert a.alloc(4096, 1) == own[0] and a.used_bytes == 17 * 4096
    # A rebuild (warm restart) puts each slot back in its own range; one that
    # does not fit there (past the end, misaligned) is refused.
    b = PartitionedAllocator([(0, 2 * chunk), (2 * chunk, chunk)], chunk)
    rejected = b.rebuild([(0, 4096), (2 * chunk, 4096), (2 * chunk + 100, 4096), (3 * chunk, 64)])
    assert sorted(rejected) == [(2 * chunk + 100, 4096), (3 * chunk, 64)]
    assert b.part_of(2 * chunk) == 1 and b.slot_bytes_at(2 * chunk) == 4096
    assert b.used_bytes == 2 * 4096 and b.free_chunks == 1
    with pytest.raises(ConfigError, match="whole chunks"):
        PartitionedAllocator([(0, chunk), (chunk, chunk // 2)], chunk)


def test_every_slot_stays_in_its_tenants_range_through_random_operations(make_manager):
    """Seeded random stores (two block sizes), loads, deletes and clears of two
    partitioned tenants and a shared one: after every step each slot lies in its
    tenant's range, each range's allocator counts exactly its tenants' slots, and
    nothing is pinned once each step's loads are released."""
    import random

    from tests.conftest import make_spec

    settings = {
        **REGIONS,
        "quotas.tenants.beta.tenant": SALT_B,
        "quotas.tenants.beta.dram_bytes": "256KiB",
    }
    m = make_manager(settings)
    part_of = {SALT_A: 1, SALT_B: 2, "c": 0}
    rng = random.Random(4321)
    spaces = [
        m.declare_namespace(make_spec(size, tenant=t, model=f"m{size}"))
        for t in part_of
        for size in (4096, 16384)
    ]
    for _ in range(300):
        ns = rng.choice(spaces)
        if ns.namespace_id not in m.namespaces:
            ns = m.declare_namespace(ns.spec)
            spaces = [s if s.spec != ns.spec else ns for s in spaces]
        op = rng.random()
        hashes = rng.sample(range(200), rng.randint(1, 24))
        if op < 0.6:
            _store(m, ns, hashes)
        elif op < 0.8:
            plan = m.prepare_load(ns.namespace_id, hashes)
            if plan.lease_id:
                m.release([plan.lease_id])
        elif op < 0.97:
            m.delete(ns.namespace_id, [h for h in hashes if h in ns.blocks])
        else:
            m.clear(ns.namespace_id)
        used = [0, 0, 0]
        for offset, block in m.placement.dram.owner.items():
            part = part_of[block.namespace.tenant]
            assert m.allocator.part_of(offset) == part
            used[part] += block.namespace.slot_bytes
        assert used == [p.used_bytes for p in m.allocator.parts]
    assert m.placement.pinned_blocks == 0
    assert m.placement.counters.evicted_blocks > 100  # the ranges were full, often
