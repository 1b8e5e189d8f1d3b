"""The one error hierarchy of kvstore.

Every operating error the daemon, its clients and its tools raise derives from
``KVStoreError``. Only the gRPC service (``kvstore.service``) maps these to
status codes; the client maps status codes back to the same classes, so a
caller handles ``LeaseNotFound`` whether the lease died in-process or across a
socket.

    KVStoreError
    ├── ConfigError               bad config file / env / flag      (INVALID_ARGUMENT)
    ├── InvalidRequest            malformed or out-of-range request (INVALID_ARGUMENT)
    │   └── BlockSizeMismatch     bytes of the wrong size for the namespace
    ├── NotFound                                                    (NOT_FOUND)
    │   ├── NamespaceNotFound     namespace never declared here
    │   ├── LeaseNotFound         lease expired, released or never issued
    │   │   └── LeaseExpired      it ran out: copies made under it are not valid
    │   └── BlockNotFound         block not (or no longer) held
    ├── StateConflict             e.g. commit without prepare       (FAILED_PRECONDITION)
    ├── CapacityExhausted         tier full and nothing evictable   (RESOURCE_EXHAUSTED)
    ├── PermissionDenied          wrong cluster secret / tenant     (PERMISSION_DENIED)
    ├── Unavailable               daemon or peer gone / draining    (UNAVAILABLE)
    │   └── DeadlineExceeded      gave up waiting                   (DEADLINE_EXCEEDED)
    ├── DataCorruption            checksum mismatch                 (DATA_LOSS)
    └── BackendError              a dependency (NIXL, disk) failed  (INTERNAL)

Programmer errors (broken invariants) are plain ``AssertionError``s: they are
bugs, not conditions a caller should handle.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of every kvstore operating error."""


class ConfigError(KVStoreError):
    """The configuration (file, environment or flags) is invalid."""


class InvalidRequest(KVStoreError):
    """A request is malformed, out of range or oversize."""


class BlockSizeMismatch(InvalidRequest):
    """Block bytes do not match the namespace's fixed block size."""


class NotFound(KVStoreError):
    """Something named by the request does not exist here."""


class NamespaceNotFound(NotFound):
    """The namespace was never declared on this daemon."""


class LeaseNotFound(NotFound):
    """The lease expired, was released, or was never issued."""


class LeaseExpired(LeaseNotFound):
    """The lease ran out before this call: its slots or pins were not the caller's
    for the whole copy, so nothing copied under it may be used (or committed)."""


class BlockNotFound(NotFound):
    """The block is not (or no longer) held."""


class StateConflict(KVStoreError):
    """The operation does not fit the object's state (commit without prepare)."""


class CapacityExhausted(KVStoreError):
    """No room: the tier is full and nothing in it may be evicted."""


class PermissionDenied(KVStoreError):
    """The caller may not do this (wrong cluster secret, foreign tenant)."""


class Unavailable(KVStoreError):
    """The daemon or a peer is unreachable, stopping or draining."""


class DeadlineExceeded(Unavailable):
    """An operation gave up after its deadline."""


class DataCorruption(KVStoreError):
    """Bytes failed their checksum; they were dropped, never served."""


class BackendError(KVStoreError):
    """A dependency (NIXL, the filesystem, Redis) failed unexpectedly."""


CLIP_CHARS = 64


def clip(value: str, max_chars: int = CLIP_CHARS) -> str:
    """How a client-supplied string enters an error message: repr(value), cut to
    max_chars with its full length said, so a 10 KB identifier cannot overflow
    the status trailer (the caller would see RESOURCE_EXHAUSTED instead)."""
    if len(value) <= max_chars:
        return repr(value)
    return f"{value[:max_chars]!r}... ({len(value)} characters)"
