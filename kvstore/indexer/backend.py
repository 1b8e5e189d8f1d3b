"""The index behind the indexer: ``block_hash -> {(node, medium)}`` per model.

Two implementations share this interface: ``memory.MemoryIndex`` (default,
in-process) and ``redis_index.RedisIndex`` (several indexer replicas share one
Redis/Valkey; an indexer restart loses nothing). Both keep, per model and block
hash, one bit per (node, medium); nodes get small integer ids, so a block held
by 100 nodes costs bits, not 100 tuples.

Primitives:

- ``add(model, node, medium, hashes)`` / ``remove(...)``: apply events.
- ``clear(node, model, mediums)``: drop a node's entries for one model
  (``None``: all models) in some tiers (``None``: all), e.g. on
  ``AllBlocksCleared`` or an unrecoverable gap. An engine's clear only
  touches its GPU tier, not the node daemon's tiers.
- ``drop_node(node)``: clear everywhere and forget the node.
- ``score(model, hashes, nodes)``: per node, the longest consecutive prefix of
  ``hashes`` it holds in any tier, split by the fastest tier holding each block.

Data-parallel ranks: the DP ranks of a node's engine share its weights, so a
block in the node's DRAM or disk tier (or the daemon's GPU tier) is valid for
every rank, but each rank's own KV cache is its own. ``add``/``remove``/
``clear`` with ``rank`` keep a rank's engine GPU entries apart, as the index
member ``rank_member(node, rank)`` (a name no node can have: node names never
contain ``@``). A node's score then carries one ``RankScore`` per rank with a
non-empty prefix (its GPU entries plus the node's shared ones) and rank -1 (the
shared ones alone: what a rank not listed gets); the node's top-level figures
are its best rank's. A node without ranks scores as before.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Protocol

import msgspec
import numpy as np

from kvstore.errors import InvalidRequest

# Bitsets are uint64 words viewed as bytes; bit b of word w is node w*64+b
# only on little-endian hosts (x86, arm64).
assert sys.byteorder == "little", "kvstore.indexer assumes a little-endian host"

# The index's mediums. A prefix block held in several of a node's mediums
# counts for the fastest: GPU (an engine's own KV cache, or the daemon's GPU
# tier), then CPU, then DISK. vLLM's engines publish "GPU" (or None) for their
# KV cache; its offloading connector's lower tier is "STORAGE", our "DISK".
# The daemon's GPU tier is its own entry, KVSTORE_GPU (a daemon source's
# "GPU" events land there): an engine and its node's daemon each clear and
# remove only their own entries, never the other's.
MEDIUMS: tuple[str, ...] = ("GPU", "CPU", "DISK", "KVSTORE_GPU")
ENGINE_GPU, CPU, DISK, KVSTORE_GPU = range(4)
_MEDIUM_INDEX = {"GPU": 0, "CPU": 1, "DISK": 2, "STORAGE": 2, "KVSTORE_GPU": 3}
# Mediums an engine source and a daemon source report (and so may clear).
ENGINE_MEDIUMS: tuple[str, ...] = ("GPU",)
DAEMON_MEDIUMS: tuple[str, ...] = ("KVSTORE_GPU", "CPU", "DISK")


def medium_index(medium: str | None) -> int:
    """Index into ``MEDIUMS`` of an event's medium; None is an engine's GPU cache."""
    if medium is None:
        return 0
    try:
        return _MEDIUM_INDEX[medium.upper()]
    except KeyError:
        raise InvalidRequest(f"unknown KV event medium {medium!r}") from None


def source_medium(medium: str | None, daemon: bool) -> str:
    """The index medium of an event's medium from a daemon or an engine source."""
    m = MEDIUMS[medium_index(medium)]
    if daemon and m == "GPU":
        return "KVSTORE_GPU"
    if not daemon and m != "GPU":
        # an engine stream reports its GPU cache only; anything else is not its to say
        raise InvalidRequest(f"an engine source reports GPU blocks only; got medium {medium!r}")
    return m


# Separates a node from a DP rank in an index member's name (node names have none).
RANK_MARK = "@"
# RankScore.rank of a node's shared entries alone (no rank's own GPU cache).
SHARED_RANK = -1


def rank_member(node: str, rank: int | None) -> str:
    """The index member holding ``rank``'s engine GPU entries (``node`` itself for None)."""
    if rank is None:
        return node
    if RANK_MARK in node:
        raise InvalidRequest(f"node id must not contain {RANK_MARK!r}; got {node!r}")
    if not isinstance(rank, int) or rank < 0:
        raise InvalidRequest(f"data-parallel rank must be an int >= 0; got {rank!r}")
    return f"{node}{RANK_MARK}{rank}"


def split_member(member: str) -> tuple[str, int | None]:
    """(node, rank) of an index member; rank None for the node's own entries."""
    node, mark, rank = member.rpartition(RANK_MARK)
    if not mark or not rank.isdigit():
        return member, None
    return node, int(rank)


