"""Warm restart of the DRAM tier: a manifest of the region's index, written on drain.

On a graceful stop the daemon keeps its shared-memory region file and writes
``<region>.manifest`` beside it: the namespaces, and for every committed DRAM
block its key, slot offset and xxh3-64 checksum, coldest first. A daemon
started with the same region path, size and chunk size reads the manifest,
deletes it at once (a later crash must never trust a stale one), verifies each
block's bytes against its checksum and serves those that match.

After ``kill -9`` there is no manifest: the region's bytes are ignored and the
DRAM tier starts empty (the disk tier has its own journal).
"""

from __future__ import annotations

import contextlib
import logging
import os

import msgspec

from kvstore.namespace import NamespaceSpec

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


def save(manifest: WarmManifest) -> str:
    """Write the manifest atomically (temp file, fsync, rename); its path."""
    path = manifest_path(manifest.region_path)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(msgspec.msgpack.encode(manifest))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def take(region_path: str, capacity_bytes: int, chunk_bytes: int) -> WarmManifest | None:
    """Read and delete the manifest of this region; None if absent or for another layout."""
    path = manifest_path(region_path)
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        return None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
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
