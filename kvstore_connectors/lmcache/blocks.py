"""The bytes of one LMCache chunk in one kvstore slot.

A namespace has one block size, LMCache chunks do not: the last chunk of a
prompt is partial. So every slot is sized for a full chunk and starts with a
header that says what it holds::

    offset 0   4 bytes  b"KVLM"
           4   u32      format version (1)
           8   u64      payload bytes
          16   LMCache's own RemoteMetadata (length, format, shapes, dtypes:
               what its built-in connectors store before the bytes)
          16+m payload (the MemoryObj's bytes), then unused padding

The header is checked on every read: a slot that does not carry it is
DataCorruption (a miss for the engine), never bytes handed to LMCache.
"""

from __future__ import annotations

import struct

import numpy as np

from kvstore import errors

MAGIC = b"KVLM"
VERSION = 1
_PREFIX = struct.Struct("<4sIQ")
PREFIX_BYTES = _PREFIX.size


def slot_bytes(meta_bytes: int, full_chunk_bytes: int) -> int:
    """The block size of a namespace holding chunks of at most ``full_chunk_bytes``."""
    return PREFIX_BYTES + meta_bytes + full_chunk_bytes


def write_block(dst: np.ndarray, meta: bytes, payload: np.ndarray) -> None:
    """Header + ``payload`` (uint8) into the start of ``dst`` (a slot, uint8)."""
    end = PREFIX_BYTES + len(meta) + len(payload)
    if end > len(dst):
        raise errors.InvalidRequest(
            f"a chunk of {len(payload)} bytes does not fit a {len(dst)}-byte slot"
        )
    dst[:PREFIX_BYTES] = np.frombuffer(_PREFIX.pack(MAGIC, VERSION, len(payload)), np.uint8)
    dst[PREFIX_BYTES : PREFIX_BYTES + len(meta)] = np.frombuffer(meta, np.uint8)
    dst[PREFIX_BYTES + len(meta) : end] = payload


def read_block(src: np.ndarray, meta_bytes: int) -> tuple[bytes, np.ndarray]:
    """(LMCache metadata bytes, payload view) of a slot written by write_block."""
    if len(src) < PREFIX_BYTES + meta_bytes:
        raise errors.DataCorruption(f"slot of {len(src)} bytes is shorter than the header")
    magic, version, nbytes = _PREFIX.unpack(src[:PREFIX_BYTES].tobytes())
    if magic != MAGIC or version != VERSION:
        raise errors.DataCorruption(
            f"slot does not hold an LMCache chunk (magic {magic!r}, version {version})"
        )
    start = PREFIX_BYTES + meta_bytes
    if start + nbytes > len(src):
        raise errors.DataCorruption(
            f"slot says {nbytes} payload bytes, only {len(src) - start} fit"
        )
    return src[PREFIX_BYTES:start].tobytes(), src[start : start + nbytes]