class RankScore(msgspec.Struct, frozen=True):
    """One DP rank's hit: its own GPU entries plus its node's shared tiers."""

    rank: int
    prefix_blocks: int
    gpu_blocks: int = 0
    cpu_blocks: int = 0
    disk_blocks: int = 0


class NodeScore(msgspec.Struct, frozen=True):
    """One node's hit on a request: prefix length in blocks and its split by tier.

    On a node whose engine GPU entries are per DP rank, the figures are the best
    rank's (``rank``; longest prefix, then most GPU blocks, then lowest rank) and
    ``ranks`` lists, by rank, ``SHARED_RANK`` (-1: the node's shared tiers alone,
    what a rank not listed gets) and every rank with a non-empty prefix."""

    node: str
    prefix_blocks: int
    gpu_blocks: int = 0
    cpu_blocks: int = 0
    disk_blocks: int = 0
    rank: int = SHARED_RANK
    ranks: tuple[RankScore, ...] = ()


class IndexBackend(Protocol):
    def add(
        self,
        model: str,
        node: str,
        medium: str | None,
        hashes: np.ndarray,
        rank: int | None = None,
    ) -> None: ...

    def remove(
        self,
        model: str,
        node: str,
        medium: str | None,
        hashes: np.ndarray,
        rank: int | None = None,
    ) -> None: ...

    def clear(
        self,
        node: str,
        model: str | None,
        mediums: Sequence[str] | None = None,
        rank: int | None = None,
    ) -> None:
        """``rank`` None: the node's own entries (not its ranks'); else that rank's."""
        ...

    def drop_node(self, node: str) -> None:
        """Clear the node and its ranks everywhere and forget them."""
        ...

    def nodes(self) -> list[str]:
        """Nodes with an id in the index (never rank members)."""
        ...

    def models(self) -> list[str]: ...

    def score(
        self, model: str, hashes: np.ndarray, nodes: Sequence[str] | None = None
    ) -> list[NodeScore]: ...

    def stats(self) -> dict[str, int]: ...

    def ping(self) -> bool:
        """Raise ``Unavailable`` if the store is unreachable; True if it lost its data
        since the last ping (a Redis restarted empty): every source must then resync."""
        ...

    def load_cursor(self, source: str) -> int | None: ...

    def save_cursor(self, source: str, seq: int) -> None: ...

    def forget_cursor(self, source: str) -> None: ...

    def close(self) -> None: ...


def as_hash_array(hashes: Sequence[int] | np.ndarray) -> np.ndarray:
    """Block hashes as a contiguous uint64 array (ints must be in [0, 2**64))."""
    if isinstance(hashes, np.ndarray):
        if hashes.dtype != np.uint64:
            if hashes.dtype.kind not in "iu":
                raise InvalidRequest(f"block hashes must be integers; got {hashes.dtype}")
            hashes = hashes.astype(np.uint64)
        return np.ascontiguousarray(hashes)
    try:
        return np.fromiter(hashes, dtype=np.uint64, count=len(hashes))
    except (OverflowError, ValueError, TypeError) as e:
        raise InvalidRequest(f"block hashes must be ints in [0, 2**64): {e}") from e


def prefix_scores(
    rows: np.ndarray, alive: np.ndarray, bit_nodes: dict[int, str]
) -> list[NodeScore]:
    """Scores from per-block node bitsets.

    ``rows``: (n_blocks, len(MEDIUMS), words) uint64, bit b of word w is node
    id ``w*64+b``; ``alive``: (words,) bitset of the candidate nodes. The
    running AND over blocks only loses bits, so each node's prefix ends at one
    of at most ``len(nodes)`` change points: find those, then split each
    node's prefix by tier, counting bit by bit only for nodes with a mix.
    Work runs on the transposed (words, blocks) layout, where every reduction
    is over contiguous memory.
    """
    n = rows.shape[0]
    if n == 0 or not alive.any():
        return []
    tiers = np.ascontiguousarray(rows.transpose(1, 2, 0))  # (medium, word, block)
    held = np.bitwise_or.reduce(tiers, axis=0)
    held &= alive[:, None]
    cum = np.bitwise_and.accumulate(held, axis=1)
    live = np.asarray(cum.any(axis=0))
    length = n if live[-1] else int(np.argmin(live))
    if length == 0:
        return []
    cum = cum[:, :length]
    prefix = np.zeros(alive.shape[0] * 64, dtype=np.int64)
    changed = np.flatnonzero((cum[:, 1:] != cum[:, :-1]).any(axis=0)) + 1
    if changed.size:
        lost = cum[:, changed - 1] & ~cum[:, changed]  # (word, change)
        which, bit = np.nonzero(_unpack(lost.T))
        prefix[bit] = changed[which]
    prefix[np.flatnonzero(_unpack(cum[:, length - 1 : length].T)[0])] = length
    g = tiers[ENGINE_GPU, :, :length]
    if tiers.shape[0] > KVSTORE_GPU:  # rows may come without the daemon-GPU medium
        g = g | tiers[KVSTORE_GPU, :, :length]
    c, d = tiers[CPU, :, :length], tiers[DISK, :, :length]
    gpu = _count_tier(g & cum, cum, prefix)
    disk_only = _count_tier(d & ~(g | c) & cum, cum, prefix)
    return counted_scores(prefix, gpu, disk_only, bit_nodes)


