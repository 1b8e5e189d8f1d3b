"""Where the block store reports what it now holds.

The placement owner (``kvstore.placement``) calls an ``EventSink`` synchronously
on its event loop whenever blocks become loadable in a tier or leave a tier. A
sink must never block: publishers queue (bounded) and send elsewhere.
``kvstore.events.publisher`` turns these calls into vLLM-format KV events.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol, runtime_checkable


class NamespaceRef(Protocol):
    """What a sink may know of a namespace (read-only)."""

    @property
    def namespace_id(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def tenant(self) -> str: ...

    @property
    def block_size_tokens(self) -> int: ...


class EventSink(Protocol):
    def blocks_stored(
        self,
        ns: NamespaceRef,
        block_hashes: Sequence[int],
        medium: str,
        parent_block_hash: int | None,
        token_ids: Sequence[int] | None,
    ) -> None: ...

    def blocks_removed(
        self, ns: NamespaceRef, block_hashes: Sequence[int], medium: str
    ) -> None: ...

    def all_cleared(self, ns: NamespaceRef | None) -> None: ...


@runtime_checkable
class SequencedSink(Protocol):
    """A sink whose events carry sequence numbers a snapshot can be pinned to."""

    def mark(self) -> Future[int]:
        """Seq of the first batch after every event the sink has been given so far."""
        ...


class NullSink:
    """The sink used when events are off."""

    def blocks_stored(
        self,
        ns: NamespaceRef,
        block_hashes: Sequence[int],
        medium: str,
        parent_block_hash: int | None,
        token_ids: Sequence[int] | None,
    ) -> None:
        return None

    def blocks_removed(self, ns: NamespaceRef, block_hashes: Sequence[int], medium: str) -> None:
        return None

    def all_cleared(self, ns: NamespaceRef | None) -> None:
        return None
