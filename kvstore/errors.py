"""The one error hierarchy of kvstore, and its one mapping to gRPC.

Every operating error the daemon, its clients and its tools raise derives from
``KVStoreError``. Each class carries the gRPC status it is sent with
(``status``) and a stable reason code (``reason``, a short string). Every
servicer (store, peer, indexer, the auth interceptor) fails a call through
``abort``/``abort_sync``, which send the status, the message and the reason as
trailing metadata (``kvstore-reason``); every client rebuilds the exact class
from the reason with ``error_from_rpc``, never from the message text, so a
caller handles ``LeaseExpired`` whether the lease died in-process or across a
socket, whatever the message says. Only a status with no reason (an older
daemon, or gRPC's own DEADLINE_EXCEEDED / UNAVAILABLE / RESOURCE_EXHAUSTED)
falls back to the status alone (``FALLBACK_BY_STATUS``).

    class                         reason               status
    KVStoreError                  kvstore_error        UNKNOWN
    ├── ConfigError               config_error         INVALID_ARGUMENT
    ├── InvalidRequest            invalid_request      INVALID_ARGUMENT
    │   └── BlockSizeMismatch     block_size_mismatch  INVALID_ARGUMENT
    ├── NotFound                  not_found            NOT_FOUND
    │   ├── NamespaceNotFound     namespace_not_found  NOT_FOUND
    │   ├── LeaseNotFound         lease_not_found      NOT_FOUND
    │   │   └── LeaseExpired      lease_expired        NOT_FOUND
    │   └── BlockNotFound         block_not_found      NOT_FOUND
    ├── StateConflict             state_conflict       FAILED_PRECONDITION
    ├── CapacityExhausted         capacity_exhausted   RESOURCE_EXHAUSTED
    ├── PermissionDenied          permission_denied    PERMISSION_DENIED
    ├── Unavailable               unavailable          UNAVAILABLE
    │   └── DeadlineExceeded      deadline_exceeded    DEADLINE_EXCEEDED
    ├── DataCorruption            data_corruption      DATA_LOSS
    └── BackendError              backend_error        INTERNAL

Reasons are part of the wire API: never rename one (add a class instead).

Programmer errors (broken invariants) are plain ``AssertionError``s: they are
bugs, not conditions a caller should handle.
"""

from __future__ import annotations

from typing import Any, ClassVar, NoReturn

import grpc

# The trailing-metadata key that carries an error's reason code.
REASON_METADATA_KEY = "kvstore-reason"

BY_REASON: dict[str, type[KVStoreError]] = {}
"""Every error class by its reason code (filled as the classes are defined)."""


class KVStoreError(Exception):
    """Base of every kvstore operating error."""

    status: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN
    """The gRPC status a servicer fails the call with."""
    reason: ClassVar[str] = "kvstore_error"
    """Stable reason code, sent as trailing metadata; the client rebuilds the class from it."""

    status_code: grpc.StatusCode | None = None
    """The status this error arrived with over gRPC (None: raised in this process)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A class without its own reason would be rebuilt as its base on the far side.
        assert "reason" in cls.__dict__, f"{cls.__name__} needs its own reason code"
        assert cls.reason not in BY_REASON, f"reason {cls.reason!r} is taken"
        BY_REASON[cls.reason] = cls


BY_REASON[KVStoreError.reason] = KVStoreError


class ConfigError(KVStoreError):
    """The configuration (file, environment or flags) is invalid."""

    status = grpc.StatusCode.INVALID_ARGUMENT
    reason = "config_error"


class InvalidRequest(KVStoreError):
    """A request is malformed, out of range or oversize."""

    status = grpc.StatusCode.INVALID_ARGUMENT
    reason = "invalid_request"


class BlockSizeMismatch(InvalidRequest):
    """Block bytes do not match the namespace's fixed block size."""

    reason = "block_size_mismatch"


class NotFound(KVStoreError):
    """Something named by the request does not exist here."""

    status = grpc.StatusCode.NOT_FOUND
    reason = "not_found"


class NamespaceNotFound(NotFound):
    """The namespace was never declared on this daemon."""

    reason = "namespace_not_found"


class LeaseNotFound(NotFound):
    """The lease expired, was released, or was never issued."""

    reason = "lease_not_found"


class LeaseExpired(LeaseNotFound):
    """The lease ran out before this call: its slots or pins were not the caller's
    for the whole copy, so nothing copied under it may be used (or committed)."""

    reason = "lease_expired"


