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
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile

import msgspec

from kvstore.errors import ConfigError
from kvstore.files import FilePolicy, check_owned
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
