"""Warm restart of the DRAM tier: a manifest of the region's index, written on drain.

On a graceful stop the daemon keeps its shared-memory region file and writes
``<region>.manifest`` beside it: the namespaces, and for every committed DRAM
block its key, slot offset and xxh3-64 checksum, coldest first. A daemon
started with the same region path, size and chunk size reads the manifest,
deletes it at once (a later crash must never trust a stale one), verifies each
block's bytes against its checksum and serves those that match. Both files
must be this daemon user's own and private (kvstore/files.py): a manifest or a
region another user could have written is never adopted.

After ``kill -9`` there is no manifest: the region's bytes are ignored and the
DRAM tier starts empty (the disk tier has its own journal).

``save_dram``/``restore_dram`` are the warm restart itself, a mover beside the
disk and GPU ones: they read the DRAM index from ``kvstore.placement`` and
rebuild it through it, never through the manager.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec

from kvstore.errors import ConfigError, InvalidRequest
from kvstore.files import FilePolicy, check_owned
from kvstore.namespace import Namespace, NamespaceSpec, Tier
from kvstore.tiers.disk import checksum_of
from kvstore.tiers.dram import slot_bytes_for

if TYPE_CHECKING:
    from kvstore.placement import Placement
    from kvstore.tiers.dram import Region

log = logging.getLogger(__name__)

MANIFEST_SUFFIX = ".manifest"
VERSION = 1


class WarmBlock(msgspec.Struct, array_like=True, frozen=True):
    namespace: int  # index into WarmManifest.namespaces
    block_hash: int
    offset: int
    checksum: int


class WarmManifest(msgspec.Struct, frozen=True, kw_only=True):
    version: int = VERSION
    region_path: str
    capacity_bytes: int
    chunk_bytes: int
    namespaces: list[NamespaceSpec]
    blocks: list[WarmBlock]  # coldest first, per slot size


def manifest_path(region_path: str) -> str:
    return region_path + MANIFEST_SUFFIX


def save(manifest: WarmManifest, files: FilePolicy | None = None) -> str:
    """Write the manifest atomically (new private temp file, fsync, rename); its path."""
    files = files or FilePolicy()
    path = manifest_path(manifest.region_path)
    directory, name = os.path.split(path)
    # mkstemp: O_EXCL with a random name, so nothing planted is written through.
    fd, tmp = tempfile.mkstemp(prefix=name + ".", suffix=".tmp", dir=directory or ".")
    try:
        files.apply(fd, files.private_mode)
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.msgpack.encode(manifest))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def take(region_path: str, capacity_bytes: int, chunk_bytes: int) -> WarmManifest | None:
    """Read and delete the manifest of this region; None if absent, untrusted or for
    another layout.

    Only a regular file this daemon's user owns and no one else may write is
    read: a manifest another local user planted would make the daemon serve
    bytes for hashes nobody stored.
    """
    path = manifest_path(region_path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.error("warm-restart manifest %s not read (%s); DRAM tier starts empty", path, exc)
        _discard(path)
        return None
    try:
        st = os.fstat(fd)
        try:
            check_owned(st, path, "warm-restart manifest")
            if stat.S_IMODE(st.st_mode) & 0o022:
                raise ConfigError(
                    f"warm-restart manifest: {path} is writable by other users "
                    f"(mode {stat.S_IMODE(st.st_mode):04o})"
                )
        except ConfigError as exc:
            log.error("%s; DRAM tier starts empty", exc)
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            blob = f.read()
    finally:
        os.close(fd)
        _discard(path)
    try:
        manifest = msgspec.msgpack.decode(blob, type=WarmManifest)
    except msgspec.DecodeError as exc:
        log.warning("warm-restart manifest %s unreadable (%s); DRAM tier starts empty", path, exc)
        return None
    if (manifest.version, manifest.region_path, manifest.capacity_bytes, manifest.chunk_bytes) != (
        VERSION,
        region_path,
        capacity_bytes,
        chunk_bytes,
    ):
        log.warning("warm-restart manifest %s is for another region layout; ignored", path)
        return None
    return manifest


def _discard(path: str) -> None:
    """A later crash must never trust a stale manifest; one we may not remove is
    refused again next time (and replaced by our own at the next drain)."""
    with contextlib.suppress(OSError):
        os.unlink(path)


def save_dram(
    placement: Placement, namespaces: Iterable[Namespace], region: Region, chunk_bytes: int
) -> None:
    """On drain: describe the DRAM index beside the region so a restart serves it."""
    kept = [ns for ns in namespaces if ns.blocks]
    index = {id(ns): i for i, ns in enumerate(kept)}
    array = region.array
    blocks = []
    for block in placement.dram.coldest():  # coldest first: restored in this order
        ns = block.namespace
        view = array[block.offset : block.offset + ns.block_bytes]
        blocks.append(WarmBlock(index[id(ns)], block.block_hash, block.offset, checksum_of(view)))
    manifest = WarmManifest(
        region_path=region.path,
        capacity_bytes=region.capacity_bytes,
        chunk_bytes=chunk_bytes,
        namespaces=[ns.spec for ns in kept],
        blocks=blocks,
    )
    path = save(manifest, region.files)
    region.keep_on_close = True
    log.info("wrote warm-restart manifest", extra={"fields": {"path": path, "blocks": len(blocks)}})


def restore_dram(placement: Placement, region: Region, chunk_bytes: int) -> list[Namespace]:
    """At start: serve the DRAM blocks a drained daemon described, those whose bytes
    still match; announce them (and adopt each namespace's recovered disk blocks).
    Returns the namespaces the manifest declared, for the caller's table."""
    manifest = take(region.path, region.capacity_bytes, chunk_bytes)
    if manifest is None:
        return []
    if not region.reused:
        # The region file is new (or was replaced as untrusted): a manifest
        # beside it describes bytes that are not there, or was planted.
        log.warning("warm-restart manifest ignored: region %s was created anew", region.path)
        return []
    namespaces: list[Namespace | None] = []
    for spec in manifest.namespaces:
        try:
            spec.validate(max_block_bytes=chunk_bytes)
        except InvalidRequest:
            namespaces.append(None)
            continue
        ns_id = spec.namespace_id()
        namespaces.append(
            Namespace(spec, ns_id, spec.block_bytes, slot_bytes_for(spec.block_bytes))
        )
    array = region.array
    candidates = []
    dropped = 0
    for wb in manifest.blocks:
        owner = namespaces[wb.namespace] if 0 <= wb.namespace < len(namespaces) else None
        if owner is None:
            dropped += 1
            continue
        view = array[wb.offset : wb.offset + owner.block_bytes]
        # Bytes changed while no daemon owned the region: never serve them.
        if len(view) != owner.block_bytes or checksum_of(view) != wb.checksum:
            dropped += 1
            continue
        candidates.append((owner, wb.block_hash, wb.offset, wb.checksum))
    restored, refused = placement.restore_dram(candidates)
    declared = [ns for ns in namespaces if ns is not None]
    for ns in declared:
        # Tell the cluster again what this node holds after its restart.
        placement.announce(ns, list(ns.blocks), Tier.DRAM)
        if placement.disk is not None:
            placement.adopt_disk(ns)
    log.info(
        "warm restart of the DRAM tier",
        extra={"fields": {"restored_blocks": len(restored), "dropped_blocks": dropped + refused}},
    )
    return declared
