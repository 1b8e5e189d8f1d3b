"""Incremental block hashing for re-sent contexts: hash only the new tail.

An agent's next turn re-sends 90%+ of the previous one. Hashing 192k tokens
costs ~13 ms on the build machines (more than the indexer's Score), but the
chain of the previous turn is a prefix of this one's: the digests up to the
first changed block are the same. ``PrefixHashCache`` keeps the chains of
recent requests (their tokens and digests) in an LRU bounded by total tokens,
finds the longest stored chain that prefixes a new request (candidates share
the first block: same salt, same first tokens), and hashes only past it.

Finding it is a vectorised compare of the two token arrays (~0.1-0.2 ms for
195k tokens warm, ~0.5 ms with both cold in cache), not a hash. A ``KnownPrefix`` hint (the router's ``PromptBytesCache``
knows how many leading ids are byte-identical to an array it parsed before)
skips that compare for a chain held in that very array's memory. Each entry
also remembers the node its request was sent to: that is the conversation's
previous turn, for session affinity.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.errors import InvalidRequest
from kvstore.hashing import BlockHasher, to_int_hashes

# At most this many chains share one first-block key (a parent and its subagents);
# the least recently used one goes first.
MAX_CHAINS_PER_KEY = 16


# eq=False: chains are told apart by identity (``list.remove`` of a parent); a
# generated __eq__ would compare the token arrays and raise on their truth value.
@dataclass(eq=False)
class _Chain:
    tokens: np.ndarray  # int64, the full blocks only
    digests: list[bytes]
    ints: np.ndarray  # uint64 (the KV-event / kvstore form)
    node: str = ""


@dataclass(frozen=True, eq=False)
class KnownPrefix:
    """A hint: ``ids[:count]`` equal ``source[:count]``, made by whoever built ``ids``
    from ``source`` (``PromptBytesCache``: the new prompt's bytes start with the ones
    ``source`` was parsed from, and ``ids`` is ``source``'s ids plus the parsed tail).

    ``PrefixHashCache.hash`` uses it only where it can check it cheaply: ``ids`` must
    be the very array it is asked to hash, ``count`` within both arrays and the two
    ids at the ends of the range equal, and it skips comparing a stored chain's ids
    only when that chain is held in ``source``'s own memory (same start address, both
    int64 and contiguous: the same bytes, so equal to ``source`` whatever happened
    since). Any other hint, or any other chain, is compared id by id as without one.
    """

    ids: np.ndarray
    source: np.ndarray
    count: int


def _contiguous_int64(a: np.ndarray) -> bool:
    return a.dtype == np.int64 and a.ndim == 1 and a.strides == (8,)


@dataclass(frozen=True)
class Hashed:
    hashes: np.ndarray
    """uint64 block hashes of every full block, as the engine computes them."""
    reused_blocks: int
    """Blocks whose digests came from a stored chain (not hashed again)."""
    previous_node: str
    """Where the request whose chain was reused went ("" = none recorded)."""
    chain: _Chain | None = None
    """The stored chain (pass the whole ``Hashed`` to ``PrefixHashCache.routed``)."""
    hinted: bool = False
    """A ``KnownPrefix`` spared comparing the ids with a stored chain."""


class PrefixHashCache:
    """Bounded LRU of recent prefix hash chains. Not thread-safe: one per router loop."""

    def __init__(self, hasher: BlockHasher, max_tokens: int = 8 << 20) -> None:
        if max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be > 0; got {max_tokens}")
        self.hasher = hasher
        self.max_tokens = max_tokens
        self._chains: OrderedDict[tuple[Any, ...], list[_Chain]] = OrderedDict()
        self._tokens = 0
        self.hits = 0
        self.misses = 0
        self.reused_blocks = 0
        self.hashed_blocks = 0
        self.hinted = 0
        """Lookups where a ``KnownPrefix`` spared comparing a stored chain's ids."""

    @property
    def stored_tokens(self) -> int:
        return self._tokens

    def hash(
        self,
        token_ids: Any,
        *,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        remember: bool = True,
        owned: bool = False,
        known: KnownPrefix | None = None,
    ) -> Hashed:
        """Block hashes of ``token_ids``; stores the chain (LRU) unless ``remember`` is off.

        ``owned``: the caller hands an int64 array over and never changes it (the
        router's parsed prompts), so the chain keeps it instead of a copy: copying
        195k ids into fresh memory costs ~1 ms of page faults, most of a re-sent
        context's hashing.

        ``known``: which leading ids equal an earlier array's (``KnownPrefix``); the
        chain found, and so every hash, is the same with or without it."""
        bs = self.hasher.block_size
        # A list (a parsed JSON prompt) becomes an array this cache owns: fromiter
        # is the cheapest conversion (~2x asarray for 195k ints); an array the
        # caller passed is copied when stored (the caller may change it) unless owned.
        if isinstance(token_ids, list):
            owned = True
            try:
                tok = np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
            except (TypeError, ValueError, OverflowError) as e:
                raise InvalidRequest(f"token ids must be integers: {e}") from None
        else:
            tok = np.asarray(token_ids)
            if tok.ndim != 1 or (tok.size and tok.dtype.kind not in "iu"):
                # the hasher raises the precise error
                self.hasher.hash_tokens(token_ids, cache_salt=cache_salt, lora=lora)
            tok = tok.astype(np.int64, copy=False)
        n_blocks = tok.size // bs
        if n_blocks == 0:
            return Hashed(np.zeros(0, dtype=np.uint64), 0, "")
        key = (cache_salt or "", lora, tok[:bs].tobytes())
        hinted_before = self.hinted
        best, best_blocks = self._longest(key, tok, n_blocks, self._checked(known, tok))
        if best is None:
            self.misses += 1
            digests = self.hasher.hash_tokens(tok, cache_salt=cache_salt, lora=lora)
            ints = to_int_hashes(digests)
            previous = ""
        else:
            self.hits += 1
            tail = tok[best_blocks * bs : n_blocks * bs]
            # Extra keys after the first block: only a LoRA's (the salt is on block 0).
            more = self.hasher.hash_tokens(
                tail, parent=best.digests[best_blocks - 1], cache_salt=None, lora=lora
            )
            if remember and best_blocks * bs == best.tokens.size:
                # The new chain extends the stored one entirely, which _store then
                # drops: its digest list moves to the new chain instead of being
                # copied (12k references taken and later released, each touching
                # a digest's memory: up to ~0.8 ms for a re-sent 195k context).
                digests = best.digests
                digests += more
            else:
                digests = best.digests[:best_blocks] + more
            ints = np.concatenate([best.ints[:best_blocks], to_int_hashes(more)])
            previous = best.node
        self.reused_blocks += best_blocks
        self.hashed_blocks += n_blocks - best_blocks
        chain = None
        if remember:
            kept = tok[: n_blocks * bs]
            chain = _Chain(kept if owned else kept.copy(), digests, ints)
            self._store(key, chain, best, best_blocks)
        return Hashed(ints, best_blocks, previous, chain, self.hinted > hinted_before)

    @staticmethod
    def routed(hashed: Hashed, node: str) -> None:
        """Record where the request ``hashed`` came from went (the next turn's affinity)."""
        if hashed.chain is not None:
            hashed.chain.node = node

    @staticmethod
    def _checked(known: KnownPrefix | None, tok: np.ndarray) -> tuple[int, int]:
        """(start address of the hint's source, ids known equal to it); (0, 0): none
        usable. Checks what is cheap to check: the hint is about ``tok`` itself (not
        an array it was converted from or a stale hint), the range fits both arrays,
        and the ids at its two ends agree."""
        if known is None or known.ids is not tok or not isinstance(known.source, np.ndarray):
            return 0, 0
        src, n = known.source, known.count
        if not (_contiguous_int64(src) and _contiguous_int64(tok)):
            return 0, 0
        if not 0 < n <= min(src.size, tok.size) or src[0] != tok[0] or src[n - 1] != tok[n - 1]:
            return 0, 0
        return src.ctypes.data, n

    def _longest(
        self, key: tuple[Any, ...], tok: np.ndarray, n_blocks: int, known: tuple[int, int]
    ) -> tuple[_Chain | None, int]:
        chains = self._chains.get(key)
        if not chains:
            return None, 0
        self._chains.move_to_end(key)
        bs = self.hasher.block_size
        address, count = known
        # The chain held in the hint's source memory: its first ``count`` ids are the
        # source's, so equal to ``tok``'s; only the rest (about one id) is compared.
        hinted, hinted_blocks = None, 0
        if count:
            for c in chains:
                if _contiguous_int64(c.tokens) and c.tokens.ctypes.data == address:
                    hinted, hinted_blocks = c, self._same_blocks(c, tok, n_blocks, count)
                    self.hinted += 1
                    break
        best, best_blocks = None, 0
        for c in chains:  # in order, as without a hint: the same chain wins ties
            if c is hinted:
                blocks = hinted_blocks
            elif min(c.tokens.size, n_blocks * bs) // bs < hinted_blocks:
                continue  # cannot reach the hinted chain's length: no need to compare
            else:
                blocks = self._same_blocks(c, tok, n_blocks, 0)
            if blocks > best_blocks:
                best, best_blocks = c, blocks
        return best, best_blocks

    def _same_blocks(self, c: _Chain, tok: np.ndarray, n_blocks: int, equal: int) -> int:
        """Full blocks ``c`` shares with ``tok``, the first ``equal`` ids known equal."""
        bs = self.hasher.block_size
        m = min(c.tokens.size, n_blocks * bs)
        start = min(equal, m)
        diff = np.flatnonzero(c.tokens[start:m] != tok[start:m])
        same = start + int(diff[0]) if diff.size else m
        return same // bs

    def _store(
        self, key: tuple[Any, ...], chain: _Chain, parent: _Chain | None, parent_blocks: int
    ) -> None:
        chains = self._chains.setdefault(key, [])
        self._chains.move_to_end(key)
        if parent is not None and parent_blocks * self.hasher.block_size == parent.tokens.size:
            # The new chain extends the old one entirely: the old one is redundant.
            chains.remove(parent)
            self._tokens -= parent.tokens.size
            chain.node = parent.node
        chains.append(chain)
        self._tokens += chain.tokens.size
        while len(chains) > MAX_CHAINS_PER_KEY:
            self._tokens -= chains.pop(0).tokens.size
        while self._tokens > self.max_tokens and self._chains:
            k, old = next(iter(self._chains.items()))
            if k == key and len(self._chains) == 1 and len(old) == 1:
                break  # the one we just stored, alone and larger than the cap: keep it
            self._tokens -= old.pop(0).tokens.size
            if not old:
                del self._chains[k]
