"""Files the daemon owns (kvstore/files.py): modes, links, owners, the region lock,
the warm-restart manifest's trust rules, and the namespace/lease bounds in-process."""

from __future__ import annotations

import grp
import logging
import os
import stat

import msgspec
import numpy as np
import pytest

from kvstore.config import load_config
from kvstore.errors import CapacityExhausted, ConfigError
from kvstore.files import FilePolicy
from kvstore.manager import BlockManager
from kvstore.movers import warm
from kvstore.rpc_guard import RateLimitedLog
from kvstore.tiers.dram import Region
from tests.conftest import make_spec
from tests.unprivileged import OTHER_UID

MiB = 1 << 20


def _region(path, **kw):
    return Region(str(path), MiB, prefault=False, huge_pages="off", **kw)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another uid needs root; run the suite as root")


def test_region_is_created_private_and_locked(tmp_path):
    path = tmp_path / "r.dram"
    old_umask = os.umask(0)
    try:
        first = _region(path)
    finally:
        os.umask(old_umask)
    try:
        assert _mode(path) == 0o600 and not first.reused
        with pytest.raises(ConfigError, match="locked by another running daemon"):
            _region(path)
    finally:
        first.close(unlink=False)
    second = _region(path)  # the lock went with the first one's close
    assert second.reused
    second.close(unlink=True)


def test_region_path_that_is_a_symlink_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    (tmp_path / "r.dram").symlink_to(target)
    with pytest.raises(ConfigError, match="symbolic link"):
        _region(tmp_path / "r.dram")
    assert target.stat().st_size == 0  # never written through


def test_region_owned_by_another_user_is_refused_naming_the_owner(tmp_path):
    _need_root()
    path = tmp_path / "r.dram"
    path.write_bytes(b"\x07" * MiB)
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=rf"{path} is owned by uid {OTHER_UID}"):
        _region(path)


def test_region_more_open_than_ours_is_replaced_empty(tmp_path):
    path = tmp_path / "r.dram"
    path.write_bytes(b"\x07" * MiB)
    os.chmod(path, 0o644)  # someone else may have it open, or still mapped
    region = _region(path)
    try:
        assert not region.reused
        assert _mode(path) == 0o600
        assert not region.array.any()  # the old bytes are gone with the old file
    finally:
        region.close(unlink=True)


def test_region_of_a_group(tmp_path):
    _need_root()
    policy = FilePolicy.from_group(grp.getgrgid(OTHER_UID).gr_name)  # "nogroup" on Debian
    _region(tmp_path / "r.dram").close(unlink=False)  # private, before a group was set
    region = _region(tmp_path / "r.dram", files=policy)
    try:
        assert region.reused  # it was private: nobody else could have mapped it
        st = os.stat(region.path)
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == policy.gid
    finally:
        region.close(unlink=True)
    with pytest.raises(ConfigError, match="no group named"):
        FilePolicy.from_group("no-such-group-here")


def _manifest(region_path: str) -> warm.WarmManifest:
    return warm.WarmManifest(
        region_path=region_path,
        capacity_bytes=MiB,
        chunk_bytes=MiB // 4,
        namespaces=[make_spec(4096)],
        blocks=[warm.WarmBlock(0, 1, 0, 123)],
    )