def counted_scores(
    prefix: np.ndarray, gpu: np.ndarray, disk_only: np.ndarray, bit_nodes: dict[int, str]
) -> list[NodeScore]:
    """Scores from per node id counts: prefix blocks, of them GPU and DISK-only ones
    (CPU is the rest); longest prefix first, then by name."""
    out = []
    for b in np.flatnonzero(prefix).tolist():
        node = bit_nodes.get(b)
        if node is None:
            continue
        p = int(prefix[b])
        gb, db = int(gpu[b]), int(disk_only[b])
        out.append(NodeScore(node, p, gb, p - gb - db, db))
    out.sort(key=lambda s: (-s.prefix_blocks, s.node))
    return out


def fold_ranks(rows: np.ndarray, pairs: Sequence[tuple[int, int]]) -> None:
    """Give each rank member's column its node's entries, in place.

    ``rows``: (n_blocks, mediums, words) uint64 bitsets; ``pairs``: (node bit,
    rank member bit). A rank holds what its node's shared tiers hold (and the
    node's rank-less engine cache) besides its own GPU entries: after the fold,
    a rank member's column scores what a request sent to that rank finds.
    """
    for nb, rb in pairs:
        got = (rows[:, :, nb // 64] >> np.uint64(nb % 64)) & np.uint64(1)
        rows[:, :, rb // 64] |= got << np.uint64(rb % 64)


def group_ranks(scores: list[NodeScore]) -> list[NodeScore]:
    """Column scores (nodes and rank members) -> one ``NodeScore`` per node.

    Members are ``rank_member`` names; a node with rank members gets ``ranks``
    (its own column as ``SHARED_RANK``) and its best rank's figures on top.
    """
    if not any(RANK_MARK in s.node for s in scores):
        return scores
    own: dict[str, NodeScore] = {}
    ranked: dict[str, list[RankScore]] = {}
    for s in scores:
        node, rank = split_member(s.node)
        if rank is None:
            own[node] = s
        else:
            ranked.setdefault(node, []).append(
                RankScore(rank, s.prefix_blocks, s.gpu_blocks, s.cpu_blocks, s.disk_blocks)
            )
    out = [s for n, s in own.items() if n not in ranked]
    for node, ranks in ranked.items():
        base = own.get(node)
        shared = RankScore(
            SHARED_RANK,
            *(
                (base.prefix_blocks, base.gpu_blocks, base.cpu_blocks, base.disk_blocks)
                if base
                else (0,)
            ),
        )
        ranks.sort(key=lambda r: r.rank)
        best = min(ranks, key=lambda r: (-r.prefix_blocks, -r.gpu_blocks, r.rank))
        out.append(
            NodeScore(
                node,
                best.prefix_blocks,
                best.gpu_blocks,
                best.cpu_blocks,
                best.disk_blocks,
                rank=best.rank,
                ranks=(shared, *ranks),
            )
        )
    out.sort(key=lambda s: (-s.prefix_blocks, s.node))
    return out


# Counting bits column by column is cheaper than unpacking the whole matrix
# while few nodes hold a prefix in a mix of tiers.
_MAX_COLUMN_COUNTS = 16


def _unpack(words_rows: np.ndarray) -> np.ndarray:
    """(k, words) uint64 -> (k, words*64) 0/1 bytes, column = node id."""
    return np.unpackbits(np.ascontiguousarray(words_rows).view(np.uint8), axis=1, bitorder="little")


def _count_tier(m: np.ndarray, cum: np.ndarray, prefix: np.ndarray) -> np.ndarray:
    """Per node id, how many of its prefix blocks have its bit in ``m`` (word, block).

    ``m`` is within ``cum``. Nodes with the bit in every prefix block count
    their whole prefix, nodes with it in none count 0; only a mix is counted.
    """
    out = np.zeros(prefix.shape[0], dtype=np.int64)
    some = np.bitwise_or.reduce(m, axis=1)
    if not some.any():
        return out
    every = np.bitwise_and.reduce(m | ~cum, axis=1)
    full = np.flatnonzero(_unpack((some & every)[None, :])[0])
    out[full] = prefix[full]
    mixed = np.flatnonzero(_unpack((some & ~every)[None, :])[0])
    if mixed.size == 0:
        return out
    if mixed.size <= _MAX_COLUMN_COUNTS:
        for b in mixed.tolist():
            col = m[b // 64] >> np.uint64(b % 64)
            out[b] = int(np.count_nonzero(col & np.uint64(1)))
        return out
    counts = _unpack(m.T).sum(axis=0, dtype=np.int64)
    out[mixed] = counts[mixed]
    return out
