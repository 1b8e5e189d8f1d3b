"""The disk tier on a real filesystem: durability, integrity, capacity, bad paths."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvstore.errors import ConfigError, DataCorruption, StateConflict
from kvstore.tiers.disk import DATA_FILE, JOURNAL_FILE, DiskTier, checksum_of

SLAB = 256 * 1024
NS = "ns-test"


def block(block_hash: int, nbytes: int) -> np.ndarray:
    """Deterministic bytes for a key, so any mix-up of blocks shows."""
    return np.random.default_rng(block_hash).integers(0, 256, nbytes, dtype=np.uint8)


def open_tier(path, capacity=4 * SLAB, **kw) -> DiskTier:
    return DiskTier(str(path), capacity, slab_bytes=SLAB, io_threads=2, **kw)


async def put(tier: DiskTier, block_hash: int, nbytes: int) -> int:
    slot = tier.allocate(nbytes)
    assert slot is not None
    await tier.write(slot, block(block_hash, nbytes), (NS, block_hash))
    return slot


async def get(tier: DiskTier, slot: int, nbytes: int) -> np.ndarray:
    out = np.empty(nbytes, dtype=np.uint8)
    await tier.read(slot, out)
    return out


async def test_blocks_survive_reopen_with_their_bytes(tmp_path):
    tier = open_tier(tmp_path)
    sizes = {h: (4096 if h % 2 else 5000) for h in range(1, 21)}  # two size classes
    slots = dict(
        zip(sizes, await asyncio.gather(*(put(tier, h, n) for h, n in sizes.items())), strict=True)
    )
    for h, slot in slots.items():
        assert np.array_equal(await get(tier, slot, sizes[h]), block(h, sizes[h]))
    await tier.close()

    tier = open_tier(tmp_path)
    found = {e.block_hash: e for e in tier.recover()}
    assert set(found) == set(sizes)
    for h, e in found.items():
        assert (e.namespace_id, e.slot, e.nbytes) == (NS, slots[h], sizes[h])
        assert e.checksum == checksum_of(block(h, sizes[h]))
        assert np.array_equal(await get(tier, e.slot, e.nbytes), block(h, e.nbytes))
    await tier.close()


async def test_unaligned_source_and_destination(tmp_path):
    tier = open_tier(tmp_path)
    backing = np.zeros(3 * 4096 + 1, dtype=np.uint8)
    src = backing[1 : 1 + 8192]  # misaligned address, aligned length
    src[:] = block(7, 8192)
    slot = tier.allocate(8192)
    assert slot is not None
    await tier.write(slot, src, (NS, 7))
    dst = np.zeros(8193, dtype=np.uint8)[1:]
    await tier.read(slot, dst)
    assert np.array_equal(dst, block(7, 8192))
    await tier.close()


async def test_flipped_byte_is_detected_and_dropped(tmp_path):
    tier = open_tier(tmp_path)
    good = await put(tier, 1, 4096)
    bad = await put(tier, 2, 4096)
    fd = os.open(tmp_path / DATA_FILE, os.O_RDWR)
    byte = os.pread(fd, 1, bad + 100)
    os.pwrite(fd, bytes([byte[0] ^ 0x01]), bad + 100)
    os.fsync(fd)
    os.close(fd)
    with pytest.raises(DataCorruption, match="checksum"):
        await get(tier, bad, 4096)
    assert tier.entry(bad) is None  # dropped, never served again
    with pytest.raises(StateConflict):
        await get(tier, bad, 4096)
    assert np.array_equal(await get(tier, good, 4096), block(1, 4096))
    await tier.close()
    tier = open_tier(tmp_path)
    assert [e.block_hash for e in tier.recover()] == [1]  # the drop was journaled
    await tier.close()


async def test_truncated_data_file_drops_the_blocks_past_its_end(tmp_path):
    tier = open_tier(tmp_path)
    first = await put(tier, 1, 4096)
    slots = [await put(tier, h, 4096) for h in range(2, 6)]
    await tier.close()
    os.truncate(tmp_path / DATA_FILE, first + 4096)
    tier = open_tier(tmp_path)
    assert [e.block_hash for e in tier.recover()] == [1]
    assert np.array_equal(await get(tier, first, 4096), block(1, 4096))
    assert os.path.getsize(tmp_path / DATA_FILE) == tier.capacity_bytes  # re-extended
    new = await put(tier, 9, 4096)
    assert new in slots or new > first
    await tier.close()


async def test_torn_journal_tail_keeps_every_earlier_record(tmp_path):
    tier = open_tier(tmp_path)
    for h in range(1, 6):
        await put(tier, h, 4096)
    await tier.close()
    journal = tmp_path / JOURNAL_FILE
    size = os.path.getsize(journal)
    with open(journal, "ab") as f:
        f.write(b"\x30\x00\x00\x00garbage-of-a-torn-append")
    tier = open_tier(tmp_path)
    assert sorted(e.block_hash for e in tier.recover()) == [1, 2, 3, 4, 5]
    assert os.path.getsize(journal) == size  # rewritten without the torn tail
    await put(tier, 6, 4096)
    await tier.close()
    # A record cut in half: the last block is lost, nothing else.
    os.truncate(journal, os.path.getsize(journal) - 3)
    tier = open_tier(tmp_path)
    assert sorted(e.block_hash for e in tier.recover()) == [1, 2, 3, 4, 5]
    await tier.close()


async def test_capacity_is_a_hard_cap(tmp_path):
    tier = open_tier(tmp_path, capacity=2 * SLAB)
    per_slab = SLAB // 65536
    slots = [await put(tier, h, 65536) for h in range(2 * per_slab)]
    assert tier.allocate(65536) is None
    assert tier.allocate(4096) is None  # no spare slab for another size either
    assert tier.used_bytes == tier.capacity_bytes
    tier.free(slots[0])
    again = await put(tier, 100, 65536)
    assert again == slots[0]
    # Empty a whole slab: it can then serve another size.
    for slot in slots[1:per_slab]:
        tier.free(slot)
    tier.free(again)
    assert tier.allocate(4096) is not None
    await tier.close()


async def test_reused_slot_after_free_recovers_the_new_block(tmp_path):
    tier = open_tier(tmp_path)
    slot = await put(tier, 1, 4096)
    tier.free(slot)
    again = await put(tier, 2, 4096)
    assert again == slot
    await tier.close()
    tier = open_tier(tmp_path)
    (entry,) = tier.recover()
    assert (entry.block_hash, entry.slot) == (2, slot)
    assert np.array_equal(await get(tier, slot, 4096), block(2, 4096))
    await tier.close()


async def test_source_that_changed_since_its_checksum_is_refused(tmp_path):
    tier = open_tier(tmp_path)
    data = block(1, 4096)
    stale = checksum_of(data)
    data[0] ^= 0xFF
    slot = tier.allocate(4096)
    assert slot is not None
    with pytest.raises(DataCorruption):
        await tier.write(slot, data, (NS, 1), stale)
    assert tier.used_bytes == 0  # the slot was given back
    await tier.close()


async def test_journal_is_compacted(tmp_path):
    tier = open_tier(tmp_path, journal_compact_bytes=8192)
    slot = await put(tier, 0, 4096)
    for h in range(1, 300):
        tier.free(slot)
        slot = await put(tier, h, 4096)
    await tier.close()
    assert os.path.getsize(tmp_path / JOURNAL_FILE) < 8192 + 4096
    tier = open_tier(tmp_path)
    assert [e.block_hash for e in tier.recover()] == [299]
    await tier.close()


async def test_buffered_io_and_tmpfs(tmp_path):
    """O_DIRECT off (by config or refused by the filesystem) serves the same bytes."""
    tier = open_tier(tmp_path, direct_io=False)
    assert tier.direct_io is False
    slot = await put(tier, 3, 5000)
    assert np.array_equal(await get(tier, slot, 5000), block(3, 5000))
    await tier.close()
    if not os.path.isdir("/dev/shm"):
        return
    import tempfile

    # tmpfs takes O_DIRECT on kernels >= 6.6 and refuses it before: either way it works.
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm_dir:
        tier = open_tier(shm_dir)
        slot = await put(tier, 4, 5000)
        assert np.array_equal(await get(tier, slot, 5000), block(4, 5000))
        await tier.close()


def test_direct_io_on_a_disk_filesystem(tmp_path):
    fs_type = subprocess.run(
        ["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True
    ).stdout.strip()
    if fs_type not in ("ext2/ext3", "xfs", "btrfs"):
        pytest.skip(f"{tmp_path} is on {fs_type}")
    tier = open_tier(tmp_path)
    assert tier.direct_io is True, fs_type
    tier.close_sync()


def test_missing_path_names_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=str(missing)):
        open_tier(missing)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match=f"{a_file} is not a directory"):
        open_tier(a_file)


def test_unwritable_path_names_the_path(tmp_path):
    if os.geteuid() == 0:
        path = "/sys"  # not writable even for root
    else:
        path = str(tmp_path / "ro")
        os.mkdir(path, 0o500)
    with pytest.raises(ConfigError, match=f"{path} is not writable"):
        open_tier(path)


def test_one_owner_per_directory(tmp_path):
    tier = open_tier(tmp_path)
    with pytest.raises(ConfigError, match="in use"):
        open_tier(tmp_path)
    tier.close_sync()
    open_tier(tmp_path).close_sync()


def test_layout_change_starts_empty(tmp_path):
    async def fill() -> None:
        tier = open_tier(tmp_path)
        await put(tier, 1, 4096)
        await tier.close()

    asyncio.run(fill())
    tier = DiskTier(str(tmp_path), 8 * SLAB, slab_bytes=SLAB)
    assert tier.recover() == []
    tier.close_sync()


_WRITER = textwrap.dedent(
    """
    import asyncio, sys
    import numpy as np
    from kvstore.tiers.disk import DiskTier

    def block(h, n):
        return np.random.default_rng(h).integers(0, 256, n, dtype=np.uint8)

    async def main(path, start):
        tier = DiskTier(path, 8 * 262144, slab_bytes=262144, io_threads=2)
        live = [e.slot for e in tier.recover()]
        h = start

        async def one(h):
            slot = tier.allocate(8192)
            while slot is None:
                tier.free(live.pop(0))
                slot = tier.allocate(8192)
            await tier.write(slot, block(h, 8192), ("ns", h))
            live.append(slot)
            sys.stdout.write(f"{h}\\n")
            sys.stdout.flush()

        print("ready", flush=True)
        while True:
            await asyncio.gather(*(one(h + i) for i in range(8)))
            h += 8

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
    """
)


async def test_kill_9_loses_no_acknowledged_block(tmp_path):
    acked: set[int] = set()
    start = 1
    for iteration in range(6):
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(tmp_path), str(start)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=os.getcwd(),
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 0.2 + 0.05 * iteration
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            acked.add(int(line))
        os.kill(proc.pid, signal.SIGKILL)
        acked.update(int(x) for x in proc.stdout.read().split())  # acked before the kill
        proc.wait(timeout=10)
        start += 10_000

        tier = open_tier(tmp_path, capacity=8 * SLAB)
        present = {e.block_hash: e for e in tier.recover()}
        for h, e in present.items():
            # Every block recovered has exactly its bytes: none torn, none swapped.
            assert np.array_equal(await get(tier, e.slot, e.nbytes), block(h, e.nbytes))
        # The writer evicts oldest-first, so the newest acknowledged blocks must be here.
        newest = sorted(h for h in acked if h >= start - 10_000)[-8:]
        assert set(newest) <= set(present), (iteration, newest, sorted(present))
        await tier.close()
    assert acked


@pytest.mark.parametrize("direct_io", [True, False])
async def test_read_many_batches_neighbours_and_verifies_each_block(tmp_path, direct_io):
    from kvstore.errors import InvalidRequest
    from kvstore.tiers.disk import MAX_RUN_BYTES

    tier = open_tier(tmp_path, capacity=8 * SLAB, direct_io=direct_io)
    nbytes = 16 * 1024
    slots = [await put(tier, h, nbytes) for h in range(1, 33)]  # 32 neighbouring slots
    assert slots == [slots[0] + i * nbytes for i in range(32)]
    flipped = slots[10]
    fd = os.open(tmp_path / DATA_FILE, os.O_RDWR)
    os.pwrite(fd, bytes([os.pread(fd, 1, flipped + 7)[0] ^ 0x80]), flipped + 7)
    os.fsync(fd)
    os.close(fd)
    # Page-aligned destinations that neighbouring reads fill with one preadv,
    # one misaligned destination (a bounce buffer when O_DIRECT), a freed slot
    # and a buffer of the wrong size.
    region = np.zeros(32 * nbytes + 4096 + 1, dtype=np.uint8)
    base = (-region.ctypes.data) % 4096
    outs = [region[base + i * nbytes : base + (i + 1) * nbytes] for i in range(32)]
    odd = np.zeros(nbytes + 1, dtype=np.uint8)[1:]
    tier.free(slots[31])
    reads = [(s, o) for s, o in zip(slots[:30], outs, strict=False)]
    reads += [(slots[30], odd), (slots[31], outs[31]), (slots[0], np.zeros(100, np.uint8))]
    results = await tier.read_many(reads[::-1])  # any order: runs follow the slots
    results = results[::-1]
    for i in range(30):
        if i == 10:
            assert isinstance(results[i], DataCorruption)
            continue
        assert results[i] is None, (i, results[i])
        assert np.array_equal(outs[i], block(i + 1, nbytes)), i
    assert results[30] is None and np.array_equal(odd, block(31, nbytes))
    assert isinstance(results[31], StateConflict)
    assert isinstance(results[32], InvalidRequest)
    assert tier.entry(flipped) is None  # dropped, the other blocks of its run kept
    assert len(tier) == 31 - 1
    # The grouping: runs of neighbours, each at most a share of the total per
    # I/O thread (2 here) and MAX_RUN_BYTES; a misaligned buffer stands alone.
    items = [(i, tier.entry(s), memoryview(outs[i])) for i, s in enumerate(slots[:8])]
    runs = tier._runs(items)  # type: ignore[arg-type]
    assert [len(r) for r in runs] == [4, 4] and 4 * nbytes <= MAX_RUN_BYTES
    await tier.close()


async def test_compaction_keeps_every_acknowledged_block_across_a_crash(tmp_path):
    """Issue 19, bug 3: a compaction right after a group commit dropped that batch's
    COMMIT records (each writer added its entry only when it resumed, after the
    snapshot), so a crash then lost blocks whose write() had returned."""
    tier = open_tier(tmp_path, capacity=8 * SLAB, journal_compact_bytes=4096)
    journal = tmp_path / JOURNAL_FILE
    compactions = 0
    journal_bytes = os.path.getsize(journal)
    live: dict[int, int] = {}  # block hash -> slot, for writes that returned
    next_hash = 1
    for _ in range(60):
        # Churn: free the oldest batch, then write one concurrently (one group commit).
        for h in sorted(live)[:-8]:
            tier.free(live.pop(h))
        batch = list(range(next_hash, next_hash + 8))
        next_hash += 8
        slots = await asyncio.gather(*(put(tier, h, 4096) for h in batch))
        live.update(zip(batch, slots, strict=True))
        size = os.path.getsize(journal)
        compactions += size < journal_bytes  # only a compaction shrinks the journal
        journal_bytes = size
    assert compactions >= 3, "the journal was never compacted: the test lost its point"
    # Crash right after the last acknowledged write: no flush, no clean close.
    tier.close_sync()
    tier = open_tier(tmp_path, capacity=8 * SLAB)
    found = {e.block_hash: e for e in tier.recover()}
    assert sorted(set(live) - set(found)) == []
    for h, slot in live.items():
        assert found[h].slot == slot
        assert np.array_equal(await get(tier, slot, 4096), block(h, 4096))
    await tier.close()