def test_manifest_is_written_private_and_taken_only_when_ours(tmp_path, caplog):
    region_path = str(tmp_path / "r.dram")
    old_umask = os.umask(0)
    try:
        path = warm.save(_manifest(region_path))
    finally:
        os.umask(old_umask)
    assert _mode(path) == 0o600
    assert warm.take(region_path, MiB, MiB // 4) == _manifest(region_path)
    assert not os.path.exists(path)  # taken means deleted

    # Writable by others: anyone could have written it.
    warm.save(_manifest(region_path))
    os.chmod(path, 0o666)
    with caplog.at_level(logging.ERROR):
        assert warm.take(region_path, MiB, MiB // 4) is None
    assert "writable by other users" in caplog.text and not os.path.exists(path)


def test_manifest_of_another_user_is_ignored(tmp_path, caplog):
    _need_root()
    region_path = str(tmp_path / "r.dram")
    path = warm.manifest_path(region_path)
    with open(path, "wb") as f:
        f.write(msgspec.msgpack.encode(_manifest(region_path)))
    os.chown(path, OTHER_UID, OTHER_UID)
    with caplog.at_level(logging.ERROR):
        assert warm.take(region_path, MiB, MiB // 4) is None
    assert f"owned by uid {OTHER_UID}" in caplog.text


def test_rate_limited_log_counts_what_it_holds_back(caplog):
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("t.rl"), interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="t.rl"):
        assert limited.warning("bad %s", "x")
        for _ in range(99):
            assert not limited.warning("bad %s", "x")
        now[0] = 10.0
        assert limited.warning("bad %s", "y")
    assert [r.getMessage() for r in caplog.records] == [
        "bad x",
        "bad y (99 more since the last such line)",
    ]


# --------------------------------------------------- bounds, in-process


@pytest.fixture
def manager(tmp_path):
    made = []
    now = [0.0]

    def make(**settings):
        assignments = ["dram.capacity_bytes=1MiB", "dram.chunk_bytes=256KiB"]
        assignments.append(f"dram.path={tmp_path}/r{len(made)}")
        assignments += [f"{k}={v}" for k, v in settings.items()]
        config = load_config(environ={}, assignments=assignments)
        region = Region(
            config.dram.path, config.dram.capacity_bytes, prefault=False, huge_pages="off"
        )
        made.append(region)
        return BlockManager(config, region, clock=lambda: now[0]), now

    yield make
    for r in made:
        r.close(unlink=True)


def test_an_empty_namespace_is_reclaimed_only_once_idle(manager):
    m, now = manager(**{"limits.max_namespaces": 2, "limits.namespace_idle_s": 60})
    a = m.declare_namespace(make_spec(4096, tenant="a"))
    m.declare_namespace(make_spec(4096, tenant="b"))
    now[0] = 30.0
    with pytest.raises(CapacityExhausted, match="namespace_idle_s=60"):
        m.declare_namespace(make_spec(4096, tenant="c"))
    m.lookup(a.namespace_id, [1])  # a is in use again: b is the one idle longest
    now[0] = 65.0  # b idle 65 s, a only 35 s
    c = m.declare_namespace(make_spec(4096, tenant="c"))
    assert sorted(m.namespaces) == sorted([a.namespace_id, c.namespace_id])


def test_a_namespace_holding_a_block_is_never_reclaimed(manager):
    m, now = manager(**{"limits.max_namespaces": 1, "limits.namespace_idle_s": 0})
    a = m.declare_namespace(make_spec(4096, tenant="a"))
    plan = m.prepare_store(a.namespace_id, [1])
    now[0] = 1e6
    with pytest.raises(CapacityExhausted):
        m.declare_namespace(make_spec(4096, tenant="b"))  # a pending store counts
    m.commit_store(plan.lease_id)
    with pytest.raises(CapacityExhausted):
        m.declare_namespace(make_spec(4096, tenant="b"))
    assert m.clear(a.namespace_id) == 1
    assert a.namespace_id not in m.namespaces  # the clear left it empty: dropped
    m.declare_namespace(make_spec(4096, tenant="b"))


def test_lease_bounds_per_client_and_in_all(manager):
    m, _ = manager(**{"limits.max_leases_per_client": 2, "limits.max_leases": 3})
    ns = m.declare_namespace(make_spec(4096))
    plan = m.prepare_store(ns.namespace_id, [1])
    m.commit_store(plan.lease_id)
    a1 = m.prepare_load(ns.namespace_id, [1], client="a")
    m.prepare_load(ns.namespace_id, [1], client="a")
    with pytest.raises(CapacityExhausted, match="max_leases_per_client=2"):
        m.prepare_load(ns.namespace_id, [1], client="a")
    m.prepare_load(ns.namespace_id, [1], client="b")
    with pytest.raises(CapacityExhausted, match="max_leases=3"):
        m.prepare_load(ns.namespace_id, [1], client="c")
    m.release([a1.lease_id])
    m.prepare_load(ns.namespace_id, [1], client="a")
    assert m.expire_leases(now_s=1e12) == 3  # expiry forgets clients too
    assert m.leases.held_by("a") == 0
    np.testing.assert_equal(len(m.leases), 0)
