"""KV events on the wire, in vLLM's exact format (``vllm/distributed/kv_events.py``, 0.32 and 0.33; tests/unit/test_vllm_interface.py
compares the fields with 0.33's).

llm-d's indexer, ours and vLLM's own tooling decode the same bytes, so these
Structs repeat vLLM's field names, order, options and tags exactly: a batch is
a msgpack array ``[ts, events, data_parallel_rank]``; each event is a map
tagged ``"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"``;
defaults are omitted. Block hashes are ints (vLLM's
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` default, the low 8 bytes of the
digest, unsigned) or, from engines run with that flag off, the raw digest
bytes; ``block_hash_to_int`` folds both to kvstore's int form.

ZMQ framing (publisher and subscriber): PUB frames ``(topic, seq, payload)``
with ``seq`` a u64 big-endian counter per publisher; replay over a ROUTER
socket: the client sends ``(b"", start_seq u64 BE)`` from a DEALER/REQ, gets
``(b"", topic, seq, payload)`` for each buffered batch with seq >= start and
then ``(b"", b"", END_SEQ, b"")``.
"""

from __future__ import annotations

from typing import Any

import msgspec

# A replay stream ends with this sequence number (-1 as signed 8-byte BE).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
TOPIC_PREFIX = "kv"
_U64_MASK = (1 << 64) - 1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    # vLLM 0.33: the tokens past each block its hash also covers (lookahead
    # hashing); None (omitted on the wire) when the engine hashes blocks alone.
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# --- what the indexer decodes -------------------------------------------------
# Lean views of the same wire bytes: the indexer needs hashes and medium only,
# and msgspec skips undeclared fields (token_ids, extra keys) without building
# Python objects for them, which is most of the decode cost of a BlockStored.


class _LeanStored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[int | bytes]
    medium: str | None = None
    block_size: int = 0
    # kept raw (no Python objects built) unless a chain's first block is checked
    parent_block_hash: int | bytes | None = None
    token_ids: msgspec.Raw = msgspec.Raw()
    lora_name: str | None = None
    extra_keys: msgspec.Raw = msgspec.Raw()
    # vLLM 0.33 lookahead hashing: the L tokens past each block (kept raw too)
    lookahead_token_ids: msgspec.Raw = msgspec.Raw()


class _LeanRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[int | bytes]
    medium: str | None = None


class _LeanCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


LeanEvent = _LeanStored | _LeanRemoved | _LeanCleared
LeanStored = _LeanStored
LeanRemoved = _LeanRemoved
LeanCleared = _LeanCleared


class LeanBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[LeanEvent]
    data_parallel_rank: int | None = None


# Engines before vLLM 0.26 (and consumers built on them) encode each event as
# a positional array, tag first: ``["BlockStored", block_hashes,
# parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
# extra_keys, ...]``, ``["BlockRemoved", block_hashes, medium, ...]``,
# ``["AllBlocksCleared"]``. Trailing fields may be absent (older engines have
# fewer) and extra ones are ignored (newer ones have more). msgspec cannot mix
# array-like and map-like structs in one union, hence a second set of views,
# turned into the lean ones by ``lean_event``.


class _PosStored(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: msgspec.Raw = msgspec.Raw()
    block_size: int = 0
    lora_id: msgspec.Raw = msgspec.Raw()
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: msgspec.Raw = msgspec.Raw()


class _PosRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: list[int | bytes]
    medium: str | None = None


class _PosCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    pass


PositionalEvent = _PosStored | _PosRemoved | _PosCleared


class PositionalBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[PositionalEvent]
    data_parallel_rank: int | None = None


def positional_decoder() -> msgspec.msgpack.Decoder[PositionalBatch]:
    return msgspec.msgpack.Decoder(PositionalBatch)


def lean_event(ev: _PosStored | _PosRemoved | _PosCleared) -> LeanEvent:
    """The lean (map-form) view of a positional event: one code path downstream."""
    if isinstance(ev, _PosStored):
        return _LeanStored(
            block_hashes=ev.block_hashes,
            medium=ev.medium,
            block_size=ev.block_size,
            parent_block_hash=ev.parent_block_hash,
            token_ids=ev.token_ids,
            lora_name=ev.lora_name,
            extra_keys=ev.extra_keys,
        )
    if isinstance(ev, _PosRemoved):
        return _LeanRemoved(block_hashes=ev.block_hashes, medium=ev.medium)
    return _LeanCleared()


def batch_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def lean_decoder() -> msgspec.msgpack.Decoder[LeanBatch]:
    return msgspec.msgpack.Decoder(LeanBatch)


def full_decoder() -> msgspec.msgpack.Decoder[KVEventBatch]:
    return msgspec.msgpack.Decoder(KVEventBatch)


def block_hash_to_int(h: int | bytes) -> int:
    """kvstore's int form of an event block hash (vLLM's ``maybe_convert_block_hash``)."""
    if isinstance(h, bytes):
        return int.from_bytes(h, "big") & _U64_MASK
    return h & _U64_MASK


def make_topic(node_id: str, model: str) -> str:
    """``kv@<node>@<model>``; an empty model means every model of the node."""
    return f"{TOPIC_PREFIX}@{node_id}@{model}"


def parse_topic(topic: bytes) -> tuple[str, str] | None:
    """``(node, model)`` of a ``kv@<node>@<model>`` topic, or None if it is not one.

    Models may contain ``@`` (split at the first two only); node ids may not.
    """
    try:
        text = topic.decode("utf-8")
    except UnicodeDecodeError:
        return None
    parts = text.split("@", 2)
    if len(parts) != 3 or parts[0] != TOPIC_PREFIX or not parts[1]:
        return None
    return parts[1], parts[2]
