from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvstore.tiers.dram import (
    HUGE_PAGE_BYTES,
    Region,
    SlabAllocator,
    page_bytes_for,
    page_bytes_of,
    pmd_mapped_bytes,
    slot_bytes_for,
)
from tests.conftest import kernel_collapses_shmem


def test_slots_are_aligned_and_bounded():
    a = SlabAllocator(capacity_bytes=1 << 20, chunk_bytes=256 << 10)
    slot = slot_bytes_for(1000)
    assert slot == 1024
    offsets = []
    while (off := a.alloc(slot)) is not None:
        offsets.append(off)
    assert len(offsets) == (1 << 20) // slot  # every byte of capacity used, never more
    assert len(set(offsets)) == len(offsets)
    assert all(o % 64 == 0 and o + slot <= (1 << 20) for o in offsets)
    assert a.used_bytes == 1 << 20
    assert a.alloc(slot) is None


def test_consecutive_allocations_are_neighbours():
    a = SlabAllocator(capacity_bytes=1 << 20, chunk_bytes=256 << 10)
    offs = [a.alloc(4096) for _ in range(10)]
    assert offs == [i * 4096 for i in range(10)]


def test_empty_chunk_returns_to_pool_for_other_sizes():
    a = SlabAllocator(capacity_bytes=512 << 10, chunk_bytes=256 << 10)
    small = [a.alloc(4096) for _ in range(128)]  # fills both chunks
    assert a.alloc(256 << 10) is None
    for off in small[:64]:  # frees exactly the first chunk
        a.free(off)
    assert a.free_chunks == 1
    big = a.alloc(256 << 10)
    assert big == 0
    assert a.used_bytes == 64 * 4096 + (256 << 10)


def test_oversize_slot_is_refused():
    a = SlabAllocator(capacity_bytes=1 << 20, chunk_bytes=256 << 10)
    with pytest.raises(ValueError):
        a.alloc((256 << 10) + 64)


def test_region_is_shared_memory_visible_to_a_second_mapping(tmp_path):
    r = Region(str(tmp_path / "r"), 1 << 20, prefault=True, huge_pages="off")
    r.array[100:104] = [1, 2, 3, 4]
    with open(tmp_path / "r", "rb") as f:
        f.seek(100)
        assert f.read(4) == bytes([1, 2, 3, 4])
    r.close(unlink=True)
    assert not (tmp_path / "r").exists()


def _free_some(rng, held: list[int], *allocs) -> None:  # type: ignore[no-untyped-def]
    """Free a random sample of ``held`` in each of ``allocs`` (and drop it from ``held``)."""
    for offset in rng.sample(held, rng.randint(1, len(held))):
        for alloc in allocs:
            alloc.free(offset)
        held.remove(offset)


def _one_by_one(alloc, size: int, n: int, part: int = 0) -> list[int]:  # type: ignore[no-untyped-def]
    """What ``n`` alloc() calls give (until one answers None)."""
    out = []
    for _ in range(n):
        offset = alloc.alloc(size, part)
        if offset is None:
            break
        out.append(offset)
    return out


def test_alloc_many_gives_what_as_many_allocs_would_give():
    """Same offsets, same order, same state after (a chunk's slice at a time), across
    chunk boundaries, a mixed size in between, frees in between, and running out."""
    import random

    from kvstore.tiers.dram import PartitionedAllocator

    rng = random.Random(7)
    for make in (
        lambda: SlabAllocator(8 * 65536, 65536),
        lambda: PartitionedAllocator([(0, 4 * 65536), (4 * 65536, 4 * 65536)], 65536),
    ):
        one, many = make(), make()
        held: list[int] = []
        for _ in range(300):
            size = rng.choice([4096, 4096, 8192])
            part = rng.choice([0, 1]) if isinstance(one, PartitionedAllocator) else 0
            if held and rng.random() < 0.4:
                _free_some(rng, held, one, many)
                continue
            n = rng.randint(1, 40)
            expected = _one_by_one(one, size, n, part)
            assert many.alloc_many(size, n, part) == expected
            assert many.used_bytes == one.used_bytes
            held += expected
        rest = []  # running out: alloc_many stops where alloc() answers None
        while (offset := one.alloc(4096)) is not None:
            rest.append(offset)
        assert many.alloc_many(4096, 10**6) == rest
        assert many.alloc(4096) is None and many.used_bytes == one.used_bytes