class BlockNotFound(NotFound):
    """The block is not (or no longer) held."""

    reason = "block_not_found"


class StateConflict(KVStoreError):
    """The operation does not fit the object's state (commit without prepare)."""

    status = grpc.StatusCode.FAILED_PRECONDITION
    reason = "state_conflict"


class CapacityExhausted(KVStoreError):
    """No room: the tier is full and nothing in it may be evicted."""

    status = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "capacity_exhausted"


class PermissionDenied(KVStoreError):
    """The caller may not do this (wrong cluster secret, foreign tenant)."""

    status = grpc.StatusCode.PERMISSION_DENIED
    reason = "permission_denied"


class Unavailable(KVStoreError):
    """The daemon or a peer is unreachable, stopping or draining."""

    status = grpc.StatusCode.UNAVAILABLE
    reason = "unavailable"


class DeadlineExceeded(Unavailable):
    """An operation gave up after its deadline."""

    status = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "deadline_exceeded"


class DataCorruption(KVStoreError):
    """Bytes failed their checksum; they were dropped, never served."""

    status = grpc.StatusCode.DATA_LOSS
    reason = "data_corruption"


class BackendError(KVStoreError):
    """A dependency (NIXL, the filesystem, Redis) failed unexpectedly."""

    status = grpc.StatusCode.INTERNAL
    reason = "backend_error"


CLIP_CHARS = 64


def clip(value: str, max_chars: int = CLIP_CHARS) -> str:
    """How a client-supplied string enters an error message: repr(value), cut to
    max_chars with its full length said, so a 10 KB identifier cannot overflow
    the status trailer (the caller would see RESOURCE_EXHAUSTED instead)."""
    if len(value) <= max_chars:
        return repr(value)
    return f"{value[:max_chars]!r}... ({len(value)} characters)"


# ---------------------------------------------------------------- the wire

FALLBACK_BY_STATUS: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: StateConflict,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityExhausted,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.DATA_LOSS: DataCorruption,
    grpc.StatusCode.INTERNAL: BackendError,
}
"""The class for a status that came without a reason: from an older daemon, or
from gRPC itself (deadline, connection, message size). The most general class
sending each status, so nothing finer is claimed than is known."""


def trailing_metadata(exc: KVStoreError) -> tuple[tuple[str, str], ...]:
    return ((REASON_METADATA_KEY, exc.reason),)


# Status details travel in an HTTP/2 trailer: one that outgrows the peer's
# header limit turns the answer into RESOURCE_EXHAUSTED. Messages clip what
# they echo (clip); this bounds the rest.
MAX_DETAILS_CHARS = 1024


def details_of(exc: Exception) -> str:
    text = str(exc)
    return text if len(text) <= MAX_DETAILS_CHARS else text[: MAX_DETAILS_CHARS - 3] + "..."


async def abort(context: grpc.aio.ServicerContext, exc: KVStoreError) -> NoReturn:
    """Fail the (grpc.aio) call with ``exc``'s status, message and reason."""
    await context.abort(exc.status, details_of(exc), trailing_metadata=trailing_metadata(exc))
    raise AssertionError("unreachable: context.abort raises") from exc


def abort_sync(context: grpc.ServicerContext, exc: KVStoreError) -> NoReturn:
    """``abort`` for a synchronous (thread-pool) server."""
    context.set_trailing_metadata(trailing_metadata(exc))
    context.abort(exc.status, details_of(exc))
    raise AssertionError("unreachable: context.abort raises") from exc


def _reason(exc: grpc.RpcError) -> str | None:
    trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == REASON_METADATA_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


def error_from_rpc(
    exc: grpc.RpcError, what: str = "", unclassified: type[KVStoreError] = KVStoreError
) -> KVStoreError:
    """The kvstore error a failed call stands for: the class named by its reason;
    without one (or with a reason this version does not know), the class for its
    status; ``unclassified`` for a status no class is sent with (UNKNOWN,
    CANCELLED, UNIMPLEMENTED...). ``what`` prefixes the message (default: the
    status name). The message never chooses the class."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    reason = _reason(exc)
    cls = BY_REASON.get(reason) if reason is not None else None
    if cls is None:
        cls = FALLBACK_BY_STATUS.get(code, unclassified)
    err = cls(f"{what or code.name}: {detail}")
    err.status_code = code
    return err
