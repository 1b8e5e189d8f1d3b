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