def test_alloc_many_of_large_slots_takes_whole_chunks_as_allocs_would():
    """Slots of half a chunk and a whole chunk (2 MiB blocks in 4 MiB chunks): taken
    from whole free chunks in bulk, the same offsets and the same state as one
    alloc() per slot, a chunk left half used included, with frees in between."""
    import random

    rng = random.Random(11)
    chunk = 65536
    one, many = SlabAllocator(40 * chunk, chunk), SlabAllocator(40 * chunk, chunk)
    held: list[int] = []
    for _ in range(400):
        size = rng.choice([chunk // 2, chunk // 2, chunk, chunk // 4])
        if held and rng.random() < 0.4:
            _free_some(rng, held, one, many)
            continue
        n = rng.randint(1, 25)
        expected = _one_by_one(one, size, n)
        assert many.alloc_many(size, n) == expected
        assert many.used_bytes == one.used_bytes
        assert many.free_chunks == one.free_chunks
        held += expected
    for size in (chunk // 4, chunk // 2, chunk):  # what is left, size by size
        rest = []
        while (offset := one.alloc(size)) is not None:
            rest.append(offset)
        assert many.alloc_many(size, 10**6) == rest
    assert many.used_bytes == one.used_bytes


@pytest.mark.parametrize(
    ("fstype", "options", "policy", "page_bytes"),
    [
        ("tmpfs", "rw,nosuid,nodev,size=24683784k", "never", 4096),  # /dev/shm as usual
        ("tmpfs", "rw,relatime,size=4194304k,huge=within_size", "never", 2 << 20),
        ("tmpfs", "rw,huge=always", "", 2 << 20),
        # advise: the region's pages come from fallocate, which no mapping advises
        ("tmpfs", "rw,huge=advise", "advise", 4096),
        ("tmpfs", "rw,huge=never", "force", 2 << 20),  # the kernel's override, both ways
        ("tmpfs", "rw,huge=within_size", "deny", 4096),
        ("hugetlbfs", "rw,relatime,pagesize=2M", "", 2 << 20),
        ("hugetlbfs", "rw,relatime,pagesize=1024M", "", 1 << 30),
        ("hugetlbfs", "rw,relatime", "", 2 << 20),
        ("ext4", "rw,relatime", "force", 4096),  # a disk: never huge, whatever the policy
        ("", "", "", 4096),  # not found
    ],
)
def test_page_bytes_follow_the_mount_and_the_kernel_policy(fstype, options, policy, page_bytes):
    assert page_bytes_for(fstype, options, policy) == page_bytes


def test_a_region_knows_its_page_size(tmp_path):
    """What the daemon reports (ready info region_page_bytes) is what the mount
    table says of the region's file, read at the time the region is created."""
    path = "/dev/shm/kvstore-test-page-bytes.dram"
    region = Region(path, 1 << 20, prefault=True, huge_pages="off")
    try:
        assert region.page_bytes == page_bytes_of(path)
        assert region.page_bytes in (4096, 2 << 20)
    finally:
        region.close(unlink=True)
    assert page_bytes_of(str(tmp_path / "x")) in (4096, 2 << 20)  # any filesystem answers


def _wait_collapsed(region: Region, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while region.collapsing:
        assert time.monotonic() < deadline, "collapse did not end"
        time.sleep(0.01)


def test_a_region_on_4_kib_pages_is_collapsed_into_2_mib_pages_bytes_unchanged():
    path = "/dev/shm/kvstore-test-collapse.dram"
    nbytes = 16 << 20
    region = Region(path, nbytes, prefault=True, huge_pages="auto")
    try:
        if region.page_bytes >= HUGE_PAGE_BYTES:
            pytest.fail("/dev/shm gives 2 MiB pages here: this test wants 4 KiB ones")
        assert region.base_address % HUGE_PAGE_BYTES == 0  # file offsets and addresses match
        pattern = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)
        region.array[:] = pattern
        assert region.huge_page_bytes == 0
        assert region.collapse_huge_pages()
        assert not region.collapse_huge_pages()  # once
        _wait_collapsed(region)
        # What the region counts is what the kernel maps this process with.
        assert region.huge_page_bytes == pmd_mapped_bytes(os.getpid(), path)
        if kernel_collapses_shmem():
            assert region.huge_page_bytes == nbytes
        np.testing.assert_array_equal(region.array, pattern)  # the bytes never change
    finally:
        region.close(unlink=True)


@pytest.mark.parametrize(("huge_pages", "prefault"), [("off", True), ("auto", False)])
def test_no_collapse_when_turned_off_or_not_prefaulted(huge_pages, prefault):
    """off: 4 KiB pages stay; without prefault there are no pages to collapse yet
    (the kernel refuses an empty range), so nothing is started."""
    path = "/dev/shm/kvstore-test-collapse-off.dram"
    region = Region(path, 4 << 20, prefault=prefault, huge_pages=huge_pages)
    try:
        assert not region.collapse_huge_pages()
        assert region.huge_page_bytes == 0 and not region.collapsing
    finally:
        region.close(unlink=True)


def test_close_stops_a_collapse_between_chunks():
    path = "/dev/shm/kvstore-test-collapse-close.dram"
    region = Region(path, 512 << 20, prefault=True, huge_pages="auto")
    assert region.collapse_huge_pages()
    started = time.monotonic()
    region.close(unlink=True)  # well before 512 MiB are done
    assert time.monotonic() - started < 5.0
    assert not region.collapsing
    assert region.huge_page_bytes < 512 << 20  # stopped, not finished
    assert not os.path.exists(path)
